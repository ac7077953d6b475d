"""Offline calibration (Alg. 1) on a tiny random model with a synthetic tool-call task whose oracle
is exact: the pipeline end to end, Eq. 5/6 floors, nested greedy paths (Prop. 2), the reserve
(Eq. 16, Prop. 4), Eq. 9 selection, resume, and stacked (vmapped) == sequential interventions."""
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import types

import numpy as np
import pytest

from pask_jax.testing import fast_compile, smollm2, tiny_llama, xla_flags
from models import random_model
from pask_jax import policy as P
from pask_jax import actions as Act
from pask_jax import tags as T
from pask_jax.decode import Runner, Sampling, generate

from calibrate import alg1, stack as S, tasks

pytestmark = pytest.mark.fast_compile

CFG = alg1.Config(thresholds=((0.0, 0.0), (0.2, 0.4)), prefill_thresholds=((0.0, 0.0), (0.2, 0.4)),
                  alpha_d=0.25, alpha_p=0.25, b_p_grid=(0.3, 0.7), path_points=3, rows=192,
                  max_tokens=64, sink=2, window=4, keep_se=0.0)   # the paper's rule
CAP = 256


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  # Compiled at the default level: Runtime-V decodes 192-row stacks over SmolLM2's 49152-token
  # vocabulary, whose execution at O0 costs more than its compile saves (44 -> 53 s measured);
  # the runners it compiles serve the file's later runs of the same shapes.
  with fast_compile(False):
    return _setup(tmp_path_factory)


def _setup(tmp_path_factory):
  from pask_jax.grammar import GrammarCompiler
  tok = smollm2().tokenizer
  model = tiny_llama(smollm2().cfg.vocab_size)
  comp = GrammarCompiler(tok, model.cfg.vocab_size)
  task = tasks.SyntheticTask(tok, comp, 8, seed=0)
  # The exact oracle: the call a Full-KV (dense cache) run of the same model writes.
  full = Runner(model, batch=8, capacity=CAP)
  res = generate(full, tok, [r.ids for r in task.requests],
                 grammars=[r.grammar for r in task.requests], sampling=Sampling(max_tokens=64))
  task.fix_oracle([r.text for r in res])
  cal, dev = task.subset(range(4)), task.subset(range(4, 8))
  out = str(tmp_path_factory.mktemp("cal"))
  C = alg1.Calibration(model, tok.hash(), cal, dev, out, CFG, capacity=CAP)
  rec = C.run()
  return C, rec, out, model, tok


def test_pipeline_end_to_end(setup):
  C, rec, out, model, tok = setup
  # π_ref (PASK cache, all-high) reproduces the dense-cache answers the oracle was made from.
  assert rec["reference_cal_accuracy"] == 1.0 and rec["dev_reference_accuracy"] == 1.0
  pol = P.load(os.path.join(out, "policy"), model.cfg, tok.hash())
  saved = json.load(open(os.path.join(out, "calibration.json")))
  assert saved["composed"]["measured_B_total"] == rec["composed"]["measured_B_total"]
  assert 0.0 < rec["composed"]["measured_B_total"] <= 1.0
  assert len(C.V) == 2 * (len(C.dec_buckets) + len(C.pre_buckets)) > 0
  assert set(C.D) == set(C.V)
  # The saved policy is the calibrated one (its tables stored once, in arrays/).
  assert "entries" not in json.load(open(os.path.join(out, "policy", "policy.json")))
  for k in ("action", "floor", "crit", "prio", "reserve", "pooled", "b_d", "b_p"):
    np.testing.assert_array_equal(np.asarray(getattr(pol, k)), np.asarray(getattr(C.final, k)))
  assert pol.record == C.final.record
  with pytest.raises(ValueError, match="another model"):
    P.load(os.path.join(out, "policy"), dict(model.cfg.identity(), n_layers=7))


def test_envelope_and_floors_follow_thresholds(setup):
  C, *_ = setup
  assert alg1.envelope(-0.1, -0.2) == (0.0, 0.0)
  assert alg1.envelope(0.1, 0.05) == (0.1, 0.1)      # releasing is at least as bad as INT4
  assert alg1.floor_of(0.3, 0.3, (0.1, 0.2)) == Act.H
  assert alg1.floor_of(0.05, 0.1, (0.1, 0.2)) == Act.R
  assert alg1.floor_of(0.05, 0.15, (0.1, 0.2)) == Act.L
  for kind in ("decode", "prefill"):
    prev = None
    for tau in sorted(CFG.thresholds):
      f = C.floors(kind, tau)
      for (i, g), a in f.items():
        vl = max(0.0, C.V[(kind, i, g, Act.L)])
        vr = max(vl, C.V[(kind, i, g, Act.R)])
        assert a == (Act.H if vl > tau[1] else Act.R if vr <= tau[0] else Act.L)
      if prev is not None:           # looser thresholds never raise a floor
        assert all(f[k] <= prev[k] for k in f)
      prev = f


def test_greedy_paths_are_nested_with_nondecreasing_nominal_cost(setup):
  C, rec, *_ = setup
  for tau in CFG.thresholds:
    f = C.floors("decode", tau)
    path = alg1.greedy_path(f, C.rho_dec)
    assert path[0] == f and all(a == Act.H for a in path[-1].values())
    for a, b in zip(path, path[1:]):
      assert all(b[k] >= a[k] for k in a) and sum(b[k] - a[k] for k in a) == 1
  for c in C.dec_cands:
    noms = c["path_nominal"]
    assert all(y >= x - 1e-12 for x, y in zip(noms, noms[1:])) and noms[-1] == pytest.approx(1.0)


def test_priorities_eq8():
  cost = np.array([[0.0] * 3, [10.0] * 3, [32.0] * 3])
  d = {(5, 0, Act.R): 3.0, (5, 0, Act.L): 1.0}
  rho = alg1.priorities(d, {5: 2.0}, cost, [(5, 0)])
  assert rho[(5, 0)] == pytest.approx(((3 - 1) / (2 * 10), 1 / (2 * 22)))


def brute_deficit(f, b, k, u):
  return max([0.0] + [sum(f[u + 1:u + 1 + h]) - h * b
                      for h in range(1, min(k, len(f) - 1 - u) + 1)])


def test_reserve_meets_prop4_on_its_sample(setup):
  C, *_ = setup
  rng = np.random.default_rng(0)
  f = rng.uniform(0, 3, 40)
  d = alg1.deficits(f, 1.2, 8)
  assert np.allclose(d, [brute_deficit(f, 1.2, 8, u) for u in range(40)])
  x = rng.normal(size=37)
  q = alg1.left_quantile(x, 0.8)
  assert np.mean(x <= q) >= 0.8 and np.mean(x < q) < 0.8     # the left empirical quantile
  # The calibrated reserve of every evaluated decode candidate, on its own calibration sample.
  cands, states = C._ref_decode()
  G = CFG.n_groups
  checked = 0
  for c in C.dec_cands:
    fpol = P.build(alg1.policy_entries(c["floors"], c["floors"], None, G), C.ident, n_groups=G)
    fc = [C.cost[alg1.resolve_rows(fpol, x)[1], np.arange(G)[None]].sum(1) for x in cands]
    b = float(c["policy"].b_d) * C.c_full
    gam, pooled, per = alg1.reserve(fc, states, b, C.c_full, CFG.reserve_k, CFG.reserve_beta)
    table = np.asarray(c["policy"].reserve)
    for sid, xs in per.items():
      if sid < 0:
        continue
      g = table[sid] * C.c_full
      assert np.mean(np.asarray(xs) <= g * (1 + 1e-6)) >= CFG.reserve_beta
      checked += 1
    allx = np.concatenate([np.asarray(v) for v in per.values()])
    assert np.mean(allx <= float(c["policy"].pooled) * C.c_full * (1 + 1e-6)) >= CFG.reserve_beta
  assert checked > 0


