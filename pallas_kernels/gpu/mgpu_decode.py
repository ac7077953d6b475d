"""The cache's INT4 partition through the Mosaic GPU kernel, as ``partials_gpu`` partials.

``partials_gpu`` (Triton) gathers every partition token by token; on Hopper, when the INT4 pool's
pages hold a multiple of 64 tokens (wgmma's M), its INT4 partition runs instead as
:func:`pallas_kernels.gpu.mgpu_paged.partition_paged`, one page per pipeline step read by TMA
straight from the cache's stacked uint8 pool, and its partials join the Triton kernel's BF16-pool
and window partials in the one Eq. 15 merge.  A cache made with ``lo_format="int4"``
(head-major int4 pages, V dim-major: ``pallas_kernels.types.LowPool``) is read instead by
:func:`pallas_kernels.gpu.mgpu_int4.partition`'s paged mode (2.34 TB/s against 1.5 TB/s on the
H200, bench/RESULTS.md 2026-12-04), the only GPU kernel that reads that format.

What this module adds around the kernel (all small XLA work on this layer's data):
* q per (sequence, KV head) padded to 16 query rows (the kernel's N side) and split into its
  nibble halves (``nibble_q``; the bytes pool only);
* the bytes pool: this layer's fp16 scales ``[P, page, Hkv, 2]`` -> head-major f32 ``[Hkv, P,
  page]`` for K and V (the Triton path repacks the same scales per layer); non-finite scales of
  unused rows become 0, so garbage in invisible rows (which the cache contract allows) cannot
  reach the output through ``p * scale``.  The int4 pool's scales are stored head-major (``[L,
  P, Hkv, 2, page]``) and go to the kernel as they are; it masks ``p * scale`` of invisible
  rows itself;
* the page table clamped to page 0 past each sequence's pages (entries there are unspecified)
  and padded to a multiple of the context splits; the layer's page offset ``layer * P`` goes to
  the kernel as ``base`` (codes of every layer stay in one array, nothing is sliced);
* the kernel's ``[BH, S, D, 16]`` outputs transposed into the Triton layout
  ``o [B, Hkv, S, 16, D]``, ``m, l [B, Hkv, S, 16]`` (log2 units in both).

``reference=True`` runs ``partition_paged_reference`` (``pool_reference`` for the int4 pool;
jnp) in the kernel's place: the CPU tests check everything above end to end against
``decode_attention_reference``.
"""
from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.compute_on import compute_on

from pallas_kernels.gpu import mgpu_common as C
from pallas_kernels.gpu import mgpu_int4 as MI
from pallas_kernels.gpu import mgpu_paged as MP
from pallas_kernels.types import LowPool, PageMaps

# Context splits of the bytes pool's kernel: enough (batch x KV head x split) blocks to fill 132
# SMs several times over (bench/RESULTS.md: 8 splits at B=8 x 8 KV heads, 32 at B=8 x 2 KV heads,
# 32K keys).
BLOCKS = 512
# The int4 pool's kernels fill whole waves instead.  One block of ``mgpu_int4.partition`` (d 128:
# 167 registers, 57 KB of shared memory) leaves room for 3 per SM, the warp-specialized kernel for
# 1; a grid of 1.29 waves (the old 512 blocks) left the SMs without work for part of the kernel
# (SMs active 71-92% of its cycles), and the split count that makes the grid closest to whole
# waves was the fastest at every measured shape (H100, bench/RESULTS.md 2026-12-06 (fifth):
# 4B-like B=8 32K 6 splits 89.3 us vs 8 splits 99.3; 0.5B-like 24 vs 32: 19.5 vs 19.8; B=32 8K 3
# vs 2: 95.0 vs 98.7).  Blocks resident per SM by (compute warpgroups, early_v, head dim): d 64 at
# 3 as measured (its 128 registers would allow 4), early_v's 213 registers at d 128 allow 2 (156
# at d 64: 3); anything not measured counts 1, so its grid is whole waves of one block per SM.
RESIDENT = {(1, False, 128): 3, (1, False, 64): 3, (1, True, 128): 2, (1, True, 64): 3}
SMS = 132                # H100 and H200 SXM, when no GPU is present to ask
MIN_PAGES = 8            # pages per split at least: 5 pages per split cost 19% at the 0.5B shape
MAX_SPLITS = 64


