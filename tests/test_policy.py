import json
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pask_jax import policy as P
from pask_jax import tags as T
from pask_jax import actions as Act

R, L, H = Act.R, Act.L, Act.H


@dataclasses.dataclass
class FakeConfig:                     # duck-types models.ModelConfig
  n_layers: int = 30
  n_kv_heads: int = 3
  head_dim: int = 64

  def identity(self):
    return {"arch": "llama", "n_layers": self.n_layers, "n_kv_heads": self.n_kv_heads,
            "head_dim": self.head_dim, "vocab_size": 49152}


def test_cost_model_paper_formula():
  m = P.cost_model(30, 3, 64)           # SmolLM2-135M: 10 layers per group
  n_c, k_c = 2 * 10 * 3 * 64, 2 * 10 * 3
  np.testing.assert_array_equal(m, [[0] * 3, [4 * n_c + 16 * k_c] * 3, [16 * n_c] * 3])
  m = P.cost_model(36, 8, 128)          # Qwen3-4B groups 12/12/12
  assert m[H, 0] == 16 * 2 * 12 * 8 * 128
  # odd head dim adds 4·p_c with p_c = 2·Σ H_kv·(d mod 2); unequal groups (L = 4: 2/1/1)
  m = P.cost_model(4, 2, 5)
  n_c = [2 * 2 * 2 * 5, 2 * 2 * 5, 2 * 2 * 5]
  k_c = [2 * 2 * 2, 2 * 2, 2 * 2]
  p_c = [2 * 2 * 2, 2 * 2, 2 * 2]
  np.testing.assert_array_equal(m[L], [4 * n + 16 * k + 4 * p for n, k, p in zip(n_c, k_c, p_c)])
  np.testing.assert_array_equal(m[H], [16 * n for n in n_c])
  # per-layer heads / dims
  m = P.cost_model(3, [1, 2, 4], [8, 8, 16])
  np.testing.assert_array_equal(m[H], [16 * 2 * 8, 16 * 2 * 16, 16 * 2 * 64])


def test_parent_fallback_precomputed():
  c = T.Cls.SCHEMA_BEARING
  req = T.fc(c, T.FCRole.REQUIRED)
  e_req = P.Entry([L, L, H], [R, L, L], [[1, 2], [3, 4], [5, 6]])
  e_cls = P.Entry([R, R, R], [R, R, R], None)
  pol = P.build({req: e_req, T.fc(c): e_cls}, FakeConfig())
  leaf = T.fc(c, T.FCRole.REQUIRED, T.FCState.CRITICAL, T.Next.LOOKAHEAD_CRITICAL)
  assert np.asarray(pol.action[leaf]).tolist() == [L, L, H]
  assert np.asarray(pol.floor[leaf]).tolist() == [R, L, L]
  np.testing.assert_array_equal(np.asarray(pol.prio[leaf]), [[1, 2], [3, 4], [5, 6]])
  opt = T.fc(c, T.FCRole.OPTIONAL, T.FCState.BOUNDARY)         # -> class entry, no scores
  assert np.asarray(pol.action[opt]).tolist() == [R, R, R]
  assert np.all(np.isnan(np.asarray(pol.prio[opt])))
  other = T.fc(T.Cls.FREE_GENERATION, T.FCRole.OPTIONAL)       # nothing compatible -> H
  assert np.asarray(pol.action[other]).tolist() == [H] * 3
  assert np.asarray(pol.floor[other]).tolist() == [H] * 3
  assert np.asarray(pol.action[T.sql(c)]).tolist() == [H] * 3   # other family: no sharing
  assert bool(pol.crit[leaf]) and not bool(pol.crit[opt])


def test_bad_entries_rejected():
  with pytest.raises(ValueError):
    P.build({T.fc(T.Cls.PURE_SCAFFOLD): P.Entry([R, R], [R, R])})       # wrong group count
  with pytest.raises(ValueError):
    P.build({T.fc(T.Cls.PURE_SCAFFOLD): P.Entry([3, R, R], [R, R, R])})  # not an action
  with pytest.raises(ValueError):
    P.build({int(T.pack(0, 0, 1)): P.Entry([R] * 3, [R] * 3)})          # malformed id


