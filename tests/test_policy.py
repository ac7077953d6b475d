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
  assert rec["format"] == P.FORMAT == "pask-policy/2"
  assert rec["layer_boundaries"] == [0, 10, 20, 30]
  assert rec["model"]["tokenizer_hash"] == "abc123" and rec["reserve"]["k"] == 8
  assert rec["budgets"] == {"b_d": 0.4, "b_p": 0.7}
  # One storage: the record holds no table (no entries, no Γ values), arrays/ holds exactly the
  # tables, and the record alone does not make a policy.
  assert "entries" not in rec and set(rec["reserve"]) == {"k", "beta", "unit"}
  assert rec["arrays"] == P.ARRAYS and set(rec["arrays"]["tables"]) == {
      "action", "floor", "prio", "crit", "gamma"}
  text = (d / "policy.json").read_text()
  assert "fc:pure_scaffold" not in text and "per_state" not in text and "1.5" not in text
  import orbax.checkpoint as ocp
  stored = ocp.PyTreeCheckpointer().restore(str(d / "arrays"))
  assert set(stored) == {"action", "floor", "prio", "crit", "gamma"}
  np.testing.assert_array_equal(stored["gamma"], np.float32([0.5, 0.5, 0.25, 0.5, 0.5, 1.5, 0.5]))
  with pytest.raises(ValueError, match="only a pask-policy/1 record holds the tables"):
    P.from_record(rec)

  # The round trip is exact: every leaf bit for bit (NaN scores included), the static fields,
  # the record.
  same = P.load(d, FakeConfig(), tokenizer_hash="abc123")
  assert jax.tree.structure(same) == jax.tree.structure(pol)
  for f in ("action", "floor", "prio", "crit", "reserve", "pooled", "b_d", "b_p", "cost",
            "c_full"):
    a, b = np.asarray(getattr(same, f)), np.asarray(getattr(pol, f))
    assert a.dtype == b.dtype and a.shape == b.shape, f
    np.testing.assert_array_equal(a.reshape(-1).view(np.uint8), b.reshape(-1).view(np.uint8),
                                  err_msg=f)
  assert np.asarray(same.action)[T.fc(T.Cls.PURE_SCAFFOLD)].tolist() == [R, L, L]
  assert same.sink == 2 and same.window == 16 and same.record == pol.record
  assert same.record_json == pol.record_json
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


LEGACY = os.path.join(os.path.dirname(__file__), "data", "policy_v1_demo")   # pask-policy/1


def _same_tables(a, b):
  for f in ("action", "floor", "prio", "crit", "reserve", "pooled", "b_d", "b_p", "cost",
            "c_full"):
    np.testing.assert_array_equal(np.asarray(getattr(a, f)).reshape(-1).view(np.uint8),
                                  np.asarray(getattr(b, f)).reshape(-1).view(np.uint8), err_msg=f)


def test_old_policy_directories_load_and_convert(tmp_path, capsys):
  from pask_jax.cli import main
  old = json.load(open(os.path.join(LEGACY, "policy.json")))
  assert old["format"] == "pask-policy/1" and "entries" in old    # the tables, twice
  demo = P.demo(FakeConfig())
  # Both copies on disk: the tables are read from arrays/, the record's copies dropped.
  pol = P.load(LEGACY, FakeConfig())
  _same_tables(pol, demo)
  assert pol.record == demo.record and "entries" not in pol.record
  # Converted in place (the CLI), it is the demo policy saved today; again: nothing to do.
  d = tmp_path / "old"
  import shutil
  shutil.copytree(LEGACY, d)
  assert main(["policy", "convert", str(d)]) == 0
  assert "converted to pask-policy/2 (tables read from arrays/" in capsys.readouterr().out
  assert json.loads((d / "policy.json").read_text()) == json.loads(json.dumps(
      P.metadata(P.demo().record)))
  _same_tables(P.load(d, FakeConfig()), demo)
  assert P.convert(d).endswith("already pask-policy/2, nothing to do")
  # Only the old record's tables left: loading names the command; converting rebuilds them.
  e = tmp_path / "json-only"
  shutil.copytree(LEGACY, e)
  shutil.rmtree(e / "arrays")
  with pytest.raises(FileNotFoundError) as err:
    P.load(e)
  assert str(err.value) == (f"{e} has no arrays/ directory: an old (pask-policy/1) policy whose "
                            f"tables are only in policy.json; convert it once with: pask-jax "
                            f"policy convert {e}")
  assert "tables rebuilt from the old policy.json's entries" in P.convert(e)
  _same_tables(P.load(e, FakeConfig()), demo)
  # Nothing to convert from: one line.
  f = tmp_path / "bare"
  shutil.copytree(e, f)
  shutil.rmtree(f / "arrays")
  (f / "policy.json").write_text(json.dumps({k: v for k, v in old.items() if k != "entries"}))
  with pytest.raises(SystemExit) as ex:
    main(["policy", "convert", str(f)])
  assert str(ex.value) == (f"error: {f} has neither arrays/ nor the entries of an old "
                           "policy.json: nothing to convert from")


