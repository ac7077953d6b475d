"""Pallas Mosaic (TPU) kernel of the Spherical KV tier partitions (docs/SPHERICAL_KV.md §2.2,
§3 "TPU"): logits in the angle domain straight from the packed codes, no dense key anywhere.

One ``pallas_call`` per tier, grid (B, Hkv, NS, T): a block is one page of one (sequence, KV
head) -- ``ang [page, NB]``, ``side [1, page]``, values ``[page, D]`` (BF16) or ``[page, D/2]``
(INT4) -- fetched through the per-(sequence, head) page table, which travels as scalar prefetch
with the lengths and the layer (as ``tpu/decode.py``).  Steps past a head's last visible page
re-map to that page (no new DMA) and skip their compute.  Running max / sum / accumulators live in
VMEM scratch across the T steps of a split; each split writes an unnormalized partial (FP32, log2
units), the splits are combined in XLA into exactly the partial ``reference.sph_partials``
returns, so the one Eq. 15 merge is shared with every other partition.

Per page, inside the kernel (every array is [page, NB] unless said; NB = packed bytes per key):

1. **Unpack** (int32, TPU has no int8 shifts): byte lane ``b`` carries ``8 / bits`` codes at shifts
   ``0, bits, 2 bits, ..``; piece j is ``(x >> shift_j) & mask_j`` with per-lane shift and mask
   (A42 mixes 4-bit and 2-bit lanes in one row).  No lane is moved: every piece keeps the byte
   lanes, and which tree position a (piece, lane) holds is a static table (``_Plan``).
2. **Trig by selection**: per (piece, lane, code) a table gives, for level-1 codes, cos/sin of
   the bin centre (the exact f32 values of ``spherical.trig_tables``) and, for level >= 2 codes
   (angles in (0, π/2), so cos and sin are > 0), their natural logs (float64 logs of those f32
   values); a select over the code alphabet reads it (no gathers, no sin/cos in the kernel).
3. **Top-down expansion in the log domain on the MXU** (the design's choice; decode leaves the MXU
   idle): the level-1 factor ``A = u¹`` of every leaf is the product of one cos-or-sin per level
   above it, so ``log A = Σ_j logcos_j · Mc_j + logsin_j · Ms_j`` with constant 0/1 matrices
   ``[NB, NB]`` (ancestor, branch) and ``A = exp(log A)``: no lane interleave.  The matmuls run at
   ``Precision.HIGHEST`` (0/1 selections of f32 values stay f32-exact up to the summation).
4. **Logit**: ``q'·ũ = Σ_leaf q'_{2i} A_i cos φ¹_i + q'_{2i+1} A_i sin φ¹_i`` -- two MMAs per leaf
   piece against the rotated query's even/odd entries laid out on the same byte lanes (zero on
   lanes that hold no leaf), prepared in XLA; then ``s = (q·μ + r̃·q'·ũ)·scale·log2 e`` with r̃
   the fp16 radius of the side word, decoded with integer ops (fp16 vector loads do not compile).
5. **Values**: BF16 rows by ``p @ V`` (``exact_pv``: p as a bf16 hi + lo pair, FP32-grade, as
   ``tpu/decode.py``); INT4 rows as half-split nibbles widened to int32, the per-row fp16 scale
   (side word's high half) folded into p, two [G, D/2] accumulators joined in XLA.

Invisible rows (beyond a head's length) may hold NaN radii, scales and values: logits are masked
before the softmax, values and scaled probabilities are zeroed before ``p @ V``.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import common
from pallas_kernels import spherical
from pallas_kernels.reference import lse_of, sph_rotation
from pallas_kernels.sph_types import SphInputs, SphPool, TierSpec
from pallas_kernels.tpu.decode import p_at_v, partials_tpu
from pallas_kernels.types import HighPool, LowPool, PageMaps, Window

HIGHEST = lax.Precision.HIGHEST
# Largest head dim: the constant 0/1 expansion matrices are [M, NB, NB] f32 in VMEM (NB = D/2 for
# A4), 2.4 MB of them at D = 512 (A42: 16 of 192 x 192), quadratic in D beyond.
MAX_D = 512


@dataclasses.dataclass(frozen=True)
class _Plan:
  """Static layout of one tier format on the packed byte lanes (numpy, built once per spec).

  ``pieces`` J = 8 / (smallest code width); per piece j and lane b: ``shift[j, b]``,
  ``mask[j, b]`` (0 where the lane holds no code of piece j) and the tree position ``pos[j, b]``
  (-1: none).  ``tab [2, J, V, NB]`` f32: (cos | log cos, sin | log sin) per code value v (0 for
  no code and the pad).  ``leaves``: the pieces holding level-1 codes; ``mats``: the nonzero
  (leaf piece f, source piece j, 0 cos / 1 sin) selections, stacked in ``mat [M, NB, NB]``;
  ``qidx [F, NB]`` the leaf index of each leaf lane (0 elsewhere) and ``qmask [F, NB]``."""

  nb: int
  pieces: int
  values: int
  shift: np.ndarray
  mask: np.ndarray
  pos: np.ndarray
  tab: np.ndarray
  leaves: tuple[int, ...]
  mats: tuple[tuple[int, int, int], ...]
  mat: np.ndarray
  qidx: np.ndarray
  qmask: np.ndarray

  def __hash__(self):
    return id(self)


@functools.cache
def plan(ts: TierSpec) -> _Plan:
  """The :class:`_Plan` of a tier format (mirrors ``spherical.pack``'s byte layouts)."""
  sp = ts.key
  d, nb = sp.d, sp.code_bytes
  if sp.b1 == sp.bh:
    segments = [(0, nb, sp.b1, 0)]                     # (first byte, end byte, bits, tree offset)
  else:
    n1 = d // 2 * sp.b1 // 8
    segments = [(0, n1, sp.b1, 0), (n1, nb, sp.bh, d // 2)]
  n_pieces = 8 // min(sp.b1, sp.bh)
  shift = np.zeros((n_pieces, nb), np.int32)
  mask = np.zeros((n_pieces, nb), np.int32)
  pos = np.full((n_pieces, nb), -1, np.int64)
  for start, end, bits, off in segments:
    n = end - start
    for j in range(8 // bits):
      for i in range(n):
        shift[j, start + i], mask[j, start + i] = bits * j, 2**bits - 1
        pos[j, start + i] = off + i + j * n
  level = spherical.level_of_position(d)
  ct, st = spherical.trig_tables(sp)                   # f32 [D, 2^max(b)]
  nv = ct.shape[1]
  tab = np.zeros((2, n_pieces, nv, nb), np.float64)
  for j in range(n_pieces):
    for b in range(nb):
      p = pos[j, b]
      if p < 0 or level[p] == 0:
        continue
      nc = 2 ** (sp.b1 if level[p] == 1 else sp.bh)
      c, s = ct[p, :nc].astype(np.float64), st[p, :nc].astype(np.float64)
      if level[p] >= 2:
        c, s = np.log(c), np.log(s)                    # angles in (0, π/2): both > 0
      tab[0, j, :nc, b], tab[1, j, :nc, b] = c, s
  # Leaves and their ancestors: leaf i's factor at level l >= 2 is node i >> (l - 1) of that level
  # (tree offset d - d / 2^(l-1)), cos if bit l - 2 of i is 0, else sin.
  leaves = tuple(j for j in range(n_pieces) if np.any((pos[j] >= 0) & (level[pos[j]] == 1)))
  leaf_of = {(j, b): int(pos[j, b]) for j in leaves for b in range(nb)
             if pos[j, b] >= 0 and level[pos[j, b]] == 1}
  where = {int(pos[j, b]): (j, b) for j in range(n_pieces) for b in range(nb) if pos[j, b] >= 0}
  sel = np.zeros((len(leaves), n_pieces, 2, nb, nb))
  for (j, b), i in leaf_of.items():
    f = leaves.index(j)
    for lvl in range(2, sp.levels + 1):
      node = d - d // 2 ** (lvl - 1) + (i >> (lvl - 1))
      src_j, src_b = where[node]
      sel[f, src_j, (i >> (lvl - 2)) & 1, src_b, b] = 1.0
  mats = tuple((f, j, w) for f in range(len(leaves)) for j in range(n_pieces) for w in range(2)
               if sel[f, j, w].any())
  qidx = np.zeros((len(leaves), nb), np.int32)
  qmask = np.zeros((len(leaves), nb), np.float32)
  for (j, b), i in leaf_of.items():
    qidx[leaves.index(j), b], qmask[leaves.index(j), b] = i, 1.0
  return _Plan(nb, n_pieces, nv, shift, mask, pos, tab.astype(np.float32), leaves, mats,
               np.stack([sel[m] for m in mats]).astype(np.float32), qidx, qmask)


def _lane_const(row: np.ndarray, shape) -> jax.Array | int:
  """A per-lane int32 constant ``row [NB]`` as a python int (uniform) or an iota select."""
  vals = sorted(set(int(x) for x in row))
  if len(vals) == 1:
    return vals[0]
  lane = lax.broadcasted_iota(jnp.int32, shape, 1)
  out = jnp.full(shape, int(row[-1]), jnp.int32)
  for b in range(len(row) - 2, -1, -1):              # runs of equal values, right to left
    if row[b] != row[b + 1]:
      out = jnp.where(lane <= b, int(row[b]), out)
  return out


def _kernel(lens_ref, tbl_ref, lay_ref, q_ref, beta_ref, tab_ref, mat_ref, ang_ref, side_ref,
            v_ref, *refs, pl_: _Plan, int4_values, page, steps, n_pages, c, exact_pv):
  # Scalar prefetch (SMEM): lens [B*Hkv], tbl [B*Hkv*n], lay [1] (only the index maps use it).
  # q_ref [2F, G, NB] f32 (rotated query's even | odd entries on the leaf lanes, per leaf piece),
  # beta_ref [G, 1] f32 (q·μ), tab_ref [2, J, V, NB] f32, mat_ref [M, NB, NB] f32,
  # ang_ref [page, NB] i8, side_ref [1, page] i32 (fp16 radius | fp16 value scale),
  # v_ref [page, D] bf16 or [page, D/2] i8 (INT4 half-split nibbles).
  if int4_values:
    o_ref, oh_ref, m_ref, l_ref, m_sc, l_sc, acc, acch = refs  # o, oh [G, D/2]; m, l [G, 1]
  else:
    o_ref, m_ref, l_ref, m_sc, l_sc, acc = refs                 # o [G, D]; m, l [G, 1]
    oh_ref = acch = None
  b, h, sp, i = pl.program_id(0), pl.program_id(1), pl.program_id(2), pl.program_id(3)
  hkv = pl.num_programs(1)
  t = sp * steps + i
  length = lens_ref[b * hkv + h]
  ng = q_ref.shape[1]

  @pl.when(i == 0)
  def _():
    m_sc[...] = jnp.full(m_sc.shape, common.NEG, jnp.float32)
    l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
    acc[...] = jnp.zeros(acc.shape, jnp.float32)
    if int4_values:
      acch[...] = jnp.zeros(acch.shape, jnp.float32)

  @pl.when((t < n_pages) & (t * page < length))
  def _():
    x = ang_ref[...].astype(jnp.int32) & 0xFF                       # [page, NB]
    shape = x.shape
    trig = []                                                       # per piece (cos|log, sin|log)
    for j in range(pl_.pieces):
      sh, mk = _lane_const(pl_.shift[j], shape), _lane_const(pl_.mask[j], shape)
      code = lax.shift_right_logical(x, sh) & mk if not isinstance(sh, int) or sh else x & mk
      cj = jnp.zeros(shape, jnp.float32)
      sj = jnp.zeros(shape, jnp.float32)
      for v in range(int(pl_.mask[j].max()) + 1):
        eq = code == v
        cj = jnp.where(eq, tab_ref[0, j, pl.ds(v, 1), :], cj)
        sj = jnp.where(eq, tab_ref[1, j, pl.ds(v, 1), :], sj)
      trig.append((cj, sj))
    dot = jnp.zeros((ng, page), jnp.float32)                        # q'·ũ [G, page]
    for f, leaf in enumerate(pl_.leaves):
      log_a = jnp.zeros(shape, jnp.float32)
      for mi, (ff, j, w) in enumerate(pl_.mats):
        if ff == f:
          log_a += jnp.dot(trig[j][w], mat_ref[mi], precision=HIGHEST,
                           preferred_element_type=jnp.float32)
      a = jnp.exp(log_a)                                            # u¹ on the leaf lanes
      for w in range(2):                                            # even (cos) | odd (sin)
        dot += lax.dot_general(q_ref[2 * f + w], a * trig[leaf][w], (((1,), (1,)), ((), ())),
                               precision=HIGHEST, preferred_element_type=jnp.float32)
    bits = side_ref[...]                                            # [1, page] int32
    r = common.f16_bits_to_f32(bits)
    col = t * page + lax.broadcasted_iota(jnp.int32, (ng, page), 1)
    ok = col < length                                               # [G, page]
    s = jnp.where(ok, (beta_ref[...] + r * dot) * c, -jnp.inf)
    m_prev = m_sc[...]                                              # [G, 1]
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    alpha = jnp.exp2(m_prev - m_new)
    p = jnp.exp2(s - m_new)                                         # [G, page]
    l_sc[...] = alpha * l_sc[...] + jnp.sum(p, axis=1, keepdims=True)
    m_sc[...] = m_new
    if int4_values:
      vs = common.f16_bits_to_f32(lax.shift_right_logical(bits, 16))
      pv = jnp.where(ok, p * vs, 0.0)                               # NaN scales stay out
      xv = v_ref[...].astype(jnp.int32)                             # [page, D/2]
      nib = lambda k: lax.shift_right_arithmetic(lax.shift_left(xv, k), 28).astype(
          jnp.float32).astype(jnp.bfloat16)
      acc[...] = alpha * acc[...] + p_at_v(pv, nib(28), exact_pv)
      acch[...] = alpha * acch[...] + p_at_v(pv, nib(24), exact_pv)
    else:
      row = t * page + lax.broadcasted_iota(jnp.int32, (page, 1), 0)
      v = jnp.where(row < length, v_ref[...], 0)                    # NaN rows stay out
      acc[...] = alpha * acc[...] + p_at_v(p, v, exact_pv)

  @pl.when(i == steps - 1)
  def _():
    o_ref[...] = acc[...]
    m_ref[...] = m_sc[...]
    l_ref[...] = l_sc[...]
    if int4_values:
      oh_ref[...] = acch[...]


def _tier(qr, beta, pool: SphPool, pages, length, ts: TierSpec, lay, *, c, splits, exact_pv,
          interpret):
  """One tier: qr [B, Hkv, G, D] f32 (rotated query, G padded to 8), beta [B, Hkv, G] ->
  unnormalized o [B, Hkv, G, D], m, l [B, Hkv, G] (log2 units)."""
  b, hkv, ng, d = qr.shape
  n_l, n_pool, page = pool.ang.shape[:3]
  n = pages.shape[2]
  if n_pool == 0 or n == 0:
    return (jnp.zeros((b, hkv, ng, d), jnp.float32), jnp.full((b, hkv, ng), common.NEG),
            jnp.zeros((b, hkv, ng), jnp.float32))
  pl_ = plan(ts)
  nb, nf = pl_.nb, len(pl_.leaves)
  ns = max(1, min(splits, n))
  steps = common.cdiv(n, ns)
  int4_values = ts.values == "int4"
  # Rotated query's even / odd entries on each leaf piece's lanes: [B, Hkv, 2F, G, NB].
  qmask = jnp.asarray(pl_.qmask)
  qe = qr[..., 2 * pl_.qidx] * qmask                                 # [B, Hkv, G, F, NB]
  qo = qr[..., 2 * pl_.qidx + 1] * qmask
  qp = jnp.stack([qe, qo], 4).transpose(0, 1, 3, 4, 2, 5).reshape(b, hkv, 2 * nf, ng, nb)
  lens = length.reshape(-1).astype(jnp.int32)
  tbl = pages.reshape(-1).astype(jnp.int32)

  def page_map(bi, hi, s, i, lens_ref, tbl_ref, lay_ref):
    # Step -> (layer, pool page): clamped to the head's last visible page (no re-fetch, never
    # out of range; garbage table entries are clipped into the pool).
    bh = bi * hkv + hi
    last = jnp.maximum(lax.div(lens_ref[bh] + page - 1, page), 1) - 1
    j = jnp.clip(s * steps + i, 0, jnp.minimum(last, n - 1))
    return lay_ref[0], jnp.clip(tbl_ref[bh * n + j], 0, n_pool - 1), 0, 0

  per_bh = lambda bi, hi, s, i, *_: (bi, hi, 0, 0, 0)
  whole = lambda nd: (lambda *_: (0,) * nd)
  ang = lax.bitcast_convert_type(pool.ang, jnp.int8)                 # [L, P, page, NB]
  side = lax.bitcast_convert_type(pool.side, jnp.int32).reshape(n_l, n_pool, 1, page)
  vw = ts.value_width
  val = pool.v if not int4_values else lax.bitcast_convert_type(pool.v, jnp.int8)
  args = [qp, beta[..., None], jnp.asarray(pl_.tab), jnp.asarray(pl_.mat), ang, side, val]
  specs = [pl.BlockSpec((None, None, 2 * nf, ng, nb), per_bh),
           pl.BlockSpec((None, None, ng, 1), lambda bi, hi, s, i, *_: (bi, hi, 0, 0)),
           pl.BlockSpec(pl_.tab.shape, whole(4)),
           pl.BlockSpec(pl_.mat.shape, whole(3)),
           pl.BlockSpec((None, None, page, nb), page_map),
           pl.BlockSpec((None, None, 1, page), page_map),
           pl.BlockSpec((None, None, page, vw), page_map)]
  out_map = lambda bi, hi, s, i, *_: (bi, hi, s, 0, 0)
  f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  n_o = 2 if int4_values else 1
  out_specs = ([pl.BlockSpec((None, None, None, ng, vw), out_map)] * n_o
               + [pl.BlockSpec((None, None, None, ng, 1), out_map)] * 2)
  out_shape = [f32(b, hkv, ns, ng, vw)] * n_o + [f32(b, hkv, ns, ng, 1)] * 2
  scratch = ([pltpu.VMEM((ng, 1), jnp.float32)] * 2 + [pltpu.VMEM((ng, vw), jnp.float32)] * n_o)
  kernel = functools.partial(_kernel, pl_=pl_, int4_values=int4_values, page=page, steps=steps,
                             n_pages=n, c=c, exact_pv=exact_pv)
  outs = pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=3, grid=(b, hkv, ns, steps), in_specs=specs, out_specs=out_specs,
          scratch_shapes=scratch),
      out_shape=out_shape,
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
      interpret=interpret,
      name=f"sph_tier_{ts.layout}_{ts.values}_tpu",
  )(lens, tbl, lay, *args)
  o = jnp.concatenate(outs[:2], -1) if int4_values else outs[0]      # [B, Hkv, NS, G, D]
  m, l = outs[-2][..., 0], outs[-1][..., 0]
  if ns == 1:
    return o[:, :, 0], m[:, :, 0], l[:, :, 0]
  return common.combine_partials(o, m, l, axis=2)


def check(q: jax.Array, sph: SphInputs, stacked: bool = False) -> None:
  """One-line ValueError for what the kernel does not take (``stacked``: pools carry a leading
  layer axis)."""
  d = q.shape[-1]
  for ts in sph.spec:
    if ts.d != d:
      raise ValueError(f"tier spec has head dim {ts.d}, queries have {d}")
  if d > MAX_D:
    raise ValueError(f"the TPU tier kernel takes head dims up to {MAX_D}, got {d}")
  if sph.spec:
    hkv = sph.maps.pages[0].shape[1]
    if q.shape[1] % hkv:
      raise ValueError(f"query heads {q.shape[1]} not a multiple of KV heads {hkv}")
    want = ("[L, P, page, NB] and side [L, P, page]" if stacked
            else "[P, page, NB] and side [P, page]")
    for pool, ts in zip(sph.pools, sph.spec):
      if (pool.ang.ndim != 3 + stacked or pool.ang.shape[-1] != ts.code_bytes
          or pool.side.shape != pool.ang.shape[:-1]):
        raise ValueError(f"a {ts.layout} tier pool at D={ts.d} needs ang {want} with NB = "
                         f"{ts.code_bytes}, got ang {pool.ang.shape} and side {pool.side.shape}")


@functools.partial(jax.jit, static_argnames=("scale", "splits", "exact_pv", "interpret"))
def sph_partials_tpu(q, sph: SphInputs, layer=None, *, scale: float | None = None,
                     splits: int = 1, exact_pv: bool = True, interpret=False):
  """The tier partials of ``reference.sph_partials`` by the kernel: q [B, Hq, D] ->
  o [B, Hkv, K, g, D], m, l [B, Hkv, K, g] (FP32, log2 units, ``sph.spec`` order; an empty tier
  has l = 0).  ``layer``: None, or the (traced) index into the pools and constants stacked on a
  leading layer axis (a scalar prefetch: the index maps pick the layer's pages).  ``splits``:
  split-KV over a head's pages (megacore / long tiers), combined here."""
  check(q, sph, stacked=layer is not None)
  b, hq, d = q.shape
  hkv = sph.maps.pages[0].shape[1] if sph.spec else 1
  g = hq // hkv
  if not sph.spec:
    z = jnp.zeros((b, hkv, 0, g), jnp.float32)
    return jnp.zeros((b, hkv, 0, g, d), jnp.float32), z, z
  pools = sph.pools
  if layer is None:
    pools = tuple(SphPool(*(x[None] for x in p)) for p in pools)
    signs, mu, layer = sph.consts.signs, sph.consts.mu, 0
  else:
    signs, mu = sph.consts.signs[layer], sph.consts.mu[layer]
  lay = jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))
  ng = common.cdiv(g, 8) * 8                                         # sublane-aligned rows
  qf = q.astype(jnp.float32).reshape(b, hkv, g, d)
  qf = jnp.pad(qf, ((0, 0), (0, 0), (0, ng - g), (0, 0)))
  qr = jnp.einsum("bhgd,ed->bhge", qf, sph_rotation(signs), precision=HIGHEST)
  beta = jnp.einsum("bhgd,hd->bhg", qf, mu.astype(jnp.float32), precision=HIGHEST)
  c = common.default_scale(d, scale) * common.LOG2E
  parts = [_tier(qr, beta, pool, pages, length, ts, lay, c=c, splits=splits, exact_pv=exact_pv,
                 interpret=interpret)
           for pool, pages, length, ts in zip(pools, sph.maps.pages, sph.maps.length, sph.spec)]
  o, m, l = (jnp.stack(x, axis=2) for x in zip(*parts))             # [B, Hkv, K, G, ...]
  return o[:, :, :, :g], m[..., :g], l[..., :g]


