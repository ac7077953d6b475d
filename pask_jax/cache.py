"""The PASK mixed-precision KV cache (docs/DESIGN.md "The cache pytree"; paper B.2, B.4, B.5).

Immutable pytree; every update returns a new one.  Shapes (L layers, B sequences, W window
slots, G layer groups, Hkv KV heads, D head dim, ``page`` rows per page)::

  layers.win_k/win_v  [L, B, W, Hkv, D]      bf16  recent window, ring slot = position % W
  layers.hi_k/hi_v    [L, P_hi, page, Hkv, D]  bf16  high pool (pages shared by sequences)
  layers.lo_k/lo_v    [L, P_lo, lo_page, Hkv, D/2] u8  low pool, INT4 half-split nibbles
                      (lo_format="bytes", the default), or with lo_format="int4":
  layers.lo_k         [L, P_lo, Hkv, lo_page, D]  int4  token rows, head-major pages
  layers.lo_v         [L, P_lo, Hkv, D, lo_page]  int4  dim-major per page
  layers.lo_s         [L, P_lo, lo_page, Hkv, 2]  f16   (K scale, V scale) per row ("bytes");
                      [L, P_lo, Hkv, 2, lo_page]  f16   K and V planes per page and head ("int4")
  win_pos             [B, W]      int32  absolute position held by each slot (-1: empty)
  win_act             [B, W, G]   int8   pending actions of each window token (R/L/H)
  count               [B]         int32  tokens written so far = next absolute position
  hi_pages/lo_pages   [G, B, n_pages] int32  page tables (layers of a group share them)
  hi_len/lo_len       [G, B]      int32  entries stored per group and sequence (<= the pages)
  hi_pos/lo_pos       [G, B, cap] int32  absolute position of entry j (-1: none)
  overflow            [B]         bool   an entry did not fit its pool (it was dropped)

Lifecycle of a token at position p (B.2): it enters window slot p % W with its pending actions
(sink positions p < ``sink`` are forced to H for every group); when position p + W is written
to the same slot, the token is *materialized* per group: H → appended to the BF16 pool, L →
quantized and appended to the INT4 pool, R → gone.  Pools are append-only and decisions are
never undone; ``hi_pos``/``lo_pos`` keep absolute positions across released gaps.  Every visible
key appears exactly once across the INT4 pool, the BF16 pool and the window (which already holds
the current token when attention runs).

**The INT4 pool's two storage formats** (``init(..., lo_format=...)``, :attr:`Cache.lo_format`
from the codes' dtype) hold the same codes (``pallas_kernels.int4.quantize``: [-7, 7]) and the
same fp16 scales in the same number of bytes: D/2 per K row and per V row (two codes a byte,
jax packs int4 that way too) plus 4 scale bytes, so the ledger and the engine's sizing are the
same for both.  "bytes" is what the Triton and TPU kernels read; "int4" is what the Mosaic GPU
kernel reads fastest (head-major pages, V dim-major: ``pallas_kernels.gpu.mgpu_int4``), and XLA
on the GPU writes a token's K row and V column into it in place.  A flat INT4 row
``r = page · lo_page + i`` (what the page tables and ``StepPlan.dest_lo`` give) is
``lo_k[l, page, :, i, :]`` and ``lo_v[l, page, :, :, i]`` there, ``_flat(lo_k)[l, r]`` in "bytes".

Page allocation here is the dense default: sequence b owns pages [b·n_pages, (b+1)·n_pages) of
every pool, identically for every group.  An engine may hand in its own page tables; the update
functions only ever go through ``*_pages``.

**The decode-step split** (the model runs its layers one by one; the shared bookkeeping is done
once per step):

  cache, plan = begin_step(cache, actions[B, G], active[B])   # once, before the layers
  for each layer ℓ (ℓ may be traced, e.g. a lax.scan over layers carrying the cache):
    cache = write_step(cache, plan, ℓ, k_ℓ[B, Hkv, D], v_ℓ[B, Hkv, D])   # scatters, in place
    window, hi, lo, maps = kernel_inputs(cache.layers, cache, g(ℓ))      # stacked [L, ...]
    out = pallas_kernels.decode_attention(q_ℓ, window, hi, lo, maps, layer=ℓ)

(:mod:`pask_jax.testing.cache` has the same update on a copy of one layer's arrays, simpler
and written independently, for tests to compare against.)

``begin_step`` moves the evicted token's bookkeeping (lengths, positions, overflow) and records the
new token's position and pending actions; ``write_step`` copies/quantizes the evicted token's
K/V into the pools of that layer (it must read the window slot before overwriting it, so both
happen there) and writes the new K/V into the window; :func:`evict_step` does the evictions of
every layer at once first when the step writes the window only.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import chex
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.types import HighPool, LowPool, PageMaps, Window
from pallas_kernels import int4
from pask_jax import tags as T
from pask_jax import actions as Act


@flax.struct.dataclass
class LayerKV:
  """Per-layer K/V storage; in :class:`Cache` every field has a leading layer axis."""
  win_k: jax.Array  # [B, W, Hkv, D] bf16
  win_v: jax.Array
  hi_k: jax.Array   # [P_hi, page, Hkv, D] bf16
  hi_v: jax.Array
  lo_k: jax.Array   # [P_lo, page, Hkv, D/2] uint8 ("bytes") or [P_lo, Hkv, page, D] int4
  lo_v: jax.Array   # [P_lo, page, Hkv, D/2] uint8 ("bytes") or [P_lo, Hkv, D, page] int4
  lo_s: jax.Array   # [P_lo, page, Hkv, 2] float16 ("int4" format: [P_lo, Hkv, 2, page])


@flax.struct.dataclass
class Cache:
  layers: LayerKV
  win_pos: jax.Array   # [B, W] int32
  win_act: jax.Array   # [B, W, G] int8
  count: jax.Array     # [B] int32
  hi_pages: jax.Array  # [G, B, n_hi_pages] int32
  lo_pages: jax.Array  # [G, B, n_lo_pages] int32
  hi_len: jax.Array    # [G, B] int32
  lo_len: jax.Array    # [G, B] int32
  hi_pos: jax.Array    # [G, B, cap_hi] int32
  lo_pos: jax.Array    # [G, B, cap_lo] int32
  overflow: jax.Array  # [B] bool
  group_of: tuple = flax.struct.field(pytree_node=False, default=())
  sink: int = flax.struct.field(pytree_node=False, default=0)

  @property
  def n_layers(self) -> int:
    return self.layers.win_k.shape[0]

  @property
  def batch(self) -> int:
    return self.win_pos.shape[0]

  @property
  def window(self) -> int:
    return self.win_pos.shape[1]

  @property
  def n_groups(self) -> int:
    return self.hi_len.shape[0]

  @property
  def page(self) -> int:
    """Rows per page of the BF16 pool."""
    return self.layers.hi_k.shape[2]

  @property
  def lo_page(self) -> int:
    """Rows per page of the INT4 pool (``page`` unless the cache was made with ``lo_page``)."""
    return self.layers.lo_s.shape[2 if self.lo_format == "bytes" else 4]

  @property
  def lo_format(self) -> str:
    """Storage format of the INT4 pool: "bytes" (uint8 half-split) or "int4" (module doc)."""
    return int4.format_of(self.layers.lo_k)

  @property
  def win_len(self) -> jax.Array:
    """[B] visible window slots: a prefix of the ring, min(count, W)."""
    return jnp.minimum(self.count, self.window)


class StepPlan(NamedTuple):
  """What one decode step does, shared by all layers (output of :func:`begin_step`)."""
  slot: jax.Array     # [B] int32 window slot of the new token; W (out of range) if inactive
  dest_hi: jax.Array  # [G, B] int32 flat hi-pool row for the evicted token; out of range: none
  dest_lo: jax.Array  # [G, B] int32 flat lo-pool row for the evicted token; out of range: none


# ---- construction -----------------------------------------------------------------------------

def init(n_layers: int, batch: int, n_kv_heads: int, head_dim: int, *, capacity: int,
         window: int, sink: int = 0, n_groups: int = 3, page: int = 16,
         hi_capacity: int | None = None, lo_capacity: int | None = None,
         lo_page: int | None = None, lo_format: str = "bytes") -> Cache:
  """An empty cache.  ``capacity``: tokens per sequence a pool can hold (default for both pools;
  ``hi_capacity``/``lo_capacity`` override), rounded up to whole pages.  ``window``/``sink`` come
  from the policy (``policy.window``, ``policy.sink``).  ``lo_page``: rows per INT4 page when it
  differs from ``page`` (the Mosaic GPU INT4 kernel reads pages of a multiple of 64 rows, one
  per pipeline step).  ``lo_format``: how the INT4 pool stores its codes, "bytes" (default) or
  "int4" (module doc).
  """
  int4.check_format(lo_format)
  if head_dim % 2:
    raise ValueError(f"INT4 packing needs an even head_dim, got {head_dim}")
  if window < 1:
    raise ValueError(f"the recent window needs at least one slot (it holds the current token), "
                     f"got window={window}")
  G, B, W, Hkv, D = n_groups, batch, window, n_kv_heads, head_dim
  n_hi = math.ceil((capacity if hi_capacity is None else hi_capacity) / page)
  lo_page = page if lo_page is None else int(lo_page)
  if page < 1 or lo_page < 1:
    raise ValueError(f"pages need at least one row, got page={page}, lo_page={lo_page}")
  n_lo = math.ceil((capacity if lo_capacity is None else lo_capacity) / lo_page)

  def dense_pages(n):   # [G, B, n]: sequence b owns pages b*n .. b*n+n-1
    return jnp.broadcast_to(jnp.arange(B * n, dtype=jnp.int32).reshape(1, B, n), (G, B, n))

  z = lambda shape, dt: jnp.zeros(shape, dt)
  lo_k_shape, lo_v_shape = _lo_shapes(n_layers, B * n_lo, lo_page, Hkv, D, lo_format)
  layers = LayerKV(
      win_k=z((n_layers, B, W, Hkv, D), jnp.bfloat16),
      win_v=z((n_layers, B, W, Hkv, D), jnp.bfloat16),
      hi_k=z((n_layers, B * n_hi, page, Hkv, D), jnp.bfloat16),
      hi_v=z((n_layers, B * n_hi, page, Hkv, D), jnp.bfloat16),
      lo_k=z(lo_k_shape, _LO_DTYPE[lo_format]), lo_v=z(lo_v_shape, _LO_DTYPE[lo_format]),
      lo_s=jnp.ones((n_layers,) + int4.scale_shape(B * n_lo, lo_page, Hkv, lo_format),
                    jnp.float16))
  return Cache(
      layers=layers, win_pos=jnp.full((B, W), -1, jnp.int32), win_act=z((B, W, G), jnp.int8),
      count=z((B,), jnp.int32), hi_pages=dense_pages(n_hi), lo_pages=dense_pages(n_lo),
      hi_len=z((G, B), jnp.int32), lo_len=z((G, B), jnp.int32),
      hi_pos=jnp.full((G, B, n_hi * page), -1, jnp.int32),
      lo_pos=jnp.full((G, B, n_lo * lo_page), -1, jnp.int32),
      overflow=z((B,), bool), group_of=tuple(T.group_of_layer(n_layers, n_groups)), sink=int(sink))


_LO_DTYPE = {"bytes": jnp.uint8, "int4": jnp.int4}


def _lo_shapes(n_layers, n_pages, page, hkv, d, fmt):
  """(lo_k, lo_v) shapes of an INT4 pool in format ``fmt``."""
  if fmt == "bytes":
    return ((n_layers, n_pages, page, hkv, d // 2),) * 2
  return (n_layers, n_pages, hkv, page, d), (n_layers, n_pages, hkv, d, page)


def init_for(model, batch: int, policy, *, capacity: int, page: int = 16, **kw) -> Cache:
  """``init`` from a model config (``n_layers``, ``n_kv_heads``, ``head_dim``) and a policy."""
  return init(model.n_layers, batch, model.n_kv_heads, model.head_dim, capacity=capacity,
              window=policy.window, sink=policy.sink, n_groups=policy.n_groups, page=page, **kw)


# ---- helpers ----------------------------------------------------------------------------------

def _flat_row(pages: jax.Array, j: jax.Array, page: int, n_rows: int) -> jax.Array:
  """Entry ``j [G, B, ...]`` through page tables ``pages [G, B, n_pages]`` -> flat pool row, or
  ``n_rows`` (out of range: scatters with mode="drop" skip it) when j is beyond the table."""
  G, B, n_pages = pages.shape
  extra = (1,) * (j.ndim - 2)
  pi = j // page
  ok = (j >= 0) & (pi < n_pages)
  gi = jnp.arange(G).reshape((G, 1) + extra)
  bi = jnp.arange(B).reshape((1, B) + extra)
  pid = pages[gi, bi, jnp.clip(pi, 0, n_pages - 1)]
  return jnp.where(ok, pid * page + j % page, n_rows)


def _flat(x: jax.Array) -> jax.Array:
  """[.., P, page, ...] -> [.., P*page, ...] (the last-but-pool axes untouched)."""
  return x.reshape(x.shape[:-4] + (x.shape[-4] * x.shape[-3],) + x.shape[-2:])


def _quant_kv(k: jax.Array, v: jax.Array, fmt: str = "bytes"):
  """K/V rows [..., D] -> (k codes, v codes, scales [..., 2]) per (token, head) row; codes are
  packed ``uint8 [..., D/2]`` for ``fmt="bytes"``, ``int4 [..., D]`` for "int4"."""
  if fmt == "bytes":
    kq, ks = int4.quantize_packed(k)
    vq, vs = int4.quantize_packed(v)
  else:
    kq, ks = int4.quantize(k)
    vq, vs = int4.quantize(v)
    kq, vq = kq.astype(jnp.int4), vq.astype(jnp.int4)
  return kq, vq, jnp.stack([ks, vs], axis=-1)


def _put_lo(lay: LayerKV, layer, rows: jax.Array, kq: jax.Array, vq: jax.Array,
            s: jax.Array) -> dict:
  """The INT4 pool of ``lay`` (stacked ``[L, ...]``) with flat row ``rows`` of layer ``layer``
  set to codes ``kq, vq`` (from :func:`_quant_kv` in the pool's format) and scales ``s``, in
  either format; ``layer`` and ``rows`` broadcast as in :func:`_put_rows`, rows out of range are
  dropped.  -> dict(lo_k=, lo_v=, lo_s=) for ``LayerKV.replace``."""
  put = lambda x, val: _put_rows(_flat(x), layer, rows, val).reshape(x.shape)
  if int4.format_of(lay.lo_k) == "bytes":
    return dict(lo_s=put(lay.lo_s, s), lo_k=put(lay.lo_k, kq), lo_v=put(lay.lo_v, vq))
  # Row r = page * lo_page + i is lo_k[l, page, :, i, :], lo_v[l, page, :, :, i] and
  # lo_s[l, page, :, :, i]; a row past the pool has page >= P_lo, which mode="drop" drops like
  # the flat row.  XLA on the GPU does the code scatters in place (bench/RESULTS.md,
  # 2026-12-04).  XLA:CPU runs an int4 scatter by widening the whole operand and back (O(pool)
  # per call: slow but correct, fine for tests).
  lo_page = lay.lo_s.shape[-1]
  pg, i = rows // lo_page, rows % lo_page
  u16 = lambda x: jax.lax.bitcast_convert_type(x.astype(jnp.float16), jnp.uint16)
  lo_s = u16(lay.lo_s).at[layer, pg, :, :, i].set(u16(s), mode="drop")   # see _put_rows
  return dict(
      lo_s=jax.lax.bitcast_convert_type(lo_s, jnp.float16),
      lo_k=lay.lo_k.at[layer, pg, :, i, :].set(kq.astype(jnp.int4), mode="drop"),
      lo_v=lay.lo_v.at[layer, pg, :, :, i].set(vq.astype(jnp.int4), mode="drop"))


def _force_sink(actions: jax.Array, pos: jax.Array, sink: int) -> jax.Array:
  """Sink positions stay H forever (B.2): ``actions [..., G]``, ``pos [...]``."""
  return jnp.where((pos < sink)[..., None], jnp.int8(Act.H), actions.astype(jnp.int8))


# ---- prefill ----------------------------------------------------------------------------------

class PrefillRows(NamedTuple):
  """Where a prefill's tokens go (:func:`prefill_rows`), shared by every layer chunk."""
  dest_h: jax.Array   # [G, B, T] flat BF16-pool row per token (rows = drop)
  dest_l: jax.Array   # [G, B, T] flat INT4-pool row per token
  slot: jax.Array     # [B, T] window slot per token (W = drop)


def materialize_prefill(cache: Cache, k: jax.Array, v: jax.Array, plan: jax.Array,
                        lengths: jax.Array | None = None) -> Cache:
  """Store a full-precision prefill into a fresh cache (B.4: retain H, quantize L, release R).

  k, v: [L, B, T, Hkv, D] (post-RoPE, any float dtype); plan: int [B, T, G] actions per prompt
  token; lengths: [B] prompt lengths (default T; rows t >= lengths[b] are padding and ignored).
  The last min(n, W) tokens of each prompt go to the window with their plan as pending actions;
  earlier ones are materialized now.  Sink positions are forced H.  ``cache`` must be empty.
  Equal to :func:`prefill_rows` followed by :func:`write_prefill` of all layers at once; a long
  prefill can be written a chunk of layers at a time with those two (bounded temporaries).
  """
  chex.assert_shape(v, k.shape)
  chex.assert_shape(cache.layers.win_k, (k.shape[0],) + k.shape[1:2] + cache.layers.win_k.shape[2:])
  cache, rows = prefill_rows(cache, plan, k.shape[2], lengths)
  return write_prefill(cache, rows, k, v, 0)


def prefill_rows(cache: Cache, plan: jax.Array, n_tokens: int,
                 lengths: jax.Array | None = None) -> tuple[Cache, PrefillRows]:
  """The layer-independent half of :func:`materialize_prefill`: every map, position, length and
  window entry of the prefill, and the rows its K/V go to (no K/V needed)."""
  B, G, W, Tn = cache.batch, cache.n_groups, cache.window, n_tokens
  chex.assert_shape(plan, (B, Tn, G))
  n = jnp.full((B,), Tn, jnp.int32) if lengths is None else jnp.asarray(lengths, jnp.int32)
  t = jnp.arange(Tn, dtype=jnp.int32)[None, :]                       # [1, T]
  real = t < n[:, None]                                              # [B, T]
  in_win = real & (t >= n[:, None] - W)
  done = real & ~in_win                                              # materialized now
  act = _force_sink(plan, jnp.broadcast_to(t, (B, Tn)), cache.sink)  # [B, T, G]
  lay = cache.layers

  def pool(which, pages, length, pool_k, page):
    sel = done[None] & (jnp.moveaxis(act, -1, 0) == which)           # [G, B, T]
    j = length[..., None] + jnp.cumsum(sel, axis=-1) - 1             # entry index per token
    rows = pool_k.shape[1] * page
    dest = jnp.where(sel, _flat_row(pages, j, page, rows), rows)
    return sel, j, dest, rows

  sel_h, j_h, dest_h, rows_h = pool(Act.H, cache.hi_pages, cache.hi_len, lay.hi_k, cache.page)
  sel_l, j_l, dest_l, rows_l = pool(Act.L, cache.lo_pages, cache.lo_len, lay.lo_k,
                                    cache.lo_page)
  # Positions and lengths per group.
  gi, bi = jnp.arange(G)[:, None, None], jnp.arange(B)[None, :, None]
  tt = jnp.broadcast_to(t[None], (G, B, Tn))
  hi_pos = cache.hi_pos.at[gi, bi, jnp.where(sel_h, j_h, cache.hi_pos.shape[-1])].set(
      tt, mode="drop")
  lo_pos = cache.lo_pos.at[gi, bi, jnp.where(sel_l, j_l, cache.lo_pos.shape[-1])].set(
      tt, mode="drop")
  # Only stored entries count (see begin_step): the entries of one pool go in order, so those
  # past its pages are the last ones and the stored ones keep their indices.
  kept_h, kept_l = sel_h & (dest_h < rows_h), sel_l & (dest_l < rows_l)
  hi_len = cache.hi_len + jnp.sum(kept_h, axis=-1)
  lo_len = cache.lo_len + jnp.sum(kept_l, axis=-1)
  overflow = cache.overflow | jnp.any(sel_h & ~kept_h, axis=(0, 2)) | jnp.any(
      sel_l & ~kept_l, axis=(0, 2))
  # Window bookkeeping.
  slot = jnp.where(in_win, t % W, W)                                 # [B, T]; W = drop
  bj = jnp.arange(B)[:, None]
  win_pos = cache.win_pos.at[bj, slot].set(jnp.broadcast_to(t, (B, Tn)), mode="drop")
  win_act = cache.win_act.at[bj, slot].set(act, mode="drop")
  cache = cache.replace(win_pos=win_pos, win_act=win_act, count=cache.count + n, hi_len=hi_len,
                        lo_len=lo_len, hi_pos=hi_pos, lo_pos=lo_pos, overflow=overflow)
  return cache, PrefillRows(dest_h, dest_l, slot)


def write_prefill(cache: Cache, rows: PrefillRows, k: jax.Array, v: jax.Array,
                  start: int = 0) -> Cache:
  """Write the K/V of layers ``[start, start + k.shape[0])`` (k, v: [Lc, B, T, Hkv, D]) of a
  prefill placed by :func:`prefill_rows`: BF16 copies of H rows, INT4 of L rows (quantized from
  the BF16 values the window would have held), the window's share.  ``start`` is static."""
  Lc, B = k.shape[:2]
  chex.assert_shape(v, k.shape)
  gl = jnp.asarray(cache.group_of, jnp.int32)[start:start + Lc]     # [Lc]
  lay = cache.layers
  li = start + jnp.arange(Lc)[:, None, None]
  d = rows.dest_h[gl]                                                # [Lc, B, T]
  hi_k = _flat(lay.hi_k).at[li, d].set(k.astype(jnp.bfloat16), mode="drop")
  hi_v = _flat(lay.hi_v).at[li, d].set(v.astype(jnp.bfloat16), mode="drop")
  d = rows.dest_l[gl]
  kq, vq, s = _quant_kv(k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), cache.lo_format)
  lo = _put_lo(lay, li, d, kq, vq, s)
  bj = jnp.arange(B)[:, None]
  win_k = lay.win_k.at[li[:, :, :1], bj, rows.slot].set(jnp.asarray(k, jnp.bfloat16), mode="drop")
  win_v = lay.win_v.at[li[:, :, :1], bj, rows.slot].set(jnp.asarray(v, jnp.bfloat16), mode="drop")
  unflat = lambda x, ref: x.reshape(ref.shape)
  layers = LayerKV(win_k=win_k, win_v=win_v, hi_k=unflat(hi_k, lay.hi_k),
                   hi_v=unflat(hi_v, lay.hi_v), **lo)
  return cache.replace(layers=layers)


