"""The INT4 partition as a Pallas Mosaic GPU kernel (Hopper), with its jnp emulation beside it.

Operand swap throughout: tokens on the wgmma M side, the query heads of one KV head (padded to 16)
on N, so the INT4 tile is the register A operand and no MMA is padded to 64 query rows.

* ``S^T[T, 16] = K[T, D] . q^T``: K upcast int4 -> bf16 in registers, q^T from shared memory. The
  per-token K scale times ``qk_scale`` (``sm_scale * log2(e)``) multiplies the rows of ``S^T``
  after the MMA: the codes are never scaled and q is never rounded after scaling.
* Online softmax per column (query head) over the rows (tokens), base 2. The row sums stay
  per element (``lazy_sum``) and are reduced across warps once per split, not once per tile.
* ``O^T[D, 16] += V^T[D, T] . P^T[T, 16]``, the per-token V scale folded into the rows of
  ``P^T`` (a [T, 16] multiply instead of [T, D]). No 4-bit transposing load exists, so V comes
  either dim-major (``v[BH, D, N]``, ``v_major="dim"``: upcast in registers into the A operand
  like K) or token-major (``v[BH, N, D]``, ``v_major="token"``: upcast into a bf16 shared-memory
  tile that wgmma reads transposed). Dim-major is the faster (bench/RESULTS.md).

Per (batch x KV head, context split) it writes the unnormalized ``O^T``, the running max and the
sum of the split (base 2), broadcast over D so every output is one [D, 16] tile; :func:`merge`
combines the splits by the log-sum-exp rule. :func:`partition_reference` is the same algorithm
in jnp (the same tiles, splits, roundings and merge), which the CPU tests check against the
float32 math of :func:`attend_reference`.

Shapes: ``q[BH, 16, D]`` bf16 (G <= 16 query heads per KV head, zero rows after them),
``k[BH, N, D]`` int4 (jax's packing: element 2j in the low nibble of byte j; :func:`int4_view`
reads our half-split bytes that way), ``ks, vs[BH, N]`` f32 scales, ``lens[BH]`` int32 visible
keys. Contiguous keys per row, or (``tbl`` given) a paged pool of head-major int4 pages: the
cache's INT4 pool when it is made with ``lo_format="int4"`` (``mgpu_decode`` runs it behind
``decode_attention``'s GPU backend, ``base`` picking the layer of the stacked codes).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import common
from pallas_kernels.gpu import mgpu_upcast
from pallas_kernels.gpu.mgpu_common import (  # noqa: F401 - N_PAD, HAS_CONCAT, ...: re-exported
    FLOOR as _FLOOR, HAS_CONCAT, LOG2E, N_PAD, SM90_SMEM, check_cols as _check_cols,
    has_concat, load as _load, params as _params, smem_bytes, softmax_tile as _softmax_tile,
    store_partials as _store_partials, transforms as _transforms, zeros as _zeros)

Q_LO = 254.0        # q's int8 low half is in units of scale / Q_LO (split_q)
K_UPCASTS = ("bf16", "bf16_up4", "bf16_perm", "bf16_perm_offset", "s8")
V_UPCASTS = ("bf16", "bf16_up4", "bf16_perm")


def _operand(ref, how: str):
  """An INT4 shared-memory tile -> wgmma A operand registers (bf16, or int8 for "s8"), by the
  kernels' ``k_upcast`` / ``v_upcast`` (:func:`partition`)."""
  if how == "s8":
    return _load(ref, plgpu.Layout.WGMMA_8BIT).astype(jnp.int8)
  if how == "bf16_up4":
    x = plgpu.layout_cast(_load(ref, plgpu.Layout.WGMMA_UPCAST_4X), plgpu.Layout.WGMMA)
    return x.astype(jnp.bfloat16)
  if how in ("bf16_perm", "bf16_perm_offset"):   # columns permuted: so is q (the callers)
    return mgpu_upcast.operand(ref, sub=how == "bf16_perm")
  return ref[...].astype(jnp.bfloat16)


@functools.partial(jax.jit, static_argnames=("tile", "stages", "splits", "lazy_sum", "v_major",
                                             "qk_scale", "k_upcast", "v_upcast", "approx_math",
                                             "no_auto_barriers", "cols", "table", "early_v"))
