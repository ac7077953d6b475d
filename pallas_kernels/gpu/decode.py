"""Pallas Triton kernel: one fused split-KV pass over {INT4 pool, BF16 pool, window}.

Grid (Hkv, NS, B).  The split axis NS is laid out as [INT4 splits | BF16-pool splits | window
splits]; each program walks ``chunk`` logical entries of one partition of one (sequence, KV head)
in blocks of ``block`` keys, with the GQA group's query heads (padded to 16 rows for the MMA) as
the M dimension, and writes an unnormalized partial (o, m, l).  The partials are merged (Eq. 15)
by one Pallas Triton launch (:mod:`pallas_kernels.gpu.merge`, the default), or with
``merge="sets"`` by XLA where they lie (:func:`merge_sets`).

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
* The INT4 pools reach the kernel as uint16 views (two code bytes per element, a free bitcast),
  split back into bytes after the load.  Pallas Triton computes a load's element offsets in
  32 bits unless the whole operand exceeds 2**32 *bytes*, and the pointer add treats them as
  signed: a uint8 operand of (2, 4] GiB (the stacked pools of a 960-row calibration batch at
  capacity 1024) wrapped every offset past 2**31 and read other memory.  With 2-byte elements
  no offset of an operand up to 4 GiB reaches 2**31 (:func:`offsets_fit`).
"""
from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.xla_metadata import set_xla_metadata
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import common
from pallas_kernels.gpu import mgpu_decode, mgpu_mixed
from pallas_kernels.gpu.merge import merge_kernel, merge_sets
from pallas_kernels.types import HighPool, LowPool, PageMaps, Window

_LO, _HI, _WIN = 0, 1, 2
BITS_OFFSET = 136.0   # INT4 "bits" dequant: bf16(0x4300 | (n ^ 8)) == n + 136
_NUM_SMS = 132  # H100 / H200: "auto" gives a large INT4 partition its own launch


def _online(carry, s, valid):
  """One online-softmax step on scores s [M, bk] (log2 units); returns (p, alpha, m, l)."""
  m_prev, l_prev = carry
  s = jnp.where(valid[None, :], s, -jnp.inf)
  m_new = jnp.maximum(m_prev, jnp.max(s, axis=1))
  alpha = jnp.exp2(m_prev - m_new)
  p = jnp.exp2(s - m_new[:, None])
  l_new = l_prev * alpha + jnp.sum(p, axis=1)
  return p, alpha, m_new, l_new


def split_bf16(x):
  """f32 -> (hi, lo) bf16 with hi + lo == x to ~2^-17: two MMAs give a near-FP32 p @ V.  Inside
  Triton kernels only: in an XLA graph on a GPU the round trip is folded (lo = 0); there use
  ``common.split_bf16``."""
  hi = x.astype(jnp.bfloat16)
  return hi, (x - hi.astype(jnp.float32)).astype(jnp.bfloat16)


def p_at_v(p, v, exact, with_sum=False):
  """p [M, bk] f32 @ v [bk, N] bf16 -> [M, N] f32 (and the row sums of the p really used)."""
  if not exact:
    pb = p.astype(v.dtype)
    out = plgpu.dot(pb, v)
    fed = pb.astype(jnp.float32)
  else:
    hi, lo = split_bf16(p)
    out = plgpu.dot(hi, v) + plgpu.dot(lo, v)
    fed = hi.astype(jnp.float32) + lo.astype(jnp.float32)
  return (out, jnp.sum(fed, axis=1)) if with_sum else out