# ---- decode: the per-step split ---------------------------------------------------------------

def begin_step(cache: Cache, actions: jax.Array, active: jax.Array | None = None):
  """Shared bookkeeping of one decode step -> (cache with new maps/positions/pending, StepPlan).

  actions: int [B, G] pending actions of the new token (controller output); active: bool [B]
  (default all) — an inactive sequence is left untouched by this step and by ``write_step``.
  The new token takes position ``count[b]`` and slot ``count[b] % W``; the token it displaces
  (position count - W, if any) is materialized by its pending actions.
  """
  B, W, G = cache.batch, cache.window, cache.n_groups
  chex.assert_shape(actions, (B, G))
  act_on = jnp.ones((B,), bool) if active is None else jnp.asarray(active, bool)
  p = cache.count
  slot = p % W
  bi = jnp.arange(B)
  evict = act_on & (p >= W)                                          # [B]
  old_pos = cache.win_pos[bi, slot]                                  # [B]
  old_act = cache.win_act[bi, slot].T                                # [G, B]
  def one_pool(which, pages, length, pos, rows, page):
    sel = evict[None] & (old_act == which)                           # [G, B]
    j = length                                                       # next entry
    dest = jnp.where(sel, _flat_row(pages, j, page, rows), rows)     # [G, B]
    cap = pos.shape[-1]
    pos = pos.at[jnp.arange(G)[:, None], bi[None], jnp.where(sel, j, cap)].set(
        jnp.broadcast_to(old_pos[None], (G, B)), mode="drop")
    # An entry past its pages is dropped and does not count: a length beyond the pages would
    # send the kernels' page-table reads past the table (an illegal address on the GPU).
    kept = sel & (dest < rows)
    return dest, length + kept, pos, jnp.any(sel & ~kept, axis=0)

  rows_h = cache.layers.hi_k.shape[1] * cache.page
  rows_l = cache.layers.lo_k.shape[1] * cache.lo_page
  dest_h, hi_len, hi_pos, lost_h = one_pool(Act.H, cache.hi_pages, cache.hi_len, cache.hi_pos,
                                            rows_h, cache.page)
  dest_l, lo_len, lo_pos, lost_l = one_pool(Act.L, cache.lo_pages, cache.lo_len, cache.lo_pos,
                                            rows_l, cache.lo_page)
  wslot = jnp.where(act_on, slot, W)                                 # W: dropped
  new_act = _force_sink(actions, p, cache.sink)
  cache = cache.replace(
      win_pos=cache.win_pos.at[bi, wslot].set(p, mode="drop"),
      win_act=cache.win_act.at[bi, wslot].set(new_act, mode="drop"),
      count=p + act_on.astype(jnp.int32), hi_len=hi_len, lo_len=lo_len, hi_pos=hi_pos,
      lo_pos=lo_pos, overflow=cache.overflow | lost_h | lost_l)
  return cache, StepPlan(slot=wslot, dest_hi=dest_h, dest_lo=dest_l)


