"""Alg. 2: hand-worked demote/promote order, candidates, stop tokens, and properties."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.extra import numpy as hnp

from pask_jax import controller as C
from pask_jax import policy as P
from pask_jax import tags as T
from pask_jax import actions as Act

pytestmark = pytest.mark.fast_compile

R, L, H = Act.R, Act.L, Act.H
# 3 layers, 1 KV head, d = 8: per group n_c = 16, k_c = 2 -> m(H) = 256, m(L) = 64 + 32 = 96.
MODEL = {"n_layers": 3, "n_kv_heads": 1, "head_dim": 8}
CRIT = T.fc(T.Cls.SCHEMA_BEARING, T.FCRole.REQUIRED, T.FCState.CRITICAL, T.Next.NO_LOOKAHEAD)
PLAIN = T.fc(T.Cls.SCHEMA_BEARING, T.FCRole.REQUIRED, T.FCState.BOUNDARY, T.Next.NO_LOOKAHEAD)
PRIO = [[1.0, 5.0], [2.0, 3.0], [4.0, 0.5]]   # per group: ρ(R→L), ρ(L→H)

_control = jax.jit(C.control)


def _pol(entries, **kw):
  return P.build(entries, MODEL, **kw)


@pytest.fixture(scope="module")
def hand():
  return _pol({CRIT: P.Entry([H, H, H], [R, L, R], PRIO),
               PLAIN: P.Entry([R, R, R], [R, R, R], PRIO),
               T.fc(T.Cls.PURE_SCAFFOLD): P.Entry([L, L, L], [R, R, R], PRIO)})


def test_cost_model_hand(hand):
  np.testing.assert_array_equal(np.asarray(hand.cost), [[0] * 3, [96] * 3, [256] * 3])
  assert float(hand.c_full) == 768


@pytest.mark.parametrize("budget,expect", [
    # demotion keys: H→L uses ρ(L→H) = 5, 3, 0.5; L→R uses ρ(R→L) = 1, 2, 4 (floors R, L, R)
    (768, [H, H, H]),     # fits, nothing to do (promotion has nothing left either)
    (700, [H, H, L]),     # g2 H→L (0.5): 608
    (500, [H, L, L]),     # then g1 H→L (3): 448
    (400, [H, L, R]),     # then g2 L→R (4): 352
    (300, [L, L, R]),     # then g0 H→L (5): 192
    (100, [R, L, R]),     # then g0 L→R (1): 96, = floors
    (0, [R, L, R]),       # floors beat the budget
])
def test_demote_order(hand, budget, expect):
  a, nb = _control(hand, T.candidates(CRIT), -1, jnp.float32(budget))
  assert a.tolist() == expect
  m = float(C.total_cost(hand, a))
  assert float(nb) == pytest.approx(budget - m + float(hand.allowance))


@pytest.mark.parametrize("budget,crit,expect", [
    # promotion order by ρ desc: g2 R→L (4), g1 R→L (2), g1 L→H (3), g0 R→L (1), g2 L→H (0.5)
    (300, True, [R, L, L]),      # 96, 192, then g1 L→H (+160 -> 352) misfits: stop
    (400, True, [R, H, L]),      # ... 352, then g0 R→L (+96 -> 448) misfits: stop
    (500, True, [L, H, L]),      # 448
    (10_000, True, [H, H, H]),   # everything fits
    (10_000, False, [R, R, R]),  # not critical: no promotion
])
def test_promote_order(hand, budget, crit, expect):
  tag = CRIT if crit else PLAIN
  pol = hand
  if crit:  # same entry as PLAIN (RRR / RRR) on the critical tag
    pol = _pol({CRIT: P.Entry([R, R, R], [R, R, R], PRIO)})
  a, _ = _control(pol, T.candidates(tag), -1, jnp.float32(budget))
  assert a.tolist() == expect


def test_reserve_lowers_budget_and_pooled_fallback():
  pol = _pol({CRIT: P.Entry([H, H, H], [R, L, R], PRIO)}, reserve={3: 268 / 768}, pooled=68 / 768)
  # state 3: B = 768 - 268 = 500 -> H L L
  assert _control(pol, T.candidates(CRIT), 3, jnp.float32(768))[0].tolist() == [H, L, L]
  # unseen states (-1, 0, 99) use the pooled 68 -> B = 700 -> H H L
  for s in (-1, 0, 99):
    assert _control(pol, T.candidates(CRIT), s, jnp.float32(768))[0].tolist() == [H, H, L]
  # negative balance: B_t clamps at 0 -> floors
  assert _control(pol, T.candidates(CRIT), 3, jnp.float32(-5e3))[0].tolist() == [R, L, R]


def test_candidates_resolution(hand):
  scaf = T.fc(T.Cls.PURE_SCAFFOLD, T.FCRole.SCAFFOLD_SEPARATOR)   # -> parent fc(pure_scaffold)
  # unique candidate: its own entry (via the parent chain), demotable to floors R R R
  assert _control(hand, T.candidates(scaf), -1, jnp.float32(0))[0].tolist() == [R, R, R]
  # two candidates: action = floor = max(LLL, RRR, HHH, RLR) = HHH; budget cannot undo it
  assert _control(hand, T.candidates(scaf, CRIT), -1, jnp.float32(0))[0].tolist() == [H, H, H]
  # two candidates whose max is below H: LLL; critical but not unique -> no promotion
  a, _ = _control(hand, T.candidates(scaf, PLAIN), -1, jnp.float32(1e9))
  assert a.tolist() == [L, L, L]
  # pads only, unknown ids, malformed ids, ids without any compatible entry -> H
  for ids in (T.candidates(), T.candidates(T.N_IDS + 5), T.candidates(int(T.pack(0, 0))),
              T.candidates(T.sql(T.Cls.FREE_GENERATION))):
    assert _control(hand, ids, -1, jnp.float32(0))[0].tolist() == [H, H, H]
  # pads anywhere are ignored
  ids = np.array([T.PAD, scaf, T.PAD, T.PAD], np.int32)
  assert _control(hand, ids, -1, jnp.float32(0))[0].tolist() == [R, R, R]


def test_stop_charges_nothing(hand):
  a, nb = _control(hand, T.candidates(T.STOP), -1, jnp.float32(123.5))
  assert a.tolist() == [R, R, R] and float(nb) == 123.5
  a, nb = jax.jit(C.control)(hand, T.candidates(CRIT), -1, jnp.float32(123.5), True)
  assert a.tolist() == [R, R, R] and float(nb) == 123.5


def test_all_high_policy_is_lossless():
  pol = P.all_high(MODEL)
  assert float(pol.allowance) == float(pol.c_full) == 768
  bal = C.initial_balance(pol)
  for tag in (CRIT, PLAIN, T.fc(T.Cls.PURE_SCAFFOLD), T.PAD):
    a, bal = _control(pol, T.candidates(tag), -1, bal)
    assert a.tolist() == [H, H, H] and float(bal) == 768     # R_t = b forever


# ---- properties -------------------------------------------------------------------------------

G = 3
NT = 24   # tokens per hypothesis example
IDS = np.asarray(T.all_ids(T.Family.FC)[:40], np.int32)


def _random_policy(seed: int, b_d: float) -> P.FrozenPolicy:
  rng = np.random.default_rng(seed)
  base = P.all_high(MODEL)
  fl = rng.integers(0, 3, (T.N_IDS, G))
  act = np.maximum(fl, rng.integers(0, 3, (T.N_IDS, G)))
  prio = rng.uniform(0, 10, (T.N_IDS, G, 2)).astype(np.float32)
  prio[rng.uniform(size=prio.shape) < 0.2] = np.nan
  return base.replace(action=jnp.asarray(act, jnp.int8), floor=jnp.asarray(fl, jnp.int8),
                      prio=jnp.asarray(prio), crit=jnp.asarray(rng.uniform(size=T.N_IDS) < 0.4),
                      reserve=jnp.asarray(rng.uniform(0, 0.5, 5), jnp.float32),
                      pooled=jnp.float32(0.2), b_d=jnp.float32(b_d))


@jax.jit
def _run(pol, tag_ids, states, stops):
  """Scan Alg. 2 over a token sequence: per-token actions, balances before each token."""
  def step(bal, x):
    ids, s, stop = x
    a, nb = C.control(pol, ids, s, bal, stop)
    return nb, (a, bal)
  return jax.lax.scan(step, C.initial_balance(pol), (tag_ids, states, stops))


_cands = hnp.arrays(np.int32, (NT, T.N_CAND),
                    elements=st.sampled_from([*IDS.tolist(), T.PAD, T.PAD, T.PAD, T.N_IDS + 1]))


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), b_d=st.sampled_from([0.0, 0.1, 0.3, 0.6, 1.0, 1.5]),
       cands=_cands, states=hnp.arrays(np.int32, (NT,), elements=st.integers(-1, 7)),
       stops=hnp.arrays(bool, (NT,), elements=st.sampled_from([False] * 7 + [True])))
def test_properties(seed, b_d, cands, states, stops):
  pol = _random_policy(seed, b_d)
  final, (acts, bals) = _run(pol, cands, states, stops)
  acts, bals = np.asarray(acts, np.int64), np.asarray(bals, np.float64)
  cost = np.asarray(pol.cost, np.float64)
  b = float(pol.allowance)
  action, floor, prio = (np.asarray(x) for x in (pol.action, pol.floor, pol.prio))
  spent, n = 0.0, 0
  for t in range(NT):
    ids = [int(i) for i in cands[t] if i >= 0]
    known = [i for i in ids if i < T.N_IDS]
    if stops[t]:
      assert acts[t].tolist() == [R] * G
    else:
      # Prop. 1: floors never violated (multi-candidate floor = max of actions and floors)
      if not ids:
        fl = np.full(G, H)
      elif len(ids) == 1:
        fl = floor[ids[0]] if known else np.full(G, H)
      else:
        fl = np.max([np.maximum(action[i], floor[i]) if i < T.N_IDS else np.full(G, H)
                     for i in ids], axis=0)
      assert np.all(acts[t] >= fl), (t, acts[t], fl)
      if len(ids) != 1:
        assert np.all(acts[t] == fl)        # conservative resolution is final
      # budget: either the cost fits B_t, or only floors remain
      s = int(states[t])
      gamma = (float(pol.reserve[s]) if 0 <= s < pol.reserve.shape[0] else float(pol.pooled))
      bt = max(bals[t] - gamma * float(pol.c_full), 0.0)
      m = cost[acts[t], np.arange(G)].sum()
      if m > bt * (1 + 1e-6) + 1e-3:
        assert np.all(acts[t] == fl), (t, m, bt)    # over budget only when floors remain
    # B.6 closed form: R_t = t·b − Σ_{i<t} M(a_i), t counting non-stop tokens from 1
    n += 0 if stops[t] else 1
    assert bals[t] == pytest.approx(_closed(n, stops[t], b, spent), rel=1e-5,
                                    abs=1e-2 * max(b, 1.0))
    if not stops[t]:
      spent += cost[acts[t], np.arange(G)].sum()
  assert float(final) == pytest.approx(_closed(n + 1, False, b, spent), rel=1e-5,
                                       abs=1e-2 * max(b, 1.0))


def _closed(n_nonstop_through_t: int, is_stop: bool, b: float, spent: float) -> float:
  """R_t before token t: (number of non-stop tokens up to and including t, or the next one if t is
  a stop token, which receives no allowance of its own) · b − spent."""
  k = n_nonstop_through_t + (1 if is_stop else 0)
  return k * b - spent


def test_history_independent_cost():
  """The per-token controller is one fixed program: tracing it inside a scan over any history
  length gives the same body, and a whole run compiles once."""
  pol = P.demo(MODEL)
  traces = []

  def ctl(pol, ids, s, bal):
    traces.append(1)
    return C.control(pol, ids, s, bal)

  f = jax.jit(ctl)
  bal = C.initial_balance(pol)
  rng = np.random.default_rng(0)
  for t in range(60):
    ids = T.candidates(int(rng.choice(IDS)))
    _, bal = f(pol, ids, int(rng.integers(-1, 4)), bal)
  assert len(traces) == 1

  def body_text(n):
    def run(pol, ids, bal):
      def step(b, i):
        a, nb = C.control(pol, i, -1, b)
        return nb, a
      return jax.lax.scan(step, bal, ids)
    jaxpr = jax.make_jaxpr(run)(pol, jnp.zeros((n, 4), jnp.int32), bal)
    scan = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"][0]
    return str(scan.params["jaxpr"])

  assert body_text(8) == body_text(512)
  single = jax.make_jaxpr(lambda p, i, b: C.control(p, i, -1, b))(pol, jnp.zeros(4, jnp.int32), bal)
  # Fixed size: the loops in closed form, O(G²) elementwise ops (~1.1K equations at G = 3;
  # they fuse into a few kernels: tests/test_gpu_merge.py)
  assert len(single.jaxpr.eqns) < 1500


def test_batch_vmap(hand):
  ids = np.stack([T.candidates(CRIT), T.candidates(PLAIN), T.candidates(T.STOP)])
  a, nb = jax.jit(C.control_batch)(hand, ids, jnp.asarray([-1, -1, -1]),
                                    jnp.asarray([400.0, 400.0, 7.0]))
  assert a.tolist() == [[H, L, R], [R, R, R], [R, R, R]]
  assert nb.tolist() == [400 - 352 + 768, 400 + 768, 7.0]


# ---- prefill companion ------------------------------------------------------------------------

LAB = T.prompt(T.PromptLabel.PARAMETER_KEY)
LAB2 = T.prompt(T.PromptLabel.SCHEMA_SCAFFOLD)


def _prefill_pol(b_p, sink=0):
  return _pol({LAB: P.Entry([H, H, H], [R, R, L], PRIO), LAB2: P.Entry([L, L, L], [L, R, R], None)},
              b_p=b_p, sink=sink)


@pytest.mark.parametrize("b_p,sink,expect,excess", [
    # upgrade keys: g1 (2, chain min(2,3)=2) > g0 (1, min(1,5)=1) > g2 L→H (0.5); ties by position
    (0.5, 0, [[R, H, L], [R, H, L]], 0.0),       # 192 +96+160 +96+160 = 704; next +96 misfits
    (1.0, 0, [[H, H, H], [H, H, H]], 0.0),       # everything fits exactly (1536)
    (0.05, 0, [[R, R, L], [R, R, L]], 192 - 76.8),  # floors beat the budget; excess recorded
    (0.75, 1, [[H, H, H], [R, H, L]], 0.0),      # sink H (768) + 96 + 96 + 160 = 1120 <= 1152
])
def test_prefill_plan_hand(b_p, sink, expect, excess):
  pol = _prefill_pol(b_p, sink)
  plan, ex = jax.jit(C.plan_prefill)(pol, np.stack([T.stack_candidates([[LAB], [LAB]])]))
  assert plan[0].tolist() == expect
  assert float(ex[0]) == pytest.approx(excess, abs=1e-3)


def test_prefill_plan_candidates_padding_budget():
  pol = _prefill_pol(0.6)
  cands = np.stack([T.stack_candidates([[LAB, LAB2], [LAB], [LAB2], [LAB]]),
                    T.stack_candidates([[LAB], [LAB], [LAB], [LAB]])])
  plan, _ = jax.jit(C.plan_prefill)(pol, cands, jnp.asarray([4, 2]))
  plan = np.asarray(plan)
  assert plan[0, 0].tolist() == [H, H, H]      # cross-label: max of actions and floors, fixed
  assert plan[0, 2].tolist() == [L, R, R]      # no scores: floors only
  assert plan[1, 2:].tolist() == [[R] * 3] * 2  # padding rows
  cost = np.asarray(pol.cost)
  for b, n in ((0, 4), (1, 2)):
    used = sum(cost[plan[b, t], np.arange(3)].sum() for t in range(n))
    floors = sum(cost[np.asarray(C.resolve(pol, cands[b, t])[1]), np.arange(3)].sum()
                 for t in range(n))
    assert used <= max(0.6 * n * 768, floors) + 1e-3


def test_control_batch_has_no_loop(hand):
  """Alg. 2's loops are in closed form: a rolled loop is a `while` thunk that the GPU runtime
  steps from the host outside the decode step's CUDA graphs (issue 24)."""
  B = 4
  text = jax.jit(C.control_batch).lower(
      hand, jnp.broadcast_to(T.candidates(CRIT), (B, T.N_CAND)), jnp.full((B,), -1, jnp.int32),
      jnp.full((B,), 300.0, jnp.float32)).as_text()
  assert "while" not in text


