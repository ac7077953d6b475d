"""``pask-jax eval`` / ``tune`` on a user's JSONL task file (calibrate.evaluate.JsonlSuite): the
splits, the scorer, one-line errors before any model loads, and the CLI's plumbing (the run
itself: tests/test_eval.py's JSONL test, on that file's session)."""
import json
import os

import numpy as np
import pytest

from calibrate import evaluate as E
from calibrate import tasks

RNG = np.random.default_rng()
HERE = os.path.dirname(os.path.abspath(__file__))
TOOLS = json.load(open(os.path.join(os.path.dirname(HERE), "examples", "weather_tools.json")))
CITIES = ["Paris", "Oslo", "Lima", "Quito", "Hanoi", "Accra", "Perth", "Bergen"]


def case(i, city, kind="tools"):
  msgs = [{"role": "user", "content": f"Weather in {city}?"}]
  if kind == "tools":
    return {"id": f"c{i}", "messages": msgs, "tools": TOOLS,
            "expected": [{"name": "get_weather", "arguments": {"city": city}}]}
  return {"id": f"c{i}", "messages": msgs, "schema": {"enum": ["sun", "rain"]},
          "scorer": "json_valid", "category": "verdict"}


def write(path, rows):
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return str(path)


def test_splits_are_the_file_and_calibrations_halves(tmp_path):
  n = int(RNG.integers(4, 9))
  cities = list(RNG.permutation(CITIES))
  rows = [case(i, cities[i % len(cities)], "tools" if i % 3 else "schema") for i in range(n)]
  cases = tasks.read_jsonl(write(tmp_path / "t.jsonl", rows))
  seed = int(RNG.integers(1000))
  suite = E.JsonlSuite(cases, None, "llama", None, seed=seed)
  assert [c.id for c in suite.cases("test")] == [r["id"] for r in rows]   # every case, in order
  cal, dev = tasks.split_jsonl(cases, seed)
  assert [c.id for c in suite.cases("cal")] == [c.id for c in cal]
  assert [c.id for c in suite.cases("development")] == [c.id for c in dev]
  assert {c.category for c in suite.cases("test", ["verdict"])} == {"verdict"}
  second = {}
  for r in rows:      # per category, the second case in file order (skip 1, at most 1)
    k = r.get("category", "tools")
    second[k] = second.get(k, []) + [r["id"]]
  want = [r["id"] for r in rows if r["id"] in [v[1] for v in second.values() if len(v) > 1]]
  assert [c.id for c in suite.cases("test", None, 1, skip=1)] == want
  with pytest.raises(ValueError, match="category simple_python not in the task file"):
    suite.cases("test", ["simple_python"])


def test_check_answer_names_pass_and_failure(tmp_path):
  city = str(RNG.choice(CITIES))
  c, s = tasks.read_jsonl(write(tmp_path / "t.jsonl", [case(0, city), case(1, city, "schema")]))
  good = json.dumps([{"name": "get_weather", "arguments": {"city": city}}])
  assert tasks.check_answer(c, good, True, "json_list") == {
      "calls": [{"name": "get_weather", "arguments": {"city": city}}], "passed": True,
      "per_call": 1.0, "error": ""}
  other = good.replace(city, city + "x")
  r = tasks.check_answer(c, other, True, "json_list")
  assert (r["passed"], r["per_call"], r["error"]) == (False, 0.0, "differs")
  assert tasks.check_answer(c, good, False, "json_list")["error"] == "incomplete output"
  assert tasks.check_answer(c, good[:-3], True, "json_list")["error"].startswith("unparseable")
  assert tasks.check_answer(s, '"rain"', True)["passed"]
  assert tasks.check_answer(s, '"snow"', True)["error"] == "invalid"


@pytest.mark.parametrize("cmd", ["eval", "tune"])
@pytest.mark.parametrize("argv, msg", [
    (["--task", "jsonl"], "error: --task jsonl needs --data FILE"),
    (["--task", "jsonl", "--data", "GOOD", "--categories", "simple_python"],
     "error: category simple_python not in the task file (it has tools)"),
    (["--task", "jsonl", "--data", "ONE", "--split", "dev"],
     "error: 1 case(s): calibration and development need at least 2"),
    (["--task", "jsonl", "--data", "BAD"], "error: BAD, line 2: not valid JSON"),
    (["--data", "GOOD"], "error: --data applies to --task jsonl"),
])
def test_bad_task_input_is_one_line_before_the_model_loads(tmp_path, monkeypatch, cmd, argv,
                                                             msg):
  from pask_jax import cli, platform
  monkeypatch.setattr(platform, "load_model",
                      lambda *a, **k: pytest.fail("model loaded before the check"))
  files = {"GOOD": write(tmp_path / "g.jsonl", [case(0, "Paris"), case(1, "Oslo")]),
           "ONE": write(tmp_path / "o.jsonl", [case(0, "Paris")])}
  files["BAD"] = str(tmp_path / "b.jsonl")
  (tmp_path / "b.jsonl").write_text(json.dumps(case(0, "Paris")) + "\n{oops\n")
  argv = [files.get(a, a) for a in argv]
  msg = msg.replace("BAD", files["BAD"])
  head = ["eval", "--method", "full"] if cmd == "eval" else ["tune"]
  with pytest.raises(SystemExit) as e:
    cli.main(head + argv + ["--out", str(tmp_path / "o")])
  assert str(e.value.code).startswith(msg) and "\n" not in str(e.value.code), e.value.code


def test_eval_cli_builds_the_jsonl_session_and_labels_the_run(tmp_path, monkeypatch, capsys):
  """The CLI's plumbing (the run itself: tests/test_eval.py's JSONL run on its session)."""
  from types import SimpleNamespace as NS

  from pask_jax import cli, grammar, platform
  loaded = NS(cfg=NS(arch="llama", vocab_size=16), tokenizer=NS(), model=None)
  monkeypatch.setattr(platform, "load_model", lambda *a, **k: loaded)
  monkeypatch.setattr(grammar, "GrammarCompiler", lambda tok, vocab: NS(tok=tok, vocab=vocab))
  seen = {}
  b = float(RNG.choice([0.3, 0.5]))

  def fake_run(s, rc, out):
    seen.update(task=s.task, rc=rc, out=out, cases=s.task.cases(rc.split, rc.categories,
                                                                 rc.max_cases))
    return {"method": rc.method, "budget": rc.budget, "measured_B": 0.25, "settings": {},
            "categories": {}, "wall_s": 0.0}

  monkeypatch.setattr(E, "run", fake_run)
  data = write(tmp_path / "mine.jsonl", [case(i, c) for i, c in enumerate(CITIES[:4])])
  assert cli.main(["eval", "--task", "jsonl", "--data", data, "--method", "h2o", "--budget",
                   str(b), "--split", "dev", "--seed", "7", "--out", str(tmp_path / "o")]) == 0
  assert isinstance(seen["task"], E.JsonlSuite) and seen["task"].name == "jsonl:mine.jsonl"
  assert seen["task"].tok is loaded.tokenizer and seen["task"].compiler.vocab == 16
  assert seen["rc"].budget == b and seen["rc"].split == "dev"
  _, dev = tasks.split_jsonl(tasks.read_jsonl(data), 7)
  assert [c.id for c in seen["cases"]] == [c.id for c in dev]
  assert f"h2o: requested B {b:g}, measured B 0.250" in capsys.readouterr().out