def set_pending(cache: Cache, actions: jax.Array, mask: jax.Array) -> Cache:
  """Give each sequence's newest window token (position ``count − 1``) its pending actions
  ``int [B, G]`` where ``mask [B]`` (sinks stay H).

  For a step that decides a token's actions one step after writing it (``begin_step`` then
  wrote a placeholder): the serving engine overlaps the host's grammar work with the device
  this way (serve/engine.py, "Overlap").  A window token is materialized only when it is
  displaced, at least one step later, so the result is the same cache as deciding at once."""
  B, W = cache.batch, cache.window
  p = cache.count - 1
  on = jnp.asarray(mask, bool) & (p >= 0)
  slot = jnp.where(on, p % W, W)                                     # W: dropped
  return cache.replace(win_act=cache.win_act.at[jnp.arange(B), slot].set(
      _force_sink(actions, p, cache.sink), mode="drop"))


def _read_evicted(lay: LayerKV, layer, bi, read):
  """(old K rows, old V rows, window K, window V): the window rows ``read[b]`` of sequence b
  in layer(s) ``layer``, behind one barrier with the windows themselves, so no window write
  (which takes the returned windows) can be scheduled before these reads; otherwise XLA GPU
  copied whole stacked windows to keep the old rows readable."""
  return jax.lax.optimization_barrier(
      (lay.win_k[layer, bi, read], lay.win_v[layer, bi, read], lay.win_k, lay.win_v))


