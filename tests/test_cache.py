"""Cache invariants against a brute-force model of the token lifecycle (docs/DESIGN.md, B.2)."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from pallas_kernels import reference
from pallas_kernels.types import HighPool, LowPool, PageMaps, Window
from pask_jax import cache as KC
from pask_jax.testing import cache as tcache
from pallas_kernels import int4
from pask_jax import actions as Act

pytestmark = pytest.mark.fast_compile

# 4 layers -> groups [0,2), [2,3), [3,4): group 0 has two layers sharing maps.
NL, B, HKV, D, W, SINK, G = 4, 3, 2, 8, 4, 2, 3
TP, STEPS, CAP, PAGE = 9, 14, 24, 4
# The INT4 pool's two storage formats (pask_jax.cache module doc).
FORMATS = pytest.mark.parametrize("fmt", ["bytes", "int4"])


def _fresh(cap=CAP, page=PAGE, fmt="bytes"):
  return KC.init(NL, B, HKV, D, capacity=cap, window=W, sink=SINK, n_groups=G, page=page,
                 lo_format=fmt)


_prefill = jax.jit(KC.materialize_prefill)
_append = jax.jit(tcache.append)


class Brute:
  """Per sequence: every written token's (k, v, actions); state derived from scratch."""

  def __init__(self):
    self.toks = [[] for _ in range(B)]   # list of (k [NL, HKV, D] f32, v, act [G])

  def add(self, b, k, v, act):
    p = len(self.toks[b])
    act = np.full(G, Act.H) if p < SINK else np.asarray(act)
    self.toks[b].append((np.asarray(k, np.float32), np.asarray(v, np.float32), act))

  def expect(self, b, g):
    n = len(self.toks[b])
    win = list(range(max(0, n - W), n))
    hi = [p for p in range(max(0, n - W)) if self.toks[b][p][2][g] == Act.H]
    lo = [p for p in range(max(0, n - W)) if self.toks[b][p][2][g] == Act.L]
    return hi, lo, win


def _bf16(x):
  return np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32))


