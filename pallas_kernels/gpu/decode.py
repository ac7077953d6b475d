"""Pallas Triton kernel: one fused split-KV pass over {INT4 pool, BF16 pool, window}.

Grid (Hkv, NS, B).  The split axis NS is laid out as [INT4 splits | BF16-pool splits | window
splits]; each program walks ``chunk`` logical entries of one partition of one (sequence, KV head)
in blocks of ``block`` keys, with the GQA group's query heads (padded to 16 rows for the MMA) as
the M dimension, and writes an unnormalized partial (o, m, l).  The partials are merged by
``common.merge`` (Eq. 15) in one small XLA fusion.

Why this shape:
* Token-granular gathers (``row = table[pos // page] * page + pos % page``) read pools in place for
  any page size, 1 included; each row is D contiguous elements, so loads stay 16 B wide.
* Masked loads (``other=0``) never touch invisible rows, whose contents are unspecified.
* INT4 rows are never concatenated: with the half-split layout, low nibbles are elements [0, D/2)
  and high nibbles [D/2, D), so q and the output are split in halves and each half gets one MMA.
  Codes in [-7, 7] are exact in bf16, so q.k uses bf16 MMAs with FP32 accumulation exactly; the
  K scale multiplies the score column and the V scale the probability column.
* ``exact_pv`` (default) feeds p to the p @ V MMA as a bf16 hi + lo pair: FP32-grade value
  accumulation (rel. error ~1e-5 instead of ~1e-3) for one more small MMA per block, which the
  memory-bound loop hides.
* Heads are the fastest grid axis (CUDA's x) so the programs reading the same tokens' rows,
  table entries and scale sectors run together.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import common
from pallas_kernels.types import HighPool, LowPool, PageMaps, Window

_LO, _HI, _WIN = 0, 1, 2
_OFF = 136.0   # INT4 "bits" dequant: bf16(0x4300 | (n ^ 8)) == n + 136


def _online(carry, s, valid):
  """One online-softmax step on scores s [M, bk] (log2 units); returns (p, alpha, m, l)."""
  m_prev, l_prev = carry
  s = jnp.where(valid[None, :], s, -jnp.inf)
  m_new = jnp.maximum(m_prev, jnp.max(s, axis=1))
  alpha = jnp.exp2(m_prev - m_new)
  p = jnp.exp2(s - m_new[:, None])
  l_new = l_prev * alpha + jnp.sum(p, axis=1)
  return p, alpha, m_new, l_new


def _split_bf16(x):
  """f32 -> (hi, lo) bf16 with hi + lo == x to ~2^-17: two MMAs give a near-FP32 p @ V."""
  hi = x.astype(jnp.bfloat16)
  return hi, (x - hi.astype(jnp.float32)).astype(jnp.bfloat16)


def _pv(p, v, exact, with_sum=False):
  """p [M, bk] f32 @ v [bk, N] bf16 -> [M, N] f32 (and the row sums of the p really used)."""
  if not exact:
    pb = p.astype(v.dtype)
    out = plgpu.dot(pb, v)
    fed = pb.astype(jnp.float32)
  else:
    hi, lo = _split_bf16(p)
    out = plgpu.dot(hi, v) + plgpu.dot(lo, v)
    fed = hi.astype(jnp.float32) + lo.astype(jnp.float32)
  return (out, jnp.sum(fed, axis=1)) if with_sum else out


def _kernel(lens_ref, q_ref, *refs, g, exact_pv, int4_dequant, page_lo, page_hi, n_lo, n_hi, chunk_lo, chunk_hi,
            chunk_w, bk_lo, bk_hi, bk_w, c, has_lo, has_hi):
  # lens_ref [4] i32 (lo, hi, win, -); q_ref [M, D] bf16.
  refs = list(refs)
  if has_lo:
    tlo_ref, klo_ref, vlo_ref, sc_ref = refs[:4]   # [n_pages], [P*page, D/2] u8 x2, [P*page, 2]
    refs = refs[4:]
  if has_hi:
    thi_ref, khi_ref, vhi_ref = refs[:3]           # [n_pages], [P*page, D] bf16 x2
    refs = refs[3:]
  kw_ref, vw_ref, o_ref, m_ref, l_ref = refs       # [W, D] x2; [M, D], [M], [M]
  m_rows, d = q_ref.shape
  h2 = d // 2
  sp = pl.program_id(1)
  row_ok = jnp.arange(m_rows) < g                   # padded query rows are never stored

  def store(o_parts, m, l):
    if len(o_parts) == 1:
      plgpu.store(o_ref, o_parts[0], mask=row_ok[:, None])
    else:
      plgpu.store(o_ref.at[:, pl.ds(0, h2)], o_parts[0], mask=row_ok[:, None])
      plgpu.store(o_ref.at[:, pl.ds(h2, h2)], o_parts[1], mask=row_ok[:, None])
    plgpu.store(m_ref, m, mask=row_ok)
    plgpu.store(l_ref, l, mask=row_ok)

  m0 = jnp.full((m_rows,), common.NEG, jnp.float32)
  l0 = jnp.zeros((m_rows,), jnp.float32)

  def bf16_part(k_ref, v_ref, rows_of, split, chunk, length, bk):
    q = q_ref[...]
    start = split * chunk
    end = jnp.minimum(start + chunk, length)

    def body(i, carry):
      o, m, l = carry
      pos = start + i * bk + jnp.arange(bk)
      valid = pos < end
      rows = rows_of(pos, valid)
      k = _gather(k_ref, rows, valid, 0.0)    # [bk, D]
      s = plgpu.dot(q, k, trans_b=True) * c                                    # [M, bk] f32
      p, alpha, m, l = _online((m, l), s, valid)
      v = _gather(v_ref, rows, valid, 0.0)
      o = o * alpha[:, None] + _pv(p, v, exact_pv)
      return o, m, l

    n = pl.cdiv(jnp.maximum(end - start, 0), bk)
    o, m, l = lax.fori_loop(0, n, body, (jnp.zeros((m_rows, d), jnp.float32), m0, l0))
    store([o], m, l)

  def int4_part(split):
    ql = plgpu.load(q_ref.at[:, pl.ds(0, h2)])
    qh = plgpu.load(q_ref.at[:, pl.ds(h2, h2)])
    start = split * chunk_lo
    end = jnp.minimum(start + chunk_lo, lens_ref[_LO])
    bk = bk_lo

    def unpack(x):  # [bk, D/2] u8 -> low, high halves as bf16
      if int4_dequant == "cvt":  # exact codes via int -> float conversions (slow on Hopper)
        x = x.astype(jnp.int32)
        lo = lax.shift_right_arithmetic(lax.shift_left(x, 28), 28)
        hi = lax.shift_right_arithmetic(lax.shift_left(x, 24), 28)
        return (lo.astype(jnp.float32).astype(jnp.bfloat16),
                hi.astype(jnp.float32).astype(jnp.bfloat16))
      # "bits": bf16 with bits 0x4300 | u is 128 + u exactly (7 mantissa bits), and u = n ^ 8
      # maps the signed nibble n to n + 8, so the value is code + OFF with integer ops only.
      # The OFF is removed after the MMA (see below).
      x = x.astype(jnp.uint16)
      lo = lax.bitcast_convert_type(((x & 0xF) ^ 8) | 0x4300, jnp.bfloat16)
      hi = lax.bitcast_convert_type(((x >> 4) ^ 8) | 0x4300, jnp.bfloat16)
      return lo, hi

    off = 0.0 if int4_dequant == "cvt" else _OFF
    # q . (code + OFF) = q . code + OFF * sum(q): subtract the second term (FP32, once).
    q_off = off * (jnp.sum(ql.astype(jnp.float32), axis=1) + jnp.sum(qh.astype(jnp.float32), axis=1))

    def body(i, carry):
      ol, oh, m, l = carry
      pos = start + i * bk + jnp.arange(bk)
      valid = pos < end
      rows = _paged_rows(tlo_ref, page_lo, pos, valid)
      kl, kh = unpack(_gather(klo_ref, rows, valid, 0))
      ks = plgpu.load(sc_ref.at[rows, jnp.zeros_like(rows)], mask=valid, other=0.0).astype(jnp.float32)
      s = plgpu.dot(ql, kl, trans_b=True) + plgpu.dot(qh, kh, trans_b=True) - q_off[:, None]
      s = s * (ks * c)[None, :]
      p, alpha, m, l = _online((m, l), s, valid)
      vs = plgpu.load(sc_ref.at[rows, jnp.ones_like(rows)], mask=valid, other=0.0).astype(jnp.float32)
      pv = p * vs[None, :]
      vl, vh = unpack(_gather(vlo_ref, rows, valid, 0))
      # Same offset on the V side: p . (code + OFF) - OFF * sum(p), with the p actually fed.
      ol_b, psum = _pv(pv, vl, exact_pv, with_sum=True)
      oh_b = _pv(pv, vh, exact_pv)
      ol = ol * alpha[:, None] + (ol_b - off * psum[:, None])
      oh = oh * alpha[:, None] + (oh_b - off * psum[:, None])
      return ol, oh, m, l

    n = pl.cdiv(jnp.maximum(end - start, 0), bk)
    z = jnp.zeros((m_rows, h2), jnp.float32)
    ol, oh, m, l = lax.fori_loop(0, n, body, (z, z, m0, l0))
    store([ol, oh], m, l)

  if has_lo:
    @pl.when(sp < n_lo)
    def _():
      int4_part(sp)

  if has_hi:
    @pl.when((sp >= n_lo) & (sp < n_lo + n_hi))
    def _():
      bf16_part(khi_ref, vhi_ref, lambda pos, ok: _paged_rows(thi_ref, page_hi, pos, ok),
                sp - n_lo, chunk_hi, lens_ref[_HI], bk_hi)

  @pl.when(sp >= n_lo + n_hi)
  def _():
    bf16_part(kw_ref, vw_ref, lambda pos, ok: pos, sp - n_lo - n_hi, chunk_w, lens_ref[_WIN],
              bk_w)


def _gather(ref, rows, valid, other):
  """ref [R, C], rows [bk] -> [bk, C]; two array indexers (the interpreter takes no mix)."""
  cols = jnp.arange(ref.shape[1])[None, :]
  return plgpu.load(ref.at[rows[:, None], cols], mask=valid[:, None], other=other)


def _paged_rows(tbl_ref, page, pos, valid):
  """Logical positions [bk] -> flat pool rows via the page table (invalid lanes -> row 0)."""
  pid = plgpu.load(tbl_ref.at[lax.div(pos, page)], mask=valid, other=0)
  return jnp.where(valid, pid * page + lax.rem(pos, page), 0)


def _plan(cap, bk, chunk):
  """Static split plan for one partition: (splits, chunk) with chunk a multiple of bk."""
  if cap == 0:
    return 0, bk
  chunk = max(bk, min(chunk, common.cdiv(cap, bk) * bk))
  chunk = common.cdiv(chunk, bk) * bk
  return common.cdiv(cap, chunk), chunk


@functools.partial(jax.jit, static_argnames=(
    "scale", "block_lo", "block_hi", "block_w", "chunk_lo", "chunk_hi", "num_warps",
    "num_stages", "exact_pv", "int4_dequant", "interpret"))
def partials_gpu(q, window: Window, hi: HighPool, lo: LowPool, maps: PageMaps, *,
                 scale: float | None = None, block_lo: int = 64, block_hi: int = 128,
                 block_w: int = 64, chunk_lo: int | None = None, chunk_hi: int | None = None,
                 num_warps: int = 8, num_stages: int = 2, exact_pv: bool = True,
                 int4_dequant: str = "bits", interpret: bool = False):
  """Unmerged partials: o [B, Hkv, NS, M, D] f32, m, l [B, Hkv, NS, M] (rows >= g unwritten)."""
  b, hq, d = q.shape
  w, hkv = window.k.shape[1], window.k.shape[2]
  g = hq // hkv
  m_rows = max(16, common.next_pow2(g))              # tl.dot needs M >= 16
  c = common.default_scale(d, scale) * common.LOG2E
  p_lo, page_lo = lo.k.shape[:2]
  p_hi, page_hi = hi.k.shape[:2]
  cap_lo = maps.lo_pages.shape[1] * page_lo if p_lo else 0
  cap_hi = maps.hi_pages.shape[1] * page_hi if p_hi else 0

  # Enough programs to fill the GPU several times over, but chunks long enough that the
  # pipelined loop amortizes its prologue; INT4 entries are ~4x fewer bytes, so longer chunks.
  target = max(1, 4 * 132 // max(1, b * hkv))
  if chunk_hi is None:
    chunk_hi = min(4096, max(256, common.cdiv(max(cap_hi, 1), target)))
  if chunk_lo is None:
    chunk_lo = min(8192, max(512, common.cdiv(max(cap_lo, 1), target)))
  n_lo, chunk_lo = _plan(cap_lo, block_lo, chunk_lo)
  n_hi, chunk_hi = _plan(cap_hi, block_hi, chunk_hi)
  block_w = min(block_w, max(16, common.next_pow2(w)))
  n_w, chunk_w = _plan(w, block_w, w)
  ns = n_lo + n_hi + n_w

  qp = q.reshape(b, hkv, g, d)
  qp = jnp.pad(qp, ((0, 0), (0, 0), (0, m_rows - g), (0, 0)))
  lens = jnp.stack([maps.lo_len, maps.hi_len, window.length, jnp.zeros_like(window.length)], 1)
  lens = lens.astype(jnp.int32)

  args = [lens, qp]
  specs = [pl.BlockSpec((None, 4), lambda h, s, i: (i, 0)),
           pl.BlockSpec((None, None, m_rows, d), lambda h, s, i: (i, h, 0, 0))]
  if n_lo:
    rows = p_lo * page_lo
    args += [maps.lo_pages.astype(jnp.int32), lo.k.reshape(rows, hkv, d // 2),
             lo.v.reshape(rows, hkv, d // 2), lo.scale.reshape(rows, hkv, 2)]
    specs += [pl.BlockSpec((None, maps.lo_pages.shape[1]), lambda h, s, i: (i, 0)),
              pl.BlockSpec((rows, None, d // 2), lambda h, s, i: (0, h, 0)),
              pl.BlockSpec((rows, None, d // 2), lambda h, s, i: (0, h, 0)),
              pl.BlockSpec((rows, None, 2), lambda h, s, i: (0, h, 0))]
  if n_hi:
    rows = p_hi * page_hi
    args += [maps.hi_pages.astype(jnp.int32), hi.k.reshape(rows, hkv, d),
             hi.v.reshape(rows, hkv, d)]
    specs += [pl.BlockSpec((None, maps.hi_pages.shape[1]), lambda h, s, i: (i, 0)),
              pl.BlockSpec((rows, None, d), lambda h, s, i: (0, h, 0)),
              pl.BlockSpec((rows, None, d), lambda h, s, i: (0, h, 0))]
  args += [window.k, window.v]
  specs += [pl.BlockSpec((None, w, None, d), lambda h, s, i: (i, 0, h, 0))] * 2

  kernel = functools.partial(
      _kernel, g=g, page_lo=page_lo, page_hi=page_hi, n_lo=n_lo, n_hi=n_hi, chunk_lo=chunk_lo,
      chunk_hi=chunk_hi, chunk_w=chunk_w, bk_lo=block_lo, bk_hi=block_hi, bk_w=block_w, c=c,
      has_lo=bool(n_lo), has_hi=bool(n_hi), exact_pv=exact_pv, int4_dequant=int4_dequant)
  o, m, l = pl.pallas_call(
      kernel,
      grid=(hkv, ns, b),   # heads fastest: they share table/scale sectors and DRAM pages
      in_specs=specs,
      out_specs=[pl.BlockSpec((None, None, None, m_rows, d), lambda h, s, i: (i, h, s, 0, 0)),
                 pl.BlockSpec((None, None, None, m_rows), lambda h, s, i: (i, h, s, 0)),
                 pl.BlockSpec((None, None, None, m_rows), lambda h, s, i: (i, h, s, 0))],
      out_shape=[jax.ShapeDtypeStruct((b, hkv, ns, m_rows, d), jnp.float32),
                 jax.ShapeDtypeStruct((b, hkv, ns, m_rows), jnp.float32),
                 jax.ShapeDtypeStruct((b, hkv, ns, m_rows), jnp.float32)],
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name="pask_decode_attention",
  )(*args)
  return o, m, l


@functools.partial(jax.jit, static_argnames=(
    "scale", "block_lo", "block_hi", "block_w", "chunk_lo", "chunk_hi", "num_warps",
    "num_stages", "exact_pv", "int4_dequant", "interpret"))
def decode_attention_gpu(q, window: Window, hi: HighPool, lo: LowPool, maps: PageMaps, **kw):
  """q [B, Hq, D] bf16 -> out [B, Hq, D] bf16 (see module doc)."""
  b, hq, d = q.shape
  g = hq // window.k.shape[2]
  o, m, l = partials_gpu(q, window, hi, lo, maps, **kw)
  o, m, l = o[:, :, :, :g], m[:, :, :, :g], l[:, :, :, :g]   # drop padded query rows
  out, _ = common.merge(o, m, l, axis=2)
  return out.reshape(b, hq, d).astype(jnp.bfloat16)