def evict_step(cache: Cache, plan: StepPlan) -> Cache:
  """Materialize the token leaving the window, in every layer at once (one scatter per pool
  array for the whole stack), before any layer writes its new K/V.  Then ``write_step(...,
  evict=False)`` only writes the window row: 2 small scatters per layer instead of 7 (on the
  H200 each is a launch-bound ~3 µs kernel; 36 layers x 5 saved ~ 0.5 ms per step)."""
  lay = cache.layers
  Lyr, B, W = lay.win_k.shape[:3]
  bi = jnp.arange(B)
  read = jnp.minimum(plan.slot, W - 1)
  old_k, old_v, win_k, win_v = _read_evicted(lay, slice(None), bi, read)   # [L, B, Hkv, D]
  gl = jnp.asarray(cache.group_of, jnp.int32)
  dh, dl = plan.dest_hi[gl], plan.dest_lo[gl]                        # [L, B]
  li = jnp.arange(Lyr)[:, None]

  def put(x, rows, val):
    return _put_rows(_flat(x), li, rows, val).reshape(x.shape)

  kq, vq, sc = _quant_kv(old_k, old_v, cache.lo_format)
  return cache.replace(layers=lay.replace(
      win_k=win_k, win_v=win_v, hi_k=put(lay.hi_k, dh, old_k), hi_v=put(lay.hi_v, dh, old_v),
      **_put_lo(lay, li, dl, kq, vq, sc)))