def test_all_high_and_demo():
  ah = P.all_high(FakeConfig())
  assert np.all(np.asarray(ah.action) == H) and np.all(np.asarray(ah.floor) == H)
  assert float(ah.b_d) == 1.0 and float(ah.pooled) == 0.0 and ah.reserve.shape == (0,)
  assert float(ah.allowance) == float(ah.c_full) == 3 * 61440
  dm = P.demo(FakeConfig())
  scaf = T.fc(T.Cls.PURE_SCAFFOLD, T.FCRole.SCAFFOLD_SEPARATOR, T.FCState.BOUNDARY,
              T.Next.NO_LOOKAHEAD)
  name = T.fc(T.Cls.SCHEMA_BEARING, T.FCRole.DISPATCH_KEY, T.FCState.CRITICAL, T.Next.NO_LOOKAHEAD)
  assert np.asarray(dm.action[scaf]).tolist() == [R, R, L]
  assert np.asarray(dm.floor[name]).tolist() == [H, H, H]
  assert float(dm.b_d) < 1
  # any group count
  assert P.demo(FakeConfig(), n_groups=5).action.shape == (T.N_IDS, 5)


def test_save_load_roundtrip_and_refusal(tmp_path):
  pol = P.build({T.fc(T.Cls.PURE_SCAFFOLD): P.Entry([R, L, L], [R, R, L], [[1, 2]] * 3)},
                FakeConfig(), reserve={2: 0.25, 5: 1.5}, pooled=0.5, b_d=0.4, b_p=0.7, sink=2,
                window=16, tokenizer_hash="abc123", adapter="fc", thresholds=[[0, 0.01]])
  d = tmp_path / "pol"
  P.save(pol, d)
  rec = json.loads((d / "policy.json").read_text())
  for key in ("adapter", "vocab", "layer_boundaries", "quantizer", "payload_cost", "sink",
              "window", "thresholds", "budgets", "reserve", "fallback", "tie_order", "model"):
    assert key in rec, key
  assert rec["layer_boundaries"] == [0, 10, 20, 30]
  assert rec["model"]["tokenizer_hash"] == "abc123" and rec["reserve"]["k"] == 8
  assert rec["entries"]["fc:pure_scaffold"]["action"] == ["R", "L", "L"]

  same = P.load(d, FakeConfig(), tokenizer_hash="abc123")
  for f in ("action", "floor", "crit", "reserve", "pooled", "b_d", "b_p", "cost", "c_full"):
    np.testing.assert_array_equal(np.asarray(getattr(same, f)), np.asarray(getattr(pol, f)))
  np.testing.assert_array_equal(np.isnan(np.asarray(same.prio)), np.isnan(np.asarray(pol.prio)))
  assert same.sink == 2 and same.window == 16 and same.record == pol.record
  assert float(same.gamma(5)) == 1.5 * float(same.c_full)
  assert float(same.gamma(3)) == 0.5 * float(same.c_full)       # unlisted state: pooled
  assert float(same.gamma(-1)) == 0.5 * float(same.c_full)
  assert P.load(d).record == pol.record                          # bound: no model needed

  with pytest.raises(ValueError, match=r"n_layers: policy .* has 30, model has 24"):
    P.load(d, FakeConfig(n_layers=24))
  with pytest.raises(ValueError) as e:
    P.load(d, FakeConfig(n_kv_heads=2, head_dim=128))
  assert "n_kv_heads" in str(e.value) and "head_dim" in str(e.value)
  assert "n_layers" not in str(e.value)
  with pytest.raises(ValueError, match="tokenizer_hash"):
    P.load(d, FakeConfig(), tokenizer_hash="zzz")


def test_template_binds_to_any_model(tmp_path):
  P.save(P.demo(), tmp_path / "demo")
  a = P.load(tmp_path / "demo", FakeConfig())
  b = P.load(tmp_path / "demo", {"n_layers": 24, "n_kv_heads": 2, "head_dim": 64})
  assert float(a.c_full) == 3 * 61440 and float(b.c_full) == 16 * 2 * 24 * 2 * 64
  np.testing.assert_array_equal(np.asarray(a.action), np.asarray(b.action))
  assert b.record["model"]["n_layers"] == 24


def test_shipped_policies_match_constructors():
  for name, ctor in P.BUILTIN.items():
    d = os.path.join(P.POLICIES_DIR, name)
    assert os.path.exists(os.path.join(d, "policy.json")), d
    shipped = P.load(d, FakeConfig())
    built = ctor(FakeConfig())
    for f in ("action", "floor", "crit", "b_d", "b_p", "cost"):
      np.testing.assert_array_equal(np.asarray(getattr(shipped, f)), np.asarray(getattr(built, f)))
    assert shipped.record == built.record
    assert P.resolve(name, FakeConfig()).record == built.record


def test_policy_is_a_pytree_under_jit():
  pol = P.demo(FakeConfig())
  traces = []

  @jax.jit
  def f(p, i):
    traces.append(1)
    return p.action[i], p.allowance

  f(pol, 3)
  f(pol.replace(b_d=jnp.float32(0.9)), 5)      # new budget: same program
  assert len(traces) == 1
