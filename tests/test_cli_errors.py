"""Issue 16 item 7: the CLI answers bad input with one line naming the problem, before loading
a model where it can (no traceback from inside a library)."""
import json

import pytest

from pask_jax import cli
from pask_jax import policy as P


def _saved(tmp_path, **change):
  d = tmp_path / "pol"
  P.save(P.demo(), d)
  rec = json.loads((d / "policy.json").read_text())
  rec.update(change)
  (d / "policy.json").write_text(json.dumps(rec))
  return str(d)


def _exit(argv) -> str:
  with pytest.raises(SystemExit) as e:
    cli.main(argv)
  return str(e.value.code)


@pytest.mark.parametrize("record,why", [
    ([], "a policy record is a JSON object, not a list"),
    ({"format": "pask-policy/1"}, "lacks 'n_groups'"),
    ("{not json", "is not valid JSON"),
])
def test_bad_policy_json(tmp_path, record, why):
  d = tmp_path / "pol"
  d.mkdir()
  (d / "policy.json").write_text(record if isinstance(record, str) else json.dumps(record))
  for cmd in (["generate", "--prompt", "hi"], ["serve"]):
    msg = _exit(cmd + ["--policy", str(d)])
    assert msg.startswith("error: policy ") and why in msg and "\n" not in msg


def test_policy_out_of_range_fields(tmp_path):
  msg = _exit(["generate", "--prompt", "hi", "--policy", _saved(tmp_path, window=-1)])
  assert "'window' must be an integer >= 1, got -1" in msg
  msg = _exit(["generate", "--prompt", "hi", "--policy", _saved(tmp_path, n_groups=0)])
  assert "'n_groups' must be an integer >= 1, got 0" in msg
  with pytest.raises(ValueError, match="window=-1"):   # the cache names the value too
    from pask_jax import cache
    cache.init(1, 1, 1, 8, capacity=16, window=-1)


def test_policy_that_is_a_file_or_missing(tmp_path):
  f = tmp_path / "policy.json"
  f.write_text("{}")
  msg = _exit(["generate", "--prompt", "hi", "--policy", str(f)])
  assert "is a file, not a policy directory" in msg and "all-high" in msg
  msg = _exit(["serve", "--policy", str(tmp_path / "nope")])
  assert "policy directory not found" in msg
  (tmp_path / "empty").mkdir()
  assert "has no policy.json" in _exit(["generate", "--prompt", "x", "--policy",
                                        str(tmp_path / "empty")])


def test_policy_without_arrays(tmp_path):
  d = _saved(tmp_path)
  import shutil
  shutil.rmtree(f"{d}/arrays")
  with pytest.raises(FileNotFoundError, match="no arrays/ directory"):
    P.load(d)


@pytest.mark.parametrize("argv,why", [
    (["generate", "--prompt", "", "--raw"], "--prompt is empty"),
    (["generate", "--prompt", "hi", "--temperature", "-1"], "--temperature must be in [0, 2]"),
    (["generate", "--prompt", "hi", "--temperature", "nan"], "--temperature must be in [0, 2]"),
    (["generate", "--prompt", "hi", "--top-p", "0"], "--top-p must be in (0, 1]"),
    (["serve", "--slots", "0"], "--slots: expected a positive integer"),
    (["serve", "--max-json-depth", "-3"], "--max-json-depth must be positive"),
    (["serve", "--port", "70000"], "--port must be in"),
])
def test_bad_arguments(argv, why, capsys):
  assert _exit(argv) == "2"
  err = capsys.readouterr().err
  assert why in err and "Traceback" not in err


@pytest.mark.parametrize("extra,why", [
    (["--methods", "h2o", "int4"], "no tuning grid for 'int4'"),
    (["--methods", "h2o", "--budget", "0.33", "1.5"], "budget B must be in (0, 1]"),
])
def test_tune_refuses_before_loading_a_model(tmp_path, monkeypatch, extra, why):
  from pask_jax import platform
  monkeypatch.setattr(platform, "load_model_or_exit",
                      lambda *a, **k: pytest.fail("loaded a model for a tune that cannot run"))
  msg = _exit(["tune", "--out", str(tmp_path / "t")] + extra)
  assert msg.startswith("error: ") and why in msg and "\n" not in msg
  assert not (tmp_path / "t").exists()