def write_step(cache: Cache, plan: StepPlan, layer, k: jax.Array, v: jax.Array, *,
               evict: bool = True) -> Cache:
  """One layer's K/V update for a step, for layer ``layer`` (may be traced) on the stacked
  arrays: materialize the evicted window token into this layer's pools (by the layer group's
  decision) and write the new ``k, v [B, Hkv, D]`` into the window.  It scatters only the
  rows that change (the evicted token's pool row, the new window row).  In a jitted step whose
  cache is donated, or a ``lax.scan`` carry, XLA does these in place, so a step costs O(rows
  written) rather than a copy of every layer's pools.
  ``evict=False``: :func:`evict_step` already moved the evicted token; write the window only."""
  lay = cache.layers
  B, W = lay.win_k.shape[1:3]
  chex.assert_shape(k, (B,) + lay.win_k.shape[3:])
  bi = jnp.arange(B)

  def win(x, val):         # [L, B, W, ...]: slot ``plan.slot[b]`` of sequence b (W: none)
    rows = jnp.where(plan.slot < W, bi * W + plan.slot, B * W)
    flat = x.reshape((x.shape[0], B * W) + x.shape[3:])
    return _put_rows(flat, layer, rows, val).reshape(x.shape)

  if not evict:
    return cache.replace(layers=lay.replace(win_k=win(lay.win_k, k), win_v=win(lay.win_v, v)))
  g = group_array(cache)[layer]
  read = jnp.minimum(plan.slot, W - 1)
  old_k, old_v, win_k, win_v = _read_evicted(lay, layer, bi, read)         # [B, Hkv, D]
  dh, dl = plan.dest_hi[g], plan.dest_lo[g]                                # [B]

  def put(x, rows, val):   # [L, P, page, ...] pool: row ``rows`` of layer ``layer`` <- val
    return _put_rows(_flat(x), layer, rows, val).reshape(x.shape)

  kq, vq, s = _quant_kv(old_k, old_v, cache.lo_format)
  return cache.replace(layers=LayerKV(
      win_k=win(win_k, k), win_v=win(win_v, v),
      hi_k=put(lay.hi_k, dh, old_k), hi_v=put(lay.hi_v, dh, old_v),
      **_put_lo(lay, layer, dl, kq, vq, s)))