def _check(cache, brute):
  for b in range(B):
    n = len(brute.toks[b])
    assert int(cache.count[b]) == n and not bool(cache.overflow[b])
    for g in range(G):
      hi, lo, win = brute.expect(b, g)
      got = tcache.stored_positions(cache, g, b)
      assert got["hi"] == hi and got["lo"] == lo, (b, g, got, hi, lo)
      assert sorted(got["win"]) == win
      # every visible key exactly once, and exactly the non-released ones
      vis = got["hi"] + got["lo"] + got["win"]
      assert len(vis) == len(set(vis))
      assert set(vis) == set(range(n)) - {p for p in range(max(0, n - W))
                                          if brute.toks[b][p][2][g] == Act.R}
      for l in [l for l in range(NL) if cache.group_of[l] == g]:
        window, hp, lp, maps = tcache.layer_inputs(cache, l)
        codes = int4.pool_codes(lp.k, lp.v)         # token-major codes, either format
        scales = int4.pool_scales(lp.scale, lp.format)   # per row, either format
        for j, p in enumerate(hi):
          pg = int(maps.hi_pages[b, j // PAGE])
          np.testing.assert_array_equal(np.asarray(hp.k[pg, j % PAGE], np.float32),
                                        _bf16(brute.toks[b][p][0][l]))
          np.testing.assert_array_equal(np.asarray(hp.v[pg, j % PAGE], np.float32),
                                        _bf16(brute.toks[b][p][1][l]))
        for j, p in enumerate(lo):
          pg = int(maps.lo_pages[b, j // PAGE])
          for which in (0, 1):
            x = _bf16(brute.toks[b][p][which][l])
            want, s = int4.quantize(jnp.asarray(x, jnp.bfloat16))
            got = np.asarray(codes[which][pg, j % PAGE])
            np.testing.assert_array_equal(got, np.asarray(want))
            np.testing.assert_array_equal(np.asarray(scales[pg, j % PAGE, :, which]),
                                          np.asarray(s))
            sc = np.asarray(scales[pg, j % PAGE, :, which], np.float32)[:, None]
            deq = got * sc
            assert np.all(np.abs(deq - x) <= sc / 2 * (1 + 1e-6))
        for p in win:
          s = p % W
          assert int(cache.win_pos[b, s]) == p
          np.testing.assert_array_equal(np.asarray(window.k[b, s], np.float32),
                                        _bf16(brute.toks[b][p][0][l]))
          np.testing.assert_array_equal(np.asarray(cache.win_act[b, s]), brute.toks[b][p][2])
        assert int(window.length[b]) == len(win)


def _run(seed, cap=CAP, page=PAGE, steps=STEPS, fmt="bytes"):
  rng = np.random.default_rng(seed)
  cache, brute = _fresh(cap, page, fmt), Brute()
  lengths = rng.integers(0, TP + 1, B)
  lengths[0] = TP
  k = rng.normal(size=(NL, B, TP, HKV, D)).astype(np.float32) * 3
  v = rng.normal(size=(NL, B, TP, HKV, D)).astype(np.float32)
  plan = rng.integers(0, 3, (B, TP, G))
  cache = _prefill(cache, jnp.asarray(k), jnp.asarray(v), jnp.asarray(plan, jnp.int8),
                   jnp.asarray(lengths))
  for b in range(B):
    for t in range(lengths[b]):
      brute.add(b, k[:, b, t], v[:, b, t], plan[b, t])
  _check(cache, brute)
  history = [cache]
  for step in range(steps):
    kn = rng.normal(size=(NL, B, HKV, D)).astype(np.float32)
    vn = rng.normal(size=(NL, B, HKV, D)).astype(np.float32)
    act = rng.integers(0, 3, (B, G))
    active = rng.uniform(size=B) < 0.8
    cache = _append(cache, jnp.asarray(kn), jnp.asarray(vn), jnp.asarray(act, jnp.int8),
                    jnp.asarray(active))
    for b in range(B):
      if active[b]:
        brute.add(b, kn[:, b], vn[:, b], act[b])
    history.append(cache)
  _check(cache, brute)
  return history


@FORMATS
@settings(max_examples=6, deadline=None)
@given(st.integers(0, 2**20))
def test_matches_brute_force(fmt, seed):
  _run(seed, fmt=fmt)


def test_pools_only_grow_and_positions_survive():
  hist = _run(7, steps=10)
  for a, b in zip(hist, hist[1:]):
    for f in ("hi_len", "lo_len"):
      assert np.all(np.asarray(getattr(b, f)) >= np.asarray(getattr(a, f)))
    # stored entries are never rewritten: positions and pool rows of old entries unchanged
    for g in range(G):
      for bb in range(B):
        hl, ll = int(a.hi_len[g, bb]), int(a.lo_len[g, bb])
        assert np.array_equal(a.hi_pos[g, bb, :hl], b.hi_pos[g, bb, :hl])
        assert np.array_equal(a.lo_pos[g, bb, :ll], b.lo_pos[g, bb, :ll])
        for l in [l for l in range(NL) if a.group_of[l] == g]:
          for j in range(hl):
            pg = int(a.hi_pages[g, bb, j // PAGE])
            assert np.array_equal(a.layers.hi_k[l, pg, j % PAGE], b.layers.hi_k[l, pg, j % PAGE])
          for j in range(ll):
            pg = int(a.lo_pages[g, bb, j // PAGE])
            assert np.array_equal(a.layers.lo_k[l, pg, j % PAGE], b.layers.lo_k[l, pg, j % PAGE])
  # released positions leave gaps, and the surviving ones keep their absolute positions
  last = hist[-1]
  pos = tcache.stored_positions(last, 0, 0)
  assert pos["hi"] == sorted(pos["hi"]) and pos["lo"] == sorted(pos["lo"])


def test_sinks_forced_high():
  cache = _fresh()
  k = jnp.ones((NL, B, TP, HKV, D))
  plan = jnp.zeros((B, TP, G), jnp.int8)    # release everything
  cache = _prefill(cache, k, k, plan, None)
  for g in range(G):
    assert tcache.stored_positions(cache, g, 0)["hi"] == list(range(SINK))
    assert tcache.stored_positions(cache, g, 0)["lo"] == []


def test_overflow_is_flagged_not_clamped():
  cache = KC.init(NL, B, HKV, D, capacity=2, window=W, sink=0, n_groups=G, page=2)
  k = jnp.arange(NL * B * TP * HKV * D, dtype=jnp.float32).reshape(NL, B, TP, HKV, D)
  plan = jnp.full((B, TP, G), Act.H, jnp.int8)
  cache = _prefill(cache, k, k, plan, None)
  assert bool(jnp.all(cache.overflow))
  # the lengths count what was stored: a length past the pages sends the kernels' page-table
  # reads past the table (CUDA_ERROR_ILLEGAL_ADDRESS on the GPU)
  assert (np.asarray(cache.hi_len) == 2).all()
  # the two entries that fit are intact (no later write clamped onto them)
  assert tcache.stored_positions(cache, 0, 1)["hi"] == [0, 1]
  np.testing.assert_array_equal(np.asarray(cache.layers.hi_k[0, 1 * 1, 1], np.float32),
                                np.asarray(k[0, 1, 1], np.float32))


def test_compiles_once_across_appends():
  traces = []

  def step(cache, k, v, a):
    traces.append(1)
    return tcache.append(cache, k, v, a)

  f = jax.jit(step)
  cache = _fresh()
  z = jnp.zeros((NL, B, HKV, D))
  for i in range(CAP + W + 3):           # past the window, past capacity
    cache = f(cache, z + i, z - i, jnp.full((B, G), i % 3, jnp.int8))
  assert len(traces) == 1
  assert int(cache.count[0]) == CAP + W + 3


@FORMATS
def test_per_layer_split_equals_append(fmt):
  """The decode-step split (begin_step / write_layer / kernel_inputs) equals ``append``, and the
  kernel inputs feed the jnp reference kernel."""
  rng = np.random.default_rng(3)
  cache = _fresh(fmt=fmt)
  for i in range(W + 3):
    cache = _append(cache, jnp.asarray(rng.normal(size=(NL, B, HKV, D)), jnp.float32),
                    jnp.asarray(rng.normal(size=(NL, B, HKV, D)), jnp.float32),
                    jnp.asarray(rng.integers(0, 3, (B, G)), jnp.int8))
  kn = jnp.asarray(rng.normal(size=(NL, B, HKV, D)), jnp.float32)
  act = jnp.asarray(rng.integers(0, 3, (B, G)), jnp.int8)
  want = _append(cache, kn, kn, act)
  c2, plan = KC.begin_step(cache, act)
  q = jnp.asarray(rng.normal(size=(B, 2 * HKV, D)), jnp.float32)
  for l in range(NL):
    lkv = tcache.write_layer(tcache.layer_slice(c2, l), plan, c2.group_of[l], kn[l], kn[l])
    win, hi, lo, maps = KC.kernel_inputs(lkv, c2, c2.group_of[l])
    assert isinstance(win, Window) and isinstance(hi, HighPool) and isinstance(lo, LowPool)
    assert isinstance(maps, PageMaps)
    out = reference.decode_attention_reference(q, win, hi, lo, maps)
    assert out.shape == (B, 2 * HKV, D) and bool(jnp.all(jnp.isfinite(out.astype(jnp.float32))))
    c2 = tcache.set_layer(c2, l, lkv)
  for x, y in zip(jax.tree.leaves(c2), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  # The in-place form: write_step on the stacked arrays (traced layer, as in a scan over layers)
  # and attention on the stacked inputs with ``layer=``.
  c3, plan = KC.begin_step(cache, act)
  step = jax.jit(KC.write_step)
  for l in range(NL):
    c3 = step(c3, plan, jnp.int32(l), kn[l], kn[l])
    got = reference.decode_attention_reference(q, *KC.kernel_inputs(c3.layers, c3, c3.group_of[l]),
                                               jnp.int32(l))
    one = reference.decode_attention_reference(q, *tcache.layer_inputs(c3, l))
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(one, np.float32))
  for x, y in zip(jax.tree.leaves(c3), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  # What the decode step does: every layer's evicted row at once, then window-only writes.
  c4, plan = KC.begin_step(cache, act)
  c4 = jax.jit(KC.evict_step)(c4, plan)
  step = jax.jit(KC.write_step, static_argnames="evict")
  for l in range(NL):
    c4 = step(c4, plan, jnp.int32(l), kn[l], kn[l], evict=False)
  for x, y in zip(jax.tree.leaves(c4), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@FORMATS
def test_attention_sees_exactly_the_stored_keys(fmt):
  """Released tokens do not influence attention; window + pools reproduce a dense computation
  over the kept keys (H exact in BF16, L dequantized)."""
  rng = np.random.default_rng(5)
  cache, brute = _fresh(fmt=fmt), Brute()
  for i in range(W + 6):
    kn = rng.normal(size=(NL, B, HKV, D)).astype(np.float32)
    vn = rng.normal(size=(NL, B, HKV, D)).astype(np.float32)
    act = rng.integers(0, 3, (B, G))
    cache = _append(cache, jnp.asarray(kn), jnp.asarray(vn), jnp.asarray(act, jnp.int8))
    for b in range(B):
      brute.add(b, kn[:, b], vn[:, b], act[b])
  q = rng.normal(size=(B, 2 * HKV, D)).astype(np.float32)
  for l in range(NL):
    g = cache.group_of[l]
    out = np.asarray(reference.decode_attention_reference(
        jnp.asarray(q), *tcache.layer_inputs(cache, l)), np.float32)
    for b in range(B):
      hi, lo, win = brute.expect(b, g)
      ks, vs = [], []
      for p in hi + win:
        ks.append(_bf16(brute.toks[b][p][0][l]))
        vs.append(_bf16(brute.toks[b][p][1][l]))
      for p in lo:
        for lst, x in ((ks, brute.toks[b][p][0][l]), (vs, brute.toks[b][p][1][l])):
          lst.append(np.asarray(int4.dequantize(*int4.quantize_packed(
              jnp.asarray(x, jnp.bfloat16)))))
      kk, vv = np.stack(ks), np.stack(vs)                      # [S, HKV, D]
      qq = q[b].reshape(HKV, 2, D)
      sc = np.einsum("hgd,shd->hgs", qq, kk) / np.sqrt(D)
      pr = np.exp(sc - sc.max(-1, keepdims=True))
      pr /= pr.sum(-1, keepdims=True)
      ref = np.einsum("hgs,shd->hgd", pr, vv).reshape(2 * HKV, D)
      np.testing.assert_allclose(out[b], ref, atol=2e-2, rtol=2e-2)


@FORMATS
def test_prefill_in_layer_chunks_equals_whole(fmt):
  """prefill_rows + write_prefill a chunk of layers at a time (long prompts, bounded temporaries)
  stores exactly what materialize_prefill stores."""
  rng = np.random.default_rng(5)
  k = jnp.asarray(rng.standard_normal((NL, B, TP, HKV, D)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((NL, B, TP, HKV, D)), jnp.float32)
  plan = jnp.asarray(rng.integers(0, 3, (B, TP, G)), jnp.int8)
  lens = jnp.asarray([TP, TP - 3, 5], jnp.int32)
  want = _prefill(_fresh(fmt=fmt), k, v, plan, lens)
  got, rows = jax.jit(KC.prefill_rows, static_argnums=2)(_fresh(fmt=fmt), plan, TP, lens)
  write = jax.jit(KC.write_prefill, static_argnums=4)
  for start, stop in ((0, 1), (1, 3), (3, 4)):
    got = write(got, rows, k[start:stop], v[start:stop], start)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ---- the INT4 pool's storage formats ----------------------------------------------------------

def test_formats_have_their_shapes_and_bad_ones_are_named():
  for fmt, k, v, s, dt in (
      ("bytes", (NL, 9, 8, HKV, D // 2), (NL, 9, 8, HKV, D // 2), (NL, 9, 8, HKV, 2), jnp.uint8),
      ("int4", (NL, 9, HKV, 8, D), (NL, 9, HKV, D, 8), (NL, 9, HKV, 2, 8), jnp.int4)):
    c = KC.init(NL, B, HKV, D, capacity=24, window=W, page=4, lo_page=8, lo_format=fmt)
    assert c.lo_format == fmt and c.lo_page == 8 and c.page == 4
    assert c.layers.lo_k.shape == k and c.layers.lo_v.shape == v
    assert c.layers.lo_k.dtype == dt and c.layers.lo_v.dtype == dt
    assert c.layers.lo_s.shape == s and c.layers.lo_s.dtype == jnp.float16
    # Same bytes per row: D/2 per K and V row (int4 two to a byte) + 4 scale bytes.
    nbytes = lambda x: x.size * (0.5 if x.dtype == jnp.int4 else x.dtype.itemsize)
    assert nbytes(c.layers.lo_k) == NL * 9 * 8 * HKV * D // 2
  with pytest.raises(ValueError, match="^lo_format must be 'bytes' or 'int4', got 'nibbles'$"):
    KC.init(NL, B, HKV, D, capacity=24, window=W, lo_format="nibbles")
  with pytest.raises(ValueError, match="^lo_format must be"):
    KC.init_paged(NL, B, HKV, D, capacity=24, window=W, hi_pool_pages=4, lo_pool_pages=4,
                  lo_format="u4")


def _same_entries(a, b):
  """Two caches (any formats) hold the same state and the same INT4 entries in the same rows."""
  for f in ("win_pos", "win_act", "count", "hi_len", "lo_len", "hi_pos", "lo_pos", "overflow",
            "hi_pages", "lo_pages"):
    np.testing.assert_array_equal(np.asarray(getattr(a, f)), np.asarray(getattr(b, f)), f)
  for f in ("win_k", "win_v", "hi_k", "hi_v"):
    np.testing.assert_array_equal(np.asarray(getattr(a.layers, f)),
                                  np.asarray(getattr(b.layers, f)), f)
  rows = lambda c: int4.pool_scales(c.layers.lo_s, c.lo_format)     # per row, either format
  np.testing.assert_array_equal(np.asarray(rows(a)), np.asarray(rows(b)), "lo_s")
  for x, y in zip(tcache.lo_dequantized(a), tcache.lo_dequantized(b)):
    np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("lo_page", [4, 8])
def test_formats_store_the_same_entries_through_prefill_and_steps(lo_page):
  """Prefill, then decode steps by the in-place split (begin_step, evict_step, write_step
  without eviction) and by write_step with eviction: both formats hold the same codes and
  scales in the same rows, and the int4 pool's codes are exactly the bytes pool's unpacked."""
  rng = np.random.default_rng(11)
  k = jnp.asarray(rng.standard_normal((NL, B, TP, HKV, D)) * 2, jnp.float32)
  v = jnp.asarray(rng.standard_normal((NL, B, TP, HKV, D)), jnp.float32)
  plan = jnp.asarray(rng.integers(0, 3, (B, TP, G)), jnp.int8)
  lens = jnp.asarray([TP, 4, 7], jnp.int32)
  fresh = lambda fmt: KC.init(NL, B, HKV, D, capacity=CAP, window=W, sink=SINK, n_groups=G,
                              page=PAGE, lo_page=lo_page, lo_format=fmt)
  caches = {f: _prefill(fresh(f), k, v, plan, lens) for f in ("bytes", "int4")}
  _same_entries(caches["bytes"], caches["int4"])
  evict = jax.jit(KC.evict_step)
  write = jax.jit(KC.write_step, static_argnames="evict")
  for step in range(12):
    kn = jnp.asarray(rng.standard_normal((NL, B, HKV, D)), jnp.float32)
    vn = jnp.asarray(rng.standard_normal((NL, B, HKV, D)), jnp.float32)
    act = jnp.asarray(rng.integers(0, 3, (B, G)), jnp.int8)
    active = jnp.asarray(rng.uniform(size=B) < 0.8)
    for f, c in caches.items():
      c, p = KC.begin_step(c, act, active)
      if step % 2:
        c = evict(c, p)
      for l in range(NL):
        c = write(c, p, jnp.int32(l), kn[l], vn[l], evict=not step % 2)
      caches[f] = c
    _same_entries(caches["bytes"], caches["int4"])
  a, b = caches["bytes"].layers, caches["int4"].layers
  for x, y in zip(int4.pool_codes(a.lo_k, a.lo_v), int4.pool_codes(b.lo_k, b.lo_v)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  assert int(caches["int4"].lo_len.sum()) > 8                    # the INT4 pool really used
  q = jnp.asarray(rng.standard_normal((B, 2 * HKV, D)), jnp.float32)
  for l in range(NL):
    outs = [reference.decode_attention_reference(q, *tcache.layer_inputs(c, l))
            for c in caches.values()]
    np.testing.assert_array_equal(np.asarray(outs[0], np.float32), np.asarray(outs[1], np.float32))


def test_int4_rows_past_the_pool_are_dropped():
  """A full INT4 pool: prefill and decode rows that do not fit are dropped (overflow flagged),
  in both formats alike (the bytes cache stepped by ``testing.cache.append``, the int4 one by
  the in-place split), and no row of another page, sequence or layer is touched."""
  rng = np.random.default_rng(2)
  k = jnp.asarray(rng.standard_normal((NL, B, TP, HKV, D)), jnp.float32)
  steps = [jnp.asarray(rng.standard_normal((NL, B, HKV, D)), jnp.float32) for _ in range(3)]
  all_l = jnp.full((B, G), Act.L, jnp.int8)
  out = []
  for fmt in ("bytes", "int4"):
    c = KC.init(NL, B, HKV, D, capacity=3, window=W, sink=0, n_groups=G, page=2, lo_page=2,
                lo_format=fmt)                    # 2 INT4 pages = 4 rows per sequence
    c = _prefill(c, k, -k, jnp.full((B, TP, G), Act.L, jnp.int8), None)
    assert bool(jnp.all(c.overflow))              # 5 tokens left the window, 4 fit
    for kn in steps:
      if fmt == "bytes":
        c = tcache.append(c, kn, kn, all_l)
      else:
        c, p = KC.begin_step(c, all_l)
        c = KC.evict_step(c, p)
        for l in range(NL):
          c = KC.write_step(c, p, l, kn[l], kn[l], evict=False)
    assert (np.asarray(c.lo_len) == 4).all()      # 8 rows went to L: the 4 stored count
    out.append(c)
  _same_entries(*out)
  kq, vq = tcache.lo_dequantized(out[1])
  for b in range(B):              # sequence b owns pages 2b, 2b+1: its first 4 entries only
    for j in range(4):
      want = np.asarray(int4.dequantize(*int4.quantize_packed(k[:, b, j].astype(jnp.bfloat16))))
      np.testing.assert_array_equal(kq[:, 2 * b + j // 2, j % 2], want)
      np.testing.assert_array_equal(vq[:, 2 * b + j // 2, j % 2], -want)


def test_int4_format_step_lowers_for_cuda():
  """The decode step's writes on an int4-format pool (evict_step's stacked scatters, write_step
  with a traced layer) lower for the GPU, as int4 scatters (no pool conversion)."""
  c = KC.init(NL, B, HKV, 64, capacity=128, window=W, sink=SINK, n_groups=G, page=16,
              lo_page=64, lo_format="int4")
  act = jnp.ones((B, G), jnp.int8)
  kn = jnp.ones((B, HKV, 64), jnp.bfloat16)

  def step(c, l):
    c, p = KC.begin_step(c, act)
    c = KC.write_step(KC.evict_step(c, p), p, l, kn, kn, evict=False)
    return KC.write_step(c, p, l, kn, kn)

  text = jax.jit(step, donate_argnums=0).trace(c, jnp.int32(1)).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "scatter" in text and "xi4>" in text