def _kernel(lens_ref, q_ref, *refs, g, exact_pv, exact_pv_lo, int4_dequant, int4_prefetch, page_lo,
            page_hi, n_lo,
            n_hi, chunk_lo, chunk_hi, chunk_w, bk_lo, bk_hi, bk_w, c, has_lo, has_hi, has_w):
  # lens_ref [8] i32 (lo, hi, win lengths; lo and window row bases of this layer and sequence,
  # -, -, -); q_ref [M, D] bf16.  Pools and window hold every layer, scales only this layer's;
  # the BF16 page table arrives with the layer's page offset already added.
  refs = list(refs)
  if has_lo:
    tlo_ref, klo_ref, vlo_ref, sc_ref = refs[:4]   # [n_pages], [L*P*page, D/4] u16 x2, [P*page] u32
    refs = refs[4:]
  if has_hi:
    thi_ref, khi_ref, vhi_ref = refs[:3]           # [n_pages], [L*P*page, D] bf16 x2
    refs = refs[3:]
  if has_w:
    kw_ref, vw_ref = refs[:2]                      # [L*B*W, D] x2
    refs = refs[2:]
  o_ref, m_ref, l_ref = refs                       # [M, D], [M], [M]
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
      o = o * alpha[:, None] + p_at_v(p, v, exact_pv)
      return o, m, l

    n = pl.cdiv(jnp.maximum(end - start, 0), bk)
    o, m, l = lax.fori_loop(0, n, body, (jnp.zeros((m_rows, d), jnp.float32), m0, l0))
    store([o], m, l)

  def int4_part(split):
    ql = plgpu.load(q_ref.at[:, pl.ds(0, h2)])
    qh = plgpu.load(q_ref.at[:, pl.ds(h2, h2)])
    chunk = _spread(lens_ref[_LO], n_lo, bk_lo)
    start = split * chunk
    end = jnp.minimum(start + chunk, lens_ref[_LO])
    bk = bk_lo
    off = 0.0 if int4_dequant == "cvt" else BITS_OFFSET
    # q . (code + OFF) = q . code + OFF * sum(q): subtract the second term (FP32, once).
    q_off = off * (jnp.sum(ql.astype(jnp.float32), axis=1)
                   + jnp.sum(qh.astype(jnp.float32), axis=1))

    def where(i):
      pos = start + i * bk + jnp.arange(bk)
      return pos, pos < end

    def rows_at(i):
      pos, valid = where(i)
      return _paged_rows(tlo_ref, page_lo, pos, valid)

    base = lens_ref[3]

    def fetch(i, rows):
      """Issue the loads of block i (raw codes and the packed K|V fp16 scales)."""
      valid = where(i)[1]
      return (_gather_codes(klo_ref, rows + base, valid),
              _gather_codes(vlo_ref, rows + base, valid),
              plgpu.load(sc_ref.at[rows], mask=valid, other=0))

    def step(i, kraw, vraw, sc, carry):
      ol, oh, m, l = carry
      valid = where(i)[1]
      kl, kh = unpack_halves(kraw, int4_dequant)
      ks, vs = _scales(sc)
      s = plgpu.dot(ql, kl, trans_b=True) + plgpu.dot(qh, kh, trans_b=True) - q_off[:, None]
      s = s * (ks * c)[None, :]
      p, alpha, m, l = _online((m, l), s, valid)
      pv = p * vs[None, :]
      vl, vh = unpack_halves(vraw, int4_dequant)
      # Same offset on the V side: p . (code + OFF) - OFF * sum(p), with the p actually fed.
      ol_b, psum = p_at_v(pv, vl, exact_pv_lo, with_sum=True)
      oh_b = p_at_v(pv, vh, exact_pv_lo)
      ol = ol * alpha[:, None] + (ol_b - off * psum[:, None])
      oh = oh * alpha[:, None] + (oh_b - off * psum[:, None])
      return ol, oh, m, l

    n = pl.cdiv(jnp.maximum(end - start, 0), bk)
    z = jnp.zeros((m_rows, h2), jnp.float32)
    if int4_prefetch:
      # Software pipeline in registers: block i+1's codes and scales and block i+2's page-table
      # rows are in flight while block i is computed, so no load waits on the one before it.
      def body(i, carry):
        acc, (kraw, vraw, sc), rows_next = carry[:4], carry[4:7], carry[7]
        rows_next2 = rows_at(i + 2)
        nxt = fetch(i + 1, rows_next)
        acc = step(i, kraw, vraw, sc, acc)
        return (*acc, *nxt, rows_next2)

      init = (z, z, m0, l0, *fetch(0, rows_at(0)), rows_at(1))
      ol, oh, m, l = lax.fori_loop(0, n, body, init)[:4]
    else:
      def body(i, carry):
        return step(i, *fetch(i, rows_at(i)), carry)

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
                sp - n_lo, _spread(lens_ref[_HI], n_hi, bk_hi), lens_ref[_HI], bk_hi)

  if has_w:
    @pl.when(sp >= n_lo + n_hi)
    def _():
      base = lens_ref[4]
      bf16_part(kw_ref, vw_ref, lambda pos, ok: pos + base, sp - n_lo - n_hi, chunk_w,
                lens_ref[_WIN], bk_w)