def _put_rows(x: jax.Array, layer, rows: jax.Array, val: jax.Array) -> jax.Array:
  """x [L, R, ...]: row ``rows[b]`` of layer ``layer`` <- ``val[b]``; rows >= R are dropped.
  ``layer`` may also be an index array broadcast against ``rows`` (several layers at once)."""
  val = val.astype(x.dtype)

  def bits_scatter(x, layer, rows, val):
    # XLA's CPU backend runs a bf16/f16 scatter (or dynamic-update-slice) by widening the WHOLE
    # operand to f32 and back, per update: O(B x pool) per step.  On the same bits as uint16 the
    # scatter is an integer scatter; the two bitcasts cost at most one pass over the pool.
    if jnp.dtype(x.dtype).itemsize != 2 or not jnp.issubdtype(x.dtype, jnp.floating):
      return x.at[layer, rows].set(val, mode="drop")
    u = jax.lax.bitcast_convert_type(x, jnp.uint16)
    u = u.at[layer, rows].set(jax.lax.bitcast_convert_type(val, jnp.uint16), mode="drop")
    return jax.lax.bitcast_convert_type(u, x.dtype)

  scatter = lambda x, layer, rows, val: x.at[layer, rows].set(val, mode="drop")
  # By the platform the step is lowered for (not the default backend: AOT lowers across).
  return jax.lax.platform_dependent(x, layer, rows, val, cpu=bits_scatter, default=scatter)


def group_array(cache: Cache) -> jax.Array:
  """``int32[L]``: the layer group of every layer (for a lax.scan over layers)."""
  return jnp.asarray(cache.group_of, jnp.int32)


def kernel_inputs(lkv: LayerKV, cache: Cache, g) -> tuple[Window, HighPool, LowPool, PageMaps]:
  """The ``pallas_kernels.types`` inputs of one layer whose group is ``g`` (may be traced);
  ``cache`` supplies the shared maps (use the cache returned by ``begin_step``).  With
  ``lkv = cache.layers`` (stacked) they are the inputs of ``decode_attention(..., layer=ℓ)``."""
  return (Window(lkv.win_k, lkv.win_v, cache.win_len),
          HighPool(lkv.hi_k, lkv.hi_v),
          LowPool(lkv.lo_k, lkv.lo_v, lkv.lo_s),
          PageMaps(cache.hi_pages[g], cache.hi_len[g], cache.lo_pages[g], cache.lo_len[g]))


# ---- engine-owned paging (serve/) -------------------------------------------------------------
# A server sizes the pools for its capacity (not batch × capacity) and hands out pages per
# sequence slot; these functions are the device half of that, the free lists live in the engine.

def init_paged(n_layers: int, batch: int, n_kv_heads: int, head_dim: int, *, capacity: int,
               window: int, hi_pool_pages: int, lo_pool_pages: int, sink: int = 0,
               n_groups: int = 3, page: int = 16, lo_page: int | None = None,
               lo_format: str = "bytes") -> Cache:
  """An empty cache of ``batch`` slots whose pools hold ``hi_pool_pages``/``lo_pool_pages`` pages
  shared by all slots; ``capacity`` (tokens per slot) sizes each slot's page tables.  ``page``:
  rows per BF16 page, ``lo_page``: rows per INT4 page (None: ``page``; :func:`init`).

  Every page-table entry starts unassigned: it holds the pool's page count, the first
  out-of-range id, so a write through it is dropped by the scatters' ``mode="drop"`` and the
  kernels (which read only entries below ``*_len``) never see it.  The engine assigns pages with
  :func:`insert_slot`.  Pools need at least one page (zero-size pools do not index).
  ``lo_format``: the INT4 pool's storage format (:func:`init`).
  """
  if hi_pool_pages < 1 or lo_pool_pages < 1:
    raise ValueError("each pool needs at least one page")
  lo_page = page if lo_page is None else int(lo_page)
  # one page per sequence in each pool: only the layout is taken from it
  base = init(n_layers, batch, n_kv_heads, head_dim, capacity=page, lo_capacity=lo_page,
              window=window, sink=sink, n_groups=n_groups, page=page, lo_page=lo_page,
              lo_format=lo_format)
  G, B = n_groups, batch
  n, n_lo = math.ceil(capacity / page), math.ceil(capacity / lo_page)
  pool = lambda x, P: jnp.zeros((n_layers, P) + x.shape[2:], x.dtype)
  lay = base.layers
  layers = lay.replace(hi_k=pool(lay.hi_k, hi_pool_pages), hi_v=pool(lay.hi_v, hi_pool_pages),
                       lo_k=pool(lay.lo_k, lo_pool_pages), lo_v=pool(lay.lo_v, lo_pool_pages),
                       lo_s=jnp.ones((n_layers, lo_pool_pages) + lay.lo_s.shape[2:], jnp.float16))
  return base.replace(
      layers=layers, hi_pages=jnp.full((G, B, n), hi_pool_pages, jnp.int32),
      lo_pages=jnp.full((G, B, n_lo), lo_pool_pages, jnp.int32),
      hi_pos=jnp.full((G, B, n * page), -1, jnp.int32),
      lo_pos=jnp.full((G, B, n_lo * lo_page), -1, jnp.int32))


