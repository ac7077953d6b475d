"""Baseline retention rules on hand-built attention patterns, their runners on a tiny random
model, and budget matching."""
import math

import jax.numpy as jnp
import numpy as np
import pytest

from pask_jax.testing import TINY
from models import random_model
from pask_jax.testing import cache as tcache
from pask_jax import ledger
from pask_jax.baselines import budget as BU
from pask_jax.baselines import h2o, int4, mikv, rocketkv, snapkv, streaming
from pask_jax.baselines.masked import Config, MaskedRunner, plan, qdq
from pask_jax.decode import PaskRunner, Runner, Sampling, generate
from pask_jax.sample import how_of

pytestmark = pytest.mark.fast_compile

RNG = np.random.default_rng()   # fresh randomness each run


class Tok:
  stop_ids = [0]

  def decode(self, ids):
    return " ".join(map(str, ids))


def arr(*xs):
  return [jnp.asarray(x) for x in xs]


# --- rules on hand-built patterns ----------------------------------------------------------------

def test_h2o_keeps_planted_heavy_hitters():
  S, n = 96, int(RNG.integers(60, 96))
  sink, recent = int(RNG.integers(1, 5)), int(RNG.integers(4, 12))
  score = RNG.random((3, S)).astype(np.float32) * 0.1
  mid = np.arange(sink, n - recent)
  planted = [RNG.choice(mid, 5, replace=False) for _ in range(3)]
  for r, p in enumerate(planted):
    score[r, p] += 1.0 + RNG.random(5)
  score[:, n:] = 10.0   # beyond the sequence: must never be kept
  cap = sink + recent + 5
  keep = np.asarray(h2o.select(*arr(score, [n] * 3, [sink] * 3, [recent] * 3, [cap] * 3)))
  for r in range(3):
    want = np.zeros(S, bool)
    want[:sink] = want[n - recent:n] = True
    want[planted[r]] = True
    assert (keep[r] == want).all()
  # a smaller capacity keeps the strongest planted ones first
  keep2 = np.asarray(h2o.select(*arr(score, [n] * 3, [sink] * 3, [recent] * 3, [cap - 2] * 3)))
  for r in range(3):
    top3 = planted[r][np.argsort(-score[r, planted[r]])[:3]]
    assert set(np.flatnonzero(keep2[r])) >= set(top3)
    assert keep2[r].sum() == cap - 2


def test_streaming_keeps_exactly_sinks_and_window():
  n, sink, w = int(RNG.integers(20, 80)), int(RNG.integers(0, 6)), int(RNG.integers(1, 15))
  keep = streaming.keep_mask(n, sink, w)
  assert set(np.flatnonzero(keep)) == set(range(min(sink, n))) | set(range(max(0, n - w), n))
  b = streaming.measured(n - 7, 7, sink, w)
  assert b["total_B"] == pytest.approx(keep.sum() / n)


def test_snapkv_keeps_what_the_window_attends_with_pooling():
  S, n, obs = 128, int(RNG.integers(90, 128)), int(RNG.integers(4, 12))
  vote = RNG.random(S).astype(np.float32) * 1e-3
  prefix = n - obs
  planted = np.sort(RNG.choice(np.arange(3, prefix - 3, 8), 4, replace=False))
  vote[planted] = 1.0 + RNG.random(4)
  for is_max in (True, False):
    for kernel in (1, 3, 5):
      h = kernel // 2
      cap = obs + 4 * kernel
      keep = np.asarray(snapkv.select(*arr(vote[None], [n], [obs], [kernel], [is_max], [cap])))[0]
      want = np.zeros(S, bool)
      want[prefix:n] = True
      for p in planted:
        want[p - h:p + h + 1] = True
      assert (keep == want).all(), (is_max, kernel)


