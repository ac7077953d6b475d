"""``pask-jax policy derive`` (calibrate.variant) and ``calibrate --target-b``: variants at another
total B derived from the committed calibrated policies' dev measurements, no model loaded."""
from __future__ import annotations

import argparse
import json
import os
import shutil

import numpy as np
import pytest

from calibrate import cli as calibrate_cli
from calibrate import evaluate as E
from calibrate import variant
from pask_jax import policy as P
from pask_jax.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The 1.5B policy of session 3 (target rule 2, uncentered keys), whose variants B0.20 and B0.25
# share their decode stage; kept here because the committed policy is recalibrated.
P15 = os.path.join(ROOT, "tests", "data", "policy15_rule2")  # variants measured
P05 = os.path.join(ROOT, "policies", "qwen2.5-coder-0.5b-instruct-bfcl")  # top-level measured
CAL05 = os.path.join(ROOT, "bench", "results", "2026-12-01_calibrate", "calibration.json")
CAL15 = os.path.join(ROOT, "bench", "results", "2026-12-02_session3",
                     "cal15_rule2_calibration.json")


@pytest.fixture(scope="module")
def p15(tmp_path_factory):
  """The session-3 1.5B policy without its B0.25 variant (derived here, compared with it)."""
  d = str(tmp_path_factory.mktemp("p15") / "policy")
  shutil.copytree(P15, d, ignore=lambda where, names: ["B0.25"] if where == P15 else [])
  return d


@pytest.fixture(scope="module")
def cal05(tmp_path_factory):
  """The 0.5B policy as ``pask-jax calibrate`` lays it out: OUT/policy beside OUT/calibration.json
  (its variants were derived, not calibrated: their records hold no measurement)."""
  out = tmp_path_factory.mktemp("cal05")
  shutil.copytree(P05, out / "policy")
  shutil.copy(CAL05, out / "calibration.json")
  return str(out / "policy")


def derive(*argv) -> None:
  assert main(["policy", "derive", *argv]) == 0


def refused(*argv) -> str:
  with pytest.raises(SystemExit) as e:
    main(["policy", "derive", *argv])
  msg = str(e.value)
  assert msg.startswith("error: ") and "\n" not in msg
  return msg


def test_derived_variant_is_the_calibrated_one_but_for_the_aimed_prefill_budget(p15, capsys):
  derive(p15, "--target-b", "0.25")
  assert "predicted total B 0.250" in capsys.readouterr().out
  mine, theirs = P.load(os.path.join(p15, "B0.25")), P.load(os.path.join(P15, "B0.25"))
  base = P.load(os.path.join(p15, "B0.20"))
  # The derivation is its base (the nearest measured composition, B0.20) with B_P re-aimed.
  for k in ("action", "floor", "prio", "crit", "reserve", "pooled", "b_d"):
    np.testing.assert_array_equal(np.asarray(getattr(mine, k)), np.asarray(getattr(base, k)))
  assert mine.window == theirs.window == base.window and mine.sink == theirs.sink
  # Calibration aimed its B0.25 (under other prefill thresholds, target rule 2) from the decode
  # candidate's own dev run, the derivation from the measured B0.20 composition: both aim the
  # same decode stage at 0.25, so the same B_P within 0.001.
  np.testing.assert_array_equal(np.asarray(mine.b_d), np.asarray(theirs.b_d))
  assert abs(float(mine.b_p) - float(theirs.b_p)) < 1e-3
  rec = mine.record
  v = rec["extra"]["variant"]
  assert rec["budgets"]["b_p"] == v["b_p"] == v["predicted_B_prefill"]
  assert abs(float(mine.b_p) - v["b_p"]) < 1e-7
  # Paths relative to the variant's directory (true in any clone of a committed variant).
  assert v["source_policy"] == ".."
  assert os.path.normpath(os.path.join(p15, "B0.25", v["source_policy"])) == p15
  assert v["base"] == "B0.20"
  assert v["requested_B"] == v["target"] == 0.25 and v["rule"] == variant.RULE
  assert v["measured"] is False and v["measured_B_total"] is None and v["dev_accuracy"] is None
  base = json.load(open(os.path.join(p15, "B0.20", "policy.json")))["extra"]["variant"]
  assert v["base_measured"]["B_total"] == base["measured_B_total"]
  s = v["prompt_share"]
  assert abs(s * v["b_p"] + (1 - s) * base["measured_B_decode"] - 0.25) < 1e-12
  assert abs(v["predicted_B_total"] - 0.25) < 1e-12
  assert rec["extra"]["name"] == "derived B0.25"
  # eval --budget finds it; a later derivation does not take the prediction as a measurement.
  assert E.pick_policy(p15, 0.25) == (os.path.join(p15, "B0.25"), 0.25)
  out = os.path.join(os.path.dirname(p15), "elsewhere", "B0.26")
  derive(p15, "--target-b", "0.26", "--out", out)
  assert json.load(open(os.path.join(out, "policy.json")))["extra"]["variant"]["base"] == "B0.20"
  assert E.pick_policy(out, None) == (out, 0.26)