def _slot_state(cache: Cache, hi_row: jax.Array, lo_row: jax.Array) -> dict:
  """The per-sequence fields of an empty batch-1 sequence with page rows ``[n_pages]`` (the same
  for every layer group) or ``[G, n_pages]``."""
  G, W = cache.n_groups, cache.window
  rows = lambda r, n: jnp.broadcast_to(jnp.asarray(r, jnp.int32), (G, n))[:, None]
  return dict(
      win_pos=jnp.full((1, W), -1, jnp.int32), win_act=jnp.zeros((1, W, G), jnp.int8),
      count=jnp.zeros((1,), jnp.int32),
      hi_pages=rows(hi_row, cache.hi_pages.shape[2]),
      lo_pages=rows(lo_row, cache.lo_pages.shape[2]),
      hi_len=jnp.zeros((G, 1), jnp.int32), lo_len=jnp.zeros((G, 1), jnp.int32),
      hi_pos=jnp.full((G, 1, cache.hi_pos.shape[2]), -1, jnp.int32),
      lo_pos=jnp.full((G, 1, cache.lo_pos.shape[2]), -1, jnp.int32),
      overflow=jnp.zeros((1,), bool))


# Axis of the batch in each per-sequence field (the layers' windows are axis 1).
_SEQ_AXIS = dict(win_pos=0, win_act=0, count=0, hi_pages=1, lo_pages=1, hi_len=1, lo_len=1,
                 hi_pos=1, lo_pos=1, overflow=0)


def _put_slot(cache: Cache, slot, part: dict) -> dict:
  put = lambda name: jax.lax.dynamic_update_slice_in_dim(getattr(cache, name), part[name], slot,
                                                         _SEQ_AXIS[name])
  return {name: put(name) for name in _SEQ_AXIS}


def insert_slot(cache: Cache, slot, k: jax.Array, v: jax.Array, plan: jax.Array, length,
                hi_row: jax.Array, lo_row: jax.Array) -> Cache:
  """Reset sequence ``slot`` (may be traced) and store one prompt's full-precision prefill there.

  k, v: [L, 1, T, Hkv, D]; plan: int [1, T, G]; length: int [1]; hi_row/lo_row: int32
  ``[G, n_pages]`` the slot's page table per layer group, or ``[n_pages]`` for the same pages in
  every group.  A page id names one page in each layer of the pool and layer groups own
  disjoint layers, so groups may reuse each other's ids: the engine keeps one free list per
  (pool, group).  Exactly
  :func:`materialize_prefill` on a batch-1 view that shares the pools, written back into the
  slot; other slots are untouched (their pages are disjoint, which the engine guarantees).
  """
  lay = cache.layers
  win = lambda x: jnp.zeros((x.shape[0], 1) + x.shape[2:], x.dtype)
  one = cache.replace(layers=lay.replace(win_k=win(lay.win_k), win_v=win(lay.win_v)),
                      **_slot_state(cache, hi_row, lo_row))
  one = materialize_prefill(one, k, v, plan, length)
  put = lambda full, part: jax.lax.dynamic_update_slice_in_dim(full, part, slot, 1)
  layers = one.layers.replace(win_k=put(lay.win_k, one.layers.win_k),
                              win_v=put(lay.win_v, one.layers.win_v))
  return cache.replace(layers=layers, **_put_slot(cache, slot, {n: getattr(one, n)
                                                                 for n in _SEQ_AXIS}))


def release_slot(cache: Cache, slot) -> Cache:
  """Empty sequence ``slot`` (may be traced): no tokens, every page-table entry unassigned, so
  the slot references none of the pages the engine hands to other requests.  Pool contents
  are left as they are (the next owner overwrites before it reads)."""
  n_hi, n_lo = cache.layers.hi_k.shape[1], cache.layers.lo_k.shape[1]
  part = _slot_state(cache, jnp.full((cache.hi_pages.shape[2],), n_hi, jnp.int32),
                     jnp.full((cache.lo_pages.shape[2],), n_lo, jnp.int32))
  return cache.replace(**_put_slot(cache, slot, part))


