"""A user's calibration task from a JSONL file (calibrate.tasks.JsonlTask): parsing and one-line
errors per bad line, the 1:1 split, scoring of right and wrong answers, the task protocol, and
``pask-jax calibrate --task jsonl`` end to end (a tiny random model over SmolLM2's tokenizer),
and the README's calibrate-then-eval commands run for real on the embedded model."""
import json
import os

import pytest

from calibrate import tasks
from pask_jax.grammar.toolcall import render_calls
from pask_jax.testing import smollm2_grammars

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples",
                       "weather_calls.jsonl")
TOOLS = json.load(open(os.path.join(os.path.dirname(EXAMPLE), "weather_tools.json")))
GOOD = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS,
        "expected": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


def write(path, *lines) -> str:
  path.write_text("\n".join(l if isinstance(l, str) else json.dumps(l) for l in lines) + "\n")
  return str(path)


def test_example_file_reads_into_checked_cases(tmp_path):
  cases = tasks.read_jsonl(EXAMPLE)
  assert len(cases) == 12 and [c.id for c in cases] == [str(n) for n in range(1, 13)]
  assert [c.category for c in cases] == ["tools"] * 10 + ["schema"] * 2
  assert [c.scorer for c in cases][-2:] == ["exact", "json_valid"]
  assert cases[-1].expected is None and cases[-1].tools is None and cases[-1].schema
  assert cases[0].tools[0]["function"]["name"] == "get_weather" and cases[0].schema is None
  assert cases[7].expected[1] == {"name": "get_weather", "arguments": {"city": "Lisbon"}}
  # bare function dicts are accepted and stored OpenAI-style
  bare = dict(GOOD, tools=[t["function"] for t in TOOLS], id="bare", category="mine")
  c, = tasks.read_jsonl(write(tmp_path / "bare.jsonl", bare))
  assert c.tools == TOOLS and (c.id, c.category) == ("bare", "mine")


def _with(**kw):
  d = dict(GOOD)
  for k, v in kw.items():
    if v is None:
      d.pop(k)
    else:
      d[k] = v
  return d


@pytest.mark.parametrize("line, msg", [
    ("{not json", "not valid JSON: Expecting property name enclosed in double quotes (column 2)"),
    ([1, 2], "a case must be a JSON object, got list"),
    (_with(expect=[]), "unknown key(s) 'expect'; a case has"),
    (_with(messages=None), "'messages' must be a non-empty list of messages"),
    (_with(messages=[{"content": "hi"}]), "messages[0] must be an object with a string 'role'"),
    (_with(messages=[{"role": "user", "content": 3}]), "messages[0].content must be a string"),
    (_with(schema=SCHEMA), "exactly one of 'tools' (tool calls) and 'schema' (JSON)"),
    (_with(tools=None), "exactly one of 'tools' (tool calls) and 'schema' (JSON)"),
    (_with(scorer="fuzzy"), "unknown scorer 'fuzzy'; choose from exact, json_valid"),
    (_with(expected=None), "a case needs 'expected' (or \"scorer\": \"json_valid\")"),
    (_with(scorer="json_valid"), "scorer json_valid takes no 'expected'"),
    (_with(tools=[{"description": "x"}]), "tools[0]: a tool needs a non-empty string 'name'"),
    (_with(expected={"name": "get_weather", "arguments": {}}),
     "'expected' must be a non-empty list of calls"),
    (_with(expected=[{"name": "get_weather", "args": {}}]),
     "expected[0] must be {\"name\": ..., \"arguments\": {...}}"),
    (_with(expected=[{"name": "get_time", "arguments": {}}]),
     "expected[0] calls 'get_time', which is not among the tools (get_weather)"),
    (_with(expected=[{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "kelvin"}}]),
     "expected[0].arguments do not satisfy 'get_weather''s parameters: 'kelvin' is not one of"),
    (_with(expected=[GOOD["expected"][0]] * 9), "'expected' holds 9 calls; an answer holds at "
                                                "most 8"),
    (_with(tools=None, schema={"type": "strng"}, expected={"n": 1}), "invalid JSON schema"),
    (_with(tools=None, schema=SCHEMA, expected={"n": "one"}),
     "'expected' does not satisfy the schema: 'one' is not of type 'integer' (at #/n)"),
    (_with(id="1"), "id '1' repeats line 1"),
    (_with(id=True), "'id' must be a non-empty string or an integer"),
    (_with(category=""), "'category' must be a non-empty string"),
])
def test_a_bad_line_is_one_error_naming_file_line_and_problem(tmp_path, line, msg):
  p = write(tmp_path / "t.jsonl", GOOD, "", line)     # the blank line counts, and is skipped
  with pytest.raises(ValueError) as e:
    tasks.read_jsonl(p)
  assert str(e.value).startswith(f"{p}, line 3: ") and msg in str(e.value), str(e.value)
  assert "\n" not in str(e.value)


