"""Prototype: the QK half of the INT4 partition as a Pallas Mosaic GPU kernel (Hopper).

This is the first stage of the Mosaic GPU INT4 decode kernel: it measures how fast packed INT4
keys can be streamed through TMA, upcast in registers and fed to wgmma as the A operand, with the
tokens on the MMA's M side and the (padded) query heads on N (the operand swap:
``S^T = K . q^T``). It computes what the softmax needs from each tile (the per-row K scale
folded into ``S^T`` after the MMA, the running column max) and nothing of P.V yet, so its time
against the packed key bytes says whether the full kernel can reach the bandwidth goal.

:func:`qk_paged` is the integration probe: the same statistics with the keys read straight from
the cache's paged INT4 pool (uint8 half-split bytes through the page table, no int4 view, no
copy), its arithmetic emulated by :func:`qk_paged_emulated`.

Shapes: ``q[BH, 8, D]`` bf16 (query heads of one KV head, padded to 8 rows), ``k[BH, N, D]``
int4 or bf16 (token-major, jax's int4 packing: element 2j in the low nibble of byte j),
``ks[BH, N]`` f32 per-token scales. Output ``[BH, splits, T, 8]`` f32: per split, the sum over its
tiles of ``S^T * ks`` plus the split's column max broadcast over the rows (see ``qk_reference``).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

N_PAD = 8   # wgmma's N granularity: query heads of one KV head, padded


def _load(ref, layout):
  """``plgpu.load`` across jax 0.10 (index required) and 0.11 (index deprecated)."""
  try:
    return plgpu.load(ref, layout=layout)
  except TypeError:
    return plgpu.load(ref, (), layout=layout)


def _bits(dtype) -> int:
  return jnp.dtype(dtype).itemsize * 8 if jnp.dtype(dtype) != jnp.int4 else 4


def _transforms(minor: int, dtype, what: str):
  bits = _bits(dtype)
  swz = plgpu.find_swizzle(minor * bits, what)
  return swz * 8 // bits, (plgpu.TilingTransform((8, swz * 8 // bits)),
                           plgpu.SwizzleTransform(swz))


def _store_stats(o_smem, out, m, tot) -> None:
  """Write a split's statistics: the tile sums plus the column max broadcast over the rows."""
  o_smem[...] = tot + lax.broadcast_in_dim(m, tot.shape, [1])
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(o_smem, out)
  plgpu.wait_smem_to_gmem(0)