def assign_pages(cache: Cache, hi_new: jax.Array, lo_new: jax.Array) -> Cache:
  """Give sequences new pages on demand, inside the jitted step (traced ids: no recompile).

  hi_new/lo_new: int32 ``[G, B]``, the id of a fresh page for the next entry of (group g,
  sequence b) — the page that entry ``*_len[g, b]`` starts, written at table index
  ``*_len // page`` — or -1 for none.  The engine passes an id exactly when the token leaving
  the window at this step starts a new page of that pool (it mirrors the pending actions).
  """
  def put(pages, length, new, page):
    G, B, n = pages.shape
    idx = jnp.where(new >= 0, length // page, n)                    # n: dropped
    return pages.at[jnp.arange(G)[:, None], jnp.arange(B)[None], idx].set(new, mode="drop")

  return cache.replace(
      hi_pages=put(cache.hi_pages, cache.hi_len, jnp.asarray(hi_new, jnp.int32), cache.page),
      lo_pages=put(cache.lo_pages, cache.lo_len, jnp.asarray(lo_new, jnp.int32), cache.lo_page))


# ---- HBM bytes of a decode step (b_HBM: docs/SPHERICAL_KV.md §4 "b_HBM as built") --------------

GRANULARITIES = ("row", "page")
TABLE_ENTRY_BYTES = 4   # an int32 page-table entry


def check_granularity(granularity: str) -> str:
  """``granularity`` if it is one of :data:`GRANULARITIES`, else a one-line ValueError."""
  if granularity not in GRANULARITIES:
    raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
  return granularity


def granularity_of(backend: str) -> str:
  """The access granularity of an attention backend (``pallas_kernels.resolve_backend``'s
  names): "page" for the TPU kernels (a block is a whole page), "row" for the GPU kernels
  (token-granular masked gathers) and for the reference, which is charged as the GPU kernels
  read (the hardware the byte model is for)."""
  return "page" if backend == "tpu" else "row"


def paged_read_bytes(length, table_pages: int, page: int, row_bytes: float,
                     granularity: str = "row") -> np.ndarray:
  """HBM bytes one attention kernel reads from ONE paged partition of one layer, per table:
  ``length`` (array) visible entries of ``row_bytes`` each, reached through a page table of
  ``table_pages`` entries of ``page`` rows (float64, same shape as ``length``).

  "row" (the Pallas-Triton kernels: masked token-granular loads): the visible rows and the table
  entries they name, ``length·row_bytes + ceil(length/page)·4``.  "page" (the Pallas-TPU kernels:
  one block is one page, the index maps clamp steps past the last visible page to it, and the
  table travels whole as scalar prefetch): ``max(1, ceil(length/page))·page·row_bytes +
  table_pages·4`` (an empty partition still fetches the page its first step names), nothing when
  the table has no entries (the kernel leaves the partition out)."""
  n = np.asarray(length, np.float64)
  used = np.ceil(n / page)
  if check_granularity(granularity) == "row":
    return n * row_bytes + used * TABLE_ENTRY_BYTES
  if table_pages <= 0:
    return np.zeros_like(n)
  return np.maximum(used, 1.0) * page * row_bytes + table_pages * TABLE_ENTRY_BYTES


def _window_rows(count, window: int, granularity: str) -> np.ndarray:
  """Window slots a kernel reads per sequence and layer: the visible ones (row) or the whole
  ring (page: the TPU kernel's window block is every slot of every KV head)."""
  count = np.asarray(count, np.float64)
  if check_granularity(granularity) == "row":
    return np.minimum(count, window)
  return np.full_like(count, float(window))


def hbm_bytes(cache: Cache, *, param_bytes: float = 0.0, batch: int | None = None,
              granularity: str = "row") -> np.ndarray:
  """HBM bytes per generated token of one decode step over ``cache`` as it stands, per sequence:
  float64 ``[B]`` (host side; exact integers up to 2**53).

  ``param_bytes / batch`` (the weights, read once per step for the whole batch; ``batch``
  defaults to the cache's) plus, in every layer, what the attention kernels read of this
  sequence: the window (BF16 K+V, ``4·D`` bytes per slot and KV head), the BF16 pool (``4·D``
  per entry and KV head), the INT4 pool (``D/2 + D/2`` code bytes and two fp16 scales, ``D + 4``
  per entry and KV head), and the two page tables (one per (group, sequence), shared by the KV
  heads), at the ``granularity`` of :func:`paged_read_bytes`.  Layers of a group read the
  group's maps each.  Not counted: queries, outputs and partials, lengths and other per-call
  scalars, the step's own writes (the new token into the window, the evicted one into its pool),
  activations and logits."""
  lay = cache.layers
  L, B, W, H, D = lay.win_k.shape
  batch = B if batch is None else int(batch)
  if batch < 1:
    raise ValueError(f"batch must be >= 1, got {batch}")
  per_layer = np.bincount(np.asarray(cache.group_of, np.int64), minlength=cache.n_groups)
  n_hi = cache.hi_pages.shape[-1] if lay.hi_k.shape[1] else 0
  n_lo = cache.lo_pages.shape[-1] if lay.lo_s.shape[1] else 0
  hi = paged_read_bytes(np.asarray(cache.hi_len), n_hi, cache.page, H * 4 * D, granularity)
  lo = paged_read_bytes(np.asarray(cache.lo_len), n_lo, cache.lo_page, H * (D + 4), granularity)
  win = _window_rows(np.asarray(cache.count), W, granularity) * H * 4 * D
  kv = L * win + np.sum(per_layer[:, None] * (hi + lo), axis=0)
  return param_bytes / batch + kv


def dense_hbm_bytes(n_tokens, *, n_layers: int, n_kv_heads: int, head_dim: int, window: int,
                    page: int = 16, table_pages: int | None = None, param_bytes: float = 0.0,
                    batch: int = 1, granularity: str = "row") -> np.ndarray:
  """:func:`hbm_bytes` of paged dense BF16 holding ``n_tokens`` (array) per sequence: every
  token past the ``window`` in the BF16 pool (PASK's all-high policy), no INT4 pool — the
  reference b_HBM divides by.  ``table_pages``: the BF16 page table's length ("page" reads it
  whole; default: the pages the tokens fill)."""
  n = np.asarray(n_tokens, np.float64)
  w = _window_rows(n, window, granularity)
  pool = n - np.minimum(n, window)
  if table_pages is None:
    table_pages = int(np.max(np.ceil(pool / page), initial=0))
  row = n_kv_heads * 4 * head_dim
  kv = w * row + paged_read_bytes(pool, table_pages, page, row, granularity)
  return param_bytes / batch + n_layers * kv


def dense_hbm_bytes_of(cache: Cache, *, granularity: str = "row") -> np.ndarray:
  """:func:`dense_hbm_bytes` of paged dense BF16 holding the tokens ``cache`` holds, with its
  shapes, window, page size and BF16 table length (b_HBM's reference for a runner over it)."""
  L, _, W, H, D = cache.layers.win_k.shape
  return dense_hbm_bytes(np.asarray(cache.count), n_layers=L, n_kv_heads=H, head_dim=D,
                         window=W, page=cache.page, table_pages=cache.hi_pages.shape[-1],
                         granularity=granularity)
