"""Ablation A5: the ``gated`` decode rule of Spherical KV (docs/SPHERICAL_KV.md §2.4;
:func:`pask_jax.spherical.rdr.gate`, ``SphRunner(decode="gated")``, method ``sphkv-gated``)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pask_jax.spherical import rdr
from pask_jax.spherical import variants as V
from pask_jax.spherical.runner import SphRunner, ladder
from pask_jax.testing import tiny_llama

pytestmark = pytest.mark.fast_compile

# per-item errors of drop and the paper ladder A2/A42/A4 for a unit-attention token (≈ 2·E[1−cos])
ERR = np.asarray([2.0, 0.22, 0.036, 0.015], np.float32)


def _cost():
  cost, _ = rdr.costs(ladder(16), [2])
  return cost                                                        # [1, 4], drop 0


def test_gate_follows_attention_where_the_fixed_rule_does_not():
  """Two leaving tokens, same keys, attention 1.0 vs 0.001: with an ample balance the fixed rule
  keeps both at the top tier; the gate keeps the attended one there and drops the other (its
  distortion no longer pays for the bytes at λ)."""
  cost = _cost()
  att = np.asarray([1.0, 1e-3], np.float32)
  dist = att[:, None, None, None] * ERR[None, None, None, :] * np.ones((2, 1, 2, 4), np.float32)
  lam = np.full((2, 1), 1e-4, np.float32)
  bal = np.full((2, 1), 1e6, np.float32)
  gate = jax.jit(rdr.gate)
  route, want, left = gate(dist, cost, lam, bal, jnp.ones((2,), bool))
  route = np.asarray(route)
  fixed_tier = np.max(np.where(cost[0, 1:] * 2 <= bal[:, :1], np.arange(1, 4), 0), axis=-1)
  assert fixed_tier.tolist() == [3, 3]                           # the fixed rule: top tier
  assert route[0].tolist() == [[3, 3]] and route[1].tolist() == [[0, 0]]
  assert np.allclose(np.asarray(left)[:, 0], bal[:, 0] - np.asarray([2 * cost[0, 3], 0.0]))
  # λ = 0: distortion alone decides, every item at the least-distorting tier
  r0, _, _ = gate(dist, cost, np.zeros_like(lam), bal, jnp.ones((2,), bool))
  assert np.asarray(r0).tolist() == [[[3, 3]], [[3, 3]]]


def test_gate_down_tiers_before_dropping_and_stays_in_the_balance():
  cost = _cost()
  c = cost[0]
  dist = np.broadcast_to(ERR, (4, 1, 2, 4)).astype(np.float32)
  # balances: everything fits / top tier too dear for both heads / only t1 / nothing fits
  bal = np.asarray([[2 * c[3]], [2 * c[2] + 1], [2 * c[1] + 1], [c[1] - 1]], np.float32)
  elig = jnp.asarray([True, True, True, True])
  route, want, left = rdr.gate(dist, cost, np.zeros((4, 1), np.float32), bal, elig)
  route, left = np.asarray(route), np.asarray(left)
  assert np.all(np.asarray(want) == 3)
  assert [r[0].tolist() for r in route] == [[3, 3], [2, 2], [1, 1], [0, 0]]
  assert np.all(left >= 0) and left[3, 0] == bal[3, 0]
  # a (token, group) that is not eligible keeps route 0 here and pays nothing
  r2, _, l2 = rdr.gate(dist[:1], cost, np.zeros((1, 1), np.float32), bal[:1],
                       jnp.zeros((1, 1), bool))
  assert np.asarray(r2).tolist() == [[[0, 0]]] and np.asarray(l2)[0, 0] == bal[0, 0]


def test_gated_runner_accumulates_window_attention_and_keeps_the_budget():
  """End to end on a tiny model: the method's runner, forced tokens through the window (each
  step adds at most one unit of mass per (group, head) to the window), measured B within the
  budget (no protection at decode: no debt), the balance never negative, one compile."""
  assert V.variant("sphkv-gated").decode == "gated" and "sphkv-gated" in V.METHODS
  with pytest.raises(ValueError, match="needs plan 'rdr'"):
    V.Variant("x", layouts=("A42",), plan="fixed", decode="gated")
  model = tiny_llama(61, seed=5)
  r = SphRunner.for_method(model, "sphkv-gated", batch=2, capacity=128, window=8, sink=2,
                           n_groups=2).configure(0.4)
  rng = np.random.default_rng(0)
  tokens = rng.integers(1, 61, (2, 64)).astype(np.int32)
  lengths = np.asarray([64, 40], np.int32)
  _, state = r.begin(tokens, lengths)
  B = 2
  off = jnp.asarray(np.full((B, 4), -1, np.int32))
  args = (off, jnp.full((B,), -1, jnp.int32), jnp.ones((B,), bool),
          jnp.asarray(np.full((B, 2), -1, np.int32)), jax.random.key(0),
          jnp.zeros((B,), jnp.float32), jnp.ones((B,), jnp.float32))
  prev = None
  for j in range(14):
    _, logits, state = r.advance_logits(state, jnp.asarray(rng.integers(1, 61, (B,)), jnp.int32),
                                        *args)
    att = np.asarray(state[1].win_att)                         # [B, W, G, H]
    assert np.all(att >= 0) and np.all(att.sum(axis=1) <= 8 + 1e-3)
    assert np.all(np.asarray(state[1].balance) >= -1e-3)
    prev = att
  assert prev.max() > 0
  rep = r.report(state)
  for x in rep:
    assert x["decode"] == "gated" and x["n_gen"] == 14
    assert x["decode_B"] <= 0.4 + 1e-6
    assert x["measured_B"] <= 0.4 + 1e-3 or x["deficit_bytes"] > 0
  assert r.traces["step"] == 1


def test_segment_weights_move_bytes_toward_the_heavier_segment():
  """Ablation A4's ω sweep (``sphkv-flat`` ω = (1, 1, 1), A0's (1, 1, 2), ``sphkv-recent4``
  (1, 1, 4)): at one binding budget, a heavier recent weight puts the last 64 prompt tokens'
  items on higher tiers (and the prefix's on lower ones) — never the other way — and the plan's
  bytes stay within the budget; bad weights are one-line errors."""
  assert V.variant("sphkv-flat").omega == (1.0, 1.0, 1.0)
  assert V.variant("sphkv-recent4").omega == (1.0, 1.0, 4.0)
  assert V.variant("spherical").omega == V.OMEGA == (1.0, 1.0, 2.0)
  for bad, msg in (((1, 1), "three positive"), ((1, 0, 2), "three positive"),
                   ((1, 1, float("nan")), "three positive"), ("abc", "three"),
                   ("112", "three numbers")):
    with pytest.raises(ValueError, match=f"^omega must be {msg}"):
      V.Variant("x", omega=bad)
  with pytest.raises(ValueError, match="need plan 'rdr'"):
    V.Variant("x", layouts=("A42",), plan="fixed", omega=(1, 1, 1))
  model = tiny_llama(61, seed=7)
  rng = np.random.default_rng(3)
  n = 160
  tokens = rng.integers(1, 61, (2, n)).astype(np.int32)
  lengths = np.asarray([n, n - 24], np.int32)
  mean_tier = {}
  for m in ("sphkv-flat", "spherical", "sphkv-recent4"):
    r = SphRunner.for_method(model, m, batch=2, capacity=192, window=8, sink=2,
                             n_groups=2).configure(0.3)
    _, _, _, plan, _ = r.prefill(tokens, lengths)
    route = np.asarray(plan.route).astype(np.int32)                       # [B, T, G, H]
    prot = np.asarray(plan.prot)
    assert np.all(np.asarray(plan.bytes) <= np.asarray(plan.budget) + 1e-3)
    per = []
    for b, ln in enumerate(lengths):
      free = ~prot[b, :ln]
      t = np.arange(ln)
      seg = {"prefix": (t >= 2) & (t < ln - 64), "recent": (t >= ln - 64) & (t < ln - 8)}
      per.append({k: route[b, :ln][free & s[:, None, None]].mean() for k, s in seg.items()})
    mean_tier[m] = {k: np.mean([p[k] for p in per]) for k in ("prefix", "recent")}
  flat, a0, r4 = mean_tier["sphkv-flat"], mean_tier["spherical"], mean_tier["sphkv-recent4"]
  assert flat["recent"] <= a0["recent"] + 1e-6 <= r4["recent"] + 2e-6
  assert flat["prefix"] + 1e-6 >= a0["prefix"] >= r4["prefix"] - 1e-6
  assert r4["recent"] - r4["prefix"] > flat["recent"] - flat["prefix"]      # the sweep moves it


def test_retrieved_marks_weigh_as_omega_says():
  """§2.4's retrieved segment: tokens a workload marks (``prefill(segments=)``) are priced with
  ω's middle weight.  Under A0 (ω = 1, 1, 2: retrieved weighs as the prefix) the marks change no
  route; under ``sphkv-retrieved`` (1, 2, 2) the marked tokens' items rise in tier and the
  unmarked prefix's never do, within the budget; unmarked, both plans are A0's.  Marks of the
  wrong length and marks for a runner that does not read them are one-line errors."""
  from pask_jax.decode import Runner, generate
  assert V.variant("sphkv-retrieved").omega == (1.0, 2.0, 2.0)
  model = tiny_llama(61, seed=7)
  rng = np.random.default_rng(5)
  n = 160
  tokens = rng.integers(1, 61, (2, n)).astype(np.int32)
  lengths = np.asarray([n, n - 24], np.int32)
  marks = [np.zeros(int(ln), bool) for ln in lengths]
  for m, (a, b) in zip(marks, ((20, 70), (40, 96))):
    m[a:b] = True
  routes = {}
  for meth in ("spherical", "sphkv-retrieved"):
    r = SphRunner.for_method(model, meth, batch=2, capacity=192, window=8, sink=2,
                             n_groups=2).configure(0.3)
    for marked in (False, True):
      plan = r.prefill(tokens, lengths, segments=marks if marked else None)[3]
      assert np.all(np.asarray(plan.bytes) <= np.asarray(plan.budget) + 1e-3)
      routes[meth, marked] = (np.asarray(plan.route).astype(np.int32), np.asarray(plan.prot))
  a0 = routes["spherical", False][0]
  np.testing.assert_array_equal(routes["spherical", True][0], a0)
  np.testing.assert_array_equal(routes["sphkv-retrieved", False][0], a0)
  (off, prot), (on, _) = routes["sphkv-retrieved", False], routes["sphkv-retrieved", True]
  rise = []
  for b, ln in enumerate(lengths):
    t = np.arange(ln)
    free = ~prot[b, :ln]
    prefix = (t >= 2) & (t < ln - 64) & ~marks[b]
    inside = free & marks[b][:, None, None]
    rise.append(on[b, :ln][inside].mean() - off[b, :ln][inside].mean())
    outside = free & prefix[:, None, None]
    assert on[b, :ln][outside].mean() <= off[b, :ln][outside].mean() + 1e-6
  assert min(rise) >= 0 and max(rise) > 0
  with pytest.raises(ValueError, match="^prompt 1's segment marks cover 160 tokens, its length "
                                       "is 136$"):
    r.prefill(tokens, lengths, segments=[marks[0], np.zeros(n, bool)])
  with pytest.raises(ValueError, match="^prompt_segments given, but Runner does not read"):
    generate(Runner(model, batch=2, capacity=192), None, [[1, 2, 3]],
             prompt_segments=[np.ones(3, bool)])
