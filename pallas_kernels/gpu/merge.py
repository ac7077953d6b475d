"""Pallas Triton kernel: the Eq. 15 merge of decode attention's partial sets, in one launch.

``decode.partial_sets`` leaves per-split partials (o, m, l) in one or two sets (the Triton
kernel's layout and, where the Mosaic GPU kernel reads the INT4 pool, its O^T layout).  XLA
merges them (:func:`merge_sets`, here beside the kernel as its reference; decode's default) in
~7 small fusions (select, reduce, select, reduce, ...): ~13 us a layer on the H100 at a 0.5B
shape against ~33 us of attention kernels.  This kernel reads every set in place and writes the
bf16 output once.

Grid (D / bd, Hkv, B), D chunks fastest: the programs of one (sequence, KV head) run together
and share that head's m, l (a few KB, L2-resident) while each reads its own slice of o.

Why this shape:
* Triton blocks are powers of two: S is padded to ``next_pow2(S)`` in the BlockSpec and every
  load is masked (``split < S``), so no partial is copied to a padded array.  The query rows
  are read as ``G = next_pow2(g)`` of the set's M (or 16) rows; rows >= g are never stored.
* The output is ``[B, Hkv, g, D]`` (a free reshape of ``[B, Hq, D]``) with a ``(G, bd)``
  block: past row g a block reaches into the next head's rows, so the store is masked to the
  g rows.  No padded output and no slice after the call (an XLA copy per layer).
* Each set's split axis is loaded as one vector ``[Sp, G, bd]`` (``[Sp, bd, G]`` for O^T), not
  split by split, and o is loaded with m and l, before the weights exist: when every set fits
  in ``tile`` registers (the default D chunk shrinks until it does) all loads are issued up
  front and the merge waits on ONE memory round trip (sm_90a SASS, 0.5B shape: every LDG
  precedes the first barrier).  Sets too large for that run in turn, in chunks of ``bs`` splits
  (a loop with an online max rescale, one round trip a chunk; Triton's pipeliner does not
  prefetch these loads, which feed no dot).
* Empty partials (l <= 0) and padded splits are masked with ``where`` before any arithmetic:
  their o and m may be garbage, NaN included, and 0 * NaN is NaN.
* O^T sets are summed in their own layout into a ``[bd, G]`` accumulator, transposed once at
  the end (through shared memory, [bd, G] only, not a pass over the partials).
* The reductions run over the split axis, which Triton spreads over warps: ~30 barriers a
  program.  Cheap next to a memory round trip, and far cheaper than XLA's seven launches.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import common

_NUM_SMS = 132     # H100 / H200
_PER_THREAD = 64   # o elements a thread holds at once (f32 registers): the default tile


def merge_sets(sets, g: int) -> jax.Array:
  """Eq. 15 over several partial sets read in place -> out [B, Hkv, g, D] f32.

  ``sets``: ``[((o, m, l), kernel_layout), ...]``: the Triton layout (``o [B, Hkv, S, M, D]``,
  ``m, l [B, Hkv, S, M]``) or the Mosaic GPU kernel's as it writes them (``kernel_layout``: ``o
  [B, Hkv, S, D, 16]``, ``m, l`` of the same shape with the values in row 0 of D). The same
  rule as ``common.merge`` over their concatenation (empty partials contribute nothing, all
  empty gives 0), without materializing the concatenation or transposing O^T: the
  sums run over each set's own layout and only the [B, Hkv, D, g] result is transposed."""
  sets = [((o, m[..., 0, :], l[..., 0, :]) if k else (o, m, l), k) for (o, m, l), k in sets]
  live, mm = [], []
  for (o, m, l), _ in sets:
    lv = l[..., :g] > 0
    live.append(lv)
    mm.append(jnp.where(lv, m[..., :g], -jnp.inf))
  v = functools.reduce(jnp.maximum, [x.max(axis=2) for x in mm])           # [B, Hkv, g]
  v = jnp.where(jnp.isfinite(v), v, 0.0)
  num = den = 0.0
  for ((o, m, l), kernel_layout), lv, x in zip(sets, live, mm):
    w = jnp.where(lv, jnp.exp2(x - v[:, :, None]), 0.0)                    # [B, Hkv, S, g]
    den = den + jnp.sum(w * jnp.where(lv, l[..., :g], 0.0), axis=2)
    if kernel_layout:      # O^T [B, Hkv, S, D, 16]: sum to [B, Hkv, D, g], then transpose
      t = jnp.sum(jnp.where(lv[:, :, :, None], o[..., :g], 0.0) * w[:, :, :, None], axis=2)
      num = num + jnp.swapaxes(t, 2, 3)
    else:
      num = num + jnp.sum(jnp.where(lv[..., None], o[..., :g, :], 0.0) * w[..., None], axis=2)
  return num / jnp.where(den > 0, den, 1.0)[..., None]