# $0, $1 <- four bytes of $2 (byte j -> 16-bit lane j): bf16 bits ((nibble ^ 8) | 0x4300).
ASM_UNPACK_LO = """{
.reg .b32 t0, t1;
prmt.b32 t0, $2, $2, 0x3130;
prmt.b32 t1, $2, $2, 0x3332;
lop3.b32 $0, t0, 0x000F000F, 0x43084308, 0x6A;
lop3.b32 $1, t1, 0x000F000F, 0x43084308, 0x6A;
}"""
ASM_UNPACK_HI = """{
.reg .b32 t0, t1;
prmt.b32 t0, $2, $2, 0x3130;
prmt.b32 t1, $2, $2, 0x3332;
shr.u32 t0, t0, 4;
shr.u32 t1, t1, 4;
lop3.b32 $0, t0, 0x000F000F, 0x43084308, 0x6A;
lop3.b32 $1, t1, 0x000F000F, 0x43084308, 0x6A;
}"""


def _spread(length, n, bk):
  """The traced chunk that spreads ``length`` entries over the ``n`` (static) splits of a pool,
  in whole blocks: the grid is sized by the pool's capacity, the work by what is stored, so a
  pool that is mostly empty (a server's page tables are sized for the longest request) still
  keeps every split busy instead of one split walking the whole length."""
  per = lax.div(length + (n - 1), n)
  return lax.div(per + (bk - 1), bk) * bk


def unpack_halves(x, mode):
  """[bk, D/2] u8 -> (low, high) halves as bf16: exact codes ("cvt") or code + BITS_OFFSET
  ("bits", "asm")."""
  if mode == "cvt":  # exact codes via int -> float conversions (slow on Hopper)
    x = x.astype(jnp.int32)
    lo = lax.shift_right_arithmetic(lax.shift_left(x, 28), 28)
    hi = lax.shift_right_arithmetic(lax.shift_left(x, 24), 28)
    return (lo.astype(jnp.float32).astype(jnp.bfloat16),
            hi.astype(jnp.float32).astype(jnp.bfloat16))
  if mode == "asm":
    # Four bytes per instance: two byte permutes spread bytes (0,1) and (2,3) to 16-bit lanes,
    # and one lop3 each gives ((n & 0xF) ^ 8) | 0x4300 per lane, i.e. bf16 code + OFF, two at a
    # time (8 instructions for 8 values instead of ~6 per value).
    sds = [jax.ShapeDtypeStruct(x.shape, jnp.bfloat16)]
    asm = lambda code: plgpu.elementwise_inline_asm(code, args=[x], constraints="=r,=r,r", pack=4,
                                                    result_shape_dtypes=sds)[0]
    return asm(ASM_UNPACK_LO), asm(ASM_UNPACK_HI)
  # "bits": bf16 with bits 0x4300 | u is 128 + u exactly (7 mantissa bits), and u = n ^ 8 maps
  # the signed nibble n to n + 8, so the value is code + OFF with integer ops only.  The OFF is
  # removed after the MMA.
  x = x.astype(jnp.uint16)
  lo = lax.bitcast_convert_type(((x & 0xF) ^ 8) | 0x4300, jnp.bfloat16)
  hi = lax.bitcast_convert_type(((x >> 4) ^ 8) | 0x4300, jnp.bfloat16)
  return lo, hi


def _scales(w):
  """u32 [bk] holding (K fp16 bits | V fp16 bits << 16) -> K, V scales as f32."""
  f16 = lambda b: lax.bitcast_convert_type(b.astype(jnp.uint16), jnp.float16).astype(jnp.float32)
  return f16(w & 0xFFFF), f16(lax.shift_right_logical(w, jnp.uint32(16)))


def _gather(ref, rows, valid, other):
  """ref [R, C], rows [bk] -> [bk, C]; two array indexers (the interpreter takes no mix)."""
  cols = jnp.arange(ref.shape[1])[None, :]
  return plgpu.load(ref.at[rows[:, None], cols], mask=valid[:, None], other=other)


def _gather_codes(ref, rows, valid):
  """The INT4 pool as a uint16 view ref [R, D/4], rows [bk] -> the rows' code bytes [bk, D/2] u8
  (little endian: byte 2j is the low half of element j)."""
  w = _gather(ref, rows, valid, 0)
  lo = (w & 0xFF).astype(jnp.uint8)
  hi = lax.shift_right_logical(w, jnp.uint16(8)).astype(jnp.uint8)
  return jnp.stack([lo, hi], axis=-1).reshape(w.shape[0], 2 * w.shape[1])