def test_a_file_without_cases_or_unreadable_is_refused(tmp_path):
  with pytest.raises(ValueError, match="no cases"):
    tasks.read_jsonl(write(tmp_path / "e.jsonl", "", " "))
  with pytest.raises(ValueError, match="cannot read the task file: No such file"):
    tasks.read_jsonl(str(tmp_path / "missing.jsonl"))


def test_split_is_seeded_disjoint_and_balanced_per_category():
  cases = tasks.read_jsonl(EXAMPLE)
  cal, dev = tasks.split_jsonl(cases, seed=0)
  ids = lambda cs: [c.id for c in cs]
  assert sorted(ids(cal) + ids(dev), key=int) == ids(cases) and not set(ids(cal)) & set(ids(dev))
  for part in (cal, dev):
    assert ids(part) == sorted(ids(part), key=int)                       # file order
    assert sum(c.category == "tools" for c in part) == 5
    assert sum(c.category == "schema" for c in part) == 1
  assert ids(tasks.split_jsonl(cases, seed=0)[0]) == ids(cal)            # deterministic
  assert ids(tasks.split_jsonl(cases, seed=1)[0]) != ids(cal)
  cal2, dev2 = tasks.split_jsonl(cases, seed=0, max_cases=2)
  assert ids(cal2) == [c.id for c in cal if c.category == "tools"][:2] + \
      [c.id for c in cal if c.category == "schema"]
  assert len(dev2) == 3
  with pytest.raises(ValueError, match="need at least 2"):
    tasks.split_jsonl(cases[:1])


@pytest.fixture(scope="module")
def task():
  tok, comp = smollm2_grammars()
  return tasks.JsonlTask(tasks.read_jsonl(EXAMPLE), tok, arch="llama", compiler=comp)


def test_scoring_compares_calls_as_normalised_json_in_any_order(task):
  fmt = task.fmt
  for i, r in enumerate(task.requests[:10]):       # every expected answer, as the model writes it
    assert task.score(i, render_calls(r.case.expected, fmt), True) == (True, 1.0)
  two = task.requests[7].case.expected              # Madrid and Lisbon
  assert task.score(7, render_calls(two[::-1], fmt), True) == (True, 1.0)
  wrong = [two[0], {"name": "get_weather", "arguments": {"city": "Porto"}}]
  assert task.score(7, render_calls(wrong, fmt), True) == (False, 0.5)
  assert task.score(7, render_calls(two + [two[0]], fmt), True) == (False, 1.0)   # an extra call
  assert task.score(7, render_calls(two[:1], fmt), True) == (False, 0.5)
  tokyo = task.requests[1].case.expected            # Tokyo in celsius
  assert task.score(1, render_calls([{"name": "get_weather", "arguments": {"city": "Tokyo"}}],
                                    fmt), True) == (False, 0.0)
  assert task.score(1, render_calls(tokyo, fmt), False) == (False, 0.0)   # cut at max_tokens
  assert task.score(1, "[{\"name\": \"get_weather\", \"argu", True) == (False, 0.0)


def test_scoring_json_answers_exact_and_valid(task):
  assert task.score(10, '{"conditions": "snow", "temperature_c": 4.0, "city": "Oslo"}', True) \
      == (True, 1.0)
  assert task.score(10, '{"city": "Oslo", "temperature_c": 5, "conditions": "snow"}', True) \
      == (False, 0.0)
  assert task.score(10, '{"city": "Oslo", "temperature_c": 4, "conditions": "snow"', True) \
      == (False, 0.0)
  rome = {"city": "Rome", "temperature_c": 27, "conditions": "sunny"}
  assert task.score(11, json.dumps(rome), True) == (True, 1.0)               # json_valid
  assert task.score(11, json.dumps(dict(rome, conditions="fog")), True) == (False, 0.0)
  assert task.score(11, json.dumps(rome), False) == (False, 0.0)
  assert tasks.canonical({"a": 1.0, "b": [True]}) == tasks.canonical({"b": [True], "a": 1})
  assert tasks.canonical([1]) != tasks.canonical([True])