# ---- against a plain-Python Alg. 2 (the module docstring, step by step) -------------------------


def _alg2(pol, ids, state, bal, stop):
  """One token of Alg. 2 in NumPy, loops written as the paper reads."""
  act, fl_t, pr_t = (np.asarray(x) for x in (pol.action, pol.floor, pol.prio))
  crit_t, cost = np.asarray(pol.crit), np.asarray(pol.cost, np.float64)
  G = cost.shape[1]
  ids = [int(i) for i in ids]
  if stop or T.STOP in ids:
    return [R] * G, bal
  valid = [i for i in ids if i >= 0]
  known = [i for i in valid if i < act.shape[0]]
  if len(valid) == 1:
    i = valid[0]
    a0 = act[i].astype(int) if i in known else np.full(G, H)
    fl = fl_t[i].astype(int) if i in known else np.full(G, H)
    pr = pr_t[i] if i in known else np.full((G, 2), np.nan)
  else:   # several candidates (or none): action = floor = max of all actions and floors
    per = [np.maximum(act[i], fl_t[i]) if i in known else np.full(G, H) for i in valid]
    a0 = fl = np.max(per, axis=0).astype(int) if per else np.full(G, H)
    pr = np.full((G, 2), np.nan)
  crit = any(crit_t[i] for i in known)
  a = np.maximum(a0, fl)
  s = int(state)
  res = np.asarray(pol.reserve)
  gam = (res[s] if 0 <= s < len(res) else float(pol.pooled)) * float(pol.c_full)
  budget = max(bal - gam, 0.0)
  m = lambda a: sum(cost[a[g], g] for g in range(G))
  for _ in range(2 * G):                                          # demote
    el = [g for g in range(G) if a[g] > fl[g]]
    if m(a) <= budget or not el:
      break
    p = lambda g: pr[g, a[g] - 1]          # the ρ of the upgrade the demotion undoes
    a[min(el, key=lambda g: (bool(np.isnan(p(g))), 0.0 if np.isnan(p(g)) else p(g), g))] -= 1
  if crit and len(valid) == 1:                                    # promote
    for _ in range(2 * G):
      el = [g for g in range(G) if a[g] < H and not np.isnan(pr[g, min(a[g], 1)])]
      if not el:
        break
      best = max(el, key=lambda g: (pr[g, min(a[g], 1)], g))
      d = cost[a[best] + 1, best] - cost[a[best], best]
      if m(a) + d > budget:
        break
      a[best] += 1
  return list(a), bal - m(a) + float(pol.allowance)