@functools.partial(jax.jit, static_argnames=("tile", "stages", "splits"))
def qk(q, k, ks, *, tile: int = 64, stages: int = 4, splits: int = 4):
  """``S^T`` statistics over INT4 (or bf16) keys; see the module docstring for shapes."""
  bh, n, d = k.shape
  if q.shape != (bh, N_PAD, d):
    raise ValueError(f"q must be [{bh}, {N_PAD}, {d}], got {q.shape}")
  if n % (tile * splits):
    raise ValueError(f"keys {n} must divide into {splits} splits of {tile}-row tiles")
  steps = n // tile // splits
  k_elems, k_tr = _transforms(d, k.dtype, "keys")
  q_elems, q_tr = _transforms(d, q.dtype, "queries")
  kslice = min(k_elems, q_elems, d)
  wgmma_row = plgpu.Layout.WGMMA.reduce(1)
  wgmma_col = plgpu.Layout.WGMMA.reduce(0)

  def body(q_gmem, k_gmem, ks_gmem, o_gmem, q_smem, o_smem, bar):
    b = lax.axis_index("bh")
    sp = lax.axis_index("sp")
    plgpu.copy_gmem_to_smem(q_gmem.at[b], q_smem, bar)
    plgpu.barrier_wait(bar)

    def step(_, k_smem, ks_smem, carry):
      m, tot = carry

      def scores(acc_ref):
        kr = k_smem[...]
        for j in range(d // kslice):
          sl = slice(j * kslice, (j + 1) * kslice)
          a = kr[:, sl]
          if a.dtype != jnp.bfloat16:
            a = a.astype(jnp.bfloat16)
          plgpu.wgmma(acc_ref, a, q_smem.at[:, sl].T)
        return acc_ref[...]

      s = pl.run_scoped(scores, plgpu.ACC((tile, N_PAD), jnp.float32))
      scale = _load(ks_smem, wgmma_row)
      s = s * lax.broadcast_in_dim(scale, s.shape, [0])
      m = jnp.maximum(m, s.max(axis=0))
      return m, tot + s

    m0 = plgpu.layout_cast(jnp.full((N_PAD,), -jnp.inf, jnp.float32), wgmma_col)
    t0 = plgpu.layout_cast(jnp.zeros((tile, N_PAD), jnp.float32), plgpu.Layout.WGMMA)
    m, tot = plgpu.emit_pipeline(
        step,
        grid=(steps,),
        in_specs=[
            plgpu.BlockSpec((tile, d), lambda i: (sp * steps + i, 0), transforms=k_tr),
            plgpu.BlockSpec((tile,), lambda i: (sp * steps + i,)),
        ],
        max_concurrent_steps=stages,
        init_carry=(m0, t0),
    )(k_gmem.at[b], ks_gmem.at[b])
    _store_stats(o_smem, o_gmem.at[b, sp], m, tot)

  return plgpu.kernel(
      body,
      out_type=jax.ShapeDtypeStruct((bh, splits, tile, N_PAD), jnp.float32),
      grid=(bh, splits),
      grid_names=("bh", "sp"),
      scratch_types=dict(
          q_smem=plgpu.SMEM((N_PAD, d), q.dtype, transforms=q_tr),
          o_smem=plgpu.SMEM((tile, N_PAD), jnp.float32),
          bar=plgpu.Barrier(),
      ),
  )(q, k, ks)


def qk_reference(q, k, ks, *, tile: int = 64, splits: int = 4):
  """jnp reference of :func:`qk` (f32 math)."""
  bh, n, d = k.shape
  s = jnp.einsum("bgd,bnd->bng", q.astype(jnp.float32), k.astype(jnp.float32))
  s = s * ks[..., None].astype(jnp.float32)                        # [BH, N, 8]
  s = s.reshape(bh, splits, n // tile // splits, tile, N_PAD)
  return s.sum(2) + s.max(axis=(2, 3))[:, :, None, :]


# --- the same statistics read straight from the paged INT4 pool (integration probe) -------------

def nibble_q(q: jax.Array) -> tuple[jax.Array, jax.Array]:
  """q[BH, 8, D] -> (q for :func:`qk_paged`, the bias it removes ``[BH, 4, 8]`` f32: 4 equal
  rows, so its copy into shared memory is 128 bytes, a multiple of the warpgroup).

  :func:`qk_paged` reads a pool byte (element i low nibble, element i + D/2 high) without 8-bit
  arithmetic, which Mosaic GPU refuses: ``x & 0xF0`` is 16 x the high element (exact in bf16),
  so the high half of q is scaled by 1/16 (a power of two: exact); ``(x & 0x0F) ^ 0x08`` is the low
  element + 8, so ``8 * sum(q_low)`` per query row is subtracted from the scores."""
  h = q.shape[-1] // 2
  lo, hi = q[..., :h], q[..., h:]
  bias = 8.0 * lo.astype(jnp.float32).sum(-1)
  bias = jnp.broadcast_to(bias[:, None], (bias.shape[0], 4, bias.shape[1]))
  return jnp.concatenate([lo, (hi.astype(jnp.float32) / 16).astype(q.dtype)], -1), bias


@functools.partial(jax.jit, static_argnames=("stages", "splits"))
def qk_paged(q, bias, pool, tbl, ks, *, stages: int = 2, splits: int = 4):
  """:func:`qk`'s statistics over keys read from our paged INT4 pool as bytes, one page a tile.

  ``q[BH, 8, D]`` and ``bias[BH, 4, 8]`` from :func:`nibble_q` (BH = B x Hkv, head-minor);
  ``pool[P, page, Hkv, D/2]`` uint8, the cache's low pool (half-split nibbles,
  ``pallas_kernels.int4``); ``tbl[B, n_pages]`` int32 the pages of each sequence in order;
  ``ks[Hkv, P, page]`` f32 the K scales, head-major so a page's scales are one TMA box.
  The page table is read in the pipeline's index map: each step's TMA box is
  ``pool[tbl[b, i], :, h, :]`` (a strided box: rows Hkv x D/2 bytes apart). Output as :func:`qk`
  with ``tile = page``."""
  bh, n8, d = q.shape
  p, page, hkv, h = pool.shape
  b_n, n_pages = tbl.shape
  if n8 != N_PAD or d != 2 * h or bh != b_n * hkv:
    raise ValueError(f"q {q.shape} does not match pool {pool.shape} and tables {tbl.shape}")
  if n_pages % splits or page % 64:
    raise ValueError(f"{n_pages} pages must divide into {splits} splits, page {page} into 64-row "
                     "MMA tiles")
  steps = n_pages // splits
  _, k_tr = _transforms(h, jnp.int8, "keys")
  _, q_tr = _transforms(h, q.dtype, "queries")   # swizzled in halves: sliced at D/2
  row = plgpu.Layout.WGMMA.reduce(1)
  col = plgpu.Layout.WGMMA.reduce(0)
  codes = lax.bitcast_convert_type(pool, jnp.int8)   # same width: a free bitcast

  def body(q_gmem, bias_gmem, k_gmem, tbl_gmem, ks_gmem, o_gmem, q_smem, b_smem, o_smem, bar):
    i_bh = lax.axis_index("bh")
    sp = lax.axis_index("sp")
    b, hd = i_bh // hkv, lax.rem(i_bh, hkv)
    plgpu.copy_gmem_to_smem(q_gmem.at[i_bh], q_smem, bar)
    plgpu.copy_gmem_to_smem(bias_gmem.at[i_bh], b_smem, bar)
    plgpu.barrier_wait(bar)
    bias = _load(b_smem.at[0], col)

    def step(_, k_smem, ks_smem, carry):
      m, tot = carry
      x = _load(k_smem, plgpu.Layout.WGMMA_UPCAST_2X)
      hi = plgpu.layout_cast(lax.bitwise_and(x, jnp.int8(-16)).astype(jnp.bfloat16),
                             plgpu.Layout.WGMMA)
      lo = plgpu.layout_cast(
          lax.bitwise_xor(lax.bitwise_and(x, jnp.int8(15)), jnp.int8(8)).astype(jnp.bfloat16),
          plgpu.Layout.WGMMA)

      def scores(acc_ref):
        plgpu.wgmma(acc_ref, lo, q_smem.at[:, :h].T)
        plgpu.wgmma(acc_ref, hi, q_smem.at[:, h:].T)
        return acc_ref[...]

      s = pl.run_scoped(scores, plgpu.ACC((page, N_PAD), jnp.float32))
      s = s - lax.broadcast_in_dim(bias, s.shape, [1])
      s = s * lax.broadcast_in_dim(_load(ks_smem, row), s.shape, [0])
      return jnp.maximum(m, s.max(axis=0)), tot + s

    page_of = lambda i: tbl_gmem[b, sp * steps + i]
    m0 = plgpu.layout_cast(jnp.full((N_PAD,), -jnp.inf, jnp.float32), col)
    t0 = plgpu.layout_cast(jnp.zeros((page, N_PAD), jnp.float32), plgpu.Layout.WGMMA)
    m, tot = plgpu.emit_pipeline(
        step,
        grid=(steps,),
        in_specs=[
            plgpu.BlockSpec((None, page, None, h), lambda i: (page_of(i), 0, hd, 0),
                            transforms=k_tr),
            plgpu.BlockSpec((None, None, page), lambda i: (hd, page_of(i), 0)),
        ],
        max_concurrent_steps=stages,
        init_carry=(m0, t0),
    )(k_gmem, ks_gmem)
    _store_stats(o_smem, o_gmem.at[i_bh, sp], m, tot)

  return plgpu.kernel(
      body,
      out_type=jax.ShapeDtypeStruct((bh, splits, page, N_PAD), jnp.float32),
      grid=(bh, splits),
      grid_names=("bh", "sp"),
      scratch_types=dict(
          q_smem=plgpu.SMEM((N_PAD, d), q.dtype, transforms=q_tr),
          b_smem=plgpu.SMEM((4, N_PAD), jnp.float32),
          o_smem=plgpu.SMEM((page, N_PAD), jnp.float32),
          bar=plgpu.Barrier(num_arrivals=2),
      ),
  )(q, bias, codes, tbl, ks)


def paged_keys(pool, tbl, ks):
  """The contiguous keys and scales :func:`qk_paged` reads: (k[BH, N, D] int8 codes,
  ks[BH, N] f32), N = n_pages x page, heads minor in BH."""
  from pallas_kernels import int4
  return _rows(int4.unpack(pool), tbl), _scale_rows(ks, tbl)


def _rows(pool, tbl):
  """``pool[P, page, Hkv, X]`` through the tables -> ``[B * Hkv, n_pages * page, X]``."""
  b, n_pages = tbl.shape
  x = jnp.moveaxis(pool[tbl], 3, 1)                          # [B, Hkv, n_pages, page, X]
  return x.reshape(b * pool.shape[2], n_pages * pool.shape[1], pool.shape[3])


def _scale_rows(scales, tbl):
  """Head-major ``scales[Hkv, P, page]`` through the tables -> ``[B * Hkv, n_pages * page]``."""
  b, n_pages = tbl.shape
  return jnp.moveaxis(scales[:, tbl], 0, 1).reshape(b * scales.shape[0], -1)


def qk_paged_reference(q, pool, tbl, ks, *, splits: int = 4):
  """jnp reference of :func:`qk_paged` (f32 math, the original q, no bias trick)."""
  k, s = paged_keys(pool, tbl, ks)
  return qk_reference(q, k, s, tile=pool.shape[1], splits=splits)


def qk_paged_emulated(qn, bias, pool, tbl, ks, *, splits: int = 4):
  """:func:`qk_paged`'s arithmetic in jnp: the page gather through the table, the bitwise nibble
  split on int8 bytes, both halves against the nibble q, the bias removed, then :func:`qk`'s
  statistics. Equal to :func:`qk_paged_reference` on the original q (the tests check it)."""
  p, page, hkv, h = pool.shape
  b, n_pages = tbl.shape
  x = _rows(lax.bitcast_convert_type(pool, jnp.int8), tbl)       # [BH, N, D/2] bytes
  hi = (x & jnp.int8(-16)).astype(jnp.float32)
  lo = ((x & jnp.int8(15)) ^ jnp.int8(8)).astype(jnp.float32)
  qf = qn.astype(jnp.float32)
  s = (jnp.einsum("bnd,bgd->bng", lo, qf[..., :h]) + jnp.einsum("bnd,bgd->bng", hi, qf[..., h:])
       - bias[:, None, 0, :])
  s = s * _scale_rows(ks, tbl)[..., None]
  s = s.reshape(b * hkv, splits, n_pages // splits, page, N_PAD)
  return s.sum(2) + s.max(axis=(2, 3))[:, :, None, :]