def test_tasks_satisfy_the_protocol_and_trackers_tag_by_answer_kind(task):
  from calibrate import stages
  from pask_jax.tracker import FREE_TAG
  tok, comp = smollm2_grammars()
  assert isinstance(task, tasks.Task)
  assert isinstance(tasks.SyntheticTask(tok, comp, 1), tasks.Task)
  assert isinstance(tasks.BFCLTask([], tok, arch="llama", compiler=comp), tasks.Task)
  assert not isinstance(object(), tasks.Task)
  r = task.requests[0]
  assert r.tools and r.fmt == task.fmt and r.tags is not None and len(r.tags) == len(r.ids)
  rec = task.tracker(0)                       # tool calls: the structural tags of FCAdapter
  for t in tok.encode(render_calls(r.case.expected, task.fmt)):
    rec.accept(t)
  assert any(int(t[0]) != int(FREE_TAG[0]) for t in rec.tags)
  rec = task.tracker(10)                      # a JSON answer: free generation, as served
  for t in tok.encode('{"city": "Oslo", "temperature_c": 4, "conditions": "snow"}'):
    rec.accept(t)
  assert all((t == FREE_TAG).all() for t in rec.tags)
  # the oracle is part of the stages' fingerprint (a changed answer does not resume old stages)
  sub = task.subset([0, 10])
  assert sub.vocab is task.vocab and [c.case.id for c in sub.requests] == ["1", "11"]
  other = task.subset([0, 10])
  other.expected = [other.expected[0], {"scorer": "exact", "expected": {"city": "Rome"}}]
  assert stages.task_fingerprint(sub)["digest"] != stages.task_fingerprint(other)["digest"]
  assert stages.task_fingerprint(sub)["categories"] == {"schema": 1, "tools": 1}


@pytest.mark.parametrize("argv, msg", [
    (["--task", "jsonl"], "error: --task jsonl needs --data FILE"),
    (["--data", "x.jsonl"], "error: --data applies to --task jsonl"),
    (["--task", "jsonl", "--data", EXAMPLE, "--categories", "simple_python"],
     "error: --categories applies to --task bfcl"),
    (["--task", "jsonl", "--data", "BAD"], "error: BAD, line 1: scorer json_valid takes no "
                                            "'expected'"),
])
def test_calibrate_cli_refuses_bad_jsonl_input_before_loading(tmp_path, monkeypatch, argv, msg):
  from pask_jax import cli, platform
  monkeypatch.setattr(platform, "load_model",
                      lambda *a, **k: pytest.fail("model loaded before the check"))
  bad = write(tmp_path / "bad.jsonl", _with(scorer="json_valid"))
  argv = [bad if a == "BAD" else a for a in argv]
  msg = msg.replace("BAD", bad)
  with pytest.raises(SystemExit) as e:
    cli.main(["calibrate", "--out", str(tmp_path / "o")] + argv)
  assert str(e.value.code).startswith(msg) and "\n" not in str(e.value.code)


def readme_jsonl_commands() -> list[list[str]]:
  """The README's "calibrate on your file ... evaluate it at that budget" block: its pask-jax
  command lines (continuations joined), each split as a shell would, without the program."""
  import re
  import shlex
  readme = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                             "README.md"), encoding="utf-8").read()
  blocks = re.findall(r"```bash\n(.*?)```", readme, re.S)
  block = next((b for b in blocks if "--task jsonl" in b and "--target-b" in b
                and "--budget" in b), None)
  assert block, "README.md lost its calibrate-on-your-JSONL / eval-at-a-budget block"
  lines = [l for l in block.replace("\\\n", " ").splitlines() if l.strip()
           and not l.lstrip().startswith("#")]
  return [shlex.split(l)[1:] for l in lines]