def as_u16(x):
  """uint8 [..., 2n] -> its uint16 view [..., n] (XLA: a bitcast, no copy)."""
  return lax.bitcast_convert_type(x.reshape(x.shape[:-1] + (x.shape[-1] // 2, 2)), jnp.uint16)


def offsets_fit(x) -> bool:
  """Whether Pallas Triton indexes ``x`` (a kernel operand) without overflow: it uses 32-bit
  element offsets, added as signed, unless the operand exceeds 2**32 bytes."""
  n, item = x.size, jnp.dtype(x.dtype).itemsize
  return n * item > 2**32 or n <= 2**31


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


_KNOBS = ("scale", "block_lo", "block_hi", "block_w", "chunk_lo", "chunk_hi", "num_warps",
          "num_stages", "exact_pv", "exact_pv_lo", "int4_dequant", "int4_prefetch", "fuse",
          "num_warps_lo", "num_stages_lo", "interpret", "int4_kernel", "splits_lo", "wgs_lo",
          "table_lo", "upcast_lo", "early_v_lo", "stream_lo")
# Knobs of int4_kernel="fused" alone (mgpu_mixed: one Mosaic GPU launch for both pools).
_FUSED_KNOBS = ("splits_hi", "tile_hi", "stages_lo", "stages_hi", "auto_barriers")
# decode_attention_gpu's own: how the partials are merged ("kernel": in place by one Pallas Triton
# launch, merge.merge_kernel, the default; "sets": in place by XLA; "concat": concatenated first,
# as partials_gpu returns them, for same-run comparisons).
_MERGE_KNOBS = ("merge",)
_MERGES = ("sets", "concat", "kernel")
_FUSED = ("fused", "fused_reference")
_GROUPS = itertools.count(1)   # XLA scheduling groups of stream_lo's call sites


def bf16_warps(d: int) -> int:
  """Warps of the Triton launch over the BF16 pool and window: 4 at head dim <= 64, else 8.
  H100, B=8 32K, CUPTI (bench/results/2026-12-06_session24/bf16_warps): at d 64 (0.5B shape) 4
  warps read the all-BF16 cache in 54.3 us against 8 warps' 66.4 (the B~0.33 call 37.5 vs 38.9);
  at d 128 (4B-like) 352.0 vs 355.5, within 1%: 8 stays, as tuned on the H200."""
  return 4 if d <= 64 else 8


def stack_inputs(window: Window, hi: HighPool, lo: LowPool, layer):
  """(window, hi, lo, layer) with a leading layer axis: one layer's arrays get a size-1 axis
  (a free reshape) and layer 0."""
  if layer is not None:
    return window, hi, lo, jnp.asarray(layer, jnp.int32)
  add = lambda t: type(t)(*(x[None] for x in t))
  return window._replace(k=window.k[None], v=window.v[None]), add(hi), add(lo), jnp.int32(0)


@functools.partial(jax.jit, static_argnames=_KNOBS)
def partials_gpu(q, window: Window, hi: HighPool, lo: LowPool, maps: PageMaps, layer=None,
                 **knobs):
  """Unmerged partials: o [B, Hkv, NS, M, D] f32, m, l [B, Hkv, NS, M] (rows >= g unwritten):
  every partition's partials in the Triton kernel's layout, concatenated along NS (knobs:
  :func:`partial_sets`)."""
  sets = partial_sets(q, window, hi, lo, maps, layer, **knobs)
  sets = [x if not kernel_layout else mgpu_decode.triton_layout(*x)
          for x, kernel_layout in sets]
  if len(sets) == 1:
    return sets[0]
  return tuple(jnp.concatenate(x, axis=2) for x in zip(*sets))


def partial_sets(q, window: Window, hi: HighPool, lo: LowPool, maps: PageMaps, layer=None, *,
                 scale: float | None = None, block_lo: int = 64, block_hi: int = 128,
                 block_w: int = 64, chunk_lo: int | None = None, chunk_hi: int | None = None,
                 num_warps: int | None = None, num_stages: int = 2, exact_pv: bool = True,
                 exact_pv_lo: bool | None = None, int4_dequant: str | None = None,
                 int4_prefetch: bool | None = None,
                 fuse: bool | str = "auto", num_warps_lo: int = 2, num_stages_lo: int = 1,
                 interpret: bool = False, int4_kernel: str = "auto",
                 splits_lo: int | None = None, wgs_lo: int = 1, table_lo: str = "gmem",
                 upcast_lo: str | None = None, early_v_lo: bool = False, stream_lo: int = 0):
  """The partial sets ``[((o, m, l), kernel_layout), ...]`` (see :func:`merge_sets`): the
  Triton kernel's (o [B, Hkv, NS, M, D] f32, m, l [B, Hkv, NS, M], rows >= g unwritten) and,
  where the Mosaic GPU kernel reads the INT4 pool, its own in its layout.

  ``int4_kernel``: which kernel reads the INT4 pool. ``"mosaic"``: the Mosaic GPU kernel
  (:mod:`pallas_kernels.gpu.mgpu_decode`; Hopper, INT4 pages of a multiple of 64 tokens, head dim
  a multiple of 64, <= 16 query heads per KV head), ``splits_lo`` context splits (default: by the
  grid size), ``wgs_lo`` > 1 its warp-specialized form (``wgs_lo`` compute warpgroups; the
  "int4" storage format only), ``table_lo`` where its index maps read the page ids ("gmem",
  or "smem": copied into shared memory once per block), ``upcast_lo`` how it turns K tiles into
  MMA operands (``mgpu_decode.UPCASTS``: ``mgpu_decode.int4_partials``' ``upcast``; default by
  the pool's storage format), ``early_v_lo`` whether it upcasts V's operand while the scores'
  MMAs run (``mgpu_decode.int4_partials``' ``early_v``), ``stream_lo`` > 0 XLA's GPU stream
  the Mosaic GPU kernel is launched on (``compute_on("gpu_stream:N")``: an async call beside
  the Triton launch over the BF16 pool and window, so the two short, ramp- and tail-bound
  kernels share the card instead of running back to back; 0, the default: the one stream);
  ``"triton"``: this module's kernel;
  ``"auto"`` (default): Mosaic GPU wherever it applies on a Hopper GPU (not in interpret mode),
  Triton elsewhere.
  ``"mosaic_reference"``: the Mosaic GPU path with the kernel's jnp reference in its place (CPU
  tests of the glue).
  An INT4 pool in the "int4" storage format (``types.LowPool``) is read by the Mosaic GPU kernel
  only: ``"auto"`` picks it (its jnp reference in interpret mode), ``"triton"`` is refused.

  ``layer`` (see ``pallas_kernels.decode_attention``): the kernel gets the whole stacked pools
  and window and adds the layer's row offset to every gathered row, so nothing is copied per
  layer except that layer's fp16 scales (4 B a row, repacked to one u32).

  ``num_warps`` (default :func:`bf16_warps` for a launch over the BF16 pool and window alone, 8
  where the launch reads INT4 entries too).
  ``fuse=False`` runs the INT4 partition as its own launch (``num_warps_lo`` warps,
  ``num_stages_lo`` stages, ``block_lo`` keys) and the BF16 pool + window as another; the
  partials are concatenated.  ``"auto"`` (default) separates them when the INT4 partition alone
  has at least one program per SM (a large pool: latency-bound, it wants few warps per program and
  many programs) and fuses otherwise (a small pool: launch-bound, one launch is cheaper).
  ``int4_dequant`` / ``int4_prefetch`` default to "asm" / True in the separate INT4 launch and to
  "bits" / False in the fused kernel (which must stay within 128 registers at 8 warps).
  ``int4_dequant="asm"`` falls back to "bits" in interpret mode (no inline PTX on the CPU).
  ``exact_pv_lo`` (default: ``exact_pv``) sets the hi+lo p split for the INT4 partition alone.
  """
  window, hi, lo, layer = stack_inputs(window, hi, lo, layer)
  b, hq, d = q.shape
  if d % 4:
    raise ValueError(f"the GPU kernel reads INT4 codes as 16-bit words: head dim must be a "
                     f"multiple of 4, got {d}")
  n_l, _, w, hkv = window.k.shape[:4]
  g = hq // hkv
  m_rows = max(16, common.next_pow2(g))              # tl.dot needs M >= 16
  c = common.default_scale(d, scale) * common.LOG2E
  p_lo, page_lo = lo.scale.shape[1], lo.page    # either storage format of the INT4 pool
  p_hi, page_hi = hi.k.shape[1:3]
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
  if int4_kernel in _FUSED:
    raise ValueError(f"int4_kernel={int4_kernel!r} writes its partials in its own layout and "
                     "merges them itself: call decode_attention_gpu")
  if int4_kernel not in ("auto", "triton", "mosaic", "mosaic_reference"):
    raise ValueError(f"int4_kernel must be 'auto', 'triton', 'mosaic', 'mosaic_reference', "
                     f"'fused' or 'fused_reference', got {int4_kernel!r}")
  if lo.format == "int4":
    if int4_kernel == "triton":
      raise ValueError("the Triton kernel reads the INT4 pool as uint8 half-split bytes only: an "
                       "int4-format pool takes int4_kernel 'auto', 'mosaic' or 'mosaic_reference'")
    if int4_kernel == "auto":
      int4_kernel = "mosaic_reference" if interpret else "mosaic"
  if int4_kernel == "auto":
    ok = n_lo and not interpret and mgpu_decode.supported(page_lo, d, g) and mgpu_decode.hopper()
    int4_kernel = "mosaic" if ok else "triton"
  if wgs_lo != 1 and (int4_kernel == "triton" or lo.format != "int4"):
    raise ValueError(f"wgs_lo={wgs_lo} is the warp-specialized Mosaic GPU kernel of the int4 "
                     f"storage format; this call reads a {lo.format!r} pool with "
                     f"int4_kernel={int4_kernel!r}")
  mosaic_only = {k: v for k, v in (("upcast_lo", upcast_lo), ("early_v_lo", early_v_lo))
                 if v not in (None, False, "bf16")}
  if stream_lo < 0 or stream_lo != int(stream_lo):
    raise ValueError(f"stream_lo must be a non-negative int (0: the main stream), got "
                     f"{stream_lo!r}")
  if stream_lo and n_lo and int4_kernel == "triton":
    raise ValueError(f"stream_lo={stream_lo} launches the Mosaic GPU INT4 kernel on another "
                     "stream; this call reads its INT4 pool with the Triton kernel")
  if mosaic_only and (int4_kernel == "triton" or lo.format != "int4"):
    raise ValueError(f"{', '.join(f'{k}={v!r}' for k, v in mosaic_only.items())}: knobs of the "
                     f"Mosaic GPU kernel of the int4 storage format; this call reads a "
                     f"{lo.format!r} pool with int4_kernel={int4_kernel!r}")
  if fuse == "auto":
    fuse = b * hkv * n_lo < _NUM_SMS
  if int4_dequant is None:
    int4_dequant = "bits" if fuse else "asm"
  if int4_prefetch is None:
    int4_prefetch = not fuse
  block_w = min(block_w, max(16, common.next_pow2(w)))
  n_w, chunk_w = _plan(w, block_w, w)

  qp = q.reshape(b, hkv, g, d)
  qp = jnp.pad(qp, ((0, 0), (0, 0), (0, m_rows - g), (0, 0)))
  # Row bases computed in XLA; the BF16 pool's goes into its page table (one more add per block in
  # the fused kernel made ptxas spill).
  bases = [layer * p_lo * page_lo, (layer * b + jnp.arange(b)) * w]
  lens = jnp.stack([maps.lo_len, maps.hi_len, window.length]
                   + [jnp.broadcast_to(x, (b,)) for x in bases]
                   + [jnp.zeros((b,), jnp.int32)] * 3, 1).astype(jnp.int32)

  lo_args, lo_specs, hi_args, hi_specs = [], [], [], []
  if n_lo and int4_kernel == "triton":
    rows = p_lo * page_lo
    # (K, V) fp16 scales of a row as one u32 (K in the low half): one 4-byte load per row.
    # Only this layer's are repacked (a size-changing bitcast may not be free).
    sc = lax.dynamic_index_in_dim(lo.scale, layer, 0, keepdims=False)
    sc = lax.bitcast_convert_type(sc, jnp.uint32).reshape(rows, hkv)
    # uint16 views of the codes: see the module doc (offsets of a uint8 pool of 2-4 GiB wrap).
    lo_args = [maps.lo_pages.astype(jnp.int32), as_u16(lo.k).reshape(n_l * rows, hkv, d // 4),
               as_u16(lo.v).reshape(n_l * rows, hkv, d // 4), sc]
    lo_specs = [pl.BlockSpec((None, maps.lo_pages.shape[1]), lambda h, s, i: (i, 0)),
                pl.BlockSpec((n_l * rows, None, d // 4), lambda h, s, i: (0, h, 0)),
                pl.BlockSpec((n_l * rows, None, d // 4), lambda h, s, i: (0, h, 0)),
                pl.BlockSpec((rows, None), lambda h, s, i: (0, h))]
  if n_hi:
    rows = p_hi * page_hi
    hi_args = [maps.hi_pages.astype(jnp.int32) + layer * p_hi, hi.k.reshape(n_l * rows, hkv, d),
               hi.v.reshape(n_l * rows, hkv, d)]
    hi_specs = [pl.BlockSpec((None, maps.hi_pages.shape[1]), lambda h, s, i: (i, 0)),
                pl.BlockSpec((n_l * rows, None, d), lambda h, s, i: (0, h, 0)),
                pl.BlockSpec((n_l * rows, None, d), lambda h, s, i: (0, h, 0))]
  w_rows = n_l * b * w
  w_args = [window.k.reshape(w_rows, hkv, d), window.v.reshape(w_rows, hkv, d)]
  w_specs = [pl.BlockSpec((w_rows, None, d), lambda h, s, i: (0, h, 0))] * 2

  if exact_pv_lo is None:
    exact_pv_lo = exact_pv
  if interpret and int4_dequant == "asm":
    int4_dequant = "bits"

  def call(n_lo_, n_hi_, n_w_, args, specs, warps, stages, name):
    ns = n_lo_ + n_hi_ + n_w_
    kernel = functools.partial(
        _kernel, g=g, page_lo=page_lo, page_hi=page_hi, n_lo=n_lo_, n_hi=n_hi_,
        chunk_lo=chunk_lo, chunk_hi=chunk_hi, chunk_w=chunk_w, bk_lo=block_lo, bk_hi=block_hi,
        bk_w=block_w, c=c, has_lo=bool(n_lo_), has_hi=bool(n_hi_), has_w=bool(n_w_),
        exact_pv=exact_pv, exact_pv_lo=exact_pv_lo, int4_dequant=int4_dequant,
        int4_prefetch=int4_prefetch)
    return pl.pallas_call(
        kernel,
        grid=(hkv, ns, b),   # heads fastest: they share table/scale sectors and DRAM pages
        in_specs=[pl.BlockSpec((None, 8), lambda h, s, i: (i, 0)),
                  pl.BlockSpec((None, None, m_rows, d), lambda h, s, i: (i, h, 0, 0))] + specs,
        out_specs=[pl.BlockSpec((None, None, None, m_rows, d), lambda h, s, i: (i, h, s, 0, 0)),
                   pl.BlockSpec((None, None, None, m_rows), lambda h, s, i: (i, h, s, 0)),
                   pl.BlockSpec((None, None, None, m_rows), lambda h, s, i: (i, h, s, 0))],
        out_shape=[jax.ShapeDtypeStruct((b, hkv, ns, m_rows, d), jnp.float32),
                   jax.ShapeDtypeStruct((b, hkv, ns, m_rows), jnp.float32),
                   jax.ShapeDtypeStruct((b, hkv, ns, m_rows), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=stages),
        interpret=interpret,
        name=name,
    )(lens, qp, *args)

  warps_bf16 = num_warps or bf16_warps(d)
  if n_lo and int4_kernel != "triton":
    lo_fn = functools.partial(mgpu_decode.int4_partials, qp, lo, maps, layer, c=c, g=g,
                              splits=splits_lo, wgs=wgs_lo, table=table_lo, upcast=upcast_lo,
                              early_v=early_v_lo, layout="kernel",
                              reference=int4_kernel == "mosaic_reference")
    def bf16_partitions():   # the BF16 pool and the window: one Triton launch
      return call(0, n_hi, n_w, hi_args + w_args, hi_specs + w_specs, warps_bf16, num_stages,
                  "pask_decode_attention")
    if not stream_lo:
      return [(lo_fn(), True), (bf16_partitions(), False)]
    # Experimental: the two launches as async calls on streams stream_lo and stream_lo + 1, one
    # scheduling group per call site so XLA may place both starts before both dones.
    with set_xla_metadata(_scheduling_group_id=str(next(_GROUPS))):
      lo_part = lo_fn(stream=stream_lo)
      with mgpu_decode.on_stream(stream_lo + 1):
        rest = jax.jit(bf16_partitions)()
    return [(lo_part, True), (rest, False)]
  if fuse or not n_lo:
    return [(call(n_lo, n_hi, n_w, lo_args + hi_args + w_args, lo_specs + hi_specs + w_specs,
                  num_warps or (8 if n_lo else warps_bf16), num_stages,
                  "pask_decode_attention"), False)]
  return [(call(n_lo, 0, 0, lo_args, lo_specs, num_warps_lo, num_stages_lo,
                "pask_decode_attention_int4"), False),
          (call(0, n_hi, n_w, hi_args + w_args, hi_specs + w_specs, warps_bf16, num_stages,
                "pask_decode_attention"), False)]


@functools.partial(jax.jit, static_argnames=_KNOBS + _FUSED_KNOBS + _MERGE_KNOBS)
def decode_attention_gpu(q, window: Window, hi: HighPool, lo: LowPool, maps: PageMaps, layer=None,
                         **kw):
  """q [B, Hq, D] bf16 -> out [B, Hq, D] bf16 (see module doc).

  ``int4_kernel="fused"`` (opt-in; Hopper, an INT4 pool in the "int4" storage format, both
  pools' pages a multiple of 64 rows): ONE Mosaic GPU launch reads the INT4 and the BF16 pool
  (:func:`pallas_kernels.gpu.mgpu_mixed.partition_mixed`), the window's partial is jnp, one
  merge; knobs ``splits_lo``, ``splits_hi``, ``tile_hi``, ``stages_lo``, ``stages_hi``,
  ``auto_barriers``, ``scale``.
  ``"fused_reference"`` (or ``"fused"`` with ``interpret=True``): the kernel's jnp reference in
  its place (CPU tests of the glue).

  ``merge``: how the partial sets become the output. ``"kernel"`` (default): one Pallas Triton
  launch that reads each set in place and writes the bf16 output
  (:func:`pallas_kernels.gpu.merge.merge_kernel`; Pallas interpret mode with ``interpret=True``;
  per step 5 % faster than "sets" at the Qwen3-4B shape and 9 % at the 0.5B shape on an H100,
  bench/RESULTS.md); ``"sets"``: :func:`merge_sets`, each set read in place by XLA (~7 small
  fusions); ``"concat"``: ``common.merge`` over :func:`partials_gpu`'s concatenation (same-run
  comparisons)."""
  fused = {k: kw.pop(k) for k in _FUSED_KNOBS if k in kw}
  if kw.get("int4_kernel") in _FUSED:
    return _fused(q, window, hi, lo, maps, layer, **kw, **fused)
  if fused:
    raise ValueError(f"{sorted(fused)} are knobs of int4_kernel='fused' only")
  b, hq, d = q.shape
  g = hq // window.k.shape[-2]
  merge = kw.pop("merge", "kernel")
  if merge == "concat":     # the partials concatenated first (partials_gpu), then merged
    o, m, l = partials_gpu(q, window, hi, lo, maps, layer, **kw)
    out, _ = common.merge(o[:, :, :, :g], m[:, :, :, :g], l[:, :, :, :g], axis=2)
    return out.reshape(b, hq, d).astype(jnp.bfloat16)
  if merge not in _MERGES:
    raise ValueError(f"merge must be 'sets', 'concat' or 'kernel', got {merge!r}")
  # Each set merged where it lies (no concatenation of the partials, no transpose of the Mosaic
  # GPU kernel's O^T): fewer XLA fusions per layer than merging partials_gpu's output.
  sets = partial_sets(q, window, hi, lo, maps, layer, **kw)
  if merge == "kernel":     # one launch instead of those fusions
    return merge_kernel(sets, g, interpret=kw.get("interpret", False))
  out = merge_sets(sets, g)
  return out.reshape(b, hq, d).astype(jnp.bfloat16)


def _fused(q, window, hi, lo, maps, layer, *, int4_kernel, scale=None, interpret=False,
           splits_lo=None, **knobs):
  """``decode_attention_gpu`` with ``int4_kernel`` "fused" / "fused_reference" (``mgpu_mixed``)."""
  if any(k not in _FUSED_KNOBS for k in knobs):
    raise ValueError(f"int4_kernel={int4_kernel!r} takes the knobs scale, interpret, splits_lo, "
                     f"{', '.join(_FUSED_KNOBS)}; got {sorted(knobs)}")
  window, hi, lo, layer = stack_inputs(window, hi, lo, layer)
  c = common.default_scale(q.shape[-1], scale) * common.LOG2E
  out = mgpu_mixed.mixed_attention(q, window, hi, lo, maps, layer, c=c, splits_lo=splits_lo,
                                   reference=interpret or int4_kernel == "fused_reference",
                                   **knobs)
  return out.astype(jnp.bfloat16)