def test_derived_from_the_calibration_record_of_the_top_level_policy(cal05):
  derive(cal05, "--target-b", "0.3")
  v = P.read_record(os.path.join(cal05, "B0.30"))["extra"]["variant"]
  comp = json.load(open(CAL05))["composed"]
  assert v["base"] == "top-level"
  assert v["calibration_record"] == os.path.join("..", "..", "calibration.json")
  assert v["source_policy"] == ".."
  # Decode measured 0: B_P = B / s, s = total / prefill.
  share = comp["measured_B_total"] / comp["measured_B_prefill"]
  assert abs(v["b_p"] - 0.3 / share) < 1e-9 and abs(v["prompt_share"] - share) < 1e-9
  # The floors (prefill thresholds 0.02/0.05) measured 0.2498 at B_P 0.25 on dev: no lower B_P.
  assert abs(v["floor_bound_B_prefill"] - 0.2498004612766142) < 1e-12
  assert E.pick_policy(cal05, 0.3)[0] == os.path.join(cal05, "B0.30")
  msg = refused(cal05, "--target-b", "0.2")
  assert "not reachable offline" in msg and "lowest predicted total B is 0.221" in msg


def test_committed_05b_variants_are_what_derive_writes(tmp_path):
  """policies/qwen2.5-coder-0.5b-instruct-bfcl/B0.33 … B0.60 are ``pask-jax policy derive
  POLICY --target-b B --calibration bench/results/2026-12-01_calibrate/calibration.json``:
  deriving them again gives the same tables, budgets and record (paths relative to each)."""
  d = str(tmp_path / "policies" / "p05")
  shutil.copytree(P05, d, ignore=lambda where, names: [n for n in names if n.startswith("B0.")]
                  if where == P05 else [])
  cal = tmp_path / "bench" / "results" / "2026-12-01_calibrate" / "calibration.json"
  os.makedirs(cal.parent)
  shutil.copy(CAL05, cal)    # the same relative place as in the repository
  for b in ("0.33", "0.40", "0.50", "0.60"):
    derive(d, "--target-b", b, "--calibration", str(cal))
    mine, theirs = P.load(os.path.join(d, f"B{b}")), P.load(os.path.join(P05, f"B{b}"))
    for k in ("action", "floor", "prio", "crit", "reserve", "pooled", "b_d", "b_p"):
      np.testing.assert_array_equal(np.asarray(getattr(mine, k)), np.asarray(getattr(theirs, k)))
    assert mine.record == theirs.record
    v = theirs.record["extra"]["variant"]
    assert v["rule"] == variant.RULE and v["base"] == "top-level" and v["measured"] is False
    assert v["source_policy"] == ".." and os.path.isfile(
        os.path.join(P05, f"B{b}", v["calibration_record"]))
    assert abs(v["predicted_B_total"] - float(b)) < 1e-12


@pytest.mark.parametrize("b", ["0", "1.5", "-0.2", "nan"])
def test_budget_outside_0_1_is_refused(p15, b):
  assert "target total B must be in (0, 1]" in refused(p15, "--target-b", b)


def test_bad_input_is_one_line(p15, cal05, tmp_path):
  demo = str(tmp_path / "demo")
  shutil.copytree(os.path.join(ROOT, "policies", "demo"), demo)
  assert "has no calibration record" in refused(demo, "--target-b", "0.3")
  no_cal = str(tmp_path / "p05")
  shutil.copytree(P05, no_cal)       # derived variants: no measured B anywhere
  assert "has no calibration record" in refused(no_cal, "--target-b", "0.3")
  assert "not reachable offline" in refused(p15, "--target-b", "0.02")
  assert "already has the variant B0.20" in refused(p15, "--target-b", "0.2")
  assert "is a variant of the policy" in refused(os.path.join(p15, "B0.15"), "--target-b", "0.3")
  assert "does not describe policy" in refused(cal05, "--target-b", "0.3", "--calibration", CAL15)
  assert "calibration record not found" in refused(p15, "--target-b", "0.3", "--calibration",
                                                   str(tmp_path / "none.json"))
  assert "policy directory not found" in refused(str(tmp_path / "nothing"), "--target-b", "0.3")
  out = os.path.join(p15, "B0.15")
  assert "already holds a policy" in refused(p15, "--target-b", "0.3", "--out", out)
  assert "names another budget" in refused(p15, "--target-b", "0.3", "--out",
                                          str(tmp_path / "B0.99"))


