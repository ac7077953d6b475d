"""Prototype: the QK half of the INT4 partition as a Pallas Mosaic GPU kernel (Hopper).

This is the first stage of the Mosaic GPU INT4 decode kernel: it measures how fast packed INT4
keys can be streamed through TMA, upcast in registers and fed to wgmma as the A operand, with the
tokens on the MMA's M side and the (padded) query heads on N (the operand swap:
``S^T = K . q^T``). It computes what the softmax needs from each tile (the per-row K scale
folded into ``S^T`` after the MMA, the running column max) and nothing of P.V yet, so its time
against the packed key bytes says whether the full kernel can reach the bandwidth goal.

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
    o_smem[...] = tot + lax.broadcast_in_dim(m, tot.shape, [1])
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[b, sp])
    plgpu.wait_smem_to_gmem(0)

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