def partition(q, k, ks, v, vs, lens, qscale=None, tbl=None, base=None, *, tile: int = 128,
              stages: int = 2, splits: int = 8, lazy_sum: bool = True, v_major: str = "dim",
              qk_scale: float = 1.0, k_upcast: str = "bf16", v_upcast: str = "bf16",
              approx_math: bool = False, no_auto_barriers: bool = False, cols: int = N_PAD,
              table: str = "gmem", early_v: bool = False):
  """-> (o[BH, splits, D, 16] f32 unnormalized O^T, m[BH, splits, D, 16], l[BH, splits, D, 16]).

  ``tbl[B, n_pages]`` int32 (paged): ``k``, ``v``, ``ks``, ``vs`` are a pool of head-major
  pages of ``tile`` tokens (:func:`pool_shapes`), read through the page table in the TMA index
  map, one page per pipeline step; ``q`` and ``lens`` stay per (sequence, KV head), head minor.
  ``base`` (paged only; int32 ``[1]``, default 0) is added to every page id of the codes but not
  of the scales, as in ``mgpu_paged.partition_paged``: codes of a layer stack ``[L * P, ...]``
  read at one layer's pages, with that layer's scales ``[P, Hkv, tile]`` alone.
  ``vs=None`` (paged only): ``ks[P, Hkv, 2, tile]`` holds both, the K plane then the V plane of
  each (page, head), in the pool's own dtype (the cache's fp16, upcast in the kernel) and with
  the codes' pages (``base`` offsets both): the cache's "int4" scales as stored.

  ``v_major="token"``: ``v[BH, N, D]``, upcast into a bf16 shared-memory tile read transposed.
  ``v_major="dim"``: ``v[BH, D, N]`` (V stored transposed), upcast in registers straight into
  wgmma's A operand like K, so no bf16 tile round trip.

  How an INT4 tile becomes an A operand (``k_upcast`` for K, ``v_upcast`` for dim-major V):
  ``"bf16"`` loads it in the 16-bit wgmma layout and upcasts there; ``"bf16_up4"`` loads it in
  the 4x-upcast layout (32-bit shared-memory loads), relayouts the packed codes (two shuffles per
  register) and upcasts; ``"bf16_perm"`` loads it in the 4x-upcast layout and upcasts in
  registers straight into the wgmma layout of the tile with its minor axis permuted
  (:mod:`pallas_kernels.gpu.mgpu_upcast`: no byte loads, no shuffles): for K the head dim, with
  ``q`` permuted the same way before the kernel (``"bf16_perm_offset"``, K only: without the
  conversion's bf16 subtract, every K value plus 136, and ``136 * sum(q)`` taken off the scores
  after the MMA, one subtract per score instead of one per two codes); for V (dim-major) the
  tokens, so the codes must be stored with each tile's tokens in ``mgpu_upcast.store_order``
  (the caller stores them so; ``P^T`` is unchanged); ``"s8"`` (K only) upcasts to int8 in the
  8-bit layout for two s8 wgmmas against ``q`` split into int8 halves (``q[BH, 2, 16, D]`` int8
  and ``qscale[BH]`` f32 from :func:`split_q`), exact integer products combined in f32.

  ``cols=8`` (at most 8 query heads per KV head, as in Qwen's 4:1 and 7:1 models): the MMAs stay
  16 wide (the narrowest P^T tile Mosaic GPU can swizzle), but the softmax, the row sums and the
  output rescaling work on the first 8 columns only and P^T's other 8 are zeros; the outputs'
  columns 8-15 are zeros (``l = 0``, which :func:`merge` reads as empty).

  ``table`` (paged only): where the TMA index maps read the page ids. ``"gmem"``: the table in
  global memory, one scalar load per box per step, whose latency the computing warps wait out
  before they can issue the step's copies; ``"smem"``: each block's ``steps`` page ids are
  copied into shared memory once at the start (the table regrouped per (sequence, split) and
  padded to 128 bytes in XLA), so a step's ids are shared-memory loads.

  ``early_v`` (dim-major V, bf16 K): V's A operand is upcast while the scores' MMAs run (issued
  before their accumulator is read) instead of after the softmax, so its ALU work overlaps the
  tensor cores; both operands' registers are then live at once.
  """
  _check_table(table)
  if early_v and (v_major != "dim" or k_upcast == "s8"):
    raise ValueError(f"early_v upcasts dim-major V beside bf16 K tiles; got v_major={v_major!r}, "
                     f"k_upcast={k_upcast!r}")
  planes = vs is None
  if tbl is None:
    if base is not None:
      raise ValueError("base offsets the page ids of a paged pool: it needs tbl")
    if planes:
      raise ValueError("vs=None (K and V scale planes in ks) is for a paged pool: it needs tbl")
    bh, n, d = k.shape
    hkv = 1
    _check(q, k, ks, v, vs, lens, tile=tile, splits=splits, v_major=v_major, stages=stages,
           k_upcast=k_upcast, v_upcast=v_upcast, qscale=qscale)
    tbl = jnp.zeros((1, 1), jnp.int32)     # unread
    paged = False
  else:
    _check_pool(q, k, ks, v, vs, lens, tbl, tile=tile, splits=splits, v_major=v_major,
                stages=stages, k_upcast=k_upcast, v_upcast=v_upcast, stacked=base is not None)
    bh, (_, hkv, _, d), n = q.shape[0], k.shape, tbl.shape[1] * tile
    paged = True
  base = jnp.zeros((1,), jnp.int32) if base is None else jnp.asarray(base, jnp.int32).reshape(1)
  if cols != N_PAD and not lazy_sum:
    raise ValueError(f"cols={cols} needs lazy_sum=True")
  narrow = _check_cols(cols)
  if qscale is None:
    qscale = jnp.ones((1,), jnp.float32)      # unread (k_upcast "s8" alone reads it): no [BH] fill
  offset = k_upcast == "bf16_perm_offset"
  if k_upcast in ("bf16_perm", "bf16_perm_offset"):   # K's head dim comes permuted (mgpu_upcast)
    q = mgpu_upcast.permute_minor(q, tile)
  if offset:     # K's values come as code + 136: the scores carry 136 * sum(q), taken off after
    qscale = mgpu_upcast.OFFSET * q.astype(jnp.float32).sum(-1)            # [BH, 16]
    qscale = jnp.pad(qscale, ((0, 0), (0, 2 * N_PAD - qscale.shape[1])))   # 128 bytes a copy
  steps = n // tile // splits
  in_smem = paged and table == "smem"
  if in_smem:
    tbl, ids = _block_ids(tbl, splits, steps)
  k_elems, k_tr = _transforms(d, k.dtype, "keys")
  q_elems, q_tr = _transforms(d, q.dtype, "queries")
  # wgmma wants equal swizzles for its two shared-memory operands; P^T's rows are 32 bytes.
  _, p_tr = _transforms(N_PAD, jnp.bfloat16, "probabilities")
  _, vb_tr = _transforms(d, jnp.bfloat16, "values", swz=32)
  _, vt_tr = _transforms(tile, v.dtype, "transposed values")
  kslice = min(k_elems, q_elems, d)
  row = plgpu.Layout.WGMMA.reduce(1)
  col = plgpu.Layout.WGMMA.reduce(0)

  s8 = k_upcast == "s8"

  def body(q_gmem, k_gmem, ks_gmem, v_gmem, vs_gmem, lens_gmem, qs_gmem, tbl_gmem, base_gmem,
           o_gmem, m_gmem, l_gmem, q_smem, vb_smem, p_smem, o_smem, tbl_smem, cs_smem, bar):
    b = lax.axis_index("bh")
    sp = lax.axis_index("sp")
    length = lens_gmem[b]
    plgpu.copy_gmem_to_smem(q_gmem.at[b], q_smem, bar.at[0])
    if offset:
      plgpu.copy_gmem_to_smem(qs_gmem.at[b], cs_smem, bar.at[2])
      plgpu.barrier_wait(bar.at[2])
      shift = _load(cs_smem.at[pl.ds(0, N_PAD)], col)                      # [16] 136 sum(q)
    if in_smem:
      plgpu.copy_gmem_to_smem(tbl_gmem.at[b // hkv, sp], tbl_smem, bar.at[1])
      plgpu.barrier_wait(bar.at[1])
    plgpu.barrier_wait(bar.at[0])

    def step(idx, k_smem, ks_smem, v_smem, vs_smem, carry):
      m, l, acc = carry

      def scores(acc_ref):
        kr = _operand(k_smem, k_upcast)
        for j in range(d // kslice):
          sl = slice(j * kslice, (j + 1) * kslice)
          plgpu.wgmma(acc_ref, kr[:, sl], q_smem.at[:, sl].T)
        # issued, not waited on: V's upcast here runs beside the MMAs (the read below waits)
        vr = _operand(v_smem, v_upcast) if early_v else None
        return acc_ref[...], vr

      def scores_s8(refs):
        hi, lo = refs
        kr = _operand(k_smem, "s8")
        for j in range(d // kslice):
          sl = slice(j * kslice, (j + 1) * kslice)
          plgpu.wgmma(hi, kr[:, sl], q_smem.at[0, :, sl].T)
          plgpu.wgmma(lo, kr[:, sl], q_smem.at[1, :, sl].T)

      kscale = _load(ks_smem, row).astype(jnp.float32)
      if s8:
        zero = plgpu.layout_cast(jnp.zeros((tile, N_PAD), jnp.int32), plgpu.Layout.WGMMA)
        hi, lo = pl.run_state(scores_s8)((plgpu.ACC.init(zero), plgpu.ACC.init(zero)))
        s = hi.astype(jnp.float32) + lo.astype(jnp.float32) * (1.0 / Q_LO)
        scale = kscale * (qk_scale * qs_gmem[b])
      else:
        s, vr = pl.run_scoped(scores, plgpu.ACC((tile, N_PAD), jnp.float32))
        if offset:
          s = s - lax.broadcast_in_dim(shift, s.shape, [1])
        scale = kscale * qk_scale
      if narrow:
        s = s[:, :cols]
      p, alpha, m_new, l = _softmax_tile(s, scale, _load(vs_smem, row).astype(jnp.float32),
                                         (sp * steps + idx[0]) * tile, length, m, l,
                                         lazy_sum=lazy_sum)
      if narrow:
        p = jnp.concatenate([p, _zeros((tile, N_PAD - cols))], axis=1)
      p_smem[...] = p.astype(jnp.bfloat16)
      if v_major == "token":
        vb_smem[...] = v_smem[...].astype(jnp.bfloat16)
      plgpu.commit_smem()

      def pv(acc_ref):
        if v_major == "token":
          plgpu.wgmma(acc_ref, vb_smem.T, p_smem)
        else:
          plgpu.wgmma(acc_ref, vr if early_v else _operand(v_smem, v_upcast), p_smem)
        return acc_ref[...]

      # A fresh accumulator plus an add ([D, 16] adds) instead of run_state over the old one.
      acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [1])
      out = pl.run_scoped(pv, plgpu.ACC((d, N_PAD), jnp.float32))
      acc = acc + (out[:, :cols] if narrow else out)
      return m_new, l, acc

    cast = plgpu.layout_cast
    m0 = cast(jnp.full((cols,), _FLOOR, jnp.float32), col)
    l0 = _zeros((tile, cols)) if lazy_sum else cast(jnp.zeros((cols,), jnp.float32), col)
    a0 = _zeros((d, cols))
    if paged:     # one page per step: its table entry picks the box, the head its row
      seq, hd = b // hkv, lax.rem(b, hkv)
      pg = (lambda i: tbl_smem[i]) if in_smem else (lambda i: tbl_gmem[seq, sp * steps + i])
      code_pg = lambda i: pg(i) + base_gmem[0]        # the codes' layer offset (not the scales')
      rows = plgpu.BlockSpec((None, None, tile, d), lambda i: (code_pg(i), hd, 0, 0),
                             transforms=k_tr)
      if planes:    # [P, Hkv, 2, tile]: plane 0 K, plane 1 V, at the codes' pages
        sc = plgpu.BlockSpec((None, None, None, tile), lambda i: (code_pg(i), hd, 0, 0))
        sc_v = plgpu.BlockSpec((None, None, None, tile), lambda i: (code_pg(i), hd, 1, 0))
      else:
        sc = sc_v = plgpu.BlockSpec((None, None, tile), lambda i: (pg(i), hd, 0))
      cols_v = plgpu.BlockSpec((None, None, d, tile), lambda i: (code_pg(i), hd, 0, 0),
                               transforms=vt_tr)
      refs = (k_gmem, ks_gmem, v_gmem, vs_gmem)
    else:
      rows = plgpu.BlockSpec((tile, d), lambda i: (sp * steps + i, 0), transforms=k_tr)
      sc = sc_v = plgpu.BlockSpec((tile,), lambda i: (sp * steps + i,))
      cols_v = plgpu.BlockSpec((d, tile), lambda i: (0, sp * steps + i), transforms=vt_tr)
      refs = (k_gmem.at[b], ks_gmem.at[b], v_gmem.at[b], vs_gmem.at[b])
    m, l, acc = plgpu.emit_pipeline(
        step,
        grid=(steps,),
        in_specs=[rows, sc, rows if v_major == "token" else cols_v, sc_v],
        max_concurrent_steps=stages,
        init_carry=(m0, l0, a0),
    )(*refs)
    if lazy_sum:
      l = l.sum(axis=0)
    _store_partials(o_smem, (o_gmem.at[b, sp], m_gmem.at[b, sp], l_gmem.at[b, sp]), acc, m, l,
                    pad=N_PAD - cols)

  f32 = jax.ShapeDtypeStruct((bh, splits, d, N_PAD), jnp.float32)
  return plgpu.kernel(
      body,
      out_type=(f32, f32, f32),
      grid=(bh, splits),
      grid_names=("bh", "sp"),
      compiler_params=_params(approx_math, no_auto_barriers),
      scratch_types=dict(
          q_smem=plgpu.SMEM(q.shape[1:], q.dtype, transforms=q_tr),
          vb_smem=plgpu.SMEM((tile if v_major == "token" else 8, d), jnp.bfloat16,
                             transforms=vb_tr),   # unused (8 rows) when V is dim-major
          p_smem=plgpu.SMEM((tile, N_PAD), jnp.bfloat16, transforms=p_tr),
          o_smem=plgpu.SMEM((d, N_PAD), jnp.float32),
          tbl_smem=plgpu.SMEM((ids if in_smem else 4,), jnp.int32),
          cs_smem=plgpu.SMEM((2 * N_PAD,), jnp.float32),   # unused unless k_upcast offsets K
          bar=plgpu.Barrier(num_barriers=3),
      ),
  )(q, k, ks, v, ks if planes else vs, lens, qscale, tbl, base)


def _check_table(table: str) -> None:
  if table not in ("gmem", "smem"):
    raise ValueError(f"table must be 'gmem' or 'smem', got {table!r}")


def _block_ids(tbl: jax.Array, splits: int, per_block: int) -> tuple[jax.Array, int]:
  """A page table ``[B, splits * per_block]`` regrouped for ``table="smem"``: ``[B, splits,
  ids]``, block (sequence, split)'s ``per_block`` ids contiguous and padded to ``ids``, a
  multiple of 32 (128 bytes: Mosaic GPU copies a multiple of the warpgroup's 128 threads'
  bytes)."""
  ids = -(-per_block // 32) * 32
  tbl = tbl.reshape(tbl.shape[0], splits, per_block)
  return jnp.pad(tbl, ((0, 0), (0, 0), (0, ids - per_block))), ids


def block_v(v: jax.Array, tile: int) -> jax.Array:
  """Dim-major ``v[BH, D, N]`` -> blocked ``[BH, N / tile, D, tile]``: each tile's values
  dim-major and contiguous, so one TMA box (and one leading index per warpgroup) reads it."""
  bh, d, n = v.shape
  return jnp.swapaxes(v.reshape(bh, d, n // tile, tile), 1, 2)


@functools.partial(jax.jit, static_argnames=("tile", "stages", "splits", "wgs", "qk_scale",
                                             "approx_math", "no_auto_barriers",
                                             "memory_registers", "cols", "table",
                                             "k_upcast"))
def partition_ws(q, k, ks, vb, vs, lens, tbl=None, base=None, *, tile: int = 128, stages: int = 2,
                 splits: int = 8, wgs: int = 2, qk_scale: float = 1.0,
                 approx_math: bool = False, no_auto_barriers: bool = False,
                 memory_registers: int = 40, cols: int = N_PAD, table: str = "gmem",
                 k_upcast: str = "bf16"):
  """Warp-specialized :func:`partition`: ``wgs`` compute warpgroups and one TMA warpgroup.

  Each pipeline step brings ``wgs`` tiles; compute warpgroup ``w`` takes tile ``w`` of every
  step with its own online softmax, so while one warpgroup waits on its MMAs, another's
  instructions issue, and the loads never wait on compute. The cross-warp reductions (the
  running max, the final row sums) take turns round the warpgroups (``exclusive``). Every
  (split, warpgroup) writes its own partial: outputs are ``[BH, splits * wgs, D, 16]``, combined
  by :func:`merge` like any splits; partial ``sp * wgs + w`` reads tiles ``(sp * steps + i) *
  wgs + w``.

  Contiguous: ``vb[BH, N / tile, D, tile]`` is V blocked dim-major (:func:`block_v`), one TMA box
  per step brings the step's ``wgs`` consecutive tiles. Paged (``tbl``, ``base`` as in
  :func:`partition`, V dim-major pages ``[P, Hkv, D, tile]``): the ``wgs`` tiles of a step are
  pages anywhere in the pool, so each is its own TMA box and each warpgroup picks its own
  buffers' registers through a switch on its index (the other branches are never taken).
  The rest (``cols``, ``table``, ``k_upcast`` "bf16" or "bf16_perm" included) as
  :func:`partition` with bf16 upcasts of V into the A operand; with ``table="smem"`` the TMA
  warpgroup copies the block's ids into shared memory before its first step.
  """
  _check_table(table)
  planes = vs is None
  paged = tbl is not None
  if not paged:
    if base is not None or planes:
      raise ValueError("base and vs=None (scale planes) are for a paged pool: they need tbl")
    bh, n, d = k.shape
    hkv = 1
    _check(q, k, ks, vb, vs, lens, tile=tile, splits=splits * wgs, v_major="block",
           stages=stages, wgs=wgs, k_upcast=k_upcast)
  else:
    _check_pool(q, k, ks, vb, vs, lens, tbl, tile=tile, splits=splits * wgs, v_major="dim",
                stages=stages, k_upcast=k_upcast, v_upcast="bf16", stacked=base is not None)
    if wgs not in (1, 2, 3):
      raise ValueError(f"wgs (compute warpgroups) must be 1, 2 or 3, got {wgs}")
    bh, (_, hkv, _, d), n = q.shape[0], k.shape, tbl.shape[1] * tile
    need = smem_bytes(d, tile, stages, "block", wgs)
    if need > SM90_SMEM:
      raise ValueError(f"tile {tile} x {stages} stages x {wgs} warpgroups needs {need} bytes of "
                       f"shared memory, over the {SM90_SMEM} a Hopper block has")
  if k_upcast not in ("bf16", "bf16_perm"):
    raise ValueError(f"the warp-specialized kernel takes k_upcast 'bf16' or 'bf16_perm', got "
                     f"{k_upcast!r}")
  if k_upcast == "bf16_perm":    # the K operand's head dim comes permuted (mgpu_upcast.perm)
    q = mgpu_upcast.permute_minor(q, tile)
  base = jnp.zeros((1,), jnp.int32) if base is None else jnp.asarray(base, jnp.int32).reshape(1)
  narrow = _check_cols(cols)
  nt = n // tile
  steps = nt // wgs // splits
  in_smem = paged and table == "smem"
  if in_smem:     # block (sequence, split) reads tiles sp*steps*wgs + j
    tbl, ids = _block_ids(tbl, splits, steps * wgs)
  k_elems, k_tr = _transforms(d, k.dtype, "keys")
  q_elems, q_tr = _transforms(d, q.dtype, "queries")
  _, p_tr = _transforms(N_PAD, jnp.bfloat16, "probabilities")
  _, vt_tr = _transforms(tile, vb.dtype, "transposed values")
  kslice = min(k_elems, q_elems, d)
  row = plgpu.Layout.WGMMA.reduce(1)
  col = plgpu.Layout.WGMMA.reduce(0)
  cast = plgpu.layout_cast

  def body(q_gmem, k_gmem, ks_gmem, v_gmem, vs_gmem, lens_gmem, tbl_gmem, base_gmem, o_gmem,
           m_gmem, l_gmem, q_smem, p_smem, o_smem, tbl_smem, qbar, turn, tbar):
    b = lax.axis_index("bh")
    sp = lax.axis_index("sp")
    wg = lax.axis_index("wg")
    if in_smem:   # the TMA warpgroup (the last) alone reads the ids: its index maps
      @pl.when(wg == wgs)
      def _():
        plgpu.copy_gmem_to_smem(tbl_gmem.at[b // hkv, sp], tbl_smem, tbar)
        plgpu.barrier_wait(tbar)

    def exclusive(reduce, first_turn):
      """``reduce()`` (a reduction across the warps of a warpgroup) with the kernel's one
      reduction scratch to this warpgroup alone: Mosaic GPU gives every warpgroup the same
      scratch, so concurrent cross-warp reductions would corrupt each other. A token passes
      round the compute warpgroups (0, 1, ..., 0, ...); warpgroup 0 starts holding it."""
      pl.when(jnp.logical_or(wg != 0, jnp.logical_not(first_turn)))(
          lambda: plgpu.barrier_wait(turn.at[wg]))
      out = reduce()
      plgpu.barrier_arrive(turn.at[lax.rem(wg + 1, wgs)])
      return out

    def mine(load):
      """``load(w)`` (registers from warpgroup ``w``'s buffers) for this warpgroup."""
      if not paged:
        return load(wg)
      return lax.switch(wg, [functools.partial(load, w) for w in range(wgs)])

    def step(idx, *refs):
      # Contiguous: refs = (k [wgs, T, D] int4, ks [wgs, T] f32, v [wgs, D, T] int4, vs, carry).
      # Paged: four refs per warpgroup (k [T, D], ks [T] (a plane: f16), v [D, T], vs), carry.
      *refs, (m, l, acc) = refs
      at = ((lambda w, j: refs[j].at[w]) if not paged else (lambda w, j: refs[4 * w + j]))
      qt, pt = q_smem.at[wg], p_smem.at[wg]
      kr, kscale, vscale = mine(lambda w: (_operand(at(w, 0), k_upcast),
                                           _load(at(w, 1), row).astype(jnp.float32),
                                           _load(at(w, 3), row).astype(jnp.float32)))

      def scores(acc_ref):
        for j in range(d // kslice):
          sl = slice(j * kslice, (j + 1) * kslice)
          plgpu.wgmma(acc_ref, kr[:, sl], qt.at[:, sl].T)
        return acc_ref[...]

      s = pl.run_scoped(scores, plgpu.ACC((tile, N_PAD), jnp.float32))
      if narrow:
        s = s[:, :cols]
      p, alpha, m_new, l = _softmax_tile(
          s, kscale * qk_scale, vscale, ((sp * steps + idx[0]) * wgs + wg) * tile, lens_gmem[b],
          m, l, col_max=lambda x: exclusive(lambda: x.max(axis=0), first_turn=idx[0] == 0))
      if narrow:
        p = jnp.concatenate([p, _zeros((tile, N_PAD - cols))], axis=1)
      pt[...] = p.astype(jnp.bfloat16)
      plgpu.commit_smem()
      vr = mine(lambda w: at(w, 2)[...].astype(jnp.bfloat16))

      def pv(acc_ref):
        plgpu.wgmma(acc_ref, vr, pt)
        return acc_ref[...]

      acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [1])
      out = pl.run_scoped(pv, plgpu.ACC((d, N_PAD), jnp.float32))
      acc = acc + (out[:, :cols] if narrow else out)
      return m_new, l, acc

    def compute(pipeline):
      plgpu.copy_gmem_to_smem(q_gmem.at[b], q_smem.at[wg], qbar.at[wg])
      plgpu.barrier_wait(qbar.at[wg])
      m, l, acc = pipeline((cast(jnp.full((cols,), _FLOOR, jnp.float32), col),
                            _zeros((tile, cols)), _zeros((d, cols))))
      l = exclusive(lambda: l.sum(axis=0), first_turn=False)
      part = sp * wgs + wg
      _store_partials(o_smem.at[wg], (o_gmem.at[b, part], m_gmem.at[b, part],
                                      l_gmem.at[b, part]), acc, m, l, pad=N_PAD - cols)

    if paged:     # one box per (tile, tensor): tile (sp * steps + i) * wgs + w is a page
      seq, hd = b // hkv, lax.rem(b, hkv)
      specs, refs = [], []
      for w in range(wgs):
        if in_smem:
          pg = lambda i, w=w: tbl_smem[i * wgs + w]
        else:
          pg = lambda i, w=w: tbl_gmem[seq, (sp * steps + i) * wgs + w]
        code = lambda i, pg=pg: pg(i) + base_gmem[0]      # the codes' layer offset
        if planes:    # [P, Hkv, 2, tile]: plane 0 K, plane 1 V, at the codes' pages
          sc = plgpu.BlockSpec((None, None, None, tile), lambda i, c=code: (c(i), hd, 0, 0))
          sc_v = plgpu.BlockSpec((None, None, None, tile), lambda i, c=code: (c(i), hd, 1, 0))
        else:
          sc = sc_v = plgpu.BlockSpec((None, None, tile), lambda i, pg=pg: (pg(i), hd, 0))
        specs += [plgpu.BlockSpec((None, None, tile, d), lambda i, c=code: (c(i), hd, 0, 0),
                                  transforms=k_tr),
                  sc,
                  plgpu.BlockSpec((None, None, d, tile), lambda i, c=code: (c(i), hd, 0, 0),
                                  transforms=vt_tr),
                  sc_v]
        refs += [k_gmem, ks_gmem, v_gmem, vs_gmem]
    else:
      blk = lambda i: (sp * steps + i, 0, 0)
      blk1 = lambda i: (sp * steps + i, 0)
      specs = [plgpu.BlockSpec((wgs, tile, d), blk, transforms=k_tr),
               plgpu.BlockSpec((wgs, tile), blk1),
               plgpu.BlockSpec((wgs, d, tile), blk, transforms=vt_tr),
               plgpu.BlockSpec((wgs, tile), blk1)]
      refs = [k_gmem.at[b], ks_gmem.at[b], v_gmem.at[b], vs_gmem.at[b]]
    plgpu.emit_pipeline_warp_specialized(
        step,
        grid=(steps,),
        memory_registers=memory_registers,
        in_specs=specs,
        max_concurrent_steps=stages,
        wg_axis="wg",
        num_compute_wgs=wgs,
        compute_context=compute,
    )(*refs)

  if paged:
    args = (q, k, ks, vb, ks if planes else vs, lens, tbl, base)
  else:
    args = (q, k.reshape(bh, nt, tile, d), ks.reshape(bh, nt, tile), vb,
            vs.reshape(bh, nt, tile), lens, jnp.zeros((1, 1), jnp.int32), base)
  f32 = jax.ShapeDtypeStruct((bh, splits * wgs, d, N_PAD), jnp.float32)
  return plgpu.kernel(
      body,
      out_type=(f32, f32, f32),
      grid=(bh, splits),
      grid_names=("bh", "sp"),
      num_threads=wgs + 1,
      thread_name="wg",
      compiler_params=_params(approx_math, no_auto_barriers),
      scratch_types=dict(
          q_smem=plgpu.SMEM((wgs, N_PAD, d), q.dtype, transforms=q_tr),
          p_smem=plgpu.SMEM((wgs, tile, N_PAD), jnp.bfloat16, transforms=p_tr),
          o_smem=plgpu.SMEM((wgs, d, N_PAD), jnp.float32),
          tbl_smem=plgpu.SMEM((ids if in_smem else 4,), jnp.int32),
          qbar=plgpu.Barrier(num_barriers=wgs),
          turn=plgpu.Barrier(num_barriers=wgs),
          tbar=plgpu.Barrier(),
      ),
  )(*args)


def _check(q, k, ks, v, vs, lens, *, tile, splits, v_major, stages=2, k_upcast="bf16",
           v_upcast="bf16", qscale=None, wgs=1) -> None:
  """One-line errors for shapes the kernel cannot take (before Mosaic GPU sees them).

  ``splits`` counts every partial: context splits times compute warpgroups."""
  if v_major not in ("token", "dim", "block"):
    raise ValueError(f"v_major must be 'token', 'dim' or 'block', got {v_major!r}")
  if wgs not in (1, 2, 3):
    raise ValueError(f"wgs (compute warpgroups) must be 1, 2 or 3, got {wgs}")
  if k_upcast not in K_UPCASTS:
    raise ValueError(f"k_upcast must be one of {K_UPCASTS}, got {k_upcast!r}")
  if v_upcast not in V_UPCASTS:
    raise ValueError(f"v_upcast must be one of {V_UPCASTS}, got {v_upcast!r}")
  if v_upcast == "bf16_perm" and v_major != "dim":
    raise ValueError(f"v_upcast='bf16_perm' reads dim-major V (v_major='dim'), got {v_major!r}")
  bh, n, d = k.shape
  v_shape = {"token": (bh, n, d), "dim": (bh, d, n),
             "block": (bh, n // tile, d, tile)}[v_major]
  s8 = k_upcast == "s8"
  want = {"q": (bh, 2, N_PAD, d) if s8 else (bh, N_PAD, d), "v": v_shape, "ks": (bh, n),
          "vs": (bh, n), "lens": (bh,)}
  if s8 and (q.dtype != jnp.int8 or qscale is None or tuple(qscale.shape) != (bh,)):
    raise ValueError("k_upcast='s8' takes q as int8 [BH, 2, 16, D] halves with qscale [BH] "
                     "(see split_q)")
  for name, arr in (("q", q), ("v", v), ("ks", ks), ("vs", vs), ("lens", lens)):
    if tuple(arr.shape) != want[name]:
      raise ValueError(f"{name} must have shape {want[name]} for k {tuple(k.shape)} "
                       f"(v_major={v_major!r}), got {tuple(arr.shape)}")
  if d % 64 or tile % 64:
    raise ValueError(f"head dim {d} and tile {tile} must be multiples of 64 (wgmma's M)")
  if n % (tile * splits):
    raise ValueError(f"keys {n} must divide into {splits} splits of {tile}-row tiles")
  need = smem_bytes(d, tile, stages, v_major, wgs)
  if need > SM90_SMEM:
    raise ValueError(f"tile {tile} x {stages} stages needs {need} bytes of shared memory, over "
                     f"the {SM90_SMEM} a Hopper block has: use fewer stages or a smaller tile")


def pool_shapes(n_pages: int, hkv: int, tile: int, d: int, v_major: str = "dim") -> dict:
  """Shapes of a paged INT4 pool of ``n_pages`` head-major pages (one page = one tile): codes
  ``k[P, Hkv, tile, D]``, ``v[P, Hkv, D, tile]`` (dim-major) or like ``k`` (token-major), f32
  scales ``ks, vs[P, Hkv, tile]``, or both as planes ``s[P, Hkv, 2, tile]`` (``vs=None``). Each
  (page, head) box is contiguous: one TMA copy."""
  return {"k": (n_pages, hkv, tile, d), "ks": (n_pages, hkv, tile), "vs": (n_pages, hkv, tile),
          "s": (n_pages, hkv, 2, tile),
          "v": (n_pages, hkv, d, tile) if v_major == "dim" else (n_pages, hkv, tile, d)}


def _check_pool(q, k, ks, v, vs, lens, tbl, *, tile, splits, v_major, stages, k_upcast,
                v_upcast, stacked=False) -> None:
  """One-line errors for a paged call (``tbl`` given): pool shapes, table, lengths.
  ``stacked`` (a ``base`` was given): the scales may cover one layer of the codes' layer stack,
  ``P_s`` pages with ``P % P_s == 0``."""
  if v_major not in ("token", "dim"):
    raise ValueError(f"a paged pool takes v_major 'token' or 'dim', got {v_major!r}")
  if k.ndim != 4:
    raise ValueError(f"k must be the pool [P, Hkv, tile, D] with a page table, got {k.shape}")
  p, hkv, page, d = k.shape
  if page != tile:
    raise ValueError(f"the pool's pages hold {page} tokens but tile is {tile}: one page is "
                     "one tile")
  if tbl.ndim != 2 or tbl.dtype != jnp.int32:
    raise ValueError(f"tbl must be int32 [B, n_pages], got {tbl.dtype} {tuple(tbl.shape)}")
  b, n_pages = tbl.shape
  want = pool_shapes(p, hkv, tile, d, v_major)
  p_s = ks.shape[0] if ks.ndim == 3 else p
  if stacked and p_s and p % p_s == 0:      # one layer's scales beside the stack's codes
    want |= {n: (p_s,) + want[n][1:] for n in ("ks", "vs")}
  if vs is None:                            # K and V planes, at the codes' pages
    want["ks"] = want["s"]
    if jnp.dtype(ks.dtype) not in (jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)):
      raise ValueError(f"scale planes must be float16 or float32, got {ks.dtype}")
  for name, arr in (("v", v), ("ks", ks)) + ((("vs", vs),) if vs is not None else ()):
    if tuple(arr.shape) != want[name]:
      raise ValueError(f"{name} must have shape {want[name]} for k {tuple(k.shape)} "
                       f"(v_major={v_major!r}), got {tuple(arr.shape)}")
  # The rest is the contiguous kernel's contract at B x Hkv rows of n_pages x tile keys.
  flat = jax.ShapeDtypeStruct((b * hkv, n_pages * tile, d), k.dtype)
  vflat = jax.ShapeDtypeStruct((b * hkv, d, n_pages * tile) if v_major == "dim" else
                               (b * hkv, n_pages * tile, d), v.dtype)
  sflat = jax.ShapeDtypeStruct((b * hkv, n_pages * tile), jnp.float32)
  _check(q, flat, sflat, vflat, sflat, lens, tile=tile, splits=splits, v_major=v_major,
         stages=stages, k_upcast=k_upcast, v_upcast=v_upcast,
         qscale=jnp.ones((b * hkv,)) if k_upcast == "s8" else None)


def pool_gather(k, ks, v, vs, tbl, *, v_major: str = "dim"):
  """A paged pool through its tables -> the contiguous operands of :func:`partition`
  (``k[BH, N, D]``, ``ks[BH, N]`` f32, ``v`` dim- or token-major, ``vs``), head minor in BH.
  ``vs=None``: ``ks`` holds the K and V planes ``[P, Hkv, 2, tile]``."""
  if vs is None:
    ks, vs = ks[:, :, 0], ks[:, :, 1]
  ks, vs = ks.astype(jnp.float32), vs.astype(jnp.float32)
  b, n_pages = tbl.shape
  p, hkv, tile, d = k.shape
  n = n_pages * tile

  def rows(x):      # [P, Hkv, A, C] -> [B * Hkv, n_pages, A, C]
    return jnp.moveaxis(x[tbl], 2, 1).reshape(b * hkv, n_pages, *x.shape[2:])

  kc = rows(k).reshape(b * hkv, n, d)
  sc = lambda s: jnp.moveaxis(s[tbl], 2, 1).reshape(b * hkv, n)
  if v_major == "dim":
    vc = jnp.moveaxis(rows(v), 2, 1).reshape(b * hkv, d, n)
  else:
    vc = rows(v).reshape(b * hkv, n, d)
  return kc, sc(ks), vc, sc(vs)


def pool_reference(q, k, ks, v, vs, lens, tbl, base=None, *, v_major: str = "dim", **knobs):
  """:func:`partition` over a paged pool, in jnp: the pool gathered through the tables, then
  :func:`partition_reference` with page-sized tiles.  ``base`` as in :func:`partition`: the
  codes at pages ``base + tbl``, the scales at ``tbl`` (planes, ``vs=None``: at ``base + tbl``
  too)."""
  if base is not None:      # the codes of the layer the scales belong to
    at = jnp.asarray(base, jnp.int32).reshape(())
    if vs is None:          # planes span the stack like the codes: offset every page id
      tbl = tbl + at
    else:
      k = lax.dynamic_slice_in_dim(k, at, ks.shape[0], 0)
      v = lax.dynamic_slice_in_dim(v, at, ks.shape[0], 0)
  kc, ksc, vc, vsc = pool_gather(k, ks, v, vs, tbl, v_major=v_major)
  return partition_reference(q, kc, ksc, vc, vsc, lens, tile=k.shape[2], v_major=v_major,
                             **knobs)


def int4_view(packed: jax.Array) -> jax.Array:
  """Half-split bytes ``uint8[..., D/2]`` (``pallas_kernels.int4``) read as jax int4 ``[..., D]``.

  Element 2j of the view is logical element j and element 2j+1 is j + D/2, so attention over the
  view equals attention over the logical row once q's columns go through :func:`interleave`.
  """
  return jax.lax.bitcast_convert_type(packed, jnp.int4).reshape(*packed.shape[:-1], -1)


def interleave(x: jax.Array) -> jax.Array:
  """Columns ``[0, D/2, 1, D/2 + 1, ...]`` of ``x[..., D]``: q for keys read by ``int4_view``."""
  half = x.shape[-1] // 2
  return jnp.stack([x[..., :half], x[..., half:]], axis=-1).reshape(x.shape)


def split_q(q: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``q[BH, 16, D]`` -> (int8 ``[BH, 2, 16, D]`` halves, f32 ``scale[BH]``) with
  ``q ~= scale * (hi + lo / Q_LO)`` to about ``max|q| / (2 * 127 * Q_LO)``: finer than bf16."""
  qf = q.astype(jnp.float32)
  scale = jnp.max(jnp.abs(qf), axis=(1, 2)) / 127.0
  scale = jnp.where(scale > 0, scale, 1.0)
  hi = jnp.clip(jnp.round(qf / scale[:, None, None]), -127, 127)
  lo = jnp.clip(jnp.round((qf / scale[:, None, None] - hi) * Q_LO), -127, 127)
  return jnp.stack([hi, lo], axis=1).astype(jnp.int8), scale


def merge(o, m, l):
  """Splits -> ``out[BH, 16, D]`` f32 by the log-sum-exp rule (base 2)."""
  m, l = m[:, :, 0, :], l[:, :, 0, :]                     # [BH, S, 16]
  top = m.max(axis=1, keepdims=True)
  w = jnp.exp2(m - top)
  den = (w * l).sum(axis=1)                               # [BH, 16]
  num = (w[:, :, None, :] * o).sum(axis=1)                # [BH, D, 16]
  return jnp.swapaxes(num / jnp.where(den > 0, den, 1.0)[:, None, :], 1, 2)


def attend(q, k, ks, v, vs, lens, *, sm_scale: float, **knobs):
  """Softmax attention of ``q[BH, 16, D]`` over the INT4 keys/values -> ``[BH, 16, D]`` f32.

  With a ``wgs`` knob it runs :func:`partition_ws` (``v`` blocked by :func:`block_v`)."""
  if "wgs" in knobs:
    return merge(*partition_ws(q.astype(jnp.bfloat16), k, ks, v, vs, lens,
                               qk_scale=sm_scale * LOG2E, **knobs))
  if knobs.get("k_upcast") == "s8":
    q8, qscale = split_q(q)
    return merge(*partition(q8, k, ks, v, vs, lens, qscale, qk_scale=sm_scale * LOG2E, **knobs))
  return merge(*partition(q.astype(jnp.bfloat16), k, ks, v, vs, lens,
                          qk_scale=sm_scale * LOG2E, **knobs))



def partition_reference(q, k, ks, v, vs, lens, qscale=None, *, tile: int = 128, splits: int = 8,
                        v_major: str = "dim", qk_scale: float = 1.0, k_upcast: str = "bf16",
                        v_upcast: str = "bf16", wgs: int = 1, **_):
  """:func:`partition` (``wgs=1``) or :func:`partition_ws` (``v_major="block"``, ``wgs``
  warpgroups) in jnp: the same tiles, partials, masks, roundings and outputs."""
  _check(q, k, ks, v, vs, lens, tile=tile, splits=splits * wgs, v_major=v_major,
         k_upcast=k_upcast, v_upcast=v_upcast, qscale=qscale, wgs=wgs)
  bh, n, d = k.shape
  steps = n // tile // splits // wgs
  if v_upcast == "bf16_perm":      # codes stored permuted per tile (mgpu_upcast.store_order)
    v = mgpu_upcast.token_order(v)
  vt = {"token": lambda: v, "dim": lambda: jnp.swapaxes(v, 1, 2),           # [BH, N, D]
        "block": lambda: jnp.swapaxes(v, 2, 3).reshape(bh, n, d)}[v_major]()
  kf = k.astype(jnp.float32)
  if k_upcast == "s8":     # two exact integer products, combined in f32 as the kernel does
    hi, lo = (jnp.einsum("bgd,bnd->bng", q[:, i].astype(jnp.float32), kf) for i in (0, 1))
    s = (hi + lo * (1.0 / Q_LO)) * qscale[:, None, None]
  else:
    s = jnp.einsum("bgd,bnd->bng", common.round_bf16(q), kf)
  s = s * (ks * qk_scale)[..., None]
  valid = jnp.arange(n)[None, :] < lens[:, None]
  s = jnp.where(valid[..., None], s, -jnp.inf)
  vs = jnp.where(valid, vs, 0.0)      # the kernel zeroes p * scale past the length (any scale)
  # Partial (split sp, warpgroup w) takes tiles (sp * steps + i) * wgs + w, i < steps.
  tiles = lambda x: jnp.moveaxis(x.reshape(bh, splits, steps, wgs, tile, *x.shape[2:]), 2,
                                 0).reshape(steps, bh, splits * wgs, tile, *x.shape[2:])
  s_t, vs_t, v_t = tiles(s), tiles(vs), tiles(vt.astype(jnp.float32))

  def step(carry, xs):
    m, l, acc = carry                                    # [BH,S,16], [BH,S,T,16], [BH,S,D,16]
    s, vs, v = xs
    m_new = jnp.maximum(m, s.max(axis=2))
    alpha = jnp.exp2(m - m_new)
    p = jnp.exp2(s - m_new[:, :, None, :])
    l = l * alpha[:, :, None, :] + p
    pb = common.round_bf16(p * vs[..., None])
    acc = acc * alpha[:, :, None, :] + jnp.einsum("bstd,bstg->bsdg", v, pb)
    return (m_new, l, acc), None

  parts = splits * wgs
  init = (jnp.full((bh, parts, N_PAD), _FLOOR, jnp.float32),
          jnp.zeros((bh, parts, tile, N_PAD), jnp.float32),
          jnp.zeros((bh, parts, d, N_PAD), jnp.float32))
  (m, l, acc), _ = lax.scan(step, init, (s_t, vs_t, v_t))
  wide = lambda x: jnp.broadcast_to(x[:, :, None, :], acc.shape)
  return acc, wide(m), wide(l.sum(axis=2))


def attend_reference(q, k, ks, v, vs, lens, *, sm_scale: float):
  """float32 math: softmax(q . dequant(K)^T * sm_scale) . dequant(V), token-major ``v``."""
  kf = k.astype(jnp.float32) * ks[..., None]
  vf = v.astype(jnp.float32) * vs[..., None]
  s = jnp.einsum("bgd,bnd->bgn", q.astype(jnp.float32), kf) * sm_scale
  valid = jnp.arange(k.shape[1])[None, None, :] < lens[:, None, None]
  s = jnp.where(valid, s, -jnp.inf)
  p = jnp.where(valid, jax.nn.softmax(s, axis=-1), 0.0)
  return jnp.einsum("bgn,bnd->bgd", p, vf)