def test_snapkv_max_pool_is_exact_for_every_kernel_and_ragged_prefix():
  """Max pooling by the sparse table: exactly the max over the window's prefix entries (-inf
  where it has none) for kernels 1-127 (RocketKV's 31-127 included), rows of ragged prefixes and
  different kernels in one call."""
  for S in (1, 6, 300):
    x = RNG.random((4, S)).astype(np.float32)
    n = RNG.integers(1, S + 1, 4)
    prefix = np.arange(S)[None] < n[:, None]
    ks = np.array([1, 31, 63, 127]) if S > 1 else np.array([1, 3, 5, 7])
    mx = np.asarray(snapkv.pool(*arr(x, prefix, ks, [True] * 4)))
    for r, k in enumerate(ks):
      for i in range(S):
        idx = [j for j in range(i - k // 2, i + k // 2 + 1) if 0 <= j < S and prefix[r, j]]
        assert mx[r, i] == (max(x[r, idx]) if idx else -np.inf), (S, k, i)


def test_snapkv_pool_matches_reference():
  S, n = 40, 33
  x = RNG.random(S).astype(np.float32)
  prefix = np.arange(S) < n
  for k in (3, 5, 7):
    mx = np.asarray(snapkv.pool(*arr(x[None], prefix[None], [k], [True])))[0]
    av = np.asarray(snapkv.pool(*arr(x[None], prefix[None], [k], [False])))[0]
    xp = np.where(prefix, x, 0)
    for i in range(n):
      idx = [j for j in range(i - k // 2, i + k // 2 + 1) if 0 <= j < n]
      assert mx[i] == pytest.approx(max(x[idx]))
      assert av[i] == pytest.approx(sum(xp[idx]) / k)


@pytest.mark.parametrize("g", [1, 2, 7])
def test_snapkv_window_votes_equal_the_full_probabilities_summed(g):
  """``window_votes`` (the window's queries alone) equals the column sums of the whole causal
  probability matrix over the window's rows, on fresh random inputs with ragged lengths (one
  shorter than the window, one filling the padded length)."""
  B, T, Hkv, D, obs = 3, 24, 2, 16, 7
  q = RNG.standard_normal((B, T, Hkv * g, D)).astype(np.float32)
  k = RNG.standard_normal((B, T, Hkv, D)).astype(np.float32)
  n = np.array([T, 5, 13], np.int32)
  got = np.asarray(snapkv.window_votes(*arr(q, k, n), obs))
  s = np.einsum("btkgd,bskd->bkgts", q.reshape(B, T, Hkv, g, D), k) / math.sqrt(D)
  pos, slot = np.arange(T)[:, None], np.arange(T)[None, :]
  want = np.zeros((B, Hkv, T), np.float64)
  for b in range(B):
    vis = (slot <= pos) & (slot < n[b])
    x = np.where(vis, s[b], -np.inf)
    p = np.exp(x - x.max(-1, keepdims=True))
    p = p / p.sum(-1, keepdims=True)
    rows = (np.arange(T) >= n[b] - obs) & (np.arange(T) < n[b])
    want[b] = (p * rows[None, None, :, None]).sum((1, 2))
  assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5
  assert np.all(got[1, :, 5:] == 0) and np.all(got[2, :, 13:] == 0)
  np.testing.assert_allclose(got.sum(-1), np.broadcast_to(np.minimum(n, obs)[:, None] * g,
                                                          (B, Hkv)), rtol=1e-5)


def test_mikv_planted_tokens_high_rest_low():
  S, n = 64, int(RNG.integers(40, 64))
  score = RNG.random(S).astype(np.float32) * 0.1
  planted = RNG.choice(np.arange(2, n - 4), 6, replace=False)
  score[planted] += 1
  keep, low = (np.asarray(x)[0] for x in mikv.select(*arr(score[None], [n], [2], [4], [12])))
  assert keep[:n].all() and not keep[n:].any()          # nothing evicted
  high = keep & ~low
  assert set(np.flatnonzero(high)) == set(range(2)) | set(range(n - 4, n)) | set(planted)
  q = BU.low_ratio(64)
  assert q == pytest.approx((4 * 128 + 32) / (16 * 128))
  assert mikv.high_ratio(0.5, q) + (1 - mikv.high_ratio(0.5, q)) * q == pytest.approx(0.5)
  with pytest.raises(ValueError):
    mikv.high_ratio(q - 0.01, q)


# --- runners on a tiny random model ---------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny():
  cfg = TINY["llama"]
  m = random_model(cfg, seed=int(RNG.integers(1 << 30)))
  prompts = [list(RNG.integers(1, cfg.vocab_size, int(n))) for n in RNG.integers(40, 100, 3)]
  full = Runner(m, batch=4, capacity=256)
  ref = generate(full, Tok(), prompts, sampling=Sampling(max_tokens=24))
  return m, prompts, ref, MaskedRunner(m, batch=4, capacity=256)


def test_masked_methods_equal_full_kv_at_b1(tiny):
  m, prompts, ref, mr = tiny
  for meth in ("h2o", "snapkv", "mikv", "rocketkv"):
    # RocketKV: every prompt entry kept (ratio 1) and a read budget over all of them
    out = generate(mr.configure(Config(meth, ratio=1.0, target=1.0, gen=0, read_frac=8.0)),
                   Tok(), prompts, sampling=Sampling(max_tokens=24))
    assert [o.tokens for o in out] == [r.tokens for r in ref], meth
    assert all(o.ledger["measured_B"] == 1.0 for o in out)
  assert mr.traces["step"] == 1 and mr.traces["compress"] == 1   # one compile for all methods


def test_masked_statistics_come_from_the_right_queries(tiny):
  """Each query's probabilities sum to 1 per query head: the accumulated prefill scores sum to
  (#queries counted)·G per (layer, head) — all prompt queries for H2O, the last obs for SnapKV."""
  m, prompts, _, mr = tiny
  from pask_jax.decode import pad_prompts
  tokens, lengths = pad_prompts(prompts, 4, 256)
  G = m.cfg.n_heads // m.cfg.n_kv_heads
  for meth, obs in (("h2o", 32), ("snapkv", 7), ("rocketkv", 7)):
    mr.configure(Config(meth, ratio=1.0, target=1.0, obs=obs))
    _, st = mr.begin(tokens, lengths)
    tot = np.asarray(st.score).sum(-1)                      # [L, B, Hkv]
    want = (lengths if meth == "h2o" else np.minimum(lengths, obs)) * G
    np.testing.assert_allclose(tot, np.broadcast_to(want[None, :, None], tot.shape), rtol=1e-4)


def test_h2o_runner_budget_and_protection(tiny):
  m, prompts, _, mr = tiny
  r, sink, recent = 0.35, 2, 6
  out = generate(mr.configure(Config("h2o", ratio=r, sink=sink, recent=recent)), Tok(), prompts,
                 sampling=Sampling(max_tokens=24))
  for o in out:
    n = o.ledger["n_prompt"] + o.ledger["n_gen"]
    assert o.ledger["measured_B"] == pytest.approx(h2o.kept_at_end(r, n, sink, recent) / n)
    assert abs(o.ledger["measured_B"] - r) <= 0.01 + 1 / n
  # protected positions of every layer and head are all still there
  from pask_jax.decode import pad_prompts
  tokens, lengths = pad_prompts(prompts, 4, 256)
  _, st = mr.begin(tokens, lengths)
  keep = np.asarray(st.keep)
  for b, n in enumerate(lengths[:3]):
    assert keep[:, b, :, :sink].all() and keep[:, b, :, n - recent:n].all()
    assert (keep[:, b].sum(-1) == max(math.ceil(r * n - 1e-4), sink + recent)).all()


def test_mikv_runner_low_rows_hold_quantized_values(tiny):
  m, prompts, _, mr = tiny
  from pask_jax.decode import pad_prompts
  tokens, lengths = pad_prompts(prompts, 4, 256)
  mr.configure(Config("mikv", ratio=1.0))
  _, ref = mr.begin(tokens, lengths)                 # ratio 1: nothing demoted, exact values
  mr.configure(Config("mikv", ratio=0.2, sink=2, recent=4))
  _, st = mr.begin(tokens, lengths)
  low, keep = np.asarray(st.low), np.asarray(st.keep)
  k, k0 = np.asarray(st.k), np.asarray(ref.k)
  assert low.any() and not np.asarray(ref.low).any()
  for b, n in enumerate(lengths[:3]):
    assert keep[:, b, :, :n].all()
    lw = np.swapaxes(low[:, b, :, :n], 1, 2)            # [L, n, Hkv]
    np.testing.assert_array_equal(k[:, b, :n][~lw], k0[:, b, :n][~lw])
    np.testing.assert_allclose(k[:, b, :n][lw], np.asarray(qdq(jnp.asarray(k0[:, b, :n][lw]))),
                               rtol=0, atol=1e-6)
    assert not np.allclose(k[:, b, :n][lw], k0[:, b, :n][lw])


def test_snapkv_runner_keeps_window_and_generated(tiny):
  m, prompts, _, mr = tiny
  obs, target, gen = 8, 0.5, 24
  out = generate(mr.configure(Config("snapkv", target=target, obs=obs, gen=gen)), Tok(), prompts,
                 sampling=Sampling(max_tokens=24))
  assert any(o.tokens for o in out)
  for o, p in zip(out, prompts):
    cap = snapkv.prompt_cap(target, len(p), obs, gen)
    if o.tokens:   # the random model may stop at once (stop id 0): no decode entries, B is NaN
      assert o.ledger["decode_B"] == 1.0
    assert o.ledger["prefill_B"] == pytest.approx(cap / len(p))


def test_rocketkv_runner_keeps_its_prompt_ratio_and_every_generated_entry(tiny):
  """RocketKV: ceil(r·n) prompt entries per (layer, KV head) after prefill, the observation
  window among them; generated entries all kept (decode B 1); the sparse reads change no stored
  byte, so B is the same at any read budget, and reading less changes what is generated."""
  m, prompts, ref, mr = tiny
  r, obs = 0.4, 8
  outs = {}
  for frac in (0.05, 0.5, 8.0):
    outs[frac] = generate(mr.configure(Config("rocketkv", ratio=r, obs=obs, kernel=31,
                                              read_frac=frac)), Tok(), prompts,
                          sampling=Sampling(max_tokens=24))
    for o, p in zip(outs[frac], prompts):
      cap = rocketkv.prompt_cap(r, len(p), obs)
      assert cap == max(obs, math.ceil(r * len(p)))
      assert o.ledger["prefill_B"] == pytest.approx(cap / len(p))
      if o.tokens:
        assert o.ledger["decode_B"] == 1.0
  # the same stored entries; a step that reads a few of them differs from one that reads all
  from pask_jax.decode import pad_prompts
  import jax
  tokens, lengths = pad_prompts(prompts, 4, 256)
  off = jnp.full((4, 4), -1, jnp.int32)
  args = (off, jnp.full((4,), -1, jnp.int32), jnp.ones((4,), bool),
          jnp.full((4, (m.cfg.vocab_size + 31) // 32), -1, jnp.int32), jax.random.key(0),
          jnp.zeros((4,), jnp.float32), jnp.ones((4,), jnp.float32),
          how_of(0.0, 1.0))   # greedy, as generate's steps above (one compile)
  step = {}
  for frac in (0.05, 8.0):
    mr.configure(Config("rocketkv", ratio=r, obs=obs, kernel=31, read_frac=frac))
    _, st = mr.begin(tokens, lengths)
    before = np.asarray(st.keep)      # the step donates the state
    _, logits, after = mr.advance_logits(st, jnp.ones((4,), jnp.int32), *args)
    step[frac] = (before, np.asarray(after.keep), np.asarray(logits))
  np.testing.assert_array_equal(step[0.05][0], step[8.0][0])
  np.testing.assert_array_equal(step[0.05][1], step[8.0][1])
  assert not np.allclose(step[0.05][2][:3], step[8.0][2][:3])
  keep = step[0.05][0]
  for b, n in enumerate(lengths[:3]):
    assert keep[:, b, :, n - obs:n].all() and not keep[:, b, :, n:].any()
  assert mr.traces["step"] == 1      # one compile with the other masked methods


def test_rocketkv_read_mask_matches_reference_on_ragged_stores():
  """The sketch's read set equals a per-(request, head) numpy reference for every GQA ratio of
  the test models, ragged stored sets, budgets below and above what is stored and any number of
  scored channels; it is a subset of the stored entries with min(budget, stored) of them, plus
  the current token."""
  for B, S, Hkv, G, D in ((3, 37, 2, 1, 8), (2, 64, 1, 7, 16), (4, 19, 2, 2, 8)):
    q = RNG.standard_normal((B, Hkv, G, D)).astype(np.float32)
    k = RNG.standard_normal((B, S, Hkv, D)).astype(np.float32)
    stored = RNG.random((B, Hkv, S)) < RNG.uniform(0.2, 0.9)
    cur = RNG.integers(0, S, B)
    stored[np.arange(B), :, cur] = True
    budget = RNG.integers(1, S + 8, B)
    top_r = RNG.integers(1, D + 1, B)
    got = np.asarray(rocketkv.read_mask(*arr(q, k, stored, cur, budget, top_r)))
    want, gap = rocketkv.read_mask_reference(q, k, stored, cur, budget, top_r, margin=True)
    # equal wherever float32 rounding cannot move an entry across the cut (its chunk's score
    # 1e-5 of the scale away from the last one read, or on the cut's own chunk)
    sure = (gap > 1e-5) | (gap == 0)
    np.testing.assert_array_equal(got[sure], want[sure])
    assert sure.mean() > 0.9
    assert not (got & ~stored).any()
    n = stored.sum(-1)
    lo = np.minimum(budget[:, None], n)
    assert ((got.sum(-1) == lo) | (got.sum(-1) == lo + 1)).all()
    assert got[np.arange(B), :, cur].all()


def test_rocketkv_config_and_budget():
  with pytest.raises(ValueError, match="max only"):
    Config("rocketkv", pool="avg")
  with pytest.raises(ValueError, match="kernel must be odd and <= 15 with avg"):
    Config("snapkv", pool="avg", kernel=31)
  Config("snapkv", pool="max", kernel=127)
  lengths = [(int(p), int(g)) for p, g in zip(RNG.integers(200, 600, 40), RNG.integers(20, 90, 40))]
  floor = rocketkv.predict_b(0.0, lengths, 32)      # the observation window + generated tokens
  for t in (floor + 0.05, floor + 0.2):
    r = plan("rocketkv", t, lengths, obs=32)
    assert 0 < r < 1 and abs(rocketkv.predict_b(r, lengths, 32) - t) < 0.01
  with pytest.warns(UserWarning, match="below the floor"):
    assert plan("rocketkv", floor - 0.03, lengths, obs=32) == 0.0


def test_streaming_and_int4_policies_on_the_pask_cache():
  """After prefill on the real PASK runner: sinks in the BF16 pool, the window in the ring, every
  other prompt token released (streaming) or in the INT4 pool (int4); B from the ledger."""
  from pask_jax.decode import pad_prompts
  cfg = TINY["qwen2"]
  m = random_model(cfg, seed=int(RNG.integers(1 << 30)))
  n, sink, w = int(RNG.integers(30, 60)), int(RNG.integers(1, 4)), int(RNG.integers(4, 10))
  prompt = list(RNG.integers(1, cfg.vocab_size, n))
  h, l = BU.entry_bits(cfg.head_dim)
  r = None
  for kind in ("streaming", "int4"):
    pol = (streaming.policy(cfg, sink=sink, window=w) if kind == "streaming"
           else int4.policy(cfg, sink=sink, window=w))
    if r is None:
      r = PaskRunner(m, pol, batch=1, capacity=128)
    r.policy = pol   # same static fields: one compilation for both
    tokens, lengths = pad_prompts([prompt], 1, 128)
    _, (cache, _, led) = r.begin(tokens, lengths)
    for g in range(pol.n_groups):
      pos = tcache.stored_positions(cache, g, 0)
      assert sorted(pos["hi"]) == list(range(sink))
      assert sorted(pos["lo"]) == ([] if kind == "streaming" else list(range(sink, n - w)))
      assert sorted(pos["win"]) == list(range(n - w, n))
    rep = ledger.summary(led, pol)[0]
    if kind == "streaming":
      # retained = what the real cache holds (sinks in the BF16 pool + the window)
      assert streaming.measured(n, 0, sink, w)["total_B"] == pytest.approx(rep["live_B"])
      assert rep["live_B"] == pytest.approx((sink + w) / n)
    else:
      assert rep["measured_B"] == pytest.approx((sink * h + (n - sink) * l) / (n * h))
  assert r.traces["commit"] == 1


# --- budget matching ------------------------------------------------------------------------------

def test_budget_matching_within_tolerance():
  lengths = [(int(p), int(g)) for p, g in zip(RNG.integers(200, 600, 40), RNG.integers(20, 90, 40))]
  q = BU.low_ratio(64)
  floor = mikv.predict_b(0.0, lengths, 4, 32, q)   # sinks + recent in BF16, the rest INT4
  assert q < floor < 0.45
  for target in RNG.uniform(floor + 0.005, 0.7, 3):
    r = plan("h2o", target, lengths, sink=4, recent=32)
    assert abs(h2o.predict_b(r, lengths, 4, 32) - target) <= 0.01
    h = plan("mikv", target, lengths, sink=4, recent=32, q=q)
    assert abs(mikv.predict_b(h, lengths, 4, 32, q) - target) <= 0.01
  # between q and the floor MiKV cannot reach the target: knob 0 with a warning naming the floor
  with pytest.warns(UserWarning, match="below the floor"):
    assert plan("mikv", 0.5 * (q + floor), lengths, sink=4, recent=32, q=q) == 0.0
    w = streaming.window_for(target, lengths, 4)
    got = np.mean([streaming.measured(p, g, 4, w)["total_B"] for p, g in lengths])
    assert abs(got - target) <= 0.01
    gen = float(np.mean([g for _, g in lengths]))
    assert abs(snapkv.predict_b(target, lengths, 32, gen) - target) <= 0.01
  with pytest.raises(ValueError):
    plan("h2o", 0.0, lengths)
  with pytest.raises(ValueError):
    plan("mikv", 0.2, lengths, q=q)
  assert BU.bisect(lambda x: x ** 2, 0.25) == pytest.approx(0.5, abs=1e-3)
