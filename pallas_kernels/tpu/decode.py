"""Pallas Mosaic (TPU) kernel: page tables as scalar prefetch, online softmax in VMEM scratch.

Grid (B, NS, T).  Along the last ("arbitrary") axis a sequence's steps are laid out as
[INT4 pages | BF16 pages | window]; split ``s`` owns steps [s*T, (s+1)*T).  Each input's index map
reads the page table from SMEM and clamps past-the-end steps to the last visible page, so the
pipeline does not re-fetch a block it already holds and never DMAs an out-of-range page.  The
running max / sum / accumulators live in VMEM scratch across the steps of a split; each split
writes an unnormalized partial, merged by ``common.merge`` (Eq. 15).  NS > 1 is split-KV, for
megacore chips or very long pools.

TPU-specific choices (each one is something that did not compile otherwise or would be slow):
* Blocks are one page of ALL KV heads, rows (token, head) flattened: ``[page * Hkv, D]``.  Scores
  are formed for all query heads against all rows and the rows of other KV heads are masked.
  This wastes Hkv x MXU work and exps but needs no strided loads or sublane relayouts, and decode
  on TPU is memory bound by a wide margin (MXU intensity far above 2 * group).
* INT4 codes travel as int8 (same bytes) and are widened to int32 before shifting (int8 shifts do
  not compile).  fp16 scales travel as raw bits packed in one int32 per row (fp16 vector loads do
  not compile) and are decoded with integer ops (``common.f16_bits_to_f32``).
* ``exact_pv`` (default) feeds p to the p @ V matmul as a bf16 hi + lo pair: FP32-grade value
  accumulation for a second MXU pass, which a memory-bound decode hides.
* The half-split nibble layout gives low/high halves of D without a lane concatenate: q is passed
  as two halves and the INT4 accumulators are two [H, D/2] halves, joined in the XLA merge.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import common
from pallas_kernels.types import HighPool, LowPool, PageMaps, Window


def p_at_v(p, v, exact):
  """p [H, R] f32 @ v [R, N] bf16 -> f32; ``exact`` splits p into a bf16 hi + lo pair."""
  f = lambda a: jnp.dot(a, v, preferred_element_type=jnp.float32)
  if not exact:
    return f(p.astype(jnp.bfloat16))
  hi = p.astype(jnp.bfloat16)
  return f(hi) + f((p - hi.astype(jnp.float32)).astype(jnp.bfloat16))


def _kernel(lens_ref, tlo_ref, thi_ref, lay_ref, *refs, exact_pv, hkv, g, page_lo, page_hi, n_lo,
            n_hi, steps, c,
            has_lo, has_hi):
  # Scalar prefetch (SMEM): lens [3*B] (lo, hi, win per sequence), tlo [B*n_lo], thi [B*n_hi],
  # lay [1] (the layer; only the index maps use it).
  refs = list(refs)
  q_ref = refs.pop(0)                                   # [1, H, D] bf16
  if has_lo:
    ql_ref, qh_ref, klo_ref, vlo_ref, sc_ref = refs[:5]  # [1,H,D/2] x2, [1,R,D/2] i8 x2, [1,1,R]
    refs = refs[5:]
  if has_hi:
    khi_ref, vhi_ref = refs[:2]                          # [1, R, D] bf16
    refs = refs[2:]
  kw_ref, vw_ref = refs[:2]                              # [1, W*Hkv, D] bf16
  refs = refs[2:]
  if has_lo:
    o_ref, o4l_ref, o4h_ref, m_ref, l_ref, m_sc, l_sc, acc, acc4l, acc4h = refs
  else:
    o_ref, m_ref, l_ref, m_sc, l_sc, acc = refs
    acc4l = acc4h = None
  b, sp, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  t = sp * steps + i
  nh = q_ref.shape[1]

  @pl.when(i == 0)
  def _():
    m_sc[...] = jnp.full(m_sc.shape, common.NEG, jnp.float32)
    l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
    acc[...] = jnp.zeros(acc.shape, jnp.float32)
    if has_lo:
      acc4l[...] = jnp.zeros(acc4l.shape, jnp.float32)
      acc4h[...] = jnp.zeros(acc4h.shape, jnp.float32)

  def visible(rows, base, length):
    # [H, R]: row r = (token r // Hkv, head r % Hkv) is seen by query head h iff its KV head is
    # h // g and the token is below the partition's length.
    r = lax.broadcasted_iota(jnp.int32, (nh, rows), 1)
    h = lax.broadcasted_iota(jnp.int32, (nh, rows), 0)
    return (lax.rem(r, hkv) == lax.div(h, g)) & (base + lax.div(r, hkv) < length)

  def row_ok(rows, base, length):
    # [R, 1]: invisible rows may hold NaN, and 0 * NaN poisons the p @ v product: zero them.
    r = lax.broadcasted_iota(jnp.int32, (rows, 1), 0)
    return base + lax.div(r, hkv) < length

  def nt(a, bm):  # a [M, K] . bm [N, K]^T -> [M, N] f32
    return lax.dot_general(a, bm, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)

  def softmax_step(s, ok):
    s = jnp.where(ok, s, -jnp.inf)
    m_prev = m_sc[...]                                              # [H, 1]
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    alpha = jnp.exp2(m_prev - m_new)
    p = jnp.exp2(s - m_new)                                         # [H, R]
    l_sc[...] = alpha * l_sc[...] + jnp.sum(p, axis=1, keepdims=True)
    m_sc[...] = m_new
    acc[...] = alpha * acc[...]
    if has_lo:
      acc4l[...] = alpha * acc4l[...]
      acc4h[...] = alpha * acc4h[...]
    return p

  def bf16_step(k_ref, v_ref, base, length):
    k = k_ref[0]                                                    # [R, D] bf16
    ok = visible(k.shape[0], base, length)
    p = softmax_step(nt(q_ref[0], k) * c, ok)
    v = jnp.where(row_ok(k.shape[0], base, length), v_ref[0], 0)
    acc[...] += p_at_v(p, v, exact_pv)

  def nibbles(x):  # int8 [R, D/2] -> bf16 low half, high half (codes exact in bf16)
    x = x.astype(jnp.int32)
    lo = lax.shift_right_arithmetic(lax.shift_left(x, 28), 28)
    hi = lax.shift_right_arithmetic(lax.shift_left(x, 24), 28)
    return lo.astype(jnp.float32).astype(jnp.bfloat16), hi.astype(jnp.float32).astype(jnp.bfloat16)

  if has_lo:
    lo_len = lens_ref[3 * b]

    @pl.when((t < n_lo) & (t * page_lo < lo_len))
    def _():
      kl, kh = nibbles(klo_ref[0])
      bits = sc_ref[0]                                              # [1, R] int32
      ks = common.f16_bits_to_f32(bits)
      vs = common.f16_bits_to_f32(lax.shift_right_logical(bits, 16))
      ok = visible(kl.shape[0], t * page_lo, lo_len)
      s = (nt(ql_ref[0], kl) + nt(qh_ref[0], kh)) * (ks * c)
      p = softmax_step(s, ok)
      # Garbage (NaN) scales of invisible rows must not reach p @ v.
      pv = jnp.where(ok, p * vs, 0.0)
      vl, vh = nibbles(vlo_ref[0])
      acc4l[...] += p_at_v(pv, vl, exact_pv)
      acc4h[...] += p_at_v(pv, vh, exact_pv)

  if has_hi:
    hi_len = lens_ref[3 * b + 1]
    th = t - n_lo

    @pl.when((th >= 0) & (th < n_hi) & (th * page_hi < hi_len))
    def _():
      bf16_step(khi_ref, vhi_ref, th * page_hi, hi_len)

  @pl.when(t == n_lo + n_hi)
  def _():
    bf16_step(kw_ref, vw_ref, 0, lens_ref[3 * b + 2])

  @pl.when(i == steps - 1)
  def _():
    o_ref[0, 0] = acc[...]
    m_ref[0, 0] = m_sc[...]
    l_ref[0, 0] = l_sc[...]
    if has_lo:
      o4l_ref[0, 0] = acc4l[...]
      o4h_ref[0, 0] = acc4h[...]


def _page_index(t, b, lens_ref, tbl_ref, which, page, n_pages, n_pool):
  """Block index of step t in a paged partition: clamped to the sequence's last visible page."""
  length = lens_ref[3 * b + which]
  last = jnp.maximum(lax.div(length + page - 1, page), 1) - 1
  j = jnp.clip(t, 0, jnp.minimum(last, n_pages - 1))
  return jnp.clip(tbl_ref[b * n_pages + j], 0, n_pool - 1)


