"""Random kernel inputs that honour the cache contract, for tests, compare-kernels and benches.

Never zeros: K/V are N(0, 1) (scaled per head so scores are not flat).  Everything the contract
calls invisible is poisoned -- NaN in BF16 slots beyond a length, NaN fp16 scales, garbage
page-table entries (out of range) beyond a sequence's pages -- so any leak of invisible data shows
as NaN.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import int4
from pallas_kernels.types import HighPool, LowPool, PageMaps, Window


@dataclasses.dataclass(frozen=True)
class Shape:
  b: int = 2
  hq: int = 8
  hkv: int = 2
  d: int = 128
  page: int = 16
  w: int = 32            # window slots
  lo_cap: int = 256      # max INT4 entries per sequence (multiple of page)
  hi_cap: int = 128      # max BF16 pool entries per sequence (multiple of page)

  @property
  def g(self) -> int:
    return self.hq // self.hkv


def make(shape: Shape, lo_len, hi_len, win_len, *, seed: int = 0, poison: bool = True,
         spare_pages: int = 3, lo_format: str = "bytes"):
  """Returns (q [B, Hq, D] bf16, Window, HighPool, LowPool, PageMaps); lengths are per sequence.

  ``lo_format``: the INT4 pool's storage format (``types.LowPool``).  "int4" holds exactly the
  codes (poison included) and scales of "bytes" for the same arguments, so one case compares
  across formats."""
  int4.check_format(lo_format)
  s = shape
  rng = np.random.default_rng(seed)
  lo_len = np.broadcast_to(np.asarray(lo_len, np.int32), (s.b,)).copy()
  hi_len = np.broadcast_to(np.asarray(hi_len, np.int32), (s.b,)).copy()
  win_len = np.broadcast_to(np.asarray(win_len, np.int32), (s.b,)).copy()
  assert (lo_len <= s.lo_cap).all() and (hi_len <= s.hi_cap).all() and (win_len <= s.w).all()
  n_lo, n_hi = s.lo_cap // s.page, s.hi_cap // s.page
  nan = np.nan if poison else 0.0

  def rows(*lead):
    # Per-head magnitudes differ so that quantization scales and softmax sharpness vary.
    mag = rng.uniform(0.5, 2.0, size=(s.hkv, 1))
    return rng.standard_normal((*lead, s.hkv, s.d)) * mag

  def tables(n_per_seq, lens):
    p_tot = s.b * n_per_seq + spare_pages
    perm = rng.permutation(p_tot)[: s.b * n_per_seq].reshape(s.b, n_per_seq)
    tbl = perm.astype(np.int32)
    used = np.zeros(p_tot, bool)
    for b in range(s.b):
      k = -(-int(lens[b]) // s.page)
      used[tbl[b, :k]] = True
      if poison:  # Entries past the sequence's pages are garbage, out of range included.
        tbl[b, k:] = rng.integers(-5, p_tot + 50, size=n_per_seq - k)
    return tbl, p_tot, used

  def mask_rows(x, tbl, lens, used, fill):
    """Poison every pool row that no sequence can see."""
    x = x.copy()
    vis = np.zeros(x.shape[:2], bool)
    for b in range(s.b):
      for j in range(int(lens[b])):
        vis[tbl[b, j // s.page], j % s.page] = True
    x[~vis] = fill
    return x

  # BF16 pool.
  hi_tbl, p_hi, hi_used = tables(n_hi, hi_len)
  khi = mask_rows(rows(p_hi, s.page), hi_tbl, hi_len, hi_used, nan)
  vhi = mask_rows(rows(p_hi, s.page), hi_tbl, hi_len, hi_used, nan)

  # INT4 pool, quantized with the project's own quantizer.
  lo_tbl, p_lo, lo_used = tables(n_lo, lo_len)
  klo_f = rows(p_lo, s.page)
  vlo_f = rows(p_lo, s.page)
  if p_lo:
    # A few all-zero rows exercise the "zero codes, scale 1" rule.
    klo_f[0, 0, 0] = 0.0
  kc, ks = _quantize(jnp.asarray(klo_f, jnp.float32))
  vc, vs = _quantize(jnp.asarray(vlo_f, jnp.float32))
  sc = np.stack([np.asarray(ks), np.asarray(vs)], axis=-1)      # [P, page, Hkv, 2] f16
  sc = mask_rows(sc, lo_tbl, lo_len, lo_used, np.float16(nan))
  kc, vc = np.asarray(kc), np.asarray(vc)
  if poison:
    kc = mask_rows(kc, lo_tbl, lo_len, lo_used, 0xFF)
    vc = mask_rows(vc, lo_tbl, lo_len, lo_used, 0xFF)

  # Window: the visible slots are a prefix.
  kw, vw = rows(s.b, s.w), rows(s.b, s.w)
  for b in range(s.b):
    kw[b, win_len[b]:] = nan
    vw[b, win_len[b]:] = nan

  q = rng.standard_normal((s.b, s.hq, s.d))
  bf = lambda x: jnp.asarray(x, jnp.float32).astype(jnp.bfloat16)
  window = Window(bf(kw), bf(vw), jnp.asarray(win_len))
  hi = HighPool(bf(khi), bf(vhi))
  kc, vc = jnp.asarray(kc, jnp.uint8), jnp.asarray(vc, jnp.uint8)
  if lo_format == "int4":        # the same codes (0xFF poison: -1s), head-major, V dim-major
    kc, vc = int4.pool_arrays(*int4.pool_codes(kc, vc), "int4")
  lo = LowPool(kc, vc, int4.scale_array(jnp.asarray(sc, jnp.float16), int4.format_of(kc)))
  maps = PageMaps(jnp.asarray(hi_tbl), jnp.asarray(hi_len), jnp.asarray(lo_tbl),
                  jnp.asarray(lo_len))
  return bf(q), window, hi, lo, maps


_quantize = jax.jit(int4.quantize_packed)


def visible_rows(window: Window, hi: HighPool, lo: LowPool, maps: PageMaps):
  """Per sequence, the explicitly listed visible keys and values in float64 (INT4 rows
  dequantized): [(k [S, Hkv, D], v [S, Hkv, D])] for b in range(B) — an independent oracle's
  reading of the pools, not the kernels' gather."""
  f = lambda x: np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)
  kw, vw, khi, vhi = f(window.k), f(window.v), f(hi.k), f(hi.v)
  sc = f(int4.pool_scales(lo.scale, lo.format))
  kcodes, vcodes = (np.asarray(x, np.float64) for x in int4.pool_codes(lo.k, lo.v))
  page_lo, page_hi = lo.page, hi.k.shape[1]
  hkv, d = window.k.shape[2], window.k.shape[3]
  out = []
  for b in range(window.k.shape[0]):
    ks, vs = [np.zeros((0, hkv, d))], [np.zeros((0, hkv, d))]
    for j in range(int(maps.lo_len[b])):
      p, r = int(maps.lo_pages[b, j // page_lo]), j % page_lo
      ks.append((kcodes[p, r] * sc[p, r, :, 0:1])[None])
      vs.append((vcodes[p, r] * sc[p, r, :, 1:2])[None])
    for j in range(int(maps.hi_len[b])):
      p, r = int(maps.hi_pages[b, j // page_hi]), j % page_hi
      ks.append(khi[p, r][None])
      vs.append(vhi[p, r][None])
    for j in range(int(window.length[b])):
      ks.append(kw[b, j][None])
      vs.append(vw[b, j][None])
    out.append((np.concatenate(ks), np.concatenate(vs)))
  return out


def naive(q, window: Window, hi: HighPool, lo: LowPool, maps: PageMaps, *, scale=None):
  """float64 numpy softmax over the explicitly listed visible keys (one independent oracle)."""
  q = np.asarray(q.astype(jnp.float32), np.float64)
  b_, hq, d = q.shape
  g = hq // window.k.shape[2]
  scale = 1 / np.sqrt(d) if scale is None else scale
  out = np.zeros((b_, hq, d))
  for b, (k, v) in enumerate(visible_rows(window, hi, lo, maps)):
    if not len(k):
      continue
    for h in range(hq):
      s = k[:, h // g] @ q[b, h] * scale
      p = np.exp(s - s.max())
      out[b, h] = p @ v[:, h // g] / p.sum()
  return out


def rel_err(out, ref) -> float:
  """||out - ref|| / ||ref|| in float64 (NaN anywhere -> inf)."""
  out = np.asarray(jnp.asarray(out).astype(jnp.float32), np.float64)
  ref = np.asarray(jnp.asarray(ref).astype(jnp.float32), np.float64)
  if not np.isfinite(out).all():
    return float("inf")
  return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def merged_f32(o, m, l, axis: int, hq: int, g: int | None = None):
  """Merge kernel partials to an FP32 [B, Hq, D] (drops padded query rows) for tight checks."""
  from pallas_kernels import common
  if g is not None:   # GPU layout [B, Hkv, NS, M, D]: keep the g real rows of each group
    o, m, l = o[..., :g, :], m[..., :g], l[..., :g]
  out, _ = common.merge(o, m, l, axis=axis)
  out = out.reshape(out.shape[0], -1, out.shape[-1])
  return out[:, :hq]


@functools.partial(jax.jit, static_argnames=("scale",))
def reference_f32(q, window, hi, lo, maps, *, scale=None):
  from pallas_kernels import reference
  o, m, l = reference.partials(q, window, hi, lo, maps, scale=scale)
  return merged_f32(o, m, l, axis=2, hq=q.shape[1])


def stack_layers(args):
  """One layer's inputs -> (q, window, hi, lo, maps) stacked on a leading axis of 3 layers that
  share the maps (as the layers of a group do) but hold different K/V: layer 0 as given, layer 1
  with K negated and the INT4 K/V codes and scales swapped, layer 2 with K and V swapped.  The
  poisoned (invisible) slots stay where they were."""
  q, win, hi, lo, maps = args
  kc, vc = int4.pool_codes(lo.k, lo.v)
  swap = LowPool(*int4.pool_arrays(vc, kc, lo.format), int4.scale_array(
      int4.pool_scales(lo.scale, lo.format)[..., ::-1], lo.format))
  layers = [(win.k, win.v, hi, lo), (-win.k, win.v, HighPool(-hi.k, hi.v), swap),
            (win.v, win.k, HighPool(hi.v, hi.k), swap)]
  st = lambda *xs: jnp.stack(xs)
  wk, wv, shi, slo = jax.tree.map(st, *layers)
  return q, Window(wk, wv, win.length), shi, slo, maps


def layer_of(stacked, layer: int):
  """Layer ``layer`` of ``stack_layers``'s output as one layer's inputs."""
  q, win, hi, lo, maps = stacked
  pick = lambda t: type(t)(*(x[layer] for x in t))
  return q, Window(win.k[layer], win.v[layer], win.length), pick(hi), pick(lo), maps


@dataclasses.dataclass(frozen=True)
class Case:
  """A kernel test case: a shape and per-sequence lengths (lo, hi, win)."""
  name: str
  shape: Shape
  lo: tuple
  hi: tuple
  win: tuple
  spare_pages: int = 3

  def make(self, seed: int = 0, poison: bool = True, lo_format: str = "bytes"):
    return make(self.shape, self.lo, self.hi, self.win, seed=seed, poison=poison,
                spare_pages=self.spare_pages, lo_format=lo_format)


# Ragged lengths: 0, 1, and non-multiples of every page and block size; every GQA ratio of the
# issue (1, 2, 4, 7, 8), head_dim 64 and 128, page 1 (dense), a non-power-of-two page, empty
# partitions, and a pool that does not exist at all (P = 0).
CASES = [
    Case("g1_d64", Shape(b=3, hq=2, hkv=2, d=64, page=16, w=24, lo_cap=288, hi_cap=96),
         (0, 1, 287), (95, 0, 17), (1, 24, 13)),
    Case("g2_d128_p8", Shape(b=2, hq=4, hkv=2, d=128, page=8, w=40, lo_cap=200, hi_cap=64),
         (199, 9), (1, 63), (40, 1)),
    Case("g4_d128", Shape(b=2, hq=16, hkv=4, d=128, page=16, w=32, lo_cap=512, hi_cap=160),
         (500, 33), (160, 2), (7, 32)),
    Case("g7_d64", Shape(b=2, hq=14, hkv=2, d=64, page=16, w=32, lo_cap=320, hi_cap=64),
         (319, 65), (0, 50), (32, 5)),
    Case("g8_d128_page1", Shape(b=2, hq=8, hkv=1, d=128, page=1, w=16, lo_cap=70, hi_cap=40),
         (70, 3), (39, 0), (16, 2)),
    Case("g4_d64_page12_hkv3", Shape(b=2, hq=12, hkv=3, d=64, page=12, w=20, lo_cap=144,
                                     hi_cap=48), (143, 0), (13, 48), (20, 1)),
    Case("no_lo_pool", Shape(b=2, hq=8, hkv=2, d=64, page=16, w=16, lo_cap=0, hi_cap=96),
         (0, 0), (90, 17), (3, 16), spare_pages=0),
    Case("no_hi_pool_empty_window", Shape(b=2, hq=8, hkv=2, d=128, page=16, w=16, lo_cap=96,
                                          hi_cap=0), (96, 41), (0, 0), (0, 0), spare_pages=0),
]


def paged_pool(batch: int, hkv: int, d: int, n: int, page: int, *, n_pad: int, seed: int = 0):
  """An INT4 low pool for ``n`` keys per sequence as the cache stores it (uint8 half-split
  ``[P, page, Hkv, D/2]``, one spare page per sequence, pages handed out in shuffled order),
  its page table ``[batch, n / page]``, head-major K scales ``[Hkv, P, page]`` and q
  ``[batch * Hkv, n_pad, D]`` (mgpu_qk's integration probe)."""
  n_pages = n // page
  pages = batch * (n_pages + 1)
  kq, kk, ks_, kp = jax.random.split(jax.random.key(seed), 4)
  codes = jax.random.randint(kk, (pages, page, hkv, d), -7, 8, jnp.int32).astype(jnp.int8)
  pool = int4.pack(codes)
  tbl = jax.random.permutation(kp, pages)[:batch * n_pages].reshape(batch, n_pages)
  tbl = tbl.astype(jnp.int32)
  ks = jax.random.uniform(ks_, (hkv, pages, page), jnp.float32, 0.01, 0.1)
  q = jax.random.normal(kq, (batch * hkv, n_pad, d), jnp.float32).astype(jnp.bfloat16)
  return q, pool, tbl, ks