def test_calibration_record_given_explicitly_adds_the_top_level_policy(p15, tmp_path):
  out = str(tmp_path / "B0.50")
  derive(p15, "--target-b", "0.5", "--calibration", CAL15, "--out", out)
  v = P.read_record(out)["extra"]["variant"]
  comp = json.load(open(CAL15))["composed"]
  # Nearest measured total: the top-level policy (0.551) beats B0.33 (0.330).
  assert v["base"] == "top-level" and v["base_measured"]["B_total"] == comp["measured_B_total"]


def _calibrate_args(*argv):
  ap = argparse.ArgumentParser()
  calibrate_cli.add_parser(ap.add_subparsers(dest="cmd"))
  return ap.parse_args(["calibrate", "--out", "o", *argv])


def test_calibrate_keeps_within_one_se_by_default_when_it_has_targets():
  from calibrate import alg1
  assert alg1.Config.keep_se == 1.0
  of = lambda *argv: calibrate_cli.keep_se_of(a := _calibrate_args(*argv),
                                              calibrate_cli.targets_of(a))
  assert of("--targets", "0.2", "0.33") == 1.0 and of("--target-b", "0.2") == 1.0
  assert of() == 0.0                                    # no variants to choose among
  assert of("--targets", "0.2", "--keep-within-se", "0") == 0.0     # the paper's rule
  assert of("--targets", "0.2", "--keep-within-se", "2.5") == 2.5
  assert of("--keep-within-se", "0") == 0.0


def test_calibrate_no_decode_keep_needs_targets(tmp_path):
  assert _calibrate_args("--targets", "0.2", "--no-decode-keep").no_decode_keep
  assert not _calibrate_args("--targets", "0.2").no_decode_keep
  with pytest.raises(SystemExit) as e:
    main(["calibrate", "--out", str(tmp_path / "o"), "--no-decode-keep"])
  assert str(e.value) == ("error: --no-decode-keep chooses among target variants: give "
                          "--targets")
  assert _calibrate_args("--targets", "0.2", "--decode-b", "0.21").decode_b == 0.21
  with pytest.raises(SystemExit) as e:
    main(["calibrate", "--out", str(tmp_path / "o"), "--decode-b", "0.21"])
  assert str(e.value) == ("error: --decode-b matches the target variants' decode stage: give "
                          "--targets")
  with pytest.raises(SystemExit) as e:
    main(["calibrate", "--out", str(tmp_path / "o"), "--targets", "0.2", "--decode-b", "0"])
  assert str(e.value) == "error: --decode-b must be in (0, 1], got 0"
  assert _calibrate_args().min_count == 1 and _calibrate_args("--min-count", "8").min_count == 8
  with pytest.raises(SystemExit) as e:
    main(["calibrate", "--out", str(tmp_path / "o"), "--min-count", "0"])
  assert str(e.value) == "error: --min-count must be at least 1, got 0"


def test_calibrate_target_b_is_the_single_target_spelling(tmp_path):
  one = calibrate_cli.targets_of(_calibrate_args("--target-b", "0.2"))
  assert one == calibrate_cli.targets_of(_calibrate_args("--targets", "0.2")) == (0.2,)
  assert calibrate_cli.targets_of(_calibrate_args()) == ()
  with pytest.raises(SystemExit) as e:
    main(["calibrate", "--out", str(tmp_path / "o"), "--target-b", "0.2", "--targets", "0.3"])
  assert str(e.value) == ("error: give --target-b B (one target) or --targets B ... (several), "
                          "not both")
  with pytest.raises(SystemExit) as e:
    main(["calibrate", "--out", str(tmp_path / "o"), "--target-b", "1.5"])
  assert str(e.value) == "error: --target-b: target total B must be in (0, 1], got 1.5"