def test_selection_meets_dev_tolerance(setup):
  C, rec, *_ = setup
  e_ref = 1 - rec["dev_reference_accuracy"]
  for stage, alpha in (("decode", CFG.alpha_d), ("prefill", CFG.alpha_p)):
    rows = rec[f"{stage}_candidates"]
    j = rec["selected"][stage]
    ok = [i for i, r in enumerate(rows) if r["dev"]["err"] - e_ref <= alpha + 1e-12]
    if j is None:
      assert not ok                                 # nothing admissible: the all-high fallback
    else:
      assert rows[j]["dev"]["err"] - e_ref <= alpha + 1e-12
      assert rows[j]["dev"]["cost"] == min(rows[i]["dev"]["cost"] for i in ok)   # Eq. 9


def test_resume_reuses_saved_stages(setup):
  C, rec, out, model, tok = setup
  C2 = alg1.Calibration(model, tok.hash(), C.cal, C.dev, out, CFG, capacity=CAP)
  rec2 = C2.run()
  assert "Runtime-V" not in C2.timings and "Runtime-D" not in C2.timings
  assert rec2["V"] == rec["V"] and rec2["selected"] == rec["selected"]


def test_stacked_interventions_equal_sequential(setup):
  C, *_ = setup
  keys = C.interventions()[::max(1, len(C.interventions()) // 6)][:6]
  pols = [C.ref_policy] + [C.intervention_policy(*k) for k in keys]
  # The setup compiled a stack of 11 (dev): it runs these 7, padded with the last (a runner of
  # up to twice the policies stands in for a compile), against one policy at a time (V = 1).
  N = len(C.cal.requests)
  assert C.runner_for(len(pols), N, most=CFG.rows // N).V == 11
  a = S.run_stack(C.runner_for, C.cal, pols, rows=CFG.rows, max_tokens=CFG.max_tokens)
  b = S.run_sequential(C.runner_for, C.cal, pols, rows=CFG.rows, max_tokens=CFG.max_tokens)
  for ra, rb in zip(a, b):
    for x, y in zip(ra, rb):
      assert x.tokens == y.tokens and x.passed == y.passed and x.ledger == y.ledger
      np.testing.assert_array_equal(x.tags, y.tags)
      np.testing.assert_array_equal(x.states, y.states)
  # Runtime-V's values are those of the sequential loop.
  ref_err = 1 - np.mean([o.passed for o in b[0]])
  for k, r in zip(keys, b[1:]):
    assert C.V[k] == pytest.approx((1 - np.mean([o.passed for o in r])) - ref_err)


def test_a_built_stack_of_up_to_twice_the_policies_serves_fewer():
  """runner_factory: a runner of V' > V policies built already serves V when V' <= min(2·V,
  most), the smallest such (no compile of another shape); otherwise, for another N or without
  ``most`` (run_sequential: V = 1 exactly), the shape asked for."""
  model = tiny_llama(97)
  get = S.runner_factory(model, P.all_high(model.cfg, sink=2, window=4), 64)
  r8 = get(8, 1)
  assert r8.V == 8 and get(8, 1) is r8 and get(8, 1, most=8) is r8
  assert get(7, 1, most=8) is r8 and get(4, 1, most=8) is r8 and get(5, 1, most=9) is r8
  r3 = get(3, 1, most=8)                   # 8 > 2·3
  assert r3.V == 3 and get(2, 1, most=8) is r3
  r5 = get(5, 1, most=7)                   # 8 > most
  assert r5.V == 5 and get(4, 1, most=8) is r5 and get(6, 1, most=8) is r8
  assert (get(3, 2, most=8).V, get(3, 2, most=8).N) == (3, 2)    # another N: its own
  r7 = get(7, 1)                           # most not given: exactly V
  assert r7.V == 7 and get(7, 1, most=8) is r7
  # What run_stack and run_sequential ask for (a task of 2 requests, rows 8)
  class Asked(Exception):
    pass

  def runner_for(V, N, most=None):
    raise Asked(V, N, most)
  task = types.SimpleNamespace(requests=[None, None])
  for run, n_pol, want in ((S.run_stack, 3, (3, 2, 4)), (S.run_stack, 9, (4, 2, 4)),
                           (S.run_sequential, 3, (1, 2, None))):   # V = 1 exactly
    with pytest.raises(Asked) as e:
      run(runner_for, task, [None] * n_pol, rows=8)
    assert e.value.args == want, run


SHARDED = r"""
import jax
from pask_jax.testing import smollm2_tokenizer, tiny_llama as tiny
CAP = 256
from pask_jax.grammar import GrammarCompiler
from pask_jax import policy as P
from calibrate import alg1, stack as S, tasks
assert len(jax.devices()) == 4
tok = smollm2_tokenizer()          # the GGUF's tokenizer without its weights
model = tiny(tok.vocab_size)
task = tasks.SyntheticTask(tok, GrammarCompiler(tok, model.cfg.vocab_size), 2, seed=3)
task.expected = [[{"name": "set_mode", "arguments": {"mode": "eco", "level": "low"}}]] * 2
cfg = alg1.Config(sink=2, window=4)
tmpl = P.all_high(model.cfg, sink=2, window=4)
ids = [T for T in (258, 162, 290)]
pols = [tmpl] + [alg1.intervention(model.cfg, cfg, i, g, a, [])
                 for i in (149, 150) for g in (0, 2) for a in (0, 1)][:7]
a = S.run_stack(S.runner_factory(model, tmpl, CAP), task, pols, rows=16, max_tokens=32)
b = S.run_stack(S.runner_factory(model, tmpl, CAP, devices=jax.devices()), task, pols, rows=16,
                max_tokens=32)
assert all(x.tokens == y.tokens and x.ledger == y.ledger
           for ra, rb in zip(a, b) for x, y in zip(ra, rb))
print("SHARDED-OK", len({tuple(o.tokens) for r in a for o in r}))
"""


def test_policy_stack_sharded_over_four_cpu_devices():
  import jax
  # compiled at this file's level (tests/conftest.py: fast_compile), as in the test process
  fast = jax.config.values["jax_disable_most_optimizations"]
  env = dict(os.environ, XLA_FLAGS=xla_flags("--xla_force_host_platform_device_count=4"),
             JAX_PLATFORMS="cpu", JAX_DISABLE_MOST_OPTIMIZATIONS=str(int(fast)))
  r = subprocess.run([sys.executable, "-c", SHARDED], capture_output=True, text=True, env=env,
                     cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), timeout=900)
  assert r.returncode == 0, r.stderr[-3000:]
  assert "SHARDED-OK" in r.stdout


@pytest.mark.parametrize("argv, msg", [
    (["--categories", "simple_java"], "unknown BFCL categories"),
    (["--max-cases", "1"], "--max-cases must be at least 2"),
    (["--rows", "0"], "--rows and --max-tokens must be positive"),
    (["--keep-within-se", "-1", "--targets", "0.3"], "--keep-within-se must be a finite number"),
    (["--keep-within-se", "nan", "--targets", "0.3"], "--keep-within-se must be a finite number"),
    (["--keep-within-se", "1"], "--keep-within-se chooses among target variants"),
])
def test_calibrate_cli_rejects_bad_input(tmp_path, argv, msg):
  from pask_jax.cli import main
  with pytest.raises(SystemExit, match=msg):
    main(["calibrate", "--out", str(tmp_path / "o")] + argv)


def test_saved_stages_are_fingerprinted_npz_without_pickles(setup):
  from calibrate import stages
  C, rec, out, model, tok = setup
  work = os.path.join(out, "work")
  names = sorted(os.listdir(work))
  assert names == sorted(f"{s}.npz" for s in alg1.Calibration.STAGES)
  for n in names:
    with np.load(os.path.join(work, n), allow_pickle=False) as z:   # no pickled object inside
      meta = json.loads(bytes(z["__meta__"]).decode())
      assert all(z[k].dtype != object for k in z.files)
    assert meta["format"] == stages.FORMAT and meta["fingerprint"]["model"]["weights"]
  ref = stages.load(work, "reference", C.keys["reference"])
  assert [o.tokens for o in ref["outcomes"]] == [o.tokens for o in C.ref]
  np.testing.assert_array_equal(ref["outcomes"][0].tags, C.ref[0].tags)
  assert ref["outcomes"][0].ledger == C.ref[0].ledger   # int-keyed count dicts round-trip


@pytest.mark.parametrize("change, names", [
    ("weights", ["model.weights"]),
    ("config", ["model.config.n_layers", "model.weights"]),
    ("task", ["calibration_split.digest", "calibration_split.requests"]),
    ("split", ["development_split.digest"]),
    ("max_tokens", ["args.max_tokens"]),
    ("alpha_d", ["args.alpha_d"]),
])
def test_resume_with_a_difference_is_refused_naming_it(setup, change, names, tmp_path):
  import dataclasses
  from calibrate.stages import StageMismatch
  C, rec, out, model, tok = setup
  m, cal, dev, cfg = model, C.cal, C.dev, CFG
  if change == "weights":
    m = random_model(model.cfg, seed=5)
  elif change == "config":
    m = random_model(dataclasses.replace(model.cfg, n_layers=4), seed=0)
  elif change == "task":
    cal = C.cal.subset(range(3))
  elif change == "split":
    dev = C.dev.subset([1, 0, 2, 3])
  else:
    cfg = dataclasses.replace(CFG, **{change: {"max_tokens": 32, "alpha_d": 0.5}[change]})
  with pytest.raises(StageMismatch) as e:
    alg1.Calibration(m, tok.hash(), cal, dev, out, cfg, capacity=CAP)
  msg = str(e.value)
  assert all(n in msg for n in names), msg
  assert "Refusing to resume" in msg and "\n" not in msg
  # nothing was overwritten: the original run still resumes
  assert alg1.Calibration(model, tok.hash(), C.cal, C.dev, out, CFG, capacity=CAP).keys == C.keys


def test_unkeyed_pickles_are_refused(tmp_path, setup):
  from calibrate.stages import StageMismatch
  C, rec, out, model, tok = setup
  (tmp_path / "work").mkdir()
  (tmp_path / "work" / "reference.pkl").write_bytes(b"\x80\x04N.")
  with pytest.raises(StageMismatch, match="unkeyed stage pickles"):
    alg1.Calibration(model, tok.hash(), C.cal, C.dev, str(tmp_path), CFG, capacity=CAP)


# ---- total-B variants (--targets) -----------------------------------------------------------

TARGETS = (0.9, 0.5, 0.15)


@pytest.fixture(scope="module")
def targeted(setup, tmp_path_factory):
  """The setup's run resumed in a copy of its work/ with targets: only the target stages run."""
  import dataclasses
  import shutil
  C, rec, out, model, tok = setup
  out2 = str(tmp_path_factory.mktemp("targets"))
  shutil.copytree(os.path.join(out, "work"), os.path.join(out2, "work"))
  cfg = dataclasses.replace(CFG, targets=TARGETS)
  C2 = alg1.Calibration(model, tok.hash(), C.cal, C.dev, out2, cfg, capacity=CAP,
                        runner_for=C.runner_for)   # the setup's compiled stack runners
  return C2, C2.run(), out2, cfg


def _measured_rows(rec) -> list[dict]:
  """Every composition the record says was measured on dev: (accuracy, total B)."""
  rows = [{"acc": rec["dev_reference_accuracy"], "total": 1.0},
          {"acc": rec["composed"]["dev_accuracy"], "total": rec["composed"]["measured_B_total"]}]
  rows += [c["dev"] for c in rec["decode_candidates"] + rec["prefill_candidates"]]
  return rows + [c["dev"] for c in rec["target_candidates"]]


def test_target_variants_fit_their_targets_and_are_the_most_accurate(targeted):
  from calibrate.evaluate import pick_policy, policy_variants
  C, rec, out, cfg = targeted
  assert "Runtime-V" not in C.timings and "dev" not in C.timings and "dev_targets" in C.timings
  saved = json.load(open(os.path.join(out, "calibration.json")))
  assert saved["variants"] == json.loads(json.dumps(rec["variants"]))
  assert sorted(policy_variants(os.path.join(out, "policy"))) == sorted(TARGETS)
  rows = _measured_rows(rec)
  for t in TARGETS:
    v = next(v for v in rec["variants"] if v["target"] == t)
    assert v["reached"] and v["measured_B_total"] <= t
    where, b = pick_policy(os.path.join(out, "policy"), t)
    assert where == os.path.join(out, "policy", f"B{t:.2f}") and b == pytest.approx(t)
    extra = json.load(open(os.path.join(where, "policy.json")))["extra"]["variant"]
    assert extra["target"] == t and extra["measured_B_total"] == v["measured_B_total"]
    assert {"measured_B_prefill", "measured_B_decode", "dev_accuracy", "from",
            "floors_relaxed"} <= set(extra)
    # The rule over everything measured: the most accurate within t, ties to the lower B.
    fits = [r for r in rows if r["total"] <= t]
    best = max(r["acc"] for r in fits)
    assert v["dev_accuracy"] == best
    assert v["measured_B_total"] == min(r["total"] for r in fits if r["acc"] == best)
  # 0.15 is below every candidate of the normal flow: reached by prefill aimed at it, with floors
  # relaxed (the configured ones cost more than it allows).
  low = next(v for v in rec["variants"] if v["target"] == 0.15)
  normal = [c["dev"]["total"] for c in rec["decode_candidates"] + rec["prefill_candidates"]]
  assert min(normal + [rec["composed"]["measured_B_total"]]) > 0.15
  assert low["from"]["kind"] in ("aimed", "re-aimed") and low["floors_relaxed"]
  assert tuple(low["from"]["prefill"]["tau"]) not in {tuple(x) for x in cfg.prefill_thresholds}


def test_the_keep_band_reselects_from_the_saved_stages(targeted, tmp_path):
  """``keep_se`` changes the selection only: the targeted run's stages resume (nothing measured
  again) and, with a band wide enough to hold every fit, each target's variant is the most
  accurate fit that releases no prompt token (prefill all-high or every prompt floor L)."""
  import dataclasses
  import shutil
  C, rec, out, cfg = targeted
  out2 = str(tmp_path / "keep")
  shutil.copytree(os.path.join(out, "work"), os.path.join(out2, "work"))
  cfg2 = dataclasses.replace(cfg, keep_se=1e6)
  C2 = alg1.Calibration(C.model, C.thash, C.cal, C.dev, out2, cfg2, capacity=CAP,
                        runner_for=C.runner_for)
  rec2 = C2.run()
  assert not {"Runtime-V", "Runtime-D", "dev", "dev_targets", "dev_targets_more"} & set(C2.timings)
  assert rec2["config"]["keep_se"] == 1e6 and rec["config"]["keep_se"] == 0.0
  keeps = lambda c: c["source"]["prefill"] == "all-high" or c["source"]["prefill"]["keeps_prompt"]
  moved = 0
  for t in TARGETS:
    v = next(v for v in rec2["variants"] if v["target"] == t)
    # measured with the prefill all-high (the reference, the decode candidates) or kept at L
    kept = [r for r in [{"acc": rec2["dev_reference_accuracy"], "total": 1.0}] +
            [c["dev"] for c in rec2["decode_candidates"]] +
            [c["dev"] for c in rec2["target_candidates"] if keeps(c)] if r["total"] <= t]
    if not kept:
      continue
    src = v["from"]
    assert src["prefill"] == "all-high" or src["prefill"]["keeps_prompt"], t
    assert v["dev_accuracy"] == max(r["acc"] for r in kept)
    before = next(x for x in rec["variants"] if x["target"] == t)
    if v["from"] != before["from"]:   # moved: the record says what the rule alone picked
      moved += 1
      assert v["keep_band"]["without"]["from"] == before["from"]
      assert v["keep_band"]["without"]["dev_accuracy"] == before["dev_accuracy"]
    else:
      assert "keep_band" not in v
  assert moved, "the band moved no variant: the test checks nothing"


def test_without_decode_keep_no_variant_composes_keep_at_L(targeted, tmp_path):
  """``decode_keep=False`` (``--no-decode-keep``): the stages before the targets resume, the
  target stages run again without keep-at-L (in neither round: a fitting keep-at-L row would stop
  the re-aiming of the variant's own compositions), and each target's variant is the most
  accurate fit among what was measured."""
  import dataclasses
  import shutil
  C, rec, out, cfg = targeted
  out2 = str(tmp_path / "nokeep")
  # the target stages are keyed by decode_keep: the run refuses the targeted run's (StageMismatch)
  shutil.copytree(os.path.join(out, "work"), os.path.join(out2, "work"),
                  ignore=shutil.ignore_patterns("dev_keep.npz", "dev_targets*.npz"))
  C2 = alg1.Calibration(C.model, C.thash, C.cal, C.dev, out2,
                        dataclasses.replace(cfg, decode_keep=False), capacity=CAP,
                        runner_for=C.runner_for)
  rec2 = C2.run()
  assert not {"Runtime-V", "Runtime-D", "dev", "dev_keep"} & set(C2.timings)
  assert "dev_targets" in C2.timings
  assert rec2["config"]["decode_keep"] is False and rec["config"]["decode_keep"] is True
  is_keep = lambda src: src["decode"] != "all-high" and tuple(src["decode"]["tau"]) == alg1.KEEP
  assert not any(tuple(c["tau"]) == alg1.KEEP for c in rec2["decode_candidates"])
  assert not any(is_keep(c["source"]) for c in rec2["target_candidates"])
  moved = 0
  for t in TARGETS:
    v = next(v for v in rec2["variants"] if v["target"] == t)
    before = next(v for v in rec["variants"] if v["target"] == t)
    moved += bool(before["reached"] and is_keep(before["from"]))
    fits = [r for r in _measured_rows(rec2) if r["total"] <= t]
    if not v["reached"]:
      assert not fits, t
      continue
    assert not is_keep(v["from"]), t
    assert v["dev_accuracy"] == max(r["acc"] for r in fits), t
  assert moved, "no variant composed keep-at-L to begin with: the test checks nothing"


def test_decode_b_composes_every_variant_from_the_matched_decode_candidate(targeted, tmp_path,
                                                                         monkeypatch):
  """``decode_b`` (``--decode-b``, the ablations' matched decode budget): the runtime stages
  resume, a saved dev stage is refused (each greedy path now also offers its step nearest
  decode_b), and every reached variant composes the one decode candidate whose dev-measured
  decode B is nearest decode_b, never keep-at-L."""
  import dataclasses
  import shutil
  from calibrate import stages
  C, rec, out, cfg = targeted
  costs = sorted({c["dev"]["cost"] for c in rec["decode_candidates"]})
  assert len(costs) >= 3, "too few distinct decode costs: the test checks nothing"
  # the middle of the widest gap between measured costs: no path point measures near it, so the
  # candidates are re-aimed by their measured cost
  gap, lo = max((hi - lo, lo) for lo, hi in zip(costs, costs[1:]))
  assert gap > 4 * alg1.MATCH_TOL, "measured costs too close: the re-aim is not exercised"
  b = float(lo + gap / 2)
  # no tolerance: the re-aim runs whatever the path's own steps measure (the rule's limits still
  # stop it: a step already measured, MATCH_ROUNDS)
  monkeypatch.setattr(alg1, "MATCH_TOL", 0.0)
  cfg2 = dataclasses.replace(cfg, decode_b=b)
  stale = str(tmp_path / "stale")
  shutil.copytree(os.path.join(out, "work"), os.path.join(stale, "work"))
  with pytest.raises(stages.StageMismatch):
    alg1.Calibration(C.model, C.thash, C.cal, C.dev, stale, cfg2, capacity=CAP,
                     runner_for=C.runner_for)
  out2 = str(tmp_path / "matched")
  shutil.copytree(os.path.join(out, "work"), os.path.join(out2, "work"),
                  ignore=shutil.ignore_patterns("dev*.npz"))
  C2 = alg1.Calibration(C.model, C.thash, C.cal, C.dev, out2, cfg2, capacity=CAP,
                        runner_for=C.runner_for)
  rec2 = C2.run()
  assert not {"Runtime-V", "Runtime-D", "dev_keep"} & set(C2.timings) and "dev" in C2.timings
  assert rec2["config"]["decode_b"] == b
  for tau in {tuple(c["tau"]) for c in C2.dec_cands}:
    mine = [c for c in C2.dec_cands if tuple(c["tau"]) == tau]
    path = mine[0]["path_nominal"]
    assert min(abs(c["nominal_b"] - b) for c in mine) == min(abs(x - b) for x in path), tau
  dc = rec2["decode_candidates"]
  j = min(range(len(dc)), key=lambda k: (abs(dc[k]["dev"]["cost"] - b), -dc[k]["dev"]["acc"], k))
  # re-aimed by the measured decode B where the path's nearest step measured off it: never
  # farther than the best path point, each a step not measured before
  first = [c for c in dc if "aim" not in c]
  again = [c for c in dc if c.get("aim") == "matched"]
  best = min(abs(c["dev"]["cost"] - b) for c in first)
  assert abs(dc[j]["dev"]["cost"] - b) <= best
  assert best > alg1.MATCH_TOL
  assert again and "dev_decode_matched" in C2.timings, "nothing re-aimed though off the aim"
  assert len(again) <= alg1.MATCH_ROUNDS
  seen = [(tuple(c["tau"]), c["step"], c["window"]) for c in dc]
  assert len(seen) == len(set(seen))
  reached = [v for v in rec2["variants"] if v["reached"]]
  assert reached, "no variant reached its target: the test checks nothing"
  for v in reached:
    assert v["from"]["decode"] != "all-high" and v["from"]["decode"]["index"] == j, v["target"]
    assert tuple(v["from"]["decode"]["tau"]) != alg1.KEEP
  # resumed from its own work/: nothing runs again, the same variants (the re-aim replays)
  C3 = alg1.Calibration(C.model, C.thash, C.cal, C.dev, out2, cfg2, capacity=CAP,
                        runner_for=C.runner_for)
  rec3 = C3.run()
  assert not {"dev", "dev_decode_matched", "dev_composed", "dev_targets"} & set(C3.timings)
  assert rec3["variants"] == rec2["variants"]
  # another re-aim rule keys the stages from it on: a work/ of this one is refused
  monkeypatch.setattr(alg1, "MATCH_ROUNDS", alg1.MATCH_ROUNDS + 1)
  with pytest.raises(stages.StageMismatch):
    alg1.Calibration(C.model, C.thash, C.cal, C.dev, out2, cfg2, capacity=CAP,
                     runner_for=C.runner_for)
  assert C2.matched_decode([]) is None
  with pytest.raises(ValueError, match="decode_b must be in"):
    alg1.Calibration(C.model, C.thash, C.cal, C.dev, str(tmp_path / "bad"),
                     dataclasses.replace(cfg, decode_b=1.5), capacity=CAP, runner_for=C.runner_for)


def test_a_saved_variant_measures_what_its_record_says(targeted):
  C, rec, out, cfg = targeted
  v = next(v for v in rec["variants"] if v["target"] == 0.5)
  pol = P.load(os.path.join(out, v["policy"]), C.model.cfg, C.thash)
  res = S.run_stack(C.runner_for, C.dev, [pol], rows=CFG.rows, max_tokens=CFG.max_tokens)[0]
  assert alg1.total_b(res) == pytest.approx(v["measured_B_total"], abs=1e-9)
  assert 1 - C.error(res) == v["dev_accuracy"]


def test_target_stages_resume_and_are_keyed_by_the_targets(targeted, tmp_path):
  import dataclasses
  import shutil
  from calibrate.stages import StageMismatch
  C, rec, out, cfg = targeted
  work = str(tmp_path / "work")
  shutil.copytree(os.path.join(out, "work"), work)
  more = os.path.join(work, "dev_targets_more.npz")
  if os.path.exists(more):        # resume with round 1 saved and round 2 not yet
    os.remove(more)
  C2 = alg1.Calibration(C.model, C.thash, C.cal, C.dev, str(tmp_path), cfg, capacity=CAP)
  rec2 = C2.run()
  assert "dev_targets" not in C2.timings and "dev" not in C2.timings
  assert rec2["variants"] == rec["variants"]
  other = dataclasses.replace(cfg, targets=(0.5,))
  with pytest.raises(StageMismatch, match="args.targets"):
    alg1.Calibration(C.model, C.thash, C.cal, C.dev, str(tmp_path), other, capacity=CAP)


def test_pick_within_takes_the_most_accurate_that_fits():
  rows = [{"acc": 0.9, "total": 0.5}, {"acc": 0.8, "total": 0.2}, {"acc": 0.9, "total": 0.3},
          {"acc": 0.95, "total": 0.31}, {"acc": 0.8, "total": 0.1}, {"acc": 0.9, "total": 0.3}]
  assert alg1.pick_within(rows, 0.3) == 2          # equal to the target fits; tie: first row
  assert alg1.pick_within(rows, 0.31) == 3         # more accurate, though costlier
  assert alg1.pick_within(rows, 1.0) == 3
  assert alg1.pick_within(rows, 0.25) == 4         # accuracy tie: the lower B
  assert alg1.pick_within(rows, 0.05) is None


def test_keeps_prompt_reads_the_floors_not_the_thresholds_name():
  R, L, H = 0, 1, 2
  assert alg1.keeps_prompt(None)                                     # prefill all-high
  assert alg1.keeps_prompt({"tau": (0.0, 0.0), "floors": {(1, 0): L, (1, 1): H}})
  assert not alg1.keeps_prompt({"tau": alg1.KEEP, "floors": {(1, 0): L, (2, 2): R}})


def test_pick_within_prefers_keeping_the_prompt_within_the_band():
  """``Config.keep_se``: a composition that releases no prompt token wins among the fits within
  the band; outside it, or with the band off, the most accurate fit does.  On the 0.5B's own dev
  measurements (its committed calibration record) the B0.33 pick moves from the releasing
  composition (dev 0.708; 71.7 % on the test split) to the one that keeps every prompt token at
  L or above (dev 0.700)."""
  rows = [{"acc": 0.80, "total": 0.30}, {"acc": 0.78, "total": 0.32}, {"acc": 0.70, "total": 0.2},
          {"acc": 0.79, "total": 0.40}]
  keeps = [False, True, True, True]
  assert alg1.pick_within(rows, 0.33) == 0                          # band off
  se = (0.8 * 0.2 / 100) ** 0.5                                     # 0.04
  assert alg1.pick_within(rows, 0.33, keeps=keeps, band=1.0, n=100) == 1
  assert alg1.pick_within(rows, 0.33, keeps=keeps, band=0.4, n=100) == 0   # 0.02 > 0.4 se
  assert alg1.pick_within(rows, 0.33, keeps=keeps, band=0.5 + 1e-9, n=100) == 1   # 0.02 = 0.5 se
  assert alg1.pick_within(rows, 0.25, keeps=keeps, band=1.0, n=100) == 2   # the only fit
  assert alg1.pick_within(rows, 0.33, keeps=[False] * 4, band=9.0, n=100) == 0
  assert abs(se - 0.04) < 1e-12
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  rec = json.load(open(os.path.join(root, "policies", "qwen2.5-coder-0.5b-instruct-bfcl-centered",
                                    "calibration.json")))
  cands = rec["target_candidates"]
  dev = [{"acc": c["dev"]["acc"], "total": c["dev"]["total"]} for c in cands]
  keep = [c["source"]["prefill"] == "all-high" or
          tuple(c["source"]["prefill"]["tau"]) == alg1.KEEP for c in cands]
  tau = lambda j: cands[j]["source"]["prefill"]["tau"]
  j0 = alg1.pick_within(dev, 0.33)
  assert tau(j0) == [0.005, 0.01] and abs(dev[j0]["acc"] - 0.7083) < 1e-3
  j1 = alg1.pick_within(dev, 0.33, keeps=keep, band=1.0, n=rec["n_dev"])
  assert tuple(tau(j1)) == alg1.KEEP and abs(dev[j1]["acc"] - 0.700) < 1e-3
  assert abs(cands[j1]["source"]["prefill"]["b_p"] - 0.3393) < 1e-3


def test_to_reaim_keeps_what_overshot_by_noise_only_when_it_beats_every_fit():
  # The 1.5B's B0.20 (H200, 2026-12-03): fits at 0.149 (0.8125); aimed 0.2000371 (0.825) and
  # 0.2015 (0.85) overshot by noise yet beat it: both re-aimed.
  measured = [{"acc": 0.8125, "total": 0.1493}, {"acc": 0.8875, "total": 0.914}]
  aimed = [{"acc": 0.825, "total": 0.2000371}, {"acc": 0.85, "total": 0.2015},
           {"acc": 0.80, "total": 0.21}]
  assert alg1.to_reaim(measured + aimed, aimed, 0.2) == ([0, 1], False)
  # A fit as accurate as what overshot: nothing to re-aim.
  better = [{"acc": 0.85, "total": 0.19}]
  assert alg1.to_reaim(measured + aimed + better, aimed, 0.2) == ([], False)
  assert alg1.to_reaim(measured + aimed, aimed, 0.25) == ([], False)
  # Unreached: every aimed row, whatever its accuracy.
  assert alg1.to_reaim(aimed, aimed, 0.1) == ([0, 1, 2], True)
  assert alg1.to_reaim([], [], 0.3) == ([], True)


def test_aim_prefill_puts_the_total_on_the_target():
  s, b_d = 0.88, 0.64
  b_p = alg1.aim_prefill(0.2, s, b_d)
  assert s * b_p + (1 - s) * b_d == pytest.approx(0.2)
  assert alg1.aim_prefill(0.05, s, b_d) < 0       # the decode share alone is over it


def test_composed_estimate_takes_prefill_from_one_and_decode_from_the_other():
  def out(passed, pb, db, n_p, n_g):
    led = {"prefill_bits": pb, "decode_bits": db, "full_kv_bits": 10.0 * (n_p + n_g),
           "n_prompt": n_p, "n_gen": n_g}
    return S.Outcome(0, [], "", "stop", passed, 1.0, led, None, None, n_p)
  d = [out(True, 800.0, 50.0, 80, 20), out(True, 400.0, 100.0, 40, 10)]
  p = [out(True, 200.0, 200.0, 80, 20), out(False, 100.0, 100.0, 40, 10)]
  b, acc = alg1.composed_estimate(d, p)
  assert b == pytest.approx((200 + 50 + 100 + 100) / 1500) and acc == 0.5


@pytest.mark.parametrize("targets, msg", [
    ((0.0,), r"must be in \(0, 1\], got 0.0"), ((1.5,), "got 1.5"), ((-0.2,), "got -0.2"),
    ((float("nan"),), "got nan"), ((0.2, 0.201), "repeat B0.20"),
])
def test_bad_targets_are_refused(targets, msg):
  with pytest.raises(ValueError, match=msg):
    alg1.check_targets(targets)
  assert alg1.check_targets((0.15, 1.0)) == (0.15, 1.0)


def test_calibrate_cli_rejects_a_target_outside_0_1(tmp_path):
  from pask_jax.cli import main
  with pytest.raises(SystemExit) as e:
    main(["calibrate", "--out", str(tmp_path / "o"), "--targets", "0.25", "1.5"])
  assert str(e.value) == "error: --targets: target total B must be in (0, 1], got 1.5"


# ---- recent window as a calibrated knob (--windows) -------------------------------------------

@pytest.fixture(scope="module")
def windowed(setup, tmp_path_factory):
  """The setup's stages up to dev resumed with decode candidates also at W = 2 and 8 (and one
  target, so variants draw on them too)."""
  import dataclasses
  import shutil
  C, rec, out, model, tok = setup
  out2 = str(tmp_path_factory.mktemp("windows"))
  shutil.copytree(os.path.join(out, "work"), os.path.join(out2, "work"),
                  ignore=shutil.ignore_patterns("dev_composed.npz"))
  cfg = dataclasses.replace(CFG, windows=(2, 8), targets=(0.5,))
  C2 = alg1.Calibration(model, tok.hash(), C.cal, C.dev, out2, cfg, capacity=CAP,
                        runner_for=C.runner_for)   # the setup's compiled stack runners (W = 4)
  return C2, C2.run(), out2, rec


def test_windows_evaluate_every_decode_candidate_per_window_and_select_over_all(windowed):
  C, rec, out, rec0 = windowed
  rows = rec["decode_candidates"]
  n = len(rec0["decode_candidates"])
  assert [r["window"] for r in rows] == [CFG.window] * n + [2] * n + [8] * n
  assert [r["dev"] for r in rows[:n]] == [r["dev"] for r in rec0["decode_candidates"]]
  assert "dev" not in C.timings and "dev_windows" in C.timings
  # Eq. 9 over every (candidate, window): the cheapest measured decode cost within alpha_d.
  e_ref = 1 - rec["dev_reference_accuracy"]
  ok = [i for i, r in enumerate(rows) if r["dev"]["err"] - e_ref <= CFG.alpha_d + 1e-12]
  j = rec["selected"]["decode"]
  assert j in ok and rows[j]["dev"]["cost"] == min(rows[i]["dev"]["cost"] for i in ok)
  pol = P.load(os.path.join(out, "policy"), C.model.cfg, C.thash)
  assert pol.window == rows[j]["window"] == rec["composed"]["window"]
  v = rec["variants"][0]
  assert v["reached"] and v["measured_B_total"] <= 0.5


def test_a_window_candidate_measures_as_an_independent_run_at_that_window(windowed):
  C, rec, out, rec0 = windowed
  n = len(rec0["decode_candidates"])
  c = C.dec_cands[n]                      # the first candidate at W = 2
  assert c["window"] == 2 and c["policy"].window == 2
  tmpl = P.all_high(C.model.cfg, sink=CFG.sink, window=2)
  res = S.run_stack(S.runner_factory(C.model, tmpl, CAP), C.dev, [c["policy"]], rows=CFG.rows,
                    max_tokens=CFG.max_tokens)[0]
  assert alg1.total_b(res) == pytest.approx(rec["decode_candidates"][n]["dev"]["total"], abs=1e-9)
  assert C.stage_cost(res, "decode") == pytest.approx(rec["decode_candidates"][n]["dev"]["cost"])


def test_windows_key_the_stages_that_depend_on_them(windowed, setup):
  C, rec, out, rec0 = windowed
  from calibrate import stages
  meta = stages.read_meta(stages.path(os.path.join(out, "work"), "dev_composed"))
  assert meta["fingerprint"]["args"]["windows"] == [2, 8]
  # Without windows the keys are those of a run that never knew them (older runs resume).
  assert "windows" not in setup[0].keys["dev_composed"]["args"]


@pytest.mark.parametrize("argv, msg", [
    (["--windows", "0"], "error: --windows: recent window W must be an integer >= 1, got 0"),
    (["--windows", "8", "8"], "error: --windows: windows repeat: [8, 8]"),
])
def test_calibrate_cli_rejects_bad_windows(tmp_path, argv, msg):
  from pask_jax.cli import main
  with pytest.raises(SystemExit) as e:
    main(["calibrate", "--out", str(tmp_path / "o")] + argv)
  assert str(e.value) == msg


def test_target_thresholds_lift_h_floors_before_any_release(targeted):
  """Relaxation order: the configured thresholds, then H floors lifted to L with release kept
  as strict as configured (no floor that was not R becomes R), then floors that may release."""
  C, rec, out, cfg = targeted
  taus = C.target_taus()
  steps = [s for _, s in taus]
  assert steps == sorted(steps, key=["configured", "lift", "release"].index)
  assert "release" in steps and taus[-1][0] == alg1.NO_FLOOR
  strict = C.floors("prefill", tuple(min(cfg.prefill_thresholds)))
  for tau, step in taus:
    f = C.floors("prefill", tau)
    if step == "lift":
      assert all(f[k] != Act.R or strict[k] == Act.R for k in f)
      assert all(a != Act.H for a in f.values()) or tau[1] < 1.0
  # The last lift (target rule 4) releases nothing of the prompt: every floor L, unless an
  # earlier threshold had those floors already.
  keep = C.floors("prefill", alg1.KEEP)
  assert set(keep.values()) == {Act.L}
  assert keep in [C.floors("prefill", t) for t, s in taus if s != "release"]
  rows = [c for c in rec["target_candidates"] if c["source"]["kind"] == "aimed"]
  assert rows and all("aimed_at" in c["source"] for c in rows)


def test_targets_aim_with_a_decode_stage_that_releases_nothing(targeted):
  """Target rule 3: besides the selected and the cheapest decode stage, the prefill is aimed
  with one that keeps every generated token at L or above (floors all L, nothing forced H),
  measured alone on dev first and recorded among the target candidates."""
  C, rec, out, cfg = targeted
  keep = [c for c in C.dec_cands if c["tau"] == alg1.KEEP]
  assert len(keep) == 1 and keep[0]["step"] == 0
  assert set(keep[0]["floors"].values()) == {Act.L} and keep[0]["map"] == keep[0]["floors"]
  kept = [c for c in rec["target_candidates"] if c["source"]["kind"] == "decode kept"]
  assert len(kept) == 1 and kept[0]["source"]["prefill"] == "all-high"
  assert kept[0]["source"]["decode"]["tau"] == list(alg1.KEEP)
  # Every generated token stored at L or H: the measured decode cost is at least all-L's.
  low = float(C.cost[Act.L].sum() / C.c_full)
  assert kept[0]["dev"]["decode"] >= low - 1e-6
  aimed = [c for c in rec["target_candidates"] if c["source"]["kind"] == "aimed"
           and c["source"]["decode"] != "all-high"
           and c["source"]["decode"]["tau"] == list(alg1.KEEP)]
  assert aimed, "no target candidate was aimed with the kept decode stage"
  assert "dev_keep" in C.timings


# ---- Alg. 1 under the paper's ablations (Fig. 5; tests/test_ablations.py has the rest) ---------

ABL_CFG = dataclasses.replace(CFG, thresholds=((0.0, 0.0),), prefill_thresholds=((0.0, 0.0),),
                              b_p_grid=(0.5,), path_points=2)


@pytest.fixture(scope="module")
def ablated(setup, tmp_path_factory):
  """Alg. 1 under an ablation (one run each, on demand) from the setup's saved stages that the
  ablation does not change (so not keyed by it): the reference; Runtime-V and Runtime-D under
  the component ablations (the same buckets); Runtime-D under no-layer (it measures every
  group of a key at once).  Returns (Calibration, record, out)."""
  from calibrate import stages
  C0, rec0, out0, model, tok = setup
  runs: dict = {}

  def run(ablation, run_all=True):
    if (ablation, run_all) not in runs:
      out = str(tmp_path_factory.mktemp(ablation))
      work = os.path.join(out, "work")
      os.makedirs(work)
      shared = ["reference"] + (["runtime_v", "runtime_d"] if ablation in T.COMPONENT_ABLATIONS
                                else ["runtime_d"] if ablation == "no-layer" else [])
      for name in shared:
        shutil.copy(stages.path(os.path.join(out0, "work"), name), stages.path(work, name))
      C = alg1.Calibration(model, tok.hash(), C0.cal, C0.dev, out,
                           dataclasses.replace(ABL_CFG, ablation=ablation), capacity=CAP,
                           runner_for=C0.runner_for)   # the setup's compiled stack runners
      rec = C.run() if run_all else None
      assert "reference (cal)" not in C.timings
      runs[ablation, run_all] = (C, rec, out)
    return runs[ablation, run_all]

  run.setup_V, run.setup_D = C0.V, C0.D
  run.setup_floors = {**C0.floors("decode", (0.0, 0.0)), **C0.floors("prefill", (0.0, 0.0))}
  return run


def _final_entries(C, selected) -> dict:
  """The entries the saved policy was packed from: the selected decode and prefill candidates'
  (``calibration.json`` ``selected``)."""
  d, p = selected["decode"], selected["prefill"]
  return C.composed_entries(None if d is None else C.dec_cands[d],
                            None if p is None else C.pre_cands[p])


def _saved(out):
  pol = P.load(os.path.join(out, "policy"))
  return pol, json.load(open(os.path.join(out, "calibration.json")))


@pytest.mark.parametrize("ablation", T.KEY_ABLATIONS)
def test_key_ablations_bucket_and_intervene_over_their_keys(setup, ablated, ablation):
  """Stages 2-3 of a key ablation, without generating: its buckets are the full method's
  merged by key (counts summed), and a single-bucket intervention acts on every tag id of
  that key, in its group only."""
  C0 = setup[0]
  C, _, _ = ablated(ablation, run_all=False)
  C.reference()
  C.buckets()
  merged: dict = {}
  for i, n in C0.nbar_dec.items():
    k = T.coarsen(i, ablation)
    merged[k] = merged.get(k, 0.0) + n
  assert C.nbar_dec == pytest.approx(merged) and C.nbar_pre == C0.nbar_pre
  if ablation == "no-state":
    assert len(merged) < len(C0.nbar_dec)      # the reference has ids this key merges
  assert C.dec_buckets == [(k, g) for k in sorted(merged) for g in range(3)]
  ids = T.all_ids()
  for k in sorted(merged):
    pol = C.intervention_policy("decode", k, 1, Act.R)
    assert P.ablation_of(pol) == ablation
    action = np.asarray(pol.action)
    for i in ids:
      ki = T.coarsen(i, ablation)
      if ki == k:
        assert action[i].tolist() == [Act.H, Act.R, Act.H], T.describe(i)
      elif ki in merged:
        assert action[i].tolist() == [Act.H] * 3, T.describe(i)


def test_no_layer_calibrates_one_bucket_per_key_tied_over_the_groups(ablated, setup):
  C, rec, out = ablated("no-layer")
  pol, saved = _saved(out)
  assert P.ablation_of(pol) == "no-layer" and saved["ablation"]["name"] == "no-layer"
  assert saved["config"]["ablation"] == "no-layer"
  assert {g for _, g in C.dec_buckets + C.pre_buckets} == {0}
  assert len(C.V) == 2 * (len(C.dec_buckets) + len(C.pre_buckets)) > 0
  assert all(k[2] == 0 for k in C.V) and all(name.split(":")[-2] == "gall" for name in saved["V"])
  # Runtime-D is the full method's (resumed); the bucket's D sums its groups.
  assert "Runtime-D" not in C.timings and C.D == setup[0].D
  # A no-layer intervention acts on every group of its key.
  i = sorted(C.nbar_dec)[0]
  assert np.asarray(C.intervention_policy("decode", i, 0, Act.L).action)[i].tolist() == [Act.L] * 3
  # Tied across the groups: actions, floors and stored priorities of every id, in the saved
  # policy and in every decode candidate.
  for p in [pol] + [c["policy"] for c in C.dec_cands + C.pre_cands]:
    for x in (p.action, p.floor):
      x = np.asarray(x)
      assert (x == x[:, :1]).all()
    pr = np.asarray(p.prio)
    np.testing.assert_array_equal(pr, np.repeat(pr[:, :1], 3, axis=1))
  ups = [c for c in C.dec_cands if c["step"] > 0]
  assert ups, "no decode candidate upgraded anything"
  # One greedy step upgrades a key in every group at once.
  for c in ups:
    full = C.expand(c["map"])
    assert all(a == full[(i, 0)] for (i, g), a in full.items())


def test_no_floors_has_no_floors_and_skips_runtime_v(ablated):
  C, rec, out = ablated("no-floors")
  pol, saved = _saved(out)
  assert C.V == {} and "Runtime-V" not in C.timings and saved["V"] == {}
  # Runtime-D resumed from the full method's stage (the same buckets): the D-ranking is kept.
  assert "Runtime-D" not in C.timings and C.D == ablated.setup_D and saved["D"]
  # The full method has floors above R on these V (at the strictest threshold, the one kept).
  assert set(ablated.setup_floors.values()) != {Act.R}
  assert all(c["floors"] == {b: Act.R for b in C.dec_buckets} for c in C.dec_cands)
  ids = sorted(C.nbar_dec) + sorted(C.nbar_pre)
  sel = saved["selected"]
  for p, ent in ([(c["policy"], C.composed_entries(c, None)) for c in C.dec_cands]
                 + [(c["policy"], C.composed_entries(None, c)) for c in C.pre_cands]
                 + [(pol, _final_entries(C, sel))]):
    ent = sorted(ent)
    assert (np.asarray(p.floor)[ent] == Act.R).all()
    assert p is pol or set(ids) & set(ent)
  assert {tuple(c["tau"]) for c in saved["decode_candidates"]} == {alg1.NO_FLOOR}


def test_fixed_order_ignores_the_distortion(ablated, monkeypatch):
  from calibrate import distortion
  boom = lambda *a, **k: pytest.fail("fixed-order computed a distortion")
  monkeypatch.setattr(distortion, "capture", boom)
  monkeypatch.setattr(distortion, "distortion", boom)
  C, rec, out = ablated("fixed-order")
  pol, saved = _saved(out)
  assert C.D == {} and saved["D"] == {} and "Runtime-D" not in C.timings
  assert C.rho_dec == alg1.fixed_order(C.dec_buckets)
  assert C.rho_pre == alg1.fixed_order(C.pre_buckets)
  # Floors still come from Runtime-V (the full method's stage, resumed); the stored priorities
  # are the fixed order's.
  assert C.V == ablated.setup_V and "Runtime-V" not in C.timings
  for c in C.dec_cands:
    prio = np.asarray(c["policy"].prio)
    for (i, g), want in alg1.fixed_order(C.dec_buckets).items():
      assert prio[i, g].tolist() == pytest.approx(list(want))
  want = {**alg1.fixed_order(C.dec_buckets), **alg1.fixed_order(C.pre_buckets)}
  prio = np.asarray(pol.prio)
  for i, e in _final_entries(C, saved["selected"]).items():   # the saved policy: fixed-order
    if e.prio is not None:                                      # scores or none
      np.testing.assert_allclose(prio[i], [want[(i, g)] for g in range(3)], rtol=1e-6)


def test_an_ablation_keys_the_runtime_stages(ablated, tmp_path):
  from calibrate.stages import StageMismatch
  C, rec, out = ablated("no-layer")
  model, tok, cal, dev = C.model, C.thash, C.cal, C.dev
  with pytest.raises(StageMismatch, match="ablation"):
    alg1.Calibration(model, tok, cal, dev, out, ABL_CFG, capacity=CAP)
  with pytest.raises(ValueError, match="unknown ablation"):
    alg1.Calibration(model, tok, cal, dev, str(tmp_path),
                     dataclasses.replace(ABL_CFG, ablation="no-thing"), capacity=CAP)


def test_no_transition_buckets_are_position_bins_and_its_rows_see_them(ablated):
  """no-transition from the shared reference: ten bins each reached by 75% of the calibration
  requests (one category here), the reference's decode tags remapped to them (stops kept), and
  a stacked run of one of its interventions feeds its rows the bins and the unseen state."""
  C, _, _ = ablated("no-transition", run_all=False)
  ref = C.reference()
  lengths = np.asarray([len(o.tokens) for o in ref])
  assert len(C.bins) == alg1.N_POSITION_BINS and C.bins[0] == 0
  assert all(np.mean(lengths > b) >= alg1.POSITION_REACH for b in C.bins)
  pos = {T.position_id(k) for k in range(len(C.bins))}
  for o in ref:
    t = np.asarray(o.tags)[:len(o.tokens)]
    stop = (t == T.STOP).any(1)
    assert set(t[~stop, 0].tolist()) <= pos and (t[~stop, 1:] == T.PAD).all()
    assert int(t[0, 0]) == T.position_id(0) and (np.asarray(o.states) == -1).all()
  C.buckets()
  assert set(C.nbar_dec) <= pos and len(C.nbar_dec) == len(C.bins)
  i = T.position_id(len(C.bins) - 1)
  pol = C.intervention_policy("decode", i, 2, Act.R)
  assert P.position_bins(pol) == C.bins
  out = S.run_stack(C.runner_for, C.cal, [pol], rows=CFG.rows, max_tokens=CFG.max_tokens)[0]
  for o in out:
    t = np.asarray(o.tags)
    stop = (t == T.STOP).any(1)
    want = [T.position_id(T.position_bin(j, C.bins)) for j in range(len(t))]
    assert t[~stop, 0].tolist() == [w for w, s in zip(want, stop) if not s]
    assert (np.asarray(o.states) == -1).all()
