"""Ledger: scheduled/prefill/live payloads and measured B over a small end-to-end run
(prefill plan -> cache -> controller -> cache append), all inside jit."""
import json
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pask_jax import cache as KC
from pask_jax.testing import cache as tcache
from pask_jax import controller as C
from pask_jax import ledger as LG
from pask_jax import policy as P
from pask_jax import tags as T
from pask_jax import actions as Act

MODEL = {"n_layers": 4, "n_kv_heads": 2, "head_dim": 8}
B, TP, STEPS, HKV, D, NL = 2, 10, 12, 2, 8, 4
DECODE_TAGS = T.all_ids(T.Family.FC)
LABELS = [T.prompt(l) for l in T.PromptLabel]


@jax.jit
def _prefill(pol, cache, led, k, v, cands, lengths):
  plan, excess = C.plan_prefill(pol, cands, lengths)
  cache = KC.materialize_prefill(cache, k, v, plan, lengths)
  led = LG.record_prefill(led, plan, lengths, pol.sink)
  return cache, LG.record_live(led, cache, pol.cost, pol.c_full), plan


@jax.jit
def _step(pol, cache, led, bal, k, v, tag_ids, states, stop, active):
  acts, nbal = C.control_batch(pol, tag_ids, states, bal, stop)
  bal = jnp.where(active, nbal, bal)
  led = LG.record_decode(led, acts, active & ~stop, cache.count, pol.sink)
  cache = tcache.append(cache, k, v, acts, active & ~stop)
  return cache, LG.record_live(led, cache, pol.cost, pol.c_full), bal, acts


def _run(pol, seed=0):
  rng = np.random.default_rng(seed)
  cache = KC.init(NL, B, HKV, D, capacity=32, window=pol.window, sink=pol.sink, page=4)
  led = LG.init(B)
  lengths = np.array([TP, TP - 3])
  cands = np.stack([T.stack_candidates([[int(rng.choice(LABELS))] for _ in range(TP)])
                    for _ in range(B)])
  k = rng.normal(size=(NL, B, TP, HKV, D)).astype(np.float32)
  cache, led, plan = _prefill(pol, cache, led, k, k, cands, lengths)
  cost = np.asarray(pol.cost, np.float64)
  want_pre = [sum(cost[np.where(t < pol.sink, Act.H, np.asarray(plan)[b, t]), np.arange(3)].sum()
                  for t in range(lengths[b])) for b in range(B)]
  bal = jnp.broadcast_to(C.initial_balance(pol), (B,))
  spent, n_gen = np.zeros(B), np.zeros(B, int)
  peak = np.asarray(LG.live_payload(cache, pol.cost, pol.c_full), np.float64)
  for s in range(STEPS):
    tags = np.stack([T.candidates(int(rng.choice(DECODE_TAGS))) for _ in range(B)])
    stop = rng.uniform(size=B) < 0.15
    active = rng.uniform(size=B) < 0.9
    kn = rng.normal(size=(NL, B, HKV, D)).astype(np.float32)
    cache, led, bal, acts = _step(pol, cache, led, bal, kn, kn, tags, jnp.full((B,), -1),
                                  stop, active)
    for b in range(B):
      if active[b] and not stop[b]:
        spent[b] += cost[np.asarray(acts[b]), np.arange(3)].sum()
        n_gen[b] += 1
    peak = np.maximum(peak, np.asarray(LG.live_payload(cache, pol.cost, pol.c_full)))
  return cache, led, bal, np.asarray(want_pre), spent, n_gen, lengths, peak


@pytest.mark.parametrize("name", ["demo", "all-high"])
def test_ledger_end_to_end(name):
  pol = P.resolve(name, MODEL)
  cache, led, bal, want_pre, spent, n_gen, lengths, peak = _run(pol)
  rows = LG.summary(led, pol)
  json.dumps(rows)
  c_full = float(pol.c_full)
  b = float(pol.allowance)
  for i, r in enumerate(rows):
    assert r["n_prompt"] == lengths[i] and r["n_gen"] == n_gen[i]
    assert r["prefill_bits"] == want_pre[i]
    assert r["decode_bits"] == spent[i]
    # the ledger agrees with the controller's balance: Σ M(a) = (n+1)·b − R_{n+1}
    assert r["decode_bits"] == pytest.approx((n_gen[i] + 1) * b - float(bal[i]), rel=1e-5)
    assert r["full_kv_bits"] == (lengths[i] + n_gen[i]) * c_full
    assert r["measured_B"] == pytest.approx((want_pre[i] + spent[i]) / r["full_kv_bits"])
    # live payload from the cache contents
    live = 0.0
    for g in range(3):
      pos = tcache.stored_positions(cache, g, i)
      live += (len(pos["hi"]) * float(pol.cost[Act.H, g])
               + len(pos["lo"]) * float(pol.cost[Act.L, g]))
    live += len(tcache.stored_positions(cache, 0, i)["win"]) * c_full
    assert r["live_bits"] == pytest.approx(live)
    assert r["peak_live_bits"] == pytest.approx(peak[i])
  got_b = np.asarray(LG.measured_b(led, pol.cost, pol.c_full))
  np.testing.assert_allclose(got_b, [r["measured_B"] for r in rows], rtol=1e-5)
  if name == "all-high":
    for r in rows:
      assert r["measured_B"] == 1.0 and r["live_B"] == 1.0
      assert all(c["R"] == c["L"] == 0 for c in r["decode_counts"].values())
  else:
    assert all(r["measured_B"] < 1.0 for r in rows)
    assert sum(c["R"] + c["L"] for r in rows for c in r["decode_counts"].values()) > 0
  assert "measured B" in LG.format_summary(rows)


def test_counts_and_sink_rule():
  led = LG.init(2)
  plan = jnp.asarray([[[0, 1, 2]] * 4, [[0, 0, 0]] * 4], jnp.int8)      # [2, 4, 3]
  led = LG.record_prefill(led, plan, jnp.asarray([4, 2]), sink=1)
  pc = np.asarray(led.prefill_counts)
  assert pc[0].tolist() == [[3, 0, 1], [0, 3, 1], [0, 0, 4]]            # sink -> H
  assert pc[1].tolist() == [[1, 0, 1]] * 3                              # 2 tokens, 1 sink
  led = LG.record_decode(led, jnp.asarray([[1, 1, 1], [0, 0, 0]]), jnp.asarray([True, False]))
  assert np.asarray(led.decode_counts)[0].tolist() == [[0, 1, 0]] * 3
  assert np.asarray(led.decode_counts)[1].sum() == 0 and led.n_gen.tolist() == [1, 0]
  led = LG.record_decode(led, jnp.asarray([[0, 0, 0], [0, 0, 0]]), None,
                         positions=jnp.asarray([0, 9]), sink=1)
  assert np.asarray(led.decode_counts)[0, :, Act.H].tolist() == [1, 1, 1]