def supported(page: int, d: int, g: int) -> bool:
  """Whether the kernel takes this pool: pages and head dim multiples of 64, <= 16 query heads
  per KV head."""
  return page % 64 == 0 and d % 64 == 0 and g <= C.N_PAD


def hopper() -> bool:
  """Whether the default device is a Hopper GPU (sm_90: wgmma, TMA)."""
  try:
    dev = jax.devices()[0]
  except RuntimeError:
    return False
  return dev.platform == "gpu" and getattr(dev, "compute_capability", "") == "9.0"


# How the int4 pool's kernel turns K tiles into MMA operands (mgpu_int4.partition's k_upcast;
# the warp-specialized kernel takes the first two).
UPCASTS = ("bf16", "bf16_perm", "bf16_perm_offset")


def splits_for(bh: int, n_pages: int) -> int:
  """Context splits of the bytes pool's kernel for ``bh`` (sequence, KV head) pairs."""
  return max(1, min(n_pages, BLOCKS // max(bh, 1)))


def sm_count() -> int:
  """Streaming multiprocessors of the default GPU (``SMS`` where none answers)."""
  try:
    dev = jax.devices()[0]
  except RuntimeError:
    return SMS
  return int(getattr(dev, "core_count", 0) or SMS) if dev.platform == "gpu" else SMS


def wave_splits(bh: int, n_pages: int, *, wgs: int = 1, early_v: bool = False, d: int = 128,
                sms: int | None = None) -> int:
  """Context splits per warpgroup of the int4 pool's kernels for ``bh`` (sequence, KV head)
  pairs over a table of ``n_pages`` pages: the fewest splits whose blocks use at least 95% of
  the block slots of the waves they span (``sms`` x ``RESIDENT`` slots per wave), each split
  keeping ``MIN_PAGES`` pages; failing that, the best-used grid.  One split where the pairs alone
  span 4 waves or more (the idle slots of its last wave are then under a fifth of the grid's)."""
  bh = max(bh, 1)
  slots = (sms or sm_count()) * RESIDENT.get((wgs, early_v, d), 1)
  if bh >= 4 * slots:
    return 1
  top = max(1, min(MAX_SPLITS, n_pages // (MIN_PAGES * wgs)))
  used = lambda s: bh * s / (-(-bh * s // slots) * slots)
  best = 1
  for s in range(1, top + 1):
    if used(s) >= 0.95:
      return s
    if used(s) > used(best):
      best = s
  return best


def on_stream(stream: int):
  """A context in which the ops traced run on XLA's GPU stream ``stream`` (an async call beside
  the main stream's work; ``compute_on("gpu_stream:N")``); 0: the main stream, no annotation.
  Only the kernel call goes in it: a nested jit inside a streamed region (jnp's ``//``,
  ``where``) became an un-annotated async call that XLA could not place (jax 0.10.2)."""
  if not stream:
    return contextlib.nullcontext()
  return compute_on(f"gpu_stream:{int(stream)}")


def int4_partials(qp: jax.Array, lo: LowPool, maps: PageMaps, layer: jax.Array, *, c: float,
                  g: int, splits: int | None = None, wgs: int = 1, table: str = "gmem",
                  upcast: str | None = None, early_v: bool = False, reference: bool = False,
                  layout: str = "triton", stream: int = 0):
  """``qp [B, Hkv, 16, D]`` bf16 (query heads padded to 16), ``lo`` stacked (``[L, P, page, Hkv,
  D/2]`` uint8 with scales ``[L, P, page, Hkv, 2]``, or ``[L, P, Hkv, page, D]`` / ``[L, P, Hkv,
  D, page]`` int4 with scales ``[L, P, Hkv, 2, page]``), ``layer`` int32 -> partials ``o [B,
  Hkv, S, 16, D]`` f32, ``m, l [B, Hkv, S, 16]``
  (``c`` = softmax scale x log2 e).

  ``wgs`` > 1 (the int4 pool only): the warp-specialized kernel (``mgpu_int4.partition_ws``,
  ``wgs`` compute warpgroups, each a partial), ``splits`` then counting context splits per
  warpgroup; ``S`` = splits x ``wgs``.  ``splits`` by default: ``wave_splits`` for the int4 pool
  (whole waves of blocks), ``splits_for`` for the bytes pool.
  ``table`` (the int4 pool): where the kernel's index maps read the page ids
  (``mgpu_int4.partition``).
  ``upcast`` (the int4 pool): how the kernel turns K tiles into wgmma operands
  (``mgpu_int4.partition``'s ``k_upcast``: "bf16"; "bf16_perm", 32-bit loads upcast in
  registers with the head dim permuted, ``mgpu_upcast``; "bf16_perm_offset", the same without
  the conversion's subtract, ``wgs`` 1 only); default "bf16_perm" for the int4 storage format
  (its K tiles 6-8% faster in the decode call on an H100, bench/RESULTS.md 2026-12-06), "bf16"
  for the bytes format.
  ``early_v`` (the int4 pool, ``wgs`` 1): V's operand upcast while the scores' MMAs run
  (``mgpu_int4.partition``'s ``early_v``).
  ``layout="kernel"``: the partials as the kernel writes them, reshaped only (no transpose, no
  slice): ``o [B, Hkv, S, D, 16]`` (O^T), ``m, l`` of the same shape with their values in row 0
  of D, for a merge that reads them in place (``merge.merge_sets``, ``merge.merge_kernel``).
  ``stream`` > 0: the kernel launched on XLA's GPU stream ``stream`` (:func:`on_stream`), so
  it runs beside the main stream's kernels (the Triton launch over the BF16 pool and window)."""
  if layout not in ("triton", "kernel"):
    raise ValueError(f"layout must be 'triton' or 'kernel', got {layout!r}")
  b, hkv, rows, d = qp.shape
  n_l, p_lo, page = lo.scale.shape[0], lo.scale.shape[1], lo.page
  if rows != C.N_PAD or not supported(page, d, g):
    raise ValueError(f"the Mosaic GPU INT4 partition takes pages and head dim in multiples of "
                     f"64 and <= {C.N_PAD} query heads per KV head; got page {page}, head dim "
                     f"{d}, {g} query heads per KV head")
  bh = b * hkv
  q = qp.reshape(bh, C.N_PAD, d).astype(jnp.bfloat16)
  tbl = maps.lo_pages.astype(jnp.int32)
  n_pages = tbl.shape[1]
  used = (maps.lo_len.astype(jnp.int32) + page - 1) // page
  tbl = jnp.where(jnp.arange(n_pages)[None, :] < used[:, None], tbl, 0)
  if upcast is None:
    upcast = "bf16_perm" if lo.format == "int4" else "bf16"
  if upcast not in UPCASTS:
    raise ValueError(f"upcast must be one of {UPCASTS}, got {upcast!r}")
  if upcast != "bf16" and lo.format != "int4":
    raise ValueError(f"upcast={upcast!r} is a knob of the int4 storage format's kernels; this "
                     f"pool is {lo.format!r}")
  if early_v and (lo.format != "int4" or wgs != 1):
    raise ValueError(f"early_v is a knob of the int4 storage format's kernel with one compute "
                     f"warpgroup; got format {lo.format!r}, wgs={wgs}")
  if wgs != 1 and lo.format != "int4":
    raise ValueError(f"wgs={wgs} (the warp-specialized kernel) reads the int4 storage format "
                     f"only; this pool is {lo.format!r}")
  if splits:
    s = splits
  elif lo.format == "int4":
    s = wave_splits(bh, n_pages, wgs=wgs, early_v=early_v, d=d)
  else:
    s = splits_for(bh, n_pages)
  tbl = jnp.pad(tbl, ((0, 0), (0, (-n_pages) % (s * wgs))))
  base = (jnp.asarray(layer, jnp.int32) * p_lo).reshape(1)
  lens = maps.lo_len.astype(jnp.int32)
  cols = 8 if g <= 8 and C.HAS_CONCAT else C.N_PAD
  if lo.format == "int4":
    # Head-major int4 pages, V dim-major: mgpu_int4.partition's paged mode (the faster read,
    # bench/RESULTS.md 2026-12-04), lengths per (sequence, KV head).  The stacked fp16 scales go
    # in as they are stored ([L * P, Hkv, 2, page]: the K and V planes of a page and head are
    # each one TMA box), read at the codes' layer offset: no per-step scale copy.
    k = lo.k.reshape(n_l * p_lo, hkv, page, d)                    # free: layers lead
    v = lo.v.reshape(n_l * p_lo, hkv, d, page)
    sc = lo.scale.reshape(n_l * p_lo, hkv, 2, page)
    lens = jnp.repeat(lens, hkv)
    if reference:
      o, m, l = MI.pool_reference(q, k, sc, v, None, lens, tbl, base, v_major="dim", splits=s,
                                  wgs=wgs, qk_scale=c)
    elif wgs > 1:
      with on_stream(stream):
        o, m, l = MI.partition_ws(q, k, sc, v, None, lens, tbl, base, tile=page, splits=s,
                                  wgs=wgs, qk_scale=c, cols=cols, approx_math=True,
                                  no_auto_barriers=True, table=table, k_upcast=upcast)
    else:
      with on_stream(stream):
        o, m, l = MI.partition(q, k, sc, v, None, lens, None, tbl, base, tile=page, splits=s,
                               v_major="dim", qk_scale=c, cols=cols, approx_math=True,
                               no_auto_barriers=True, table=table, k_upcast=upcast,
                               early_v=early_v)
    return _layout(o, m, l, b, hkv, s * wgs, d, layout)
  # The bytes pool: this layer's scales [P, page, Hkv, 2] -> head-major f32 [Hkv, P, page];
  # non-finite scales of unused rows become 0 (garbage there must not reach the output).
  sc = lax.dynamic_index_in_dim(lo.scale, layer, 0, keepdims=False).astype(jnp.float32)
  sc = jnp.where(jnp.isfinite(sc), sc, 0.0)
  ks = jnp.transpose(sc[..., 0], (2, 0, 1))
  vs = jnp.transpose(sc[..., 1], (2, 0, 1))
  k = lo.k.reshape(n_l * p_lo, page, hkv, d // 2)                 # free: layers lead
  v = lo.v.reshape(n_l * p_lo, page, hkv, d // 2)
  if reference:
    o, m, l = MP.partition_paged_reference(q, k, ks, v, vs, tbl, lens, base, splits=s,
                                           qk_scale=c)
  else:
    qn, bias = MP.nibble_q(q)
    with on_stream(stream):
      o, m, l = MP.partition_paged(qn, bias, k, ks, v, vs, tbl, lens, base, splits=s,
                                   qk_scale=c, cols=cols, approx_math=True,
                                   no_auto_barriers=True)
  return _layout(o, m, l, b, hkv, s, d, layout)


def triton_layout(o, m, l):
  """Partials of ``layout="kernel"`` -> the Triton kernel's layout (``o [B, Hkv, S, 16, D]``,
  ``m, l [B, Hkv, S, 16]``)."""
  return jnp.swapaxes(o, 3, 4), m[..., 0, :], l[..., 0, :]


def _layout(o, m, l, b, hkv, s, d, layout="triton"):
  """The kernels' ``[BH, S, D, 16]`` partials (m, l in row 0 of D) -> ``o [B, Hkv, S, 16, D]``,
  ``m, l [B, Hkv, S, 16]`` (the Triton kernel's layout); ``layout="kernel"``: all three ``[B,
  Hkv, S, D, 16]`` as written (free reshapes: a consumer reads row 0 of m, l in place)."""
  o, m, l = (x.reshape(b, hkv, s, d, C.N_PAD) for x in (o, m, l))
  return triton_layout(o, m, l) if layout == "triton" else (o, m, l)