def merge_reference(sets, g: int) -> jax.Array:
  """The jnp merge (:func:`merge_sets`, the reference semantics) -> out [B, Hq, D] bf16."""
  return _reference(tuple(x for x, _ in sets), g=g, layouts=tuple(bool(k) for _, k in sets))


@functools.partial(jax.jit, static_argnames=("g", "layouts"))
def _reference(parts, *, g, layouts):
  out = merge_sets(list(zip(parts, layouts)), g)                 # [B, Hkv, g, D] f32
  b, hkv, _, d = out.shape
  return out.reshape(b, hkv * g, d).astype(jnp.bfloat16)


def _kernel(*refs, g, layouts, splits, chunks, up_front):
  # refs: per set o [Sp, G, bd] (O^T: [Sp, bd, G]), m, l [Sp, G] f32 (Sp = next_pow2(S) blocks
  # of arrays with S splits: every load is masked); then out [G, bd] bf16 (rows >= g: the next
  # head's, never stored).  chunks[i]: splits per load of set i (up_front: Sp, one chunk a set,
  # every set loaded before any arithmetic).
  out_ref = refs[-1]
  rows, bd = out_ref.shape
  row_ok = jnp.arange(rows) < g
  ninf = jnp.float32(-jnp.inf)

  def load(i, j):
    """Chunk j of set i: (ok [bs, 1], m, l [bs, G], o [bs, G, bd] or O^T [bs, bd, G]).  o is
    loaded with m and l, not after the weights: one memory round trip, not two."""
    o_ref, m_ref, l_ref = refs[3 * i:3 * i + 3]
    bs = chunks[i]
    at = pl.ds(j * bs, bs)
    ok = (j * bs + jnp.arange(bs) < splits[i])[:, None]
    return (ok, plgpu.load(m_ref.at[at, :], mask=ok, other=ninf),
            plgpu.load(l_ref.at[at, :], mask=ok, other=0.0),
            plgpu.load(o_ref.at[at, :, :], mask=ok[:, :, None], other=0.0))

  def update(carry, kernel_layout, ok, m, l, o):
    """Online Eq. 15 step: running max v [G] (log2 units), den [G], acc [G, bd], acc^T [bd, G]
    (the O^T sets, transposed once at the end)."""
    v, den, acc, acc_t = carry
    live = ok & row_ok[None, :] & (l > 0)      # empty, padded or rows >= g: masked, never * 0
    mm = jnp.where(live, m, ninf)
    v_new = jnp.maximum(v, jnp.max(mm, axis=0))
    # Nothing live before (v = -inf): acc and den are 0, and exp2(-inf - -inf) would be NaN.
    alpha = jnp.where(v > ninf, jnp.exp2(v - v_new), 0.0)                   # [G]
    w = jnp.where(live, jnp.exp2(mm - v_new[None, :]), 0.0)                 # [bs, G]
    den = den * alpha + jnp.sum(w * jnp.where(live, l, 0.0), axis=0)
    if acc is not None:
      acc = acc * alpha[:, None]
    if acc_t is not None:
      acc_t = acc_t * alpha[None, :]
    if kernel_layout:                                                       # o [bs, bd, G]
      acc_t = acc_t + jnp.sum(jnp.where(live[:, None, :], o, 0.0) * w[:, None, :], axis=0)
    else:                                                                   # o [bs, G, bd]
      acc = acc + jnp.sum(jnp.where(live[:, :, None], o, 0.0) * w[:, :, None], axis=0)
    return v_new, den, acc, acc_t

  carry = (jnp.full((rows,), ninf), jnp.zeros((rows,), jnp.float32),
           jnp.zeros((rows, bd), jnp.float32) if not all(layouts) else None,
           jnp.zeros((bd, rows), jnp.float32) if any(layouts) else None)
  if up_front:
    # Straight-line: every load issued up front, so the whole merge waits on one round trip.
    loaded = [load(i, 0) for i in range(len(layouts))]
    for kernel_layout, x in zip(layouts, loaded):
      carry = update(carry, kernel_layout, *x)
  else:
    # Too many splits for the registers: a loop over chunks per set (one round trip each).
    for i, kernel_layout in enumerate(layouts):
      body = lambda j, c, i=i, kl=kernel_layout: update(c, kl, *load(i, j))
      n = pl.cdiv(splits[i], chunks[i])
      carry = body(0, carry) if n == 1 else lax.fori_loop(0, n, body, carry)

  _, den, acc, acc_t = carry
  if acc_t is not None:
    acc = acc_t.T if acc is None else acc + acc_t.T
  out = (acc / jnp.where(den > 0, den, 1.0)[:, None]).astype(out_ref.dtype)  # all empty -> 0
  if rows == g:
    out_ref[...] = out
  else:
    plgpu.store(out_ref, out, mask=row_ok[:, None])