@functools.partial(jax.jit, static_argnames=("scale", "splits", "exact_pv", "interpret"))
def partials_tpu(q, window: Window, hi: HighPool, lo: LowPool, maps: PageMaps, layer=None, *,
                 scale: float | None = None, splits: int = 1, exact_pv: bool = True,
                 interpret=False):
  """Unmerged partials: o [B, NS, H, D] f32 (INT4 halves already joined), m, l [B, NS, H].

  ``layer`` (see ``pallas_kernels.decode_attention``) is one more scalar prefetch: the index
  maps pick the layer's blocks from the stacked pools and window, so no layer is copied except
  its scales (repacked to int32 bits, 4 B a row).  The INT4 pool must be in the "bytes" storage
  format (``types.LowPool``); an "int4" pool is refused.
  """
  if lo.format != "bytes":
    raise NotImplementedError("the TPU kernel reads the INT4 pool as uint8 half-split bytes only: "
                              "make the cache with lo_format='bytes' (or use backend='reference')")
  if layer is None:
    add = lambda t: type(t)(*(x[None] for x in t))
    window, hi, lo, layer = window._replace(k=window.k[None], v=window.v[None]), add(hi), add(lo), 0
  lay = jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))
  b, hq, d = q.shape
  n_l, _, w, hkv = window.k.shape[:4]
  g = hq // hkv
  nh = common.cdiv(hq, 8) * 8                        # sublane-aligned query rows
  c = common.default_scale(d, scale) * common.LOG2E
  p_lo, page_lo = lo.k.shape[1:3]
  p_hi, page_hi = hi.k.shape[1:3]
  n_lo = maps.lo_pages.shape[1] if p_lo else 0
  n_hi = maps.hi_pages.shape[1] if p_hi else 0
  has_lo, has_hi = n_lo > 0, n_hi > 0
  total = n_lo + n_hi + 1
  ns = max(1, min(splits, total))
  steps = common.cdiv(total, ns)

  lens = jnp.stack([maps.lo_len, maps.hi_len, window.length], 1).reshape(-1).astype(jnp.int32)
  tlo = maps.lo_pages.reshape(-1).astype(jnp.int32) if has_lo else jnp.zeros((1,), jnp.int32)
  thi = maps.hi_pages.reshape(-1).astype(jnp.int32) if has_hi else jnp.zeros((1,), jnp.int32)
  qp = jnp.pad(q, ((0, 0), (0, nh - hq), (0, 0)))    # padded heads match no KV head

  def lo_map(bi, s, i, lens_ref, tlo_ref, thi_ref, lay_ref):
    return _page_index(s * steps + i, bi, lens_ref, tlo_ref, 0, page_lo, n_lo, p_lo), 0, 0

  def hi_map(bi, s, i, lens_ref, tlo_ref, thi_ref, lay_ref):
    return _page_index(s * steps + i - n_lo, bi, lens_ref, thi_ref, 1, page_hi, n_hi, p_hi), 0, 0

  in_layer = lambda f: lambda *a: (a[-1][0],) + f(*a)   # (layer, *f's block index)
  per_b = lambda bi, s, i, *_: (bi, 0, 0)
  args, specs = [qp], [pl.BlockSpec((1, nh, d), per_b)]
  if has_lo:
    r_lo = page_lo * hkv
    codes = lambda x: lax.bitcast_convert_type(x, jnp.int8).reshape(n_l, p_lo, r_lo, d // 2)
    sc = lax.dynamic_index_in_dim(lo.scale, lay[0], 0, keepdims=False)
    args += [qp[..., : d // 2], qp[..., d // 2:], codes(lo.k), codes(lo.v),
             common.scale_bits(sc).reshape(p_lo, 1, r_lo)]
    specs += [pl.BlockSpec((1, nh, d // 2), per_b), pl.BlockSpec((1, nh, d // 2), per_b),
              pl.BlockSpec((None, 1, r_lo, d // 2), in_layer(lo_map)),
              pl.BlockSpec((None, 1, r_lo, d // 2), in_layer(lo_map)),
              pl.BlockSpec((1, 1, r_lo), lo_map)]
  if has_hi:
    r_hi = page_hi * hkv
    args += [hi.k.reshape(n_l, p_hi, r_hi, d), hi.v.reshape(n_l, p_hi, r_hi, d)]
    specs += [pl.BlockSpec((None, 1, r_hi, d), in_layer(hi_map))] * 2
  args += [window.k.reshape(n_l, b, w * hkv, d), window.v.reshape(n_l, b, w * hkv, d)]
  specs += [pl.BlockSpec((None, 1, w * hkv, d), in_layer(per_b))] * 2

  out_map = lambda bi, s, i, *_: (bi, s, 0, 0)
  o_spec = pl.BlockSpec((1, 1, nh, d), out_map)
  h_spec = pl.BlockSpec((1, 1, nh, d // 2), out_map)
  s_spec = pl.BlockSpec((1, 1, nh, 1), out_map)
  f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  out_specs = [o_spec] + ([h_spec, h_spec] if has_lo else []) + [s_spec, s_spec]
  out_shape = ([f32(b, ns, nh, d)] + ([f32(b, ns, nh, d // 2)] * 2 if has_lo else [])
               + [f32(b, ns, nh, 1)] * 2)
  scratch = [pltpu.VMEM((nh, 1), jnp.float32), pltpu.VMEM((nh, 1), jnp.float32),
             pltpu.VMEM((nh, d), jnp.float32)]
  if has_lo:
    scratch += [pltpu.VMEM((nh, d // 2), jnp.float32)] * 2

  kernel = functools.partial(
      _kernel, hkv=hkv, g=g, page_lo=page_lo, page_hi=page_hi, n_lo=n_lo, n_hi=n_hi,
      steps=steps, c=c, has_lo=has_lo, has_hi=has_hi, exact_pv=exact_pv)
  outs = pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=4, grid=(b, ns, steps), in_specs=specs, out_specs=out_specs,
          scratch_shapes=scratch),
      out_shape=out_shape,
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "arbitrary")),
      interpret=interpret,
      name="pask_decode_attention_tpu",
  )(lens, tlo, thi, lay, *args)
  if has_lo:
    o, o4l, o4h, m, l = outs
    o = o + jnp.concatenate([o4l, o4h], axis=-1)
  else:
    o, m, l = outs
  return o, m[..., 0], l[..., 0]


@functools.partial(jax.jit, static_argnames=("scale", "splits", "exact_pv", "interpret"))
def decode_attention_tpu(q, window: Window, hi: HighPool, lo: LowPool, maps: PageMaps, layer=None,
                         *, scale: float | None = None, splits: int = 1, exact_pv: bool = True,
                         interpret=False):
  """q [B, Hq, D] bf16 -> out [B, Hq, D] bf16 (see module doc)."""
  hq = q.shape[1]
  o, m, l = partials_tpu(q, window, hi, lo, maps, layer, scale=scale, splits=splits,
                         exact_pv=exact_pv,
                         interpret=interpret)
  out, _ = common.merge(o, m, l, axis=1)
  return out[:, :hq].astype(jnp.bfloat16)