@functools.partial(jax.jit,
                   static_argnames=("scale", "splits", "exact_pv", "interpret", "return_lse"))
def decode_attention_sph_tpu(q, window: Window, hi: HighPool, lo: LowPool, maps: PageMaps,
                             sph: SphInputs | None, layer=None, *, scale: float | None = None,
                             splits: int = 1, exact_pv: bool = True, interpret=False,
                             return_lse: bool = False):
  """``tpu.decode_attention_tpu`` plus the tier partitions: q [B, Hq, D] -> out [B, Hq, D] bf16
  (and, with ``return_lse``, the natural-log LSE of the scaled logits over every visible key,
  f32 [B, Hq]).  The base partitions and the tiers are separate launches; their partials meet
  in one Eq. 15 merge."""
  b, hq, d = q.shape
  if sph is not None and sph.spec and sph.maps.pages[0].shape[1] != window.k.shape[-2]:
    raise ValueError(f"tier maps have {sph.maps.pages[0].shape[1]} KV heads, the window has "
                     f"{window.k.shape[-2]}")
  o, m, l = partials_tpu(q, window, hi, lo, maps, layer, scale=scale, splits=splits,
                         exact_pv=exact_pv, interpret=interpret)     # [B, NS, nh, D], [B, NS, nh]
  nh = o.shape[2]
  if sph is not None and sph.spec:
    so, sm, sl = sph_partials_tpu(q, sph, layer, scale=scale, splits=splits, exact_pv=exact_pv,
                                  interpret=interpret)               # [B, Hkv, K, g, ...]
    k = so.shape[2]
    heads = lambda x: jnp.moveaxis(x, 2, 1).reshape(b, k, hq, *x.shape[4:])
    pad = lambda x, fill: jnp.pad(x, [(0, 0), (0, 0), (0, nh - hq)] + [(0, 0)] * (x.ndim - 3),
                                  constant_values=fill)
    o = jnp.concatenate([o, pad(heads(so), 0.0)], 1)
    m = jnp.concatenate([m, pad(heads(sm), common.NEG)], 1)
    l = jnp.concatenate([l, pad(heads(sl), 0.0)], 1)
  out, _ = common.merge(o, m, l, axis=1)
  out = out[:, :hq].astype(jnp.bfloat16)
  if not return_lse:
    return out
  return out, lse_of(m, l, axis=1)[:, :hq]