def default_block_d(b: int, hkv: int, d: int, per_d: int = 0,
                    tile: int = _PER_THREAD * 128) -> int:
  """D chunk: halved (down to 8 floats, one 32 B sector a row) until the grid has two programs
  per SM (the merge is latency-bound: programs in flight matter more than their size) and the
  o of all sets, ``per_d`` elements per D column (sum of Sp x G), fits in ``tile`` registers."""
  bd = d
  while bd > 8 and (b * hkv * (d // bd) < 2 * _NUM_SMS or per_d * bd > tile):
    bd //= 2
  return bd


def merge_kernel(sets, g: int, *, block_d: int | None = None, tile: int | None = None,
                 num_warps: int = 4, num_stages: int = 1, interpret: bool = False) -> jax.Array:
  """Eq. 15 over ``sets`` (``[((o, m, l), kernel_layout), ...]``, see :func:`merge_sets`) ->
  out [B, Hq, D] bf16, Hq = Hkv * g: ``merge_reference(sets, g)`` in one ``pallas_call``.

  ``block_d``: the D chunk per program (default: :func:`default_block_d`); ``tile``: the most
  o elements a program holds at once (default 64 a thread): all sets' splits when they fit
  (every load up front), else chunks of a power-of-two splits in a loop per set;
  ``interpret``: Pallas interpret mode (CPU)."""
  if not sets:
    raise ValueError("merge_kernel needs at least one partial set")
  (o0, m0, _), kl0 = sets[0]
  b, hkv = m0.shape[:2]
  d = o0.shape[3] if kl0 else o0.shape[4]
  rows = common.next_pow2(g)
  tile = tile or _PER_THREAD * 32 * num_warps
  for (o, m, l), kernel_layout in sets:
    n_s, m_rows = m.shape[2], m.shape[-1]
    want = (b, hkv, n_s, d, m_rows) if kernel_layout else (b, hkv, n_s, m_rows, d)
    want_ml = want if kernel_layout else want[:4]
    if o.shape != want or m.shape != want_ml or l.shape != m.shape or rows > m_rows:
      raise ValueError(f"a partial set must be o {want} (kernel_layout={kernel_layout}), m, l "
                       f"{want_ml} with >= {rows} rows; got o {o.shape}, m {m.shape}, "
                       f"l {l.shape}")
  sp = [common.next_pow2(m.shape[2]) for (_, m, _), _ in sets]
  bd = block_d or default_block_d(b, hkv, d, sum(sp) * rows, tile)
  if d % bd or bd & (bd - 1):
    raise ValueError(f"block_d must be a power of two dividing the head dim {d}, got {bd}")
  # One chunk a set (all loads up front) when everything fits, else chunks of the tile.
  fit = sum(sp) * rows * bd <= tile
  chunks = tuple(s if fit else min(s, _prev_pow2(max(1, tile // (rows * bd)))) for s in sp)
  args, specs = [], []
  for ((o, m, l), kernel_layout), s in zip(sets, sp):
    if kernel_layout:    # O^T: [B, Hkv, S, D, 16] -> [Sp, bd, G] blocks
      o_spec = pl.BlockSpec((None, None, s, bd, rows), lambda j, h, i: (i, h, 0, j, 0))
      # m, l as the Mosaic GPU kernel writes them ([B, Hkv, S, D, 16], values in row 0 of D):
      # read in place, where slicing row 0 first would be an XLA copy per array and layer
      ml_spec = pl.BlockSpec((None, None, s, None, rows), lambda j, h, i: (i, h, 0, 0, 0))
    else:                # [B, Hkv, S, M, D] -> [Sp, G, bd] blocks
      o_spec = pl.BlockSpec((None, None, s, rows, bd), lambda j, h, i: (i, h, 0, 0, j))
      ml_spec = pl.BlockSpec((None, None, s, rows), lambda j, h, i: (i, h, 0, 0))
    args += [o, m, l]
    specs += [o_spec, ml_spec, ml_spec]
  kernel = functools.partial(_kernel, g=g, layouts=tuple(bool(k) for _, k in sets),
                             splits=tuple(m.shape[2] for (_, m, _), _ in sets), chunks=chunks,
                             up_front=fit)
  out = pl.pallas_call(
      kernel,
      grid=(d // bd, hkv, b),        # D chunks fastest: they share the head's m, l
      in_specs=specs,
      out_specs=pl.BlockSpec((None, None, rows, bd), lambda j, h, i: (i, h, 0, j)),
      out_shape=jax.ShapeDtypeStruct((b, hkv, g, d), jnp.bfloat16),
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name="pask_merge",
  )(*args)
  return out.reshape(b, hkv * g, d)       # free: [B, Hkv, g, D] is [B, Hq, D]


def _prev_pow2(x: int) -> int:
  return 1 << max(0, x.bit_length() - 1)
