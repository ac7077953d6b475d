"""INT4 tiles -> bf16 wgmma A operands by 32-bit shared-memory loads, without a relayout.

Why: in the INT4 partition (``mgpu_int4``) loading an int4 tile in the 16-bit wgmma layout gives
each thread single bytes (two codes per register, the thread's next pair four bytes away), so
Mosaic GPU issues one ``LDS.S8`` and a shift, a ``PRMT``, a ``LOP3`` and a ``HADD2`` per byte:
20.6 of the kernel's 31.6 warp-instructions per (key, KV head) at the 4B shape (Nsight Compute,
``bench/results/2026-12-06_session21/int4_sass``). Loading the tile in the 4x-upcast layout
instead gives each thread 8 consecutive codes per 32-bit register, and the ``layout_cast`` to the
wgmma layout that ``k_upcast="bf16_up4"`` does costs shuffles again.

What this does: load in the 4x-upcast layout, convert each 32-bit word into four bf16 pairs in
registers (``shr`` + ``lop3`` + ``sub.bf16x2``: nibbles ``k`` and ``k + 4`` of the word become one
pair, CUTLASS's magic-number conversion), and declare those registers the wgmma layout of the
tile **with its minor axis permuted** (:func:`perm`). For K (``S^T = K . q^T``, the head dim is
the contraction) the permutation is absorbed by permuting ``q``'s head dim the same way before
the kernel: ``K[:, p] q[p]`` summed over ``p`` is the same dot product in any order. For
dim-major V (``O^T = V^T . P^T``, the tokens are the contraction and ``P^T`` fixes their order)
the codes themselves are stored permuted (:func:`store_order`), so the operand comes out in token
order. Per word (eight codes) that is one load and 11 ALU instructions instead of four loads and
16; ``operand(..., sub=False)`` drops the four subtracts, for a caller that takes ``136 * sum(q)``
off the scores after the MMA (``mgpu_int4``'s ``k_upcast="bf16_perm_offset"``).

:func:`perm` is derived from Mosaic GPU's own layout definitions (:func:`elements` replays its
``TiledLayout`` index arithmetic in numpy), and :func:`convert_reference` replays the register
conversion bit for bit, so the CPU tests check the mapping the GPU will run.
"""
from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
from jax.experimental.mosaic.gpu import fragmented_array as fa
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.gpu.mgpu_common import load

# bf16 0x4308 = 136.0: exponent for 128 (the mantissa's low bits count integers) plus the bias 8
# that flipping the code's sign bit adds.
MAGIC = 0x43084308
OFFSET = 136.0      # what a value converted without the subtract (sub=False) carries: code + 136
MASK = 0x000F000F
LUT = (0xF0 & 0xCC) ^ 0xAA          # lop3: (a & b) ^ c


