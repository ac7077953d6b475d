"""What the Mosaic GPU INT4 kernels share (``mgpu_int4``'s contiguous partitions and
``mgpu_paged``'s over the paged pool): the padded query width, the tile softmax, the partial
writer, shared-memory layouts and budgets, compiler parameters."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

# wgmma N: the query heads of one KV head, padded; 16 so the bf16 P^T tile's rows are 32 bytes,
# the smallest swizzle.
N_PAD = 16
LOG2E = math.log2(math.e)
FLOOR = -1e30   # finite "minus infinity" for the running max: empty tiles give alpha = 1, p = 0
SM90_SMEM = 232448   # bytes of shared memory a Hopper block may use (the H200's limit)
SCRATCH = 8192      # Mosaic GPU's reduction scratch and barriers, rounded up


def smem_bytes(d: int, tile: int, stages: int, v_major: str, wgs: int = 1) -> int:
  """Shared memory of one block: the pipeline's buffers, q, the P^T tile, the bf16 V tile
  (token-major V only) and the output staging tile, those three per compute warpgroup.
  Mosaic GPU checks it only on the device."""
  per_stage = wgs * 2 * (tile * d // 2 + tile * 4)    # K and V codes + f32 scales
  vb = {"token": tile, "dim": 8, "block": 0}[v_major] * d * 2
  per_wg = N_PAD * d * 2 + tile * N_PAD * 2 + d * N_PAD * 4
  return stages * per_stage + vb + wgs * per_wg + SCRATCH


def has_concat() -> bool:
  """Whether this jax lowers ``jnp.concatenate`` of registers in Mosaic GPU (0.11 does)."""
  try:
    from jax._src.pallas.mosaic_gpu import core as gpu_core, lowering
    return lax.concatenate_p in lowering.mosaic_lowering_rules[gpu_core.LANExWG_SEMANTICS]
  except (ImportError, AttributeError, KeyError):   # a private table: unknown means no
    return False


HAS_CONCAT = has_concat()


def zeros(shape):
  return plgpu.layout_cast(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA)


def softmax_tile(s, kscale, vscale, first, length, m, l, *, lazy_sum=True, col_max=None):
  """One tile's online softmax (base 2) on ``S^T[T, C]``: scale the rows by the K scales, mask
  the keys at or past ``length`` (``first`` is the tile's first key), update the running column
  max ``m[C]`` and the row sums ``l`` (per element ``[T, C]`` with ``lazy_sum``, else ``[C]``).
  ``col_max`` does the cross-warp max (default ``x.max(axis=0)``).
  -> (P^T times the V scales ``[T, C]``, zero past ``length`` whatever the scales hold there
  (rows the cache never wrote may hold any bits), alpha ``[C]``, new m, new l).
  ``kscale`` may be a Python float (one scale for every row: a BF16 tile) and ``vscale`` None
  (P^T unscaled)."""
  if isinstance(kscale, (int, float)):
    s = s * kscale
  else:
    s = s * lax.broadcast_in_dim(kscale, s.shape, [0])
  tok = plgpu.broadcasted_iota(jnp.int32, s.shape, 0, layout=plgpu.Layout.WGMMA)
  valid = tok + first < length
  s = jnp.where(valid, s, -jnp.inf)
  m_new = jnp.maximum(m, s.max(axis=0) if col_max is None else col_max(s))
  alpha = jnp.exp2(m - m_new)
  p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [1]))
  if lazy_sum:   # per-element partial sums, one cross-warp reduction at the end
    l = l * lax.broadcast_in_dim(alpha, p.shape, [1]) + p
  else:
    l = l * alpha + p.sum(axis=0)
  if vscale is not None:
    p = p * lax.broadcast_in_dim(vscale, p.shape, [0])
  return jnp.where(valid, p, 0.0), alpha, m_new, l


def store_partials(o_smem, outs, acc, m, l, pad: int = 0) -> None:
  """Write one partial: ``acc`` and ``m``, ``l`` broadcast over its rows, each staged through
  ``o_smem`` into ``outs`` (the three output refs at this partial), ``pad`` zero columns added."""
  for out, val in zip(outs, (acc, lax.broadcast_in_dim(m, acc.shape, [1]),
                             lax.broadcast_in_dim(l, acc.shape, [1]))):
    o_smem[...] = jnp.concatenate([val, zeros((val.shape[0], pad))], axis=1) if pad else val
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, out)
    plgpu.wait_smem_to_gmem(0)


def load(ref, layout):
  try:
    return plgpu.load(ref, layout=layout)
  except TypeError:   # jax 0.10 wants the index
    return plgpu.load(ref, (), layout=layout)


def dtype_bits(dtype) -> int:
  return 4 if jnp.dtype(dtype) == jnp.int4 else jnp.dtype(dtype).itemsize * 8


def transforms(minor: int, dtype, what: str, swz: int | None = None):
  bits = dtype_bits(dtype)
  swz = swz or plgpu.find_swizzle(minor * bits, what)
  return swz * 8 // bits, (plgpu.TilingTransform((8, swz * 8 // bits)),
                           plgpu.SwizzleTransform(swz))


def params(approx_math: bool, no_auto_barriers: bool):
  """Mosaic GPU compiler parameters: ``approx_math`` lets exp2 be ``ex2.approx``;
  ``no_auto_barriers`` drops the barriers Pallas inserts around shared-memory loads and stores
  (safe here: no thread reads and writes one region, and no committed region is overwritten
  by an async copy)."""
  return plgpu.CompilerParams(approx_math=approx_math, unsafe_no_auto_barriers=no_auto_barriers)


def check_cols(cols: int) -> bool:
  """Whether the softmax is narrowed to ``cols`` < 16 columns; a ValueError for other widths, or
  where this jax cannot build the zero-padded P^T (no Mosaic GPU register concatenate)."""
  if cols not in (8, N_PAD):
    raise ValueError(f"cols must be 8 or {N_PAD}, got {cols}")
  if cols < N_PAD and not HAS_CONCAT:
    raise ValueError(f"cols=8 needs Pallas Mosaic GPU's concatenate (jax >= 0.11), this is jax "
                     f"{jax.__version__}")
  return cols < N_PAD
