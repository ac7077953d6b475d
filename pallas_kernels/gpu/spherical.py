"""Pallas Triton (GPU) kernel of the Spherical KV tier partitions (docs/SPHERICAL_KV.md §2.2,
§3 "GPU"): logits in the angle domain straight from the packed codes, no dense key anywhere.

Why Triton (not Mosaic GPU): a tier page is 16 tokens of one (sequence, KV head), so a block of
keys is a token-granular gather through a per-head page table -- what ``gpu/decode.py``'s Triton
kernel already does for every page size -- while Mosaic GPU wants TMA tiles of >= 64 rows
(``mgpu_decode`` needs INT4 pages of a multiple of 64).  Triton also runs in interpret mode on a
CPU host and compiles to PTX there (``gpu/aot.py``), so both numerics and registers/spills are
checked before a GPU is at hand.

One ``pallas_call`` per tier (the format is static), grid (Hkv, NS, B) as ``gpu/decode.py`` (heads
fastest): program (h, s, b) walks split s of (sequence b, KV head h)'s tier entries in blocks of
``block`` keys, the GQA group's query heads (padded to 16 rows for the MMA) as M, and writes an
unnormalized partial (FP32, log2 units).  Splits are combined in XLA into exactly the partial
``reference.sph_partials`` returns, so the one Eq. 15 merge is shared with the base partitions.

Per block (rows ``table[pos // page] * page + pos % page`` of the layer's flat pool):

1. **Codes**: A4 tiers load each key's D/2 code bytes once (one contiguous row load the
   pipeliner prefetches) and split them into levels in registers (``codes="row"``); A42 and A2
   tiers load each packed region once the same way and keep levels 1 and 2 in halves (level 1's
   halves are stored apart in both layouts; :func:`codes_from`: "halves"), so steps 3 and 4 run
   per half and nothing is concatenated in registers; ``codes="levels"`` reads each level's
   codes as their own [block, width] gather of the packed row (column ``byte(p)`` and
   per-column shift of tree position ``p``, mirroring ``spherical.pack``'s layouts; the re-reads
   hit L1).
2. **Trig**: every decoded angle is π/4 + x with |x| < π/4 known from the code's own bits
   (``trig="code"``, :func:`sincos_code`): short Taylor polynomials around π/4 (degree from the
   level's static range; four-angle alphabets by two selects of exact constants), level 1's
   quarter turn by sign flips, no range reduction, tables, gathers or libdevice calls; the
   polynomials by explicit FMAs (``fma=True``: Triton does not contract ``a * b + c``).
3. **Top-down expansion by width-doubling joins**: ``u^{ℓ-1} = interleave(u^ℓ cos φ^ℓ,
   u^ℓ sin φ^ℓ)`` (a two-way last-axis stack + reshape), from level n down to the level-1 factor
   ``A = u¹`` [block, D/2] (with "halves": from level 3 to ``u²``, then each half of ``u²`` to
   its half of ``A`` [block, D/4]).
4. **Logit**: ``q'·ũ = q'_even·(A cos φ¹)ᵀ + q'_odd·(A sin φ¹)ᵀ`` -- two [M, D/2] x [D/2, block]
   MMAs (four of [M, D/4] x [D/4, block] with "halves"), each in three bf16 passes (hi·hi +
   hi·lo + lo·hi: FP32-grade, ~1e-5, on the tensor cores; ``qk_passes=1`` is the single bf16
   pass) with q' split in XLA; then ``s = (q·μ + r̃·q'·ũ)
   ·scale·log2 e`` with r̃ the fp16 radius of the side word.
5. **Values**: BF16 rows by ``p @ V`` (``exact_pv``: p as a bf16 hi + lo pair, as
   ``gpu/decode.py``); INT4 rows (half-split nibbles, fp16 scale in the side word's high half)
   dequantized as ``code + 136`` by bit ops (``gpu.decode.unpack_halves``), the scale folded into
   p and the offset removed after the MMA, into two [M, D/2] accumulators.

Invisible rows (past a head's length) are never loaded (masked loads, ``other=0``), their logits
are -inf before the softmax and their probabilities 0 before ``p @ V``, so NaN there cannot leak.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import common
from pallas_kernels import spherical
from pallas_kernels.gpu.decode import (BITS_OFFSET, offsets_fit, p_at_v, partials_gpu,
                                       split_bf16, unpack_halves)
from pallas_kernels.reference import lse_of, sph_rotation
from pallas_kernels.sph_types import SphInputs, SphPool, TierSpec
from pallas_kernels.types import HighPool, LowPool, PageMaps, Window

HIGHEST = lax.Precision.HIGHEST
MIN_D = 32   # q'_even · U_eᵀ contracts over D/2: Triton's MMA needs K >= 16
_HALF_PI_HI = 1.5707963705062866    # f32(π/2)
_HALF_PI_LO = -4.371139000186243e-08  # π/2 - f32(π/2)
_KNOBS = ("scale", "block", "splits", "chunk", "num_warps", "num_stages", "qk_passes",
          "exact_pv", "int4_dequant", "trig", "expand", "codes", "fma", "interpret")
TRIG = ("poly", "table", "code")
EXPAND = ("joins", "direct")
CODES = ("levels", "row")


# --- static format helpers (Python ints / floats per tier and level) ---------------------------


def _level_range(d: int, lvl: int) -> tuple[int, int]:
  """(first tree position, width) of level ``lvl`` (1..n)."""
  return d - d // 2 ** (lvl - 1), d // 2 ** lvl


def _byte_shift(sp: spherical.Spec, p):
  """Byte index and shift of tree positions ``p`` (an int array; every p of one call on the
  same side of D/2) in ``spherical.pack``'s layouts.  Powers of two only: shifts and masks."""
  d = sp.d
  lg = lambda x: x.bit_length() - 1
  if sp.b1 == sp.bh:                          # A4: pieces of D/2, A2: pieces of D/4
    per = d * sp.b1 // 8
    return p & (per - 1), (p >> lg(per)) * sp.b1
  # A42: level-1 block of D/4 bytes (4-bit pieces of D/4), then D/8 bytes of 2-bit pieces.
  lo = p < d // 2
  o = p - d // 2
  byte = jnp.where(lo, p & (d // 4 - 1), d // 4 + (o & (d // 8 - 1)))
  shift = jnp.where(lo, (p >> lg(d // 4)) * 4, (o >> lg(d // 8)) * 2)
  return byte, shift


def codes_from(codes: str, sp: spherical.Spec, expand: str) -> str:
  """How the kernel reads a tier's codes: "row" (A4: one load of the row, levels split in
  registers), "halves" (A42 / A2 with ``codes="row"``: one load per packed region, levels 1 and
  2 kept in halves; needs the joins expansion and D >= 64, so that each half's logit MMA
  contracts over D/4 >= 16), or "levels" (a gather per level)."""
  if codes != "row":
    return "levels"
  if sp.layout == "A4":
    return "row"
  return "halves" if expand == "joins" and sp.d >= 64 else "levels"


def _affine(sp: spherical.Spec, lvl: int) -> tuple[float, float, int]:
  """(a, Δ, mask): decoded angle ``a + c·Δ`` of a level's code c (``spherical.centers``)."""
  dl = float(spherical.steps(sp)[lvl - 1])
  if lvl == 1:
    return -math.pi + 0.5 * dl, dl, 2**sp.b1 - 1
  return math.pi / 4 + (0.5 - 2 ** (sp.bh - 1)) * dl, dl, 2**sp.bh - 1


def mul_add(a, b, c):
  """a·b + c as two rounded operations (what Triton emits for ``a * b + c``: no contraction)."""
  return a * b + c


def fma_ptx(a, b, c):
  """a·b + c in one rounding (PTX ``fma.rn.f32``), inside a Pallas Triton kernel only: Triton
  does not contract ``a * b + c``, so a Horner polynomial is twice the instructions and twice
  the dependent latency without it."""
  shape = jnp.broadcast_shapes(jnp.shape(a), jnp.shape(b), jnp.shape(c))
  a, b, c = (jnp.broadcast_to(jnp.asarray(x, jnp.float32), shape) for x in (a, b, c))
  return plgpu.elementwise_inline_asm(
      "fma.rn.f32 $0, $1, $2, $3;", args=[a, b, c], constraints="=f,f,f,f", pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct(shape, jnp.float32)])[0]


def sincos(theta, fma=mul_add):
  """(cos θ, sin θ) for f32 θ ∈ [-π, π]: quadrant reduction (two-part π/2) and Taylor
  polynomials on [-π/4, π/4] (abs. error < 3e-8) in Horner form by ``fma(a, b, c) = a·b + c``
  (:func:`mul_add`, or :func:`fma_ptx` in a kernel).  Elementwise ops only (Triton and XLA)."""
  k = jnp.floor(fma(theta, 2 / math.pi, 0.5))
  x = fma(k, -_HALF_PI_LO, fma(k, -_HALF_PI_HI, theta))
  x2 = x * x
  c = fma(x2, fma(x2, fma(x2, fma(x2, 1 / 40320, -1 / 720), 1 / 24), -0.5), 1.0)
  s = x * fma(x2, fma(x2, fma(x2, fma(x2, 1 / 362880, -1 / 5040), 1 / 120), -1 / 6), 1.0)
  q = k.astype(jnp.int32) & 3
  odd = (q & 1) == 1
  cos = jnp.where(odd, s, c)
  sin = jnp.where(odd, c, s)
  cos = jnp.where((q == 1) | (q == 2), -cos, cos)
  sin = jnp.where(q >= 2, -sin, sin)
  return cos, sin


def _taylor_terms(x_max: float, first: int, tol: float = 1e-8) -> int:
  """Horner steps of the Taylor series ``Σ_k (−1)^k x^{2k+first}/(2k+first)!`` (cos: first 0,
  sin: 1) until the remainder on |x| <= x_max is below ``tol``."""
  k = 0
  while x_max ** (2 * k + 2 + first) / math.factorial(2 * k + 2 + first) > tol:
    k += 1
  return k


def _rot45(x, x_max: float, fma):
  """(C, S) = (cos x, sin x)/√2 for |x| <= x_max, so that cos(π/4 + x) = C − S and
  sin(π/4 + x) = C + S: Taylor polynomials in Horner form, as many terms as x_max needs."""
  h = math.sqrt(0.5)
  coef = lambda k, first: h * (-1) ** k / math.factorial(2 * k + first)
  x2 = x * x
  kc, ks = _taylor_terms(x_max, 0), _taylor_terms(x_max, 1)
  c = coef(kc, 0)
  for k in range(kc - 1, -1, -1):
    c = fma(x2, c, coef(k, 0))
  s = coef(ks, 1)
  for k in range(ks - 1, -1, -1):
    s = fma(x2, s, coef(k, 1))
  return c, x * s


def _rot45_of4(r, dl: float):
  """(C, S) = (cos x, sin x)/√2 at x = (r − 3/2)·Δ for a 2-bit integer r (four angles symmetric
  about 0): C is even and S odd in x, so two selects between float64-exact constants and one
  sign flip replace the polynomials."""
  h = math.sqrt(0.5)
  outer = (r == 0) | (r == 3)                          # |x| = 3Δ/2, else Δ/2
  c = jnp.where(outer, h * math.cos(1.5 * dl), h * math.cos(0.5 * dl))
  s = jnp.where(outer, h * math.sin(1.5 * dl), h * math.sin(0.5 * dl))
  neg = ((~r).astype(jnp.uint32) & 2) << 30              # x < 0 for r < 2
  return c.astype(jnp.float32), _flip(s.astype(jnp.float32), neg)


def _flip(x, mask):
  """x with its sign bit XORed with ``mask``'s (u32: 0 or 1 << 31)."""
  u = lax.bitcast_convert_type(x, jnp.uint32) ^ mask
  return lax.bitcast_convert_type(u, jnp.float32)


def sincos_code(code, sp: spherical.Spec, lvl: int, fma=mul_add):
  """(cos, sin) of level ``lvl``'s decoded angle of integer codes (``spherical.centers``) with no
  range reduction: every decoded angle is π/4 + x with |x| < π/4 from the code's own bits.

  Levels >= 2 decode to π/4 + (c + ½ − 2^{bh−1})·Δ_ℓ: a short polynomial pair around π/4 whose
  degree follows the level's (static) angle range.  Level 1 decodes to −π + (c + ½)·Δ₁, i.e.
  the quarter turn q = c >> (b1 − 2) rotated by (q + 2)·π/2 from π/4 + (r + ½)·Δ₁ − π/4, r the
  low bits: a quarter-turn rotation of (C − S, C + S) only swaps and negates, so cos = σC + τS
  and sin = σS − τC with signs σ, τ = ±1 from the code's top two bits (integer ops and sign-bit
  XORs, no selects).  ``fma`` as in :func:`sincos`.  Elementwise ops only (Triton and XLA)."""
  code = code.astype(jnp.int32)
  dl = float(spherical.steps(sp)[lvl - 1])
  if lvl >= 2:
    half = 2 ** (sp.bh - 1)
    if sp.bh == 2:
      c, s = _rot45_of4(code, dl)
    else:
      c, s = _rot45(fma(code.astype(jnp.float32), dl, (0.5 - half) * dl),
                    (half - 0.5) * dl, fma)
    return c - s, c + s
  lo = sp.b1 - 2                                       # r: the code's low b1 − 2 bits
  if lo == 0:                                          # every inner angle is π/4 itself
    c, s = jnp.full(code.shape, math.sqrt(0.5), jnp.float32), jnp.zeros(code.shape, jnp.float32)
  elif lo == 2:                                        # r − 3/2 = x / Δ₁
    c, s = _rot45_of4(code & 3, dl)
  else:
    r = (code & (2**lo - 1)).astype(jnp.float32)
    c, s = _rot45(fma(r, dl, 0.5 * dl - math.pi / 4), math.pi / 4 - 0.5 * dl, fma)
  # Quarter turns k = (q + 2) & 3 of (C − S, C + S): cos = σC + τS, sin = σS − τC with σ < 0
  # for k ∈ {1, 2} (q ∈ {3, 0}: q's two bits equal) and τ < 0 for k ∈ {0, 1} (q ∈ {2, 3}:
  # q's high bit set).
  u = code.astype(jnp.uint32)
  top = jnp.uint32(1 << 31)
  sigma = ((~(u ^ (u >> 1))) << (33 - sp.b1)) & top     # bit b1−2 of ¬(c ^ c>>1) -> bit 31
  tau = (u << (32 - sp.b1)) & top                       # bit b1−1 of c -> bit 31
  return _flip(c, sigma) + _flip(s, tau), _flip(s, sigma) - _flip(c, tau)


def trig_table(sp: spherical.Spec) -> tuple[np.ndarray, tuple[int, ...]]:
  """(table f32 [T], offset per level): level ℓ's entry ``off[ℓ-1] + 2·code + t`` holds the cos
  (t = 0) or sin (t = 1) of the code's decoded angle, the exact values of
  ``spherical.trig_tables`` (the reference's)."""
  ct, st = spherical.trig_tables(sp)
  parts, offs, at = [], [], 0
  for lvl in range(1, sp.levels + 1):
    row, n = _level_range(sp.d, lvl)[0], 2 ** (sp.b1 if lvl == 1 else sp.bh)
    parts.append(np.stack([ct[row, :n], st[row, :n]], -1).reshape(-1))
    offs.append(at)
    at += 2 * n
  return np.concatenate(parts).astype(np.float32), tuple(offs)


def _gather(ref, rows, cols, valid, other):
  """ref [R, C], rows [bk], cols [w] -> [bk, w] (masked rows read ``other``)."""
  return plgpu.load(ref.at[rows[:, None], cols[None, :]], mask=valid[:, None], other=other)


# --- the kernel ----------------------------------------------------------------------------------


def _kernel(meta_ref, tbl_ref, q_ref, beta_ref, tab_ref, ang_ref, side_ref, v_ref, o_ref, m_ref,
            l_ref, *, ts: TierSpec, g, page, n_pages, n_pool_pages, splits, bk, c, qk_passes,
            exact_pv, int4_dequant, trig, expand, codes_from, fma, tab_off):
  # meta_ref [4] i32 (length, layer's first flat row, -, -); tbl_ref [n] i32 (this head's pages);
  # q_ref [4, M, D/2] bf16 (q'_even hi, lo, q'_odd hi, lo); beta_ref [M] f32 (q·μ);
  # tab_ref [T] f32 (trig_table); ang_ref [L*P*page, NB] u8; side_ref [L*P*page] u32;
  # v_ref [L*P*page, D] bf16 or [.., D/2] u8.
  sp = ts.key
  d, h2 = sp.d, sp.d // 2
  int4_values = ts.values == "int4"
  m_rows = q_ref.shape[1]
  split = pl.program_id(1)
  length = meta_ref[0]
  base = meta_ref[1]
  per = lax.div(length + (splits - 1), splits)
  chunk = lax.div(per + (bk - 1), bk) * bk
  start = split * chunk
  end = jnp.minimum(start + chunk, length)
  if codes_from == "halves":   # q' over level-1 positions [0, D/4) and [D/4, D/2)
    q_halves = [tuple(q_ref[j, :, pl.ds(k * (h2 // 2), h2 // 2)] for j in range(4))
                for k in range(2)]                       # (even hi, lo, odd hi, lo) per half
  else:
    qeh, qel, qoh, qol = (q_ref[j] for j in range(4))
  beta = beta_ref[...]
  row_ok = jnp.arange(m_rows) < g

  # Loop-invariant per-level columns and shifts (tree positions -> packed bytes).
  levels = []
  for lvl in range(1, sp.levels + 1):
    off, w = _level_range(d, lvl)
    byte, shift = _byte_shift(sp, off + jnp.arange(w))
    levels.append((lvl, byte, shift) + _affine(sp, lvl))

  def codes(lvl_info, rows, valid, pos=None):
    """A level's codes [bk, w] (its own positions), or [bk, len(pos)] at positions ``pos`` of
    the level (indices into its width, repeats allowed)."""
    lvl, byte, shift, a, dl, mask = lvl_info
    if pos is not None:
      byte, shift = _byte_shift(sp, _level_range(d, lvl)[0] + pos)
    raw = _gather(ang_ref, rows, byte, valid, 0).astype(jnp.int32)
    return (raw >> shift[None, :]) & mask                           # codes >= 0

  def row_codes(rows, valid):
    """A4 (``codes_from="row"``): every level's codes [bk, width] from ONE load of the row's
    D/2 code bytes (contiguous, so vectorized and prefetched by the pipeliner; per-level
    gathers are byte loads that wait on the page table each block).  Tree position p sits in
    byte p mod D/2, low nibble for p < D/2: level 1 is the low nibbles, and level ℓ >= 2 the
    next first half of the high nibbles (levels are contiguous runs of positions)."""
    raw = _gather(ang_ref, rows, jnp.arange(sp.code_bytes), valid, 0).astype(jnp.int32)
    out, rest = {1: raw & 15}, raw >> 4
    for lvl in range(2, sp.levels + 1):
      out[lvl], rest = jnp.split(rest, 2, axis=1)
    return out

  def halved_row_codes(rows, valid):
    """A42 / A2 (``codes_from="halves"``): every level's codes from one contiguous load per
    packed region, levels 1 and 2 as their halves (level 1's halves are pieces of their own in
    both layouts, and level 2's in A42), so the tree is never concatenated: the expansion and
    the logit MMAs run per half.  A42: D/4 bytes of level-1 nibbles (low: positions [0, D/4),
    high: [D/4, D/2)), then D/8 bytes of 2-bit pieces of D/8 positions (level 2's halves,
    level 3, then the higher levels in halving runs).  A2: D/4 bytes of 2-bit pieces of D/4
    (level 1's halves, level 2, then level 3 and up in halving runs)."""
    if sp.layout == "A42":
      q4 = d // 4
      raw1 = _gather(ang_ref, rows, jnp.arange(q4), valid, 0).astype(jnp.int32)
      raw2 = _gather(ang_ref, rows, q4 + jnp.arange(d // 8), valid, 0).astype(jnp.int32)
      out = {1: (raw1 & 15, raw1 >> 4), 2: (raw2 & 3, (raw2 >> 2) & 3), 3: (raw2 >> 4) & 3}
      rest = raw2 >> 6
    else:
      raw = _gather(ang_ref, rows, jnp.arange(sp.code_bytes), valid, 0).astype(jnp.int32)
      out = {1: (raw & 3, (raw >> 2) & 3), 2: jnp.split((raw >> 4) & 3, 2, axis=1)}
      out[3], rest = jnp.split(raw >> 6, 2, axis=1)
    for lvl in range(4, sp.levels + 1):
      out[lvl], rest = jnp.split(rest, 2, axis=1)
    return out

  def level_trig(lvl_info, rows, valid, code=None):
    lvl, _, _, a, dl, _ = lvl_info
    if code is None:
      code = codes(lvl_info, rows, valid)
    if trig == "table":
      at = tab_off[lvl - 1] + 2 * code
      return plgpu.load(tab_ref.at[at]), plgpu.load(tab_ref.at[at + 1])
    if trig == "code":
      return sincos_code(code, sp, lvl, fma)
    return sincos(fma(code.astype(jnp.float32), dl, a), fma)

  def factor(lvl_info, rows, valid, col):
    """Level ℓ's factor of every level-1 position i: cos or sin (bit ℓ-2 of i) of φ^ℓ_{i>>(ℓ-1)}
    [bk, D/2] (the direct expansion: no joins, so no layout shuffles in the loop)."""
    lvl, _, _, a, dl, _ = lvl_info
    code = codes(lvl_info, rows, valid, col >> (lvl - 1))
    t = (col >> (lvl - 2)) & 1
    if trig == "table":
      return plgpu.load(tab_ref.at[tab_off[lvl - 1] + 2 * code + t[None, :]])
    if trig == "code":
      cl, sl = sincos_code(code, sp, lvl, fma)
    else:
      cl, sl = sincos(fma(code.astype(jnp.float32), dl, a), fma)
    return jnp.where(t[None, :] == 1, sl, cl)

  def dot3(qh, ql, u):
    uh, ul = split_bf16(u)
    out = plgpu.dot(qh, uh, trans_b=True)
    if qk_passes == 3:
      out += plgpu.dot(qh, ul, trans_b=True) + plgpu.dot(ql, uh, trans_b=True)
    return out

  def body(i, carry):
    o_parts, m_prev, l_prev = carry[:-2], carry[-2], carry[-1]
    pos = start + i * bk + jnp.arange(bk)
    valid = pos < end
    pid = plgpu.load(tbl_ref.at[lax.div(pos, page)], mask=valid, other=0)
    pid = jnp.clip(pid, 0, n_pool_pages - 1)
    rows = jnp.where(valid, base + pid * page + lax.rem(pos, page), 0)
    row = row_codes(rows, valid) if codes_from == "row" else {}
    if codes_from == "halves":   # the tree's two halves below level 3 (halved_row_codes)
      row = halved_row_codes(rows, valid)
      u = jnp.ones((bk, 1), jnp.float32)
      for info in reversed(levels[2:]):
        cl, sl = level_trig(info, rows, valid, row[info[0]])
        u = jnp.stack([u * cl, u * sl], axis=-1).reshape(bk, 2 * u.shape[1])
      dot = 0.0
      for u2, code2, code1, qh in zip(jnp.split(u, 2, axis=1), row[2], row[1], q_halves):
        cl, sl = level_trig(levels[1], rows, valid, code2)
        u1 = jnp.stack([u2 * cl, u2 * sl], axis=-1).reshape(bk, 2 * u2.shape[1])
        c1, s1 = level_trig(levels[0], rows, valid, code1)                # [bk, D/4]
        dot = dot + dot3(qh[0], qh[1], u1 * c1) + dot3(qh[2], qh[3], u1 * s1)
    elif expand == "direct":   # u¹_i = Π_{ℓ=n..2} factor_ℓ(i), in the joins' order of products
      col = jnp.arange(h2)
      u = jnp.ones((bk, h2), jnp.float32)
      for info in reversed(levels[1:]):
        u = u * factor(info, rows, valid, col)
    else:  # top-down: u^n = 1, u^{l-1} = interleave(u^l cos φ^l, u^l sin φ^l)
      u = jnp.ones((bk, 1), jnp.float32)
      for info in reversed(levels[1:]):
        cl, sl = level_trig(info, rows, valid, row.get(info[0]))
        u = jnp.stack([u * cl, u * sl], axis=-1).reshape(bk, 2 * u.shape[1])
    if codes_from != "halves":
      c1, s1 = level_trig(levels[0], rows, valid, row.get(1))                  # [bk, D/2]
      dot = dot3(qeh, qel, u * c1) + dot3(qoh, qol, u * s1)               # [M, bk]
    word = plgpu.load(side_ref.at[rows], mask=valid, other=0)             # [bk] u32
    f16 = lambda x: lax.bitcast_convert_type(x.astype(jnp.uint16), jnp.float16).astype(
        jnp.float32)
    r = f16(word & 0xFFFF)
    s = (beta[:, None] + r[None, :] * dot) * c
    s = jnp.where(valid[None, :], s, -jnp.inf)
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1))
    alpha = jnp.exp2(m_prev - m_new)
    p = jnp.exp2(s - m_new[:, None])
    l_new = l_prev * alpha + jnp.sum(p, axis=1)
    if int4_values:
      vs = f16(lax.shift_right_logical(word, jnp.uint32(16)))
      pv = jnp.where(valid[None, :], p * vs[None, :], 0.0)
      vraw = _gather(v_ref, rows, jnp.arange(h2), valid, 0)                # [bk, D/2] u8
      vl, vh = unpack_halves(vraw, int4_dequant)
      off = 0.0 if int4_dequant == "cvt" else BITS_OFFSET
      ol_b, psum = p_at_v(pv, vl, exact_pv, with_sum=True)
      oh_b = p_at_v(pv, vh, exact_pv)
      o_new = (o_parts[0] * alpha[:, None] + (ol_b - off * psum[:, None]),
               o_parts[1] * alpha[:, None] + (oh_b - off * psum[:, None]))
    else:
      v = _gather(v_ref, rows, jnp.arange(d), valid, 0.0)                 # [bk, D] bf16
      o_new = (o_parts[0] * alpha[:, None] + p_at_v(p, v, exact_pv),)
    return (*o_new, m_new, l_new)

  n = pl.cdiv(jnp.maximum(end - start, 0), bk)
  width = h2 if int4_values else d
  o0 = tuple(jnp.zeros((m_rows, width), jnp.float32) for _ in range(2 if int4_values else 1))
  out = lax.fori_loop(0, n, body, (*o0, jnp.full((m_rows,), common.NEG, jnp.float32),
                                   jnp.zeros((m_rows,), jnp.float32)))
  o_parts, m, l = out[:-2], out[-2], out[-1]
  if int4_values:
    plgpu.store(o_ref.at[:, pl.ds(0, h2)], o_parts[0], mask=row_ok[:, None])
    plgpu.store(o_ref.at[:, pl.ds(h2, h2)], o_parts[1], mask=row_ok[:, None])
  else:
    plgpu.store(o_ref, o_parts[0], mask=row_ok[:, None])
  plgpu.store(m_ref, m, mask=row_ok)
  plgpu.store(l_ref, l, mask=row_ok)


def _tier(qs, beta, pool: SphPool, pages, length, ts: TierSpec, layer, *, g, c, block, splits,
          chunk, num_warps, num_stages, qk_passes, exact_pv, int4_dequant, trig, expand,
          codes, fma, interpret):
  """One tier: qs [B, Hkv, 4, M, D/2] bf16, beta [B, Hkv, M] -> o [B, Hkv, M, D], m, l
  [B, Hkv, M] (unnormalized, log2 units; rows >= g are zero)."""
  b, hkv, _, m_rows, h2 = qs.shape
  d = 2 * h2
  n_l, n_pool, page = pool.ang.shape[:3]
  n = pages.shape[2]
  if n_pool == 0 or n == 0:
    return (jnp.zeros((b, hkv, m_rows, d), jnp.float32),
            jnp.full((b, hkv, m_rows), common.NEG, jnp.float32),
            jnp.zeros((b, hkv, m_rows), jnp.float32))
  cap = n * page
  if splits is None:   # enough programs to fill 132 SMs a few times, chunks of >= 512 keys
    want = common.cdiv(cap, chunk) if chunk else common.cdiv(4 * 132, b * hkv)
    splits = max(1, min(want, common.cdiv(cap, 512)))
  splits = max(1, min(splits, common.cdiv(cap, block)))
  rows = n_l * n_pool * page
  meta = jnp.stack([length.astype(jnp.int32),
                    jnp.broadcast_to(layer * (n_pool * page), (b, hkv)).astype(jnp.int32)]
                   + [jnp.zeros((b, hkv), jnp.int32)] * 2, -1)            # [B, Hkv, 4]
  ang = pool.ang.reshape(rows, ts.code_bytes)
  side = pool.side.reshape(rows)
  val = pool.v.reshape(rows, ts.value_width)
  for x in (ang, val):
    if not offsets_fit(x):
      raise ValueError(f"a tier stream of {x.size} elements of {x.dtype} overflows Pallas "
                       "Triton's 32-bit signed offsets: use fewer layers per call")
  tab, offs = trig_table(ts.key)
  kernel = functools.partial(
      _kernel, ts=ts, g=g, page=page, n_pages=n, n_pool_pages=n_pool, splits=splits, bk=block,
      c=c, qk_passes=qk_passes, exact_pv=exact_pv, int4_dequant=int4_dequant, trig=trig,
      expand=expand, tab_off=offs,
      codes_from=codes_from(codes, ts.key, expand),
      fma=fma_ptx if fma and not interpret else mul_add)
  whole = lambda *shape: pl.BlockSpec(shape, lambda h, s, i: (0,) * len(shape))
  o, m, l = pl.pallas_call(
      kernel,
      grid=(hkv, splits, b),
      in_specs=[pl.BlockSpec((None, None, 4), lambda h, s, i: (i, h, 0)),
                pl.BlockSpec((None, None, n), lambda h, s, i: (i, h, 0)),
                pl.BlockSpec((None, None, 4, m_rows, h2), lambda h, s, i: (i, h, 0, 0, 0)),
                pl.BlockSpec((None, None, m_rows), lambda h, s, i: (i, h, 0)),
                whole(tab.size), whole(rows, ts.code_bytes), whole(rows),
                whole(rows, ts.value_width)],
      out_specs=[pl.BlockSpec((None, None, None, m_rows, d), lambda h, s, i: (i, h, s, 0, 0)),
                 pl.BlockSpec((None, None, None, m_rows), lambda h, s, i: (i, h, s, 0)),
                 pl.BlockSpec((None, None, None, m_rows), lambda h, s, i: (i, h, s, 0))],
      out_shape=[jax.ShapeDtypeStruct((b, hkv, splits, m_rows, d), jnp.float32),
                 jax.ShapeDtypeStruct((b, hkv, splits, m_rows), jnp.float32),
                 jax.ShapeDtypeStruct((b, hkv, splits, m_rows), jnp.float32)],
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name=f"sph_tier_{ts.layout}_{ts.values}_gpu",
  )(meta, pages.astype(jnp.int32), qs, beta, jnp.asarray(tab), ang, side, val)
  if splits == 1:
    return o[:, :, 0], m[:, :, 0], l[:, :, 0]
  return common.combine_partials(o, m, l, axis=2)


def check(q: jax.Array, sph: SphInputs, stacked: bool = False) -> None:
  """One-line ValueError for what the kernel does not take (``stacked``: pools carry a leading
  layer axis)."""
  d = q.shape[-1]
  for ts in sph.spec:
    if ts.d != d:
      raise ValueError(f"tier spec has head dim {ts.d}, queries have {d}")
  if sph.spec and d < MIN_D:
    raise ValueError(f"the GPU tier kernel needs head dim >= {MIN_D} (MMA over D/2), got {d}")
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


@functools.partial(jax.jit, static_argnames=_KNOBS)
def sph_partials_gpu(q, sph: SphInputs, layer=None, *, scale: float | None = None,
                     block: int = 32, splits: int | None = None, chunk: int | None = None,
                     num_warps: int = 2, num_stages: int = 2, qk_passes: int = 3,
                     exact_pv: bool = True, int4_dequant: str = "bits", trig: str = "code",
                     expand: str = "joins", codes: str = "row", fma: bool = True,
                     interpret: bool = False):
  """The tier partials of ``reference.sph_partials`` by the kernel: q [B, Hq, D] ->
  o [B, Hkv, K, g, D], m, l [B, Hkv, K, g] (FP32, log2 units, ``sph.spec`` order; an empty tier
  has l = 0).  ``layer``: None, or the (traced) index into pools and constants stacked on a
  leading layer axis (the kernel adds the layer's row offset; nothing is copied per layer).
  Knobs: ``block`` keys per loop step (a power of two >= 16), ``splits`` split-KV programs per
  (sequence, head) (default: from ``chunk`` keys per split, else enough to fill the GPU),
  ``num_warps``/``num_stages``, ``qk_passes`` (3: FP32-grade logits by bf16 hi/lo MMAs, 1: one
  bf16 pass), ``exact_pv``, ``int4_dequant`` ("bits", "cvt", "asm": ``gpu.decode``'s modes; "asm"
  falls back to "bits" in interpret mode), ``trig`` ("poly": cos/sin by quadrant reduction and
  polynomials, "table": read from :func:`trig_table`, L1-resident, "code": :func:`sincos_code`, no
  range reduction and each level's polynomial degree from its range), ``expand`` ("joins": the
  tree expanded level by level by width-doubling joins, "direct": each level-1 position's product
  of level factors, no joins), ``codes`` ("levels": each level's codes gathered on their own,
  "row": each key's code bytes read once per packed region and split into levels in registers
  (A42 and A2: with ``expand="joins"`` and D >= 64, levels 1 and 2 in halves, see
  :func:`codes_from`; else per level), with ``expand="direct"`` levels >= 2 gathered), ``fma``
  (the angle decode and the trig polynomials by explicit ``fma.rn.f32``: Triton does not
  contract; plain multiply-adds in interpret mode), ``interpret``.  The defaults (``trig="code"``,
  ``codes="row"``, ``fma=True``, 2 warps) were the fastest of the knob sweep on an H100
  (bench/RESULTS.md, issue 26's G2 sweep): 2.2–2.7× the device time of the first kernel's."""
  check(q, sph, stacked=layer is not None)
  if trig not in TRIG:
    raise ValueError(f"trig must be one of {TRIG}, got {trig!r}")
  if expand not in EXPAND:
    raise ValueError(f"expand must be one of {EXPAND}, got {expand!r}")
  if codes not in CODES:
    raise ValueError(f"codes must be one of {CODES}, got {codes!r}")
  if qk_passes not in (1, 3):
    raise ValueError(f"qk_passes must be 1 or 3, got {qk_passes}")
  if block < 16 or block & (block - 1):
    raise ValueError(f"block must be a power of two >= 16, got {block}")
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
  layer = jnp.asarray(layer, jnp.int32)
  m_rows = max(16, common.next_pow2(g))
  qf = q.astype(jnp.float32).reshape(b, hkv, g, d)
  qf = jnp.pad(qf, ((0, 0), (0, 0), (0, m_rows - g), (0, 0)))
  qr = jnp.einsum("bhgd,ed->bhge", qf, sph_rotation(signs), precision=HIGHEST)
  beta = jnp.einsum("bhgd,hd->bhg", qf, mu.astype(jnp.float32), precision=HIGHEST)
  qe_h, qe_l = common.split_bf16(qr[..., 0::2])     # XLA-side split (see common.split_bf16)
  qo_h, qo_l = common.split_bf16(qr[..., 1::2])
  qs = jnp.stack([qe_h, qe_l, qo_h, qo_l], 2)                         # [B, Hkv, 4, M, D/2]
  c = common.default_scale(d, scale) * common.LOG2E
  if interpret and int4_dequant == "asm":
    int4_dequant = "bits"
  parts = [_tier(qs, beta, pool, pages, length, ts, layer, g=g, c=c, block=block, splits=splits,
                 chunk=chunk, num_warps=num_warps, num_stages=num_stages, qk_passes=qk_passes,
                 exact_pv=exact_pv, int4_dequant=int4_dequant, trig=trig, expand=expand,
                 codes=codes, fma=fma, interpret=interpret)
           for pool, pages, length, ts in zip(pools, sph.maps.pages, sph.maps.length, sph.spec)]
  o, m, l = (jnp.stack(x, axis=2) for x in zip(*parts))             # [B, Hkv, K, M, ...]
  return o[:, :, :, :g], m[..., :g], l[..., :g]


@functools.partial(jax.jit, static_argnames=("return_lse",))
def _merge(o, m, l, so, sm, sl, *, return_lse):
  b, hkv, _, g, d = o.shape
  o, m, l = (jnp.concatenate(x, axis=2) for x in ((o, so), (m, sm), (l, sl)))
  out, _ = common.merge(o, m, l, axis=2)
  out = out.reshape(b, hkv * g, d).astype(jnp.bfloat16)
  if not return_lse:
    return out
  return out, lse_of(m, l, axis=2).reshape(b, hkv * g)


def decode_attention_sph_gpu(q, window: Window, hi: HighPool, lo: LowPool, maps: PageMaps,
                             sph: SphInputs | None, layer=None, *, scale: float | None = None,
                             return_lse: bool = False, interpret: bool = False,
                             sph_knobs: dict | None = None, **knobs):
  """``gpu.decode_attention_gpu`` plus the tier partitions: q [B, Hq, D] -> out [B, Hq, D] bf16
  (and, with ``return_lse``, the natural-log LSE of the scaled logits over every visible key,
  f32 [B, Hq]).  The base partitions (``partials_gpu`` with ``knobs``) and each tier
  (:func:`sph_partials_gpu` with ``sph_knobs``) are separate launches whose partials meet in one
  Eq. 15 merge.  Jittable (the knobs are Python values)."""
  b, hq, d = q.shape
  hkv = window.k.shape[-2]
  if knobs.get("int4_kernel") in ("fused", "fused_reference"):
    raise ValueError("int4_kernel='fused' merges its own partials: it does not take sph= or "
                     "return_lse")
  if sph is not None and sph.spec and sph.maps.pages[0].shape[1] != hkv:
    raise ValueError(f"tier maps have {sph.maps.pages[0].shape[1]} KV heads, the window has "
                     f"{hkv}")
  g = hq // hkv
  o, m, l = partials_gpu(q, window, hi, lo, maps, layer, scale=scale, interpret=interpret,
                         **knobs)
  o, m, l = o[:, :, :, :g], m[:, :, :, :g], l[:, :, :, :g]            # drop padded query rows
  if sph is not None and sph.spec:
    so, sm, sl = sph_partials_gpu(q, sph, layer, scale=scale, interpret=interpret,
                                  **(sph_knobs or {}))
  else:
    so = jnp.zeros((b, hkv, 0, g, d), jnp.float32)
    sm = sl = jnp.zeros((b, hkv, 0, g), jnp.float32)
  return _merge(o, m, l, so, sm, sl, return_lse=return_lse)


__all__ = ["MIN_D", "check", "decode_attention_sph_gpu", "sincos", "sph_partials_gpu"]
