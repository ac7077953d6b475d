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


def _fresh(cap=CAP, page=PAGE):
  return KC.init(NL, B, HKV, D, capacity=cap, window=W, sink=SINK, n_groups=G, page=page)


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
        for j, p in enumerate(hi):
          pg = int(maps.hi_pages[b, j // PAGE])
          np.testing.assert_array_equal(np.asarray(hp.k[pg, j % PAGE], np.float32),
                                        _bf16(brute.toks[b][p][0][l]))
          np.testing.assert_array_equal(np.asarray(hp.v[pg, j % PAGE], np.float32),
                                        _bf16(brute.toks[b][p][1][l]))
        for j, p in enumerate(lo):
          pg = int(maps.lo_pages[b, j // PAGE])
          for which, kv in ((0, lp.k), (1, lp.v)):
            x = _bf16(brute.toks[b][p][which][l])
            codes, s = int4.quantize_packed(jnp.asarray(x, jnp.bfloat16))
            np.testing.assert_array_equal(np.asarray(kv[pg, j % PAGE]), np.asarray(codes))
            np.testing.assert_array_equal(np.asarray(lp.scale[pg, j % PAGE, :, which]),
                                          np.asarray(s))
            deq = np.asarray(int4.dequantize(kv[pg, j % PAGE], lp.scale[pg, j % PAGE, :, which]))
            sc = np.asarray(lp.scale[pg, j % PAGE, :, which], np.float32)[:, None]
            assert np.all(np.abs(deq - x) <= sc / 2 * (1 + 1e-6))
        for p in win:
          s = p % W
          assert int(cache.win_pos[b, s]) == p
          np.testing.assert_array_equal(np.asarray(window.k[b, s], np.float32),
                                        _bf16(brute.toks[b][p][0][l]))
          np.testing.assert_array_equal(np.asarray(cache.win_act[b, s]), brute.toks[b][p][2])
        assert int(window.length[b]) == len(win)


def _run(seed, cap=CAP, page=PAGE, steps=STEPS):
  rng = np.random.default_rng(seed)
  cache, brute = _fresh(cap, page), Brute()
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


@settings(max_examples=6, deadline=None)
@given(st.integers(0, 2**20))
def test_matches_brute_force(seed):
  _run(seed)


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


def test_per_layer_split_equals_append():
  """The decode-step split (begin_step / write_layer / kernel_inputs) equals ``append``, and the
  kernel inputs feed the jnp reference kernel."""
  rng = np.random.default_rng(3)
  cache = _fresh()
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


def test_attention_sees_exactly_the_stored_keys():
  """Released tokens do not influence attention; window + pools reproduce a dense computation
  over the kept keys (H exact in BF16, L dequantized)."""
  rng = np.random.default_rng(5)
  cache, brute = _fresh(), Brute()
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


def test_prefill_in_layer_chunks_equals_whole():
  """prefill_rows + write_prefill a chunk of layers at a time (long prompts, bounded temporaries)
  stores exactly what materialize_prefill stores."""
  rng = np.random.default_rng(5)
  k = jnp.asarray(rng.standard_normal((NL, B, TP, HKV, D)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((NL, B, TP, HKV, D)), jnp.float32)
  plan = jnp.asarray(rng.integers(0, 3, (B, TP, G)), jnp.int8)
  lens = jnp.asarray([TP, TP - 3, 5], jnp.int32)
  want = _prefill(_fresh(), k, v, plan, lens)
  got, rows = jax.jit(KC.prefill_rows, static_argnums=2)(_fresh(), plan, TP, lens)
  write = jax.jit(KC.write_prefill, static_argnums=4)
  for start, stop in ((0, 1), (1, 3), (3, 4)):
    got = write(got, rows, k[start:stop], v[start:stop], start)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