def elements(layout, shape: tuple[int, int]) -> np.ndarray:
  """``E[r, thread, e]``: the linear index (row-major over ``shape``) of vector element ``e`` of
  register ``r`` (flattened in the register array's order) of ``thread`` (0..127) in a
  ``TiledLayout`` — Mosaic GPU's ``TiledLayout.thread_idxs`` in numpy."""
  contig = tuple(mgpu_utils.get_contiguous_strides(shape))
  ts = layout.tiling.tile_strides(contig)
  tshape = layout.tiled_tiling_shape
  suffix = ts[-len(tshape):]

  def offset(idx: int, dims) -> int:
    sizes = tuple(d.times if isinstance(d, fa.Replicated) else tshape[d] for d in dims)
    strides = mgpu_utils.get_contiguous_strides(sizes)
    return sum(((idx // s) % n) * suffix[d] for d, s, n in zip(dims, strides, sizes)
               if not isinstance(d, fa.Replicated))

  regs = layout.registers_shape(shape)
  base = np.array([sum(i * s for i, s in zip(ti, ts)) for ti in np.ndindex(regs)], np.int64)
  thread = np.array([offset(t // 32, layout.warp_dims) + offset(t % 32, layout.lane_dims)
                     for t in range(128)], np.int64)
  vec = np.arange(layout.vector_length, dtype=np.int64) * ts[layout.vector_dim]
  return base[:, None, None] + thread[None, :, None] + vec[None, None, :]


def register_blocks(shape: tuple[int, int]) -> tuple[tuple[int, ...], tuple[int, ...], int]:
  """The two layouts' register shapes and the axis on which they differ (by 4: one 32-column
  block of the 4x-upcast layout holds four 8-column blocks of the wgmma layout)."""
  ur = fa.WGMMA_LAYOUT_UPCAST_4X.registers_shape(shape)
  wr = fa.WGMMA_LAYOUT.registers_shape(shape)
  diff = [i for i, (a, b) in enumerate(zip(ur, wr)) if a != b]
  if len(ur) != len(wr) or len(diff) != 1 or wr[diff[0]] != 4 * ur[diff[0]]:
    raise NotImplementedError(f"unexpected register shapes {ur} / {wr} for {shape}")
  return ur, wr, diff[0]


def target_register(ui: tuple[int, ...], k: int, axis: int) -> tuple[int, ...]:
  """The wgmma-layout register that pair ``k`` of 4x-upcast register ``ui`` becomes."""
  return ui[:axis] + (4 * ui[axis] + k,) + ui[axis + 1:]


@functools.lru_cache(maxsize=None)
def perm(rows: int, cols: int) -> np.ndarray:
  """``pi[p]``: the column of the wgmma-layout operand that column ``p`` of a ``[rows, cols]``
  tile loaded in the 4x-upcast layout lands in (the same for every row), a permutation of
  ``range(cols)``. Raises if the two layouts do not pair up row for row."""
  shape = (rows, cols)
  if cols % 32 or rows % 64:
    raise ValueError(f"a {shape} int4 tile needs rows in multiples of 64 and columns in "
                     "multiples of 32 for 32-bit upcast loads")
  ur, wr, axis = register_blocks(shape)
  u = elements(fa.WGMMA_LAYOUT_UPCAST_4X, shape)          # [regs, 128, 8]
  w = elements(fa.WGMMA_LAYOUT, shape)                    # [regs, 128, 2]
  w_index = {ti: i for i, ti in enumerate(np.ndindex(wr))}
  pi = np.full(cols, -1, np.int64)
  for i, ui in enumerate(np.ndindex(ur)):
    for k in range(4):
      j = w_index[target_register(ui, k, axis)]
      for e in range(2):                                  # pair k: nibbles k and k + 4
        src, dst = u[i, :, k + 4 * e], w[j, :, e]
        if np.any(src // cols != dst // cols):
          raise NotImplementedError(f"the layouts put different rows in one register ({shape})")
        p, c = src % cols, dst % cols
        if np.any((pi[p] != -1) & (pi[p] != c)):
          raise NotImplementedError(f"no single column permutation for {shape}")
        pi[p] = c
        if np.any(pi[p] != c):      # two threads sent one column to two places
          raise NotImplementedError(f"no single column permutation for {shape}")
  if sorted(pi.tolist()) != list(range(cols)):
    raise NotImplementedError(f"the column map of {shape} is not a permutation")
  return pi


def permute_minor(x: jnp.ndarray, rows: int = 64) -> jnp.ndarray:
  """``x[..., p]`` moved to ``x[..., perm(rows, D)[p]]``: what ``q`` needs so that ``q . k`` over
  the permuted operand equals the plain dot product. On the decode path (every layer's q), so a
  reshape and transpose XLA fuses with q's other layout work rather than a gather: column
  32b + 8t + 4e + k goes to 32b + 8k + 2t + e (:func:`perm`, checked here against the layouts)."""
  d = x.shape[-1]
  perm(rows, d)                                     # the layouts pair up as the transpose says
  lead = x.shape[:-1]
  y = x.reshape(*lead, d // 32, 4, 2, 4)            # [.., b, t, e, k]
  n = len(lead)
  y = jnp.transpose(y, (*range(n + 1), n + 3, n + 1, n + 2))      # [.., b, k, t, e]
  return y.reshape(*lead, d)


def store_order(x: jnp.ndarray) -> jnp.ndarray:
  """Dim-major V codes ``[..., D, N]`` (tokens minor, N a multiple of 32) in token order -> the
  order whose :func:`operand` is the tile in token order (column ``p`` holds token
  ``perm[p]``; the map repeats every 32 tokens, so a tile or page of any multiple of 32 keeps
  its own tokens). For V the contraction runs over the tokens, whose order ``P^T`` fixes: the
  permutation must be in the stored codes, not in the other operand."""
  return x[..., perm(64, x.shape[-1])]


def token_order(x: jnp.ndarray) -> jnp.ndarray:
  """Inverse of :func:`store_order`."""
  return x[..., np.argsort(perm(64, x.shape[-1]))]


def convert_reference(words: np.ndarray, sub: bool = True) -> np.ndarray:
  """The register conversion in numpy: uint32 words of eight int4 codes (code ``i`` in bits
  ``4i..4i+3``) -> ``[..., 4, 2]`` float32 (pair ``k`` = codes ``k``, ``k + 4``), through the
  same bit operations (``shr``, ``lop3``, bf16 subtract) the kernel issues."""
  words = np.asarray(words, np.uint32)
  out = []
  for k in range(4):
    t = ((words >> np.uint32(4 * k)) & np.uint32(MASK)) ^ np.uint32(MAGIC)
    halves = np.stack([t & np.uint32(0xFFFF), t >> np.uint32(16)], axis=-1).astype(np.uint32)
    f = (halves << np.uint32(16)).view(np.float32)          # bf16 bits -> float32
    out.append(f - np.float32(136.0) if sub else f)
  return np.stack(out, axis=-2)


def _asm(k: int, sub: bool) -> str:
  shift = f"shr.u32 t, $1, {4 * k};" if k else "mov.b32 t, $1;"
  tail = (f"mov.b32 m, {MAGIC:#x}; sub.bf16x2 $0, t, m;" if sub else "mov.b32 $0, t;")
  return (f"{{ .reg .b32 t, m; {shift} lop3.b32 t, t, {MASK:#x}, {MAGIC:#x}, {LUT:#x}; "
          f"{tail} }}")


def operand(ref, *, sub: bool = True):
  """An int4 shared-memory tile ``[T, D]`` -> the bf16 wgmma A operand of that tile with its
  columns permuted by :func:`perm` (``sub=False``: every value plus 136, for callers that
  subtract ``136 * sum(q)`` after the MMA instead)."""
  from jax._src.lib.mlir import ir                    # the MLIR of the lowering context
  from jax._src.lib.mlir.dialects import llvm
  shape = tuple(ref.shape)
  ur, wr, axis = register_blocks(shape)
  perm(*shape)                                        # the pairing is checked at trace time

  @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA_UPCAST_4X,),
                     return_type=plgpu.ShapeDtypeStruct(shape, jnp.bfloat16,
                                                        layout=plgpu.Layout.WGMMA))
  def upcast(_, x):
    i32 = ir.IntegerType.get_signless(32)
    pair = ir.VectorType.get((2,), ir.BF16Type.get())
    regs = x.registers
    out = np.empty(wr, dtype=object)
    for ui in np.ndindex(ur):
      word = mgpu_utils.bitcast(regs[ui], i32)
      for k in range(4):
        val = llvm.inline_asm(i32, [word], _asm(k, sub), "=r,r")
        out[target_register(ui, k, axis)] = mgpu_utils.bitcast(val, pair)
    return fa.FragmentedArray(_registers=out, _layout=fa.WGMMA_LAYOUT, _is_signed=None)

  return upcast(load(ref, plgpu.Layout.WGMMA_UPCAST_4X))
