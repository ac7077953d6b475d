"""The whole mixed cache in ONE Pallas Mosaic GPU launch (Hopper): INT4 pool and BF16 pool.

``mgpu_decode`` runs the INT4 pool through ``mgpu_int4.partition`` and the BF16 pool and window
through the Triton kernel: two launches one after the other, each with an underfilled tail, and
~17 µs of XLA glue (pads, transposes of the Mosaic outputs into Triton's layout, the merge)
(bench/RESULTS.md, 2026-12-04 second session). This kernel reads both pools of every (sequence,
KV head) in one grid ``(B x Hkv, splits_lo + splits_hi)``: a block with ``sp < splits_lo`` runs
the INT4 pipeline over its share of the INT4 pages, the others the BF16 pipeline over their
share of the BF16 pages (two ``plgpu.emit_pipeline`` under ``pl.when``; Mosaic GPU sizes shared
memory by the larger branch, not the sum). Both write partials in one layout, so the merge with
the window's partial (jnp, :func:`window_partial`: 64 tokens are not worth a pipeline) is one
small step (:func:`merge`).

Operand swap in both pipelines: tokens on wgmma's M side, the query heads of one KV head
(padded to 16) on N.

* INT4 pipeline: ``mgpu_int4.partition``'s paged mode with dim-major V and the cache's fp16 scale
  planes (``vs=None``), unchanged: K and V^T upcast int4 -> bf16 in registers as A operands, the
  K scale times ``qk_scale`` on the rows of S^T, the V scale on the rows of P^T.
* BF16 pipeline: the K tile ``[T, D]`` is the A operand straight from shared memory (TMA box
  ``hi_k[page, rows, head, :]``, rows ``Hkv x D`` apart, 128-byte swizzle like q);
  ``O^T[D, 16] += V^T[D, T] . P^T[T, 16]`` reads V^T as a transposed shared-memory A operand
  (V's box in the 32-byte swizzle of P^T: wgmma wants equal swizzles). Invisible rows of the BF16
  pool may hold anything (NaN included: the cache contract) and ``0 * NaN`` would reach O^T
  through the MMA, so a tile that reaches past the length has its invisible V rows zeroed in
  shared memory first (only the last tile of a sequence and tiles past it; K needs nothing:
  masked scores are selected away). ``tile_hi`` (64 or the page) rows per step: half pages keep
  the BF16 branch's buffers (and so every block's shared memory) small.

Shapes (B sequences, Hkv KV heads, BH = B x Hkv with the head minor, L layers stacked):
``q[BH, 16, D]`` bf16 (G <= 16 real rows); ``lo_k[L*P_lo, Hkv, page_lo, D]``,
``lo_v[L*P_lo, Hkv, D, page_lo]`` int4, ``lo_s[L*P_lo, Hkv, 2, page_lo]`` f16 (K, V planes);
``hi_k, hi_v[L*P_hi, page_hi, Hkv, D]`` bf16; ``lo_tbl[B, n_lo]``, ``hi_tbl[B, n_hi]`` int32
pages in order (``n_lo`` a multiple of ``splits_lo``; ``n_hi * page_hi / tile_hi`` of
``splits_hi``); ``lens[B, 2]`` int32 (INT4 entries, BF16-pool entries); ``base[2]`` int32 page
offsets of the layer (INT4, BF16) added to every table entry. Outputs per (row, partial): ``o[BH,
S, D, 16]`` f32 unnormalized O^T and ``ml[BH, S, 64, 16]`` f32, the running max (base 2) in rows
0-31 and the exponential sum in rows 32-63 (one 4 KB tile instead of two broadcast [D, 16] ones);
``S = splits_lo + splits_hi``, INT4 partials first.

:func:`partition_mixed_reference` is the same algorithm in jnp (the same tiles, splits,
roundings, zeroing and outputs) for the CPU tests; :func:`mixed_attention` is the glue behind
``decode_attention``'s GPU backend (``int4_kernel="fused"``).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import common
from pallas_kernels.gpu import mgpu_common as C
from pallas_kernels.gpu import mgpu_int4 as MI
from pallas_kernels.types import HighPool, LowPool, PageMaps, Window

ML_ROWS = 64    # rows of the (m, l) output tile: one warpgroup's wgmma-layout tile
BLOCKS = 512    # blocks per launch to aim for (as mgpu_decode.BLOCKS): several waves of 132 SMs

__all__ = ["partition_mixed", "partition_mixed_reference", "mixed_attention", "merge",
           "window_partial", "supported", "plan", "smem_bytes", "ML_ROWS"]


def smem_bytes(d: int, page_lo: int, tile_hi: int, stages_lo: int, stages_hi: int,
               has_lo: bool = True, has_hi: bool = True) -> int:
  """Shared memory of one block: q and the output staging tile, plus the larger of the two
  branches (INT4: codes + fp16 scale planes and the P^T tile; BF16: K and V tiles and P^T)."""
  lo = stages_lo * (page_lo * d + 2 * page_lo * 2) + page_lo * C.N_PAD * 2 if has_lo else 0
  hi = stages_hi * 2 * tile_hi * d * 2 + tile_hi * C.N_PAD * 2 if has_hi else 0
  return C.N_PAD * d * 2 + d * C.N_PAD * 4 + max(lo, hi) + C.SCRATCH


def _check(q, lo_k, lo_s, lo_v, hi_k, hi_v, lo_tbl, hi_tbl, lens, *, splits_lo, splits_hi,
           tile_hi, stages_lo, stages_hi) -> None:
  """One-line errors for shapes the kernel cannot take (before Mosaic GPU sees them)."""
  bh, n16, d = q.shape
  b = lens.shape[0]
  if n16 != C.N_PAD or q.dtype != jnp.bfloat16:
    raise ValueError(f"q must be bf16 [BH, {C.N_PAD}, D] (query heads padded), got {q.dtype} "
                     f"{tuple(q.shape)}")
  if d % 64:
    raise ValueError(f"head dim {d} must be a multiple of 64 (wgmma's K and M)")
  if lens.shape != (b, 2) or lens.dtype != jnp.int32:
    raise ValueError(f"lens must be int32 [B, 2] (INT4, BF16-pool entries), got {lens.dtype} "
                     f"{tuple(lens.shape)}")
  hkv = bh // b if b else 0
  if splits_lo:
    if lo_k.dtype != jnp.int4 or lo_k.ndim != 4:
      raise ValueError(f"lo_k must be the int4 pool [P, Hkv, page, D], got {lo_k.dtype} "
                       f"{tuple(lo_k.shape)}")
    p, hkv_, page, d_ = lo_k.shape
    want = {"lo_v": (p, hkv_, d_, page), "lo_s": (p, hkv_, 2, page)}
    for name, arr in (("lo_v", lo_v), ("lo_s", lo_s)):
      if tuple(arr.shape) != want[name]:
        raise ValueError(f"{name} must have shape {want[name]} for lo_k {tuple(lo_k.shape)}, "
                         f"got {tuple(arr.shape)}")
    if page % 64:
      raise ValueError(f"INT4 pages of {page} rows: the fused kernel takes pages of a multiple "
                       "of 64 rows (wgmma's M)")
    if (hkv_, d_) != (hkv, d):
      raise ValueError(f"the INT4 pool has {hkv_} heads of {d_}, q {hkv} of {d}")
    if lo_tbl.shape[0] != b or lo_tbl.shape[1] % splits_lo:
      raise ValueError(f"INT4 table {tuple(lo_tbl.shape)}: its pages must divide into "
                       f"{splits_lo} splits")
  if splits_hi:
    if hi_k.dtype != jnp.bfloat16 or hi_k.ndim != 4 or hi_v.shape != hi_k.shape:
      raise ValueError(f"hi_k, hi_v must be the bf16 pool [P, page, Hkv, D], got {hi_k.dtype} "
                       f"{tuple(hi_k.shape)}, {tuple(hi_v.shape)}")
    p, page, hkv_, d_ = hi_k.shape
    if page % 64:
      raise ValueError(f"BF16 pages of {page} rows: the fused kernel takes pages of a multiple "
                       "of 64 rows (wgmma's M)")
    if tile_hi % 64 or page % tile_hi:
      raise ValueError(f"tile_hi {tile_hi} must be a multiple of 64 dividing the BF16 page "
                       f"({page} rows)")
    if (hkv_, d_) != (hkv, d):
      raise ValueError(f"the BF16 pool has {hkv_} heads of {d_}, q {hkv} of {d}")
    if hi_tbl.shape[0] != b or (hi_tbl.shape[1] * page // tile_hi) % splits_hi:
      raise ValueError(f"BF16 table {tuple(hi_tbl.shape)}: its {tile_hi}-row tiles must divide "
                       f"into {splits_hi} splits")
  page_lo = lo_k.shape[2] if splits_lo else 64
  need = smem_bytes(d, page_lo, tile_hi, stages_lo, stages_hi, bool(splits_lo), bool(splits_hi))
  if need > C.SM90_SMEM:
    raise ValueError(f"stages {stages_lo} (INT4) / {stages_hi} (BF16, {tile_hi}-row tiles) need "
                     f"{need} bytes of shared memory, over the {C.SM90_SMEM} a Hopper block has")


def _store(o_smem, o_out, ml_out, acc, m, l, pad):
  """One partial: O^T ``[D, C]`` and the (m, l) tile, each staged through ``o_smem``."""
  cols = acc.shape[1]
  wide = lambda x: jnp.concatenate([x, C.zeros((x.shape[0], pad))], axis=1) if pad else x
  o_smem[...] = wide(acc)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(o_smem, o_out)
  plgpu.wait_smem_to_gmem(0)
  row = plgpu.broadcasted_iota(jnp.int32, (ML_ROWS, cols), 0, layout=plgpu.Layout.WGMMA)
  ml = jnp.where(row < ML_ROWS // 2, lax.broadcast_in_dim(m, (ML_ROWS, cols), [1]),
                 lax.broadcast_in_dim(l, (ML_ROWS, cols), [1]))
  o_smem.at[:ML_ROWS][...] = wide(ml)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(o_smem.at[:ML_ROWS], ml_out)
  plgpu.wait_smem_to_gmem(0)


@functools.partial(jax.jit, static_argnames=("splits_lo", "splits_hi", "tile_hi", "stages_lo",
                                             "stages_hi", "qk_scale", "cols", "approx_math",
                                             "no_auto_barriers"))
def partition_mixed(q, lo_k, lo_s, lo_v, hi_k, hi_v, lo_tbl, hi_tbl, lens, base, *,
                    splits_lo: int, splits_hi: int, tile_hi: int = 64, stages_lo: int = 2,
                    stages_hi: int = 2, qk_scale: float = 1.0, cols: int = C.N_PAD,
                    approx_math: bool = False, no_auto_barriers: bool = False):
  """-> (o ``[BH, S, D, 16]`` f32, ml ``[BH, S, 64, 16]`` f32), S = splits_lo + splits_hi
  (module doc). ``splits_lo=0`` / ``splits_hi=0``: no INT4 / BF16 pipeline (its arrays unread).
  ``cols=8``: the softmax and O^T over the first 8 query columns (``mgpu_int4.partition``)."""
  _check(q, lo_k, lo_s, lo_v, hi_k, hi_v, lo_tbl, hi_tbl, lens, splits_lo=splits_lo,
         splits_hi=splits_hi, tile_hi=tile_hi, stages_lo=stages_lo, stages_hi=stages_hi)
  if not splits_lo + splits_hi:
    raise ValueError("no partition to read: splits_lo and splits_hi are both 0")
  narrow = C.check_cols(cols)
  bh, _, d = q.shape
  b = lens.shape[0]
  hkv = bh // b
  base = jnp.asarray(base, jnp.int32).reshape(2)
  parts = splits_lo + splits_hi
  q_elems, q_tr = C.transforms(d, q.dtype, "queries")
  _, p_tr = C.transforms(C.N_PAD, jnp.bfloat16, "probabilities")
  row = plgpu.Layout.WGMMA.reduce(1)
  col = plgpu.Layout.WGMMA.reduce(0)
  wg = plgpu.Layout.WGMMA
  cast = plgpu.layout_cast

  def init(tile):
    return (cast(jnp.full((cols,), C.FLOOR, jnp.float32), col), C.zeros((tile, cols)),
            C.zeros((d, cols)))

  def pv_add(acc, alpha, pv):
    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [1])
    out = pl.run_scoped(pv, plgpu.ACC((d, C.N_PAD), jnp.float32))
    return acc + (out[:, :cols] if narrow else out)

  def put_p(p_smem, p):
    if narrow:
      p = jnp.concatenate([p, C.zeros((p.shape[0], C.N_PAD - cols))], axis=1)
    p_smem[...] = p.astype(jnp.bfloat16)

  def body(q_gmem, lok_gmem, los_gmem, lov_gmem, hik_gmem, hiv_gmem, lot_gmem, hit_gmem,
           lens_gmem, base_gmem, o_gmem, ml_gmem, q_smem, o_smem, bar):
    i = lax.axis_index("bh")
    sp = lax.axis_index("sp")
    seq, hd = i // hkv, lax.rem(i, hkv)
    plgpu.copy_gmem_to_smem(q_gmem.at[i], q_smem, bar)
    plgpu.barrier_wait(bar)

    def finish(carry):
      m, l, acc = carry
      _store(o_smem, o_gmem.at[i, sp], ml_gmem.at[i, sp], acc, m, l.sum(axis=0),
             C.N_PAD - cols)

    if splits_lo:      # ---- INT4 pool: mgpu_int4.partition's paged mode, V dim-major --------
      page_lo = lo_k.shape[2]
      steps_lo = lo_tbl.shape[1] // splits_lo
      k_elems_lo, k_tr_lo = C.transforms(d, lo_k.dtype, "keys")
      _, vt_tr = C.transforms(page_lo, lo_v.dtype, "transposed values")
      kslice_lo = min(k_elems_lo, q_elems, d)
      length_lo = lens_gmem[seq, 0]

      def lo_branch(p_smem):
        def step(idx, k_smem, ks_smem, v_smem, vs_smem, carry):
          m, l, acc = carry

          def scores(acc_ref):
            kr = k_smem[...].astype(jnp.bfloat16)
            for j in range(d // kslice_lo):
              sl = slice(j * kslice_lo, (j + 1) * kslice_lo)
              plgpu.wgmma(acc_ref, kr[:, sl], q_smem.at[:, sl].T)
            return acc_ref[...]

          s = pl.run_scoped(scores, plgpu.ACC((page_lo, C.N_PAD), jnp.float32))
          if narrow:
            s = s[:, :cols]
          kscale = C.load(ks_smem, row).astype(jnp.float32) * qk_scale
          p, alpha, m_new, l = C.softmax_tile(
              s, kscale, C.load(vs_smem, row).astype(jnp.float32),
              (sp * steps_lo + idx[0]) * page_lo, length_lo, m, l)
          put_p(p_smem, p)
          plgpu.commit_smem()

          def pv(acc_ref):
            plgpu.wgmma(acc_ref, v_smem[...].astype(jnp.bfloat16), p_smem)
            return acc_ref[...]

          return m_new, l, pv_add(acc, alpha, pv)

        code_pg = lambda j: lot_gmem[seq, sp * steps_lo + j] + base_gmem[0]
        rows = plgpu.BlockSpec((None, None, page_lo, d), lambda j: (code_pg(j), hd, 0, 0),
                               transforms=k_tr_lo)
        sck = plgpu.BlockSpec((None, None, None, page_lo), lambda j: (code_pg(j), hd, 0, 0))
        scv = plgpu.BlockSpec((None, None, None, page_lo), lambda j: (code_pg(j), hd, 1, 0))
        vcols = plgpu.BlockSpec((None, None, d, page_lo), lambda j: (code_pg(j), hd, 0, 0),
                                transforms=vt_tr)
        finish(plgpu.emit_pipeline(step, grid=(steps_lo,), in_specs=[rows, sck, vcols, scv],
                                   max_concurrent_steps=stages_lo, init_carry=init(page_lo),
                                   )(lok_gmem, los_gmem, lov_gmem, los_gmem))

      @pl.when(sp < splits_lo)
      def _():
        pl.run_scoped(lo_branch, plgpu.SMEM((page_lo, C.N_PAD), jnp.bfloat16, transforms=p_tr))

    if splits_hi:      # ---- BF16 pool: K straight from shared memory, V^T transposed -------
      page_hi = hi_k.shape[1]
      per = page_hi // tile_hi                      # tiles per page_hi
      steps_hi = hi_tbl.shape[1] * per // splits_hi
      k_elems_hi, k_tr_hi = C.transforms(d, jnp.bfloat16, "keys")
      _, v_tr = C.transforms(d, jnp.bfloat16, "values", swz=32)   # P^T's swizzle
      kslice_hi = min(k_elems_hi, q_elems, d)
      length_hi = lens_gmem[seq, 1]

      def hi_branch(p_smem):
        sh = sp - splits_lo

        def step(idx, k_smem, v_smem, carry):
          m, l, acc = carry
          first = (sh * steps_hi + idx[0]) * tile_hi

          def scores(acc_ref):
            for j in range(d // kslice_hi):
              sl = slice(j * kslice_hi, (j + 1) * kslice_hi)
              plgpu.wgmma(acc_ref, k_smem.at[:, sl], q_smem.at[:, sl].T)
            return acc_ref[...]

          s = pl.run_scoped(scores, plgpu.ACC((tile_hi, C.N_PAD), jnp.float32))
          if narrow:
            s = s[:, :cols]
          p, alpha, m_new, l = C.softmax_tile(s, qk_scale, None, first, length_hi, m, l)
          put_p(p_smem, p)

          @pl.when(first + tile_hi > length_hi)     # invisible rows may hold NaN: zero them
          def _():
            for r in range(tile_hi // 64):
              rows = v_smem.at[r * 64:(r + 1) * 64]
              v = C.load(rows, wg)
              tok = plgpu.broadcasted_iota(jnp.int32, v.shape, 0, layout=wg) + (first + r * 64)
              rows[...] = jnp.where(tok < length_hi, v, jnp.zeros_like(v))

          plgpu.commit_smem()

          def pv(acc_ref):
            plgpu.wgmma(acc_ref, v_smem.T, p_smem)
            return acc_ref[...]

          return m_new, l, pv_add(acc, alpha, pv)

        def at(j):
          t = sh * steps_hi + j
          return hit_gmem[seq, lax.div(t, per)] + base_gmem[1], lax.rem(t, per)

        def kmap(j):
          pg, part = at(j)
          return pg, part, hd, 0

        kspec = plgpu.BlockSpec((None, tile_hi, None, d), kmap, transforms=k_tr_hi)
        vspec = plgpu.BlockSpec((None, tile_hi, None, d), kmap, transforms=v_tr)
        finish(plgpu.emit_pipeline(step, grid=(steps_hi,), in_specs=[kspec, vspec],
                                   max_concurrent_steps=stages_hi, init_carry=init(tile_hi),
                                   )(hik_gmem, hiv_gmem))

      @pl.when(sp >= splits_lo)
      def _():
        pl.run_scoped(hi_branch, plgpu.SMEM((tile_hi, C.N_PAD), jnp.bfloat16, transforms=p_tr))

  f32 = lambda rows: jax.ShapeDtypeStruct((bh, parts, rows, C.N_PAD), jnp.float32)
  return plgpu.kernel(
      body,
      out_type=(f32(d), f32(ML_ROWS)),
      grid=(bh, parts),
      grid_names=("bh", "sp"),
      compiler_params=C.params(approx_math, no_auto_barriers),
      scratch_types=dict(
          q_smem=plgpu.SMEM((C.N_PAD, d), jnp.bfloat16, transforms=q_tr),
          o_smem=plgpu.SMEM((d, C.N_PAD), jnp.float32),
          bar=plgpu.Barrier(),
      ),
  )(q, lo_k, lo_s, lo_v, hi_k, hi_v, lo_tbl, hi_tbl, lens, base)


def _hi_gather(hi_k, hi_v, tbl, lens, base):
  """The BF16 pool through its tables -> contiguous ``k, v[BH, N, D]`` (head minor in BH), V
  rows at or past the length zeroed (as the kernel zeroes them in shared memory)."""
  b, n_pages = tbl.shape
  _, page, hkv, d = hi_k.shape
  ids = tbl + base

  def rows(x):      # [P, page, Hkv, D] -> [B * Hkv, n_pages * page, D]
    return jnp.moveaxis(x[ids], 3, 1).reshape(b * hkv, n_pages * page, d)

  n = n_pages * page
  vis = jnp.arange(n)[None, :] < jnp.repeat(lens, hkv)[:, None]
  v = jnp.where(vis[..., None], rows(hi_v), jnp.zeros((), hi_v.dtype))
  return rows(hi_k), v


def partition_mixed_reference(q, lo_k, lo_s, lo_v, hi_k, hi_v, lo_tbl, hi_tbl, lens, base, *,
                              splits_lo: int, splits_hi: int, tile_hi: int = 64,
                              qk_scale: float = 1.0, **_):
  """:func:`partition_mixed` in jnp: the INT4 pipeline is ``mgpu_int4.pool_reference`` (page
  tiles, dim-major V, scale planes at the codes' pages), the BF16 pipeline
  ``mgpu_int4.partition_reference`` over the gathered pool with unit scales (bf16 K exact in
  f32, ``tile_hi`` tiles, P^T rounded to bf16), partials in the kernel's layout."""
  _check(q, lo_k, lo_s, lo_v, hi_k, hi_v, lo_tbl, hi_tbl, lens, splits_lo=splits_lo,
         splits_hi=splits_hi, tile_hi=tile_hi, stages_lo=1, stages_hi=1)
  bh, _, d = q.shape
  b = lens.shape[0]
  hkv = bh // b
  base = jnp.asarray(base, jnp.int32).reshape(2)
  outs = []
  if splits_lo:
    outs.append(MI.pool_reference(q, lo_k, lo_s, lo_v, None, jnp.repeat(lens[:, 0], hkv),
                                  lo_tbl, base[0:1], v_major="dim", splits=splits_lo,
                                  qk_scale=qk_scale))
  if splits_hi:
    k, v = _hi_gather(hi_k, hi_v, hi_tbl, lens[:, 1], base[1])
    ones = jnp.ones(k.shape[:2], jnp.float32)
    outs.append(MI.partition_reference(q, k, ones, v, ones, jnp.repeat(lens[:, 1], hkv),
                                       tile=tile_hi, splits=splits_hi, v_major="token",
                                       qk_scale=qk_scale))
  o = jnp.concatenate([x[0] for x in outs], axis=1)
  m = jnp.concatenate([x[1][:, :, :1] for x in outs], axis=1)
  l = jnp.concatenate([x[2][:, :, :1] for x in outs], axis=1)
  half = ML_ROWS // 2
  ml = jnp.concatenate([jnp.broadcast_to(m, m.shape[:2] + (half, C.N_PAD)),
                        jnp.broadcast_to(l, l.shape[:2] + (half, C.N_PAD))], axis=2)
  return o, ml


def window_partial(qf, kw, vw, length, c):
  """The window's partial in jnp, FP32: ``qf[B, Hkv, G, D]`` f32 (bf16 values), ``kw, vw[B, W,
  Hkv, D]`` bf16, ``length[B]`` -> ``o[B * Hkv, D, G]``, ``m, l[B * Hkv, G]`` (log2 units)."""
  b, hkv, g, d = qf.shape
  vis = jnp.arange(kw.shape[1])[None, :] < length[:, None]                     # [B, W]
  kf = jnp.where(vis[..., None, None], kw.astype(jnp.float32), 0.0)
  vf = jnp.where(vis[..., None, None], vw.astype(jnp.float32), 0.0)
  s = jnp.einsum("bhgd,bwhd->bhgw", qf, kf, precision="highest") * c
  s = jnp.where(vis[:, None, None, :], s, -jnp.inf)
  m = jnp.max(s, axis=-1, initial=common.NEG)
  p = jnp.exp2(s - m[..., None])
  o = jnp.einsum("bhgw,bwhd->bhdg", p, vf, precision="highest")
  return o.reshape(b * hkv, d, g), m.reshape(b * hkv, g), p.sum(-1).reshape(b * hkv, g)


def merge(o, ml, win, g: int):
  """Eq. 15 over the kernel's partials (``o[BH, S, D, 16]``, ``ml[BH, S, 64, 16]``) and the
  window's (``window_partial``; None: no window) -> ``out[BH, G, D]`` f32. Empty partials
  (l = 0) contribute nothing; all empty gives 0."""
  o = o[..., :g]
  m, l = ml[:, :, 0, :g], ml[:, :, ML_ROWS // 2, :g]                      # [BH, S, G]
  if win is not None:
    ow, mw, lw = win
    m = jnp.concatenate([m, mw[:, None]], axis=1)
    l = jnp.concatenate([l, lw[:, None]], axis=1)
  live = l > 0
  mm = jnp.where(live, m, -jnp.inf)
  top = jnp.max(mm, axis=1, keepdims=True)
  top = jnp.where(jnp.isfinite(top), top, 0.0)
  w = jnp.where(live, jnp.exp2(mm - top), 0.0)                             # [BH, S(+1), G]
  den = jnp.sum(w * jnp.where(live, l, 0.0), axis=1)                       # [BH, G]
  s = o.shape[1]
  num = jnp.einsum("bsg,bsdg->bdg", w[:, :s], jnp.where(live[:, :s, None, :], o, 0.0),
                   precision="highest")
  if win is not None:
    num = num + w[:, s, None, :] * jnp.where(live[:, s, None, :], ow, 0.0)
  return jnp.swapaxes(num / jnp.where(den > 0, den, 1.0)[:, None, :], 1, 2)


def supported(page_lo: int, page_hi: int, d: int, g: int) -> bool:
  """Whether the fused kernel takes these pools: pages and head dim multiples of 64, <= 16
  query heads per KV head (a pool without pages takes any page size)."""
  return page_lo % 64 == 0 and page_hi % 64 == 0 and d % 64 == 0 and g <= C.N_PAD


def plan(bh: int, n_lo: int, page_lo: int, n_hi: int, page_hi: int, d: int, tile_hi: int,
         splits_lo: int | None = None, splits_hi: int | None = None) -> tuple[int, int]:
  """Context splits per pool (static): about ``BLOCKS`` blocks in all, shared in proportion to
  the time each pool's table capacity should take (an INT4 row is ``D/2 + 4`` bytes read at
  ~2/3 of the BF16 rate: 2.1 against 3.2 TB/s on the H200, bench/RESULTS.md 2026-12-04; a BF16
  row ``4D`` bytes), so the blocks of both pipelines take about as long; never more splits than
  tiles, none for a pool without pages. Given splits are kept (but a pool without pages has
  none)."""
  t_lo, t_hi = n_lo, n_hi * (page_hi // tile_hi if n_hi else 0)
  total = max(2, BLOCKS // max(bh, 1))
  b_lo, b_hi = n_lo * page_lo * (d // 2 + 4) * 1.5, n_hi * page_hi * 4 * d
  if splits_lo is None:
    splits_lo = 0 if not t_lo else (total if not t_hi else
                                    round(total * b_lo / (b_lo + b_hi)))
    splits_lo = min(t_lo, max(1, splits_lo)) if t_lo else 0
  if splits_hi is None:
    splits_hi = 0 if not t_hi else max(1, min(t_hi, total - splits_lo))
  return (splits_lo if t_lo else 0), (splits_hi if t_hi else 0)


def _table(pages, length, page, splits_tiles, per=1):
  """A page table clamped to page 0 past each sequence's pages (entries there are unspecified)
  and padded with page 0 so its tiles (``per`` a page) divide into ``splits_tiles`` splits."""
  tbl = pages.astype(jnp.int32)
  n = tbl.shape[1]
  used = (length.astype(jnp.int32) + page - 1) // page
  tbl = jnp.where(jnp.arange(n)[None, :] < used[:, None], tbl, 0)
  if not splits_tiles:
    return tbl
  step = splits_tiles // math.gcd(splits_tiles, per)     # pages whose tiles fill the splits
  return jnp.pad(tbl, ((0, 0), (0, (-n) % step)))


@functools.partial(jax.jit, static_argnames=("c", "splits_lo", "splits_hi", "tile_hi",
                                             "stages_lo", "stages_hi", "auto_barriers",
                                             "reference"))
def mixed_attention(q, window: Window, hi: HighPool, lo: LowPool, maps: PageMaps, layer, *,
                    c: float, splits_lo: int | None = None, splits_hi: int | None = None,
                    tile_hi: int | None = None, stages_lo: int = 2, stages_hi: int = 2,
                    auto_barriers: bool = False, reference: bool = False) -> jax.Array:
  """``decode_attention``'s GPU backend with ``int4_kernel="fused"``: q ``[B, Hq, D]`` ->
  out ``[B, Hq, D]`` f32. Window, pools and scales carry the cache's leading layer axis and
  ``layer`` (an int32) picks one, or ``layer=None`` and they are one layer's; the INT4 pool must
  be in the "int4" storage format. One :func:`partition_mixed` launch reads both pools
  (``reference=True``: its jnp reference instead), the window's partial is jnp, one
  :func:`merge`. ``c`` = softmax scale x log2 e. ``auto_barriers=True`` keeps the barriers
  Pallas puts around shared-memory loads and stores (default: dropped, as in ``mgpu_decode``)."""
  if lo.format != "int4":
    raise ValueError("int4_kernel='fused' reads the INT4 pool in the 'int4' storage format "
                     "(a cache made with lo_format='int4'), got 'bytes'")
  if layer is None:         # one layer's arrays: a leading layer axis of 1 (free reshapes)
    add = lambda t: type(t)(*(x[None] for x in t))
    window, hi, lo, layer = window._replace(k=window.k[None], v=window.v[None]), add(hi), \
        add(lo), 0
  b, hq, d = q.shape
  n_l, _, w, hkv = window.k.shape[:4]
  g = hq // hkv
  p_lo, page_lo = lo.scale.shape[1], lo.page
  p_hi, page_hi = hi.k.shape[1:3]
  n_lo = maps.lo_pages.shape[1] if p_lo else 0
  n_hi = maps.hi_pages.shape[1] if p_hi else 0
  if not supported(page_lo if n_lo else 64, page_hi if n_hi else 64, d, g):
    raise ValueError(f"the fused Mosaic GPU kernel takes pages and head dim in multiples of 64 "
                     f"and <= {C.N_PAD} query heads per KV head; got INT4 pages of {page_lo}, "
                     f"BF16 pages of {page_hi}, head dim {d}, {g} query heads per KV head")
  if tile_hi is None:      # half pages of 128: the BF16 branch's buffers stay small
    tile_hi = 64
  bh = b * hkv
  s_lo, s_hi = plan(bh, n_lo, page_lo, n_hi, page_hi, d, tile_hi, splits_lo, splits_hi)
  layer = jnp.asarray(layer, jnp.int32)
  qf = q.astype(jnp.float32).reshape(b, hkv, g, d)
  kw = lax.dynamic_index_in_dim(window.k, layer, 0, keepdims=False)
  vw = lax.dynamic_index_in_dim(window.v, layer, 0, keepdims=False)
  win = window_partial(qf, kw, vw, window.length.astype(jnp.int32), c) if w else None
  if not s_lo + s_hi:
    z = jnp.zeros((bh, 0, d, C.N_PAD), jnp.float32)
    out = merge(z, jnp.zeros((bh, 0, ML_ROWS, C.N_PAD), jnp.float32), win, g)
    return out.reshape(b, hq, d)
  qp = jnp.pad(q.reshape(b, hkv, g, d), ((0, 0), (0, 0), (0, C.N_PAD - g), (0, 0)))
  qp = qp.reshape(bh, C.N_PAD, d).astype(jnp.bfloat16)
  lo_tbl = (_table(maps.lo_pages, maps.lo_len, page_lo, s_lo) if s_lo else
            jnp.zeros((b, 1), jnp.int32))
  hi_tbl = (_table(maps.hi_pages, maps.hi_len, page_hi, s_hi, page_hi // tile_hi) if s_hi else
            jnp.zeros((b, 1), jnp.int32))
  lens = jnp.stack([maps.lo_len, maps.hi_len], axis=1).astype(jnp.int32)
  base = jnp.stack([layer * p_lo, layer * p_hi]).astype(jnp.int32)
  if s_lo:
    lo_k = lo.k.reshape(n_l * p_lo, hkv, page_lo, d)               # free: layers lead
    lo_v = lo.v.reshape(n_l * p_lo, hkv, d, page_lo)
    lo_s = lo.scale.reshape(n_l * p_lo, hkv, 2, page_lo)
  else:                     # unread: a one-page stand-in (no zero-sized kernel operand)
    lo_k = jnp.zeros((1, hkv, 64, d), jnp.int4)
    lo_v = jnp.zeros((1, hkv, d, 64), jnp.int4)
    lo_s = jnp.zeros((1, hkv, 2, 64), jnp.float16)
  if s_hi:
    hi_k = hi.k.reshape(n_l * p_hi, page_hi, hkv, d)
    hi_v = hi.v.reshape(n_l * p_hi, page_hi, hkv, d)
  else:
    hi_k = hi_v = jnp.zeros((1, 64, hkv, d), jnp.bfloat16)
  args = (qp, lo_k, lo_s, lo_v, hi_k, hi_v, lo_tbl, hi_tbl, lens, base)
  kw_ = dict(splits_lo=s_lo, splits_hi=s_hi, tile_hi=tile_hi, qk_scale=c)
  if reference:
    o, ml = partition_mixed_reference(*args, **kw_)
  else:
    cols = 8 if g <= 8 and C.HAS_CONCAT else C.N_PAD
    o, ml = partition_mixed(*args, **kw_, stages_lo=stages_lo, stages_hi=stages_hi, cols=cols,
                            approx_math=True, no_auto_barriers=not auto_barriers)
  return merge(o, ml, win, g).reshape(b, hq, d)