@pytest.mark.parametrize("groups", [1, 3, 9])
def test_matches_plain_alg2(groups):
  """control_batch (its loops in closed form) against the NumPy Alg. 2 on random policies: NaN
  scores, ties (small integer scores), floors, reserves, budgets exactly on a cost sum, stop
  tokens, several and unknown candidates; G = 1, 3, 9."""
  model = {"n_layers": 9, "n_kv_heads": 1, "head_dim": 8}
  rng = np.random.default_rng(groups)
  base = P.all_high(model, n_groups=groups)
  n = T.N_IDS
  fl = rng.integers(0, 3, (n, groups))
  act = np.maximum(fl, rng.integers(0, 3, (n, groups)))
  prio = rng.integers(0, 4, (n, groups, 2)).astype(np.float32)    # small integers: many ties
  prio[rng.uniform(size=prio.shape) < 0.25] = np.nan
  run = jax.jit(C.control_batch)
  for trial in range(6):
    pol = base.replace(action=jnp.asarray(act, jnp.int8), floor=jnp.asarray(fl, jnp.int8),
                       prio=jnp.asarray(prio), crit=jnp.asarray(rng.uniform(size=n) < 0.5),
                       reserve=jnp.asarray(rng.uniform(0, 0.5, 5) * (rng.uniform(size=5) < 0.5),
                                           jnp.float32),
                       pooled=jnp.float32(0.2), b_d=jnp.float32(rng.choice([0.0, 0.2, 0.5, 1.0])))
    B = 256
    ids = rng.choice([*IDS.tolist(), T.PAD, T.PAD, T.PAD, T.PAD, T.STOP, n + 3], (B, T.N_CAND))
    ids[: B // 2, 1:] = T.PAD                                          # half unique
    states = rng.integers(-1, 7, B).astype(np.int32)
    bal = rng.uniform(-100, 3 * float(np.asarray(base.cost).sum()), B).astype(np.float32)
    # Budgets on the boundary: exact sums of costs (states whose reserve is 0), so "fits" and
    # "exceeds" are decided by equality there.
    cost = np.asarray(base.cost)
    exact = cost[rng.integers(0, 3, (B, groups)), np.arange(groups)].sum(1)
    res = np.asarray(pol.reserve)
    at = (rng.uniform(size=B) < 0.5) & (states >= 0) & (states < 5)
    at &= res[np.clip(states, 0, 4)] == 0
    bal = np.where(at, exact, bal).astype(np.float32)
    stops = rng.uniform(size=B) < 0.1
    got_a, got_b = run(pol, jnp.asarray(ids, jnp.int32), jnp.asarray(states), jnp.asarray(bal),
                       jnp.asarray(stops))
    for b in range(B):
      want_a, want_b = _alg2(pol, ids[b], states[b], float(bal[b]), bool(stops[b]))
      assert list(np.asarray(got_a[b])) == want_a, (trial, b, ids[b])
      assert float(got_b[b]) == pytest.approx(want_b, rel=1e-6, abs=1e-3)