def test_record_budgets_are_checked_and_follow_the_arrays(tmp_path):
  d = tmp_path / "pol"
  P.save(P.demo(), d)
  rec = json.loads((d / "policy.json").read_text())
  for bad in ({}, {"b_d": 0.5}, {"b_d": "x", "b_p": 0.5}, {"b_d": -1, "b_p": 0.5}):
    (d / "policy.json").write_text(json.dumps({**rec, "budgets": bad}))
    with pytest.raises(ValueError, match=r"'budgets' must give 'b_\w' as a finite number"):
      P.load(d)
  # A policy whose budget array moved on without its record is saved with the array's budget.
  pol = P.demo().replace(b_p=jnp.float32(0.25))
  P.save(pol, d)
  assert P.read_record(d)["budgets"] == {"b_d": 0.5, "b_p": 0.25}
  assert float(P.load(d).b_p) == 0.25


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


def test_committed_policies_store_each_thing_once():
  """Every policy directory the repository ships (built-ins, calibrated policies, their B<b>
  variants, the transfer) is pask-policy/2: the tables in arrays/ only, a record without them."""
  import glob
  found = glob.glob(os.path.join(P.POLICIES_DIR, "**", "policy.json"), recursive=True)
  dirs = sorted(os.path.dirname(f) for f in found)
  assert {os.path.basename(d) for d in dirs} >= {"all-high", "demo", "B0.33"}, dirs
  for d in dirs:
    text = open(os.path.join(d, "policy.json"), encoding="utf-8").read()
    rec = json.loads(text)
    assert rec["format"] == P.FORMAT and rec["arrays"] == P.ARRAYS, d
    assert "entries" not in rec and "per_state" not in text, d
    assert set(rec["reserve"]) == {"k", "beta", "unit"}, d
    assert os.path.isdir(os.path.join(d, "arrays")), d


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


def test_a_convert_stopped_before_its_record_leaves_a_policy_that_loads_and_converts(
    tmp_path, monkeypatch):
  """`policy convert` writes arrays/ (pask-policy/2: no budgets there) and then the record; one
  stopped between the two leaves the old record beside the new arrays/, which still loads (the
  budgets from the record) and converts; the record itself is replaced whole or not at all."""
  import shutil
  demo = P.demo(FakeConfig())
  d = tmp_path / "old"
  shutil.copytree(LEGACY, d)
  before = (d / "policy.json").read_text()

  def stopped(*a):
    raise KeyboardInterrupt

  with monkeypatch.context() as m:
    m.setattr(os, "replace", stopped)
    with pytest.raises(KeyboardInterrupt):
      P.convert(d)
  assert (d / "policy.json").read_text() == before            # the old record, untouched
  _same_tables(P.load(d, FakeConfig()), demo)
  assert "converted to pask-policy/2" in P.convert(d)
  _same_tables(P.load(d, FakeConfig()), demo)
  assert json.loads((d / "policy.json").read_text())["format"] == "pask-policy/2"