def test_readme_calibrate_then_eval_at_the_budget_on_the_embedded_model(tmp_path, monkeypatch,
                                                                         capsys):
  """The README's two-command workflow, run for real through the CLI on the embedded default
  model (SmolLM2-135M): ``calibrate --task jsonl --data FILE --target-b B`` writes
  ``OUT/policy/B<B>/``, ``eval --task jsonl --method pask --policy OUT/policy --budget B`` runs
  that variant at a measured B within the budget and labels its summary with both, ``eval
  --method full`` beside it.  The README's flags and budget as written; what changes: the model
  (the embedded one in place of the Qwen 0.5B, which CI does not have), the file (two yes/no
  cases the 135M model can answer under their schema: one exact, one json_valid), paths under
  tmp, and small settings for a CPU (``--rows 8 --max-tokens 4 --path-points 1``)."""
  from models import registry
  from pask_jax import cli
  from pask_jax import policy as P
  yes_no = {"enum": ["yes", "no"]}
  data = write(tmp_path / "t.jsonl",
               {"messages": [{"role": "user", "content": "Is the sky blue? Answer yes or no."}],
                "schema": yes_no, "expected": "yes"},
               {"messages": [{"role": "user", "content": "Is fire cold? Answer yes or no."}],
                "schema": yes_no, "scorer": "json_valid"})
  assert [c.id for c in tasks.split_jsonl(tasks.read_jsonl(data))[1]] == ["2"]   # dev: json_valid
  cal, pask, full = readme_jsonl_commands()
  assert cal[:1] == ["calibrate"] and pask[:1] == full[:1] == ["eval"]
  assert "--target-b" in cal and "--budget" in pask and pask[pask.index("--method") + 1] == "pask"
  b = pask[pask.index("--budget") + 1]
  assert cal[cal.index("--target-b") + 1] == b           # the same B in both commands
  out = cal[cal.index("--out") + 1]
  assert pask[pask.index("--policy") + 1] == f"{out}/policy"     # eval reads what calibrate wrote
  runs = {}
  # Both commands load the embedded GGUF with the same arguments: the second gets the first's
  # model (parsing the file's 98k metadata strings and dequantizing its weights cost ~7 s of CPU
  # a time; loading itself is tests/test_loaders.py's subject).  Each command still reads the
  # model through platform.load_model and runs it for real.
  from pask_jax import platform
  real, loaded = platform.load_model, {}

  def load_once(*a, **k):
    key = repr((a, sorted(k.items())))
    if key not in loaded:
      loaded[key] = real(*a, **k)
    return loaded[key]
  monkeypatch.setattr(platform, "load_model", load_once)

  def here(argv, extra):
    argv = list(argv)
    argv[argv.index("--model") + 1] = registry.DEFAULT
    argv[argv.index("--data") + 1] = data
    o = argv.index("--out") + 1
    runs[argv[0]] = argv[o] = str(tmp_path / argv[o].replace("/", "_"))
    if "--policy" in argv:
      argv[argv.index("--policy") + 1] = runs["calibrate"] + "/policy"
    return argv + extra

  assert cli.main(here(cal, ["--rows", "8", "--max-tokens", "4", "--path-points", "1"])) == 0
  said = capsys.readouterr().out
  assert f"calibration 1 cases, development 1 ({data})" in said
  variant = os.path.join(runs["calibrate"], "policy", f"B{float(b):.2f}")
  assert P.load(variant).record["model"]["n_layers"] == 30             # SmolLM2's policy
  rec = json.load(open(os.path.join(runs["calibrate"], "calibration.json")))
  assert rec["n_cal"] == 1 and rec["n_dev"] == 1
  assert rec["dev_reference_accuracy"] == 1.0        # the json_valid case: any complete answer
  assert cli.main(here(pask, ["--max-tokens", "4"])) == 0
  said = capsys.readouterr().out
  got = json.load(open(os.path.join(runs["eval"], "summary.json")))
  assert got["method"] == "pask" and got["budget"] == float(b) and got["n_cases"] == 2
  assert got["settings"]["policy"] == variant
  assert 0.0 < got["measured_B"] <= float(b) + 0.02    # the budget asked for, measured
  assert (f"pask: requested B {b}, measured B {got['measured_B']:.3f} (policy {variant})"
          in said)
  cases = [json.loads(l) for l in open(os.path.join(runs["eval"], "cases.jsonl"))]
  assert [c["id"] for c in cases] == ["1", "2"] and cases[1]["passed"]   # json_valid: complete
  # the third command, Full KV beside it, as the CLI reads it (its runs are test_eval's)
  seen = []
  monkeypatch.setattr(cli, "cmd_eval", lambda a: seen.append(a) or 0)
  assert cli.main(here(full, ["--max-tokens", "4"])) == 0
  assert [(a.cmd, a.method, a.policy, a.data) for a in seen] == [("eval", "full", None, data)]
  assert len(loaded) == 1                              # one model, the same for both commands