def test_digest_is_the_policy_not_its_files(tmp_path):
  """``policy.digest`` (the campaign's cell key): an old directory, its conversion and a re-save
  (new orbax files, new timestamps) digest the same; one changed table entry, budget or record
  field does not."""
  import shutil
  d = tmp_path / "old"
  shutil.copytree(LEGACY, d)
  want = P.digest(d)
  assert len(want) == 64
  P.convert(d)
  assert P.digest(d) == want
  again = tmp_path / "again"
  P.save(P.load(d), again)
  assert P.digest(again) == want
  pol = P.load(d)
  rng = np.random.default_rng()
  i, g = int(rng.integers(pol.action.shape[0])), int(rng.integers(pol.action.shape[1]))
  changed = {
      "table": pol.replace(floor=pol.floor.at[i, g].set((pol.floor[i, g] + 1) % 3)),
      "budget": pol.replace(b_d=pol.b_d + np.float32(1e-3)),
      "record": pol.replace(record_json=json.dumps({**pol.record, "name": "another"})),
      "window": pol.replace(window=pol.window + 1,   # save writes the record's sink and window
                            record_json=json.dumps({**pol.record, "window": pol.window + 1})),
  }
  for what, p in changed.items():
    P.save(p, tmp_path / what)
    assert P.digest(tmp_path / what) != want, what


def test_transfer_binds_the_same_tables_to_another_model(tmp_path, capsys):
  """``policy transfer`` (the paper's Table 4): the 1.5B's calibrated policy and its B<b>
  variants bound to the embedded SmolLM2 — tables, budgets and Γ unchanged, the target's layer
  groups and bits, the source's identity kept; the result loads for SmolLM2 and is refused for
  the 1.5B; bad input is one line."""
  from models import registry
  from pask_jax.cli import main
  src = os.path.join(os.path.dirname(__file__), "data", "policy15_rule2")
  out = tmp_path / "moved"
  assert main(["policy", "transfer", src, "--model", registry.DEFAULT, "--out", str(out)]) == 0
  said = capsys.readouterr().out
  smol = {"arch": "llama", "n_layers": 30, "n_kv_heads": 3, "head_dim": 64, "vocab_size": 49152}
  for rel in ["", "B0.15", "B0.20", "B0.25", "B0.33"]:
    a, b = P.load(os.path.join(src, rel)), P.load(out / rel, smol)
    assert f"{os.path.join(str(out), rel) if rel else str(out)}: " in said
    for k in ("action", "floor", "crit", "reserve", "pooled", "b_d", "b_p"):
      np.testing.assert_array_equal(np.asarray(getattr(a, k)), np.asarray(getattr(b, k)), k)
    np.testing.assert_array_equal(np.isnan(a.prio), np.isnan(b.prio))
    assert (a.sink, a.window) == (b.sink, b.window)
    assert {k: b.record["model"][k] for k in smol} == smol
    assert b.record["transferred_from"]["model"] == a.record["model"]
    assert b.record["model"]["n_layers"] != a.record["model"]["n_layers"]   # 28: the 1.5B
    assert float(b.c_full) != float(a.c_full)
    assert b.record["layer_boundaries"] == list(T.layer_boundaries(30, b.n_groups))
    with pytest.raises(ValueError, match="made for another model"):
      P.load(out / rel, a.record["model"])
  # an --out that already holds a policy, a source that is none, a model too small: one line
  for argv, msg in [([src, "--out", str(out)], f"error: {out} already holds a policy"),
                    ([str(tmp_path), "--out", str(tmp_path / "x")], "error: "),
                    ]:
    with pytest.raises(SystemExit) as e:
      main(["policy", "transfer", *argv, "--model", registry.DEFAULT])
    assert str(e.value.code).startswith(msg) and "\n" not in str(e.value.code)
  pol = P.load(src)
  with pytest.raises(ValueError, match="3 layer groups, the model only 2 layers"):
    P.transfer(pol, {"n_layers": 2, "n_kv_heads": 2, "head_dim": 64})
