"""The resumable campaign (calibrate.campaign) end to end on a tiny random model with a synthetic
enum task (exact oracle) through the real evaluator (calibrate.evaluate.run): cells run, resume,
fit a time limit, survive an interrupted cell, pool into the report; keys; bad plans (the
long-context workloads' keys too); the BFCL split selection against the evaluator's own; the
stability metrics against Full KV (calibrate.stability) from hand-built and committed cells; and
the sizes of the Spherical KV frontier plan.  (W1/W2 plans end to end: tests/test_longctx.py.)"""
import dataclasses
import json
import os
import re
import shutil

import numpy as np
import pytest

from calibrate import campaign as C
from calibrate import evaluate as E
from models import Loaded, ModelConfig, random_model
from pask_jax import cli
from pask_jax.grammar import tool_call_grammar
from pask_jax.prompt import Prompt
from pask_jax.testing import grammar_compiler, stored_tokenizer

pytestmark = pytest.mark.fast_compile

DATA = os.path.join(os.path.dirname(__file__), "data", "qwen_tokenizer.json.gz")
COLORS = ["red", "green", "blue", "amber"]
TOOL = {"type": "function", "function": {"name": "paint", "description": "Paint the wall",
                                         "parameters": {"type": "object", "properties": {
                                             "color": {"type": "string", "enum": COLORS}},
                                             "required": ["color"]}}}
CATS = ("simple_python", "multiple", "parallel")


def read_json(path):
  with open(path) as f:
    return json.load(f)


@dataclasses.dataclass
class Case:
  id: str
  category: str
  target: str
  text: str


class EnumEval:
  """The evaluator's side of the task: prompts, one enum tool-call grammar, the exact oracle."""
  name = "enum"

  def __init__(self, tok, compiler):
    self.tok = tok
    self.grammar = tool_call_grammar(compiler, [TOOL], "json_list", max_calls=1)

  def prepare(self, cases, prompt_labels):
    return [Prompt(c.text, self.tok.encode(c.text), None, self.grammar, case=c) for c in cases]

  def score(self, case, text, complete):
    if not complete:
      return {"calls": None, "passed": False, "per_call": 0.0, "error": "incomplete"}
    calls = json.loads(text)
    ok = calls == [{"name": "paint", "arguments": {"color": case.target}}]
    return {"calls": calls, "passed": ok, "per_call": float(ok), "error": ""}


class EnumCampaign:
  """The campaign's side: a split's cases (6 per split, 2 per category, fixed by the seed) before
  any model, and one session (the tiny model, built once) for every load."""
  name = "enum"

  def __init__(self):
    self.tok = stored_tokenizer(DATA)
    self.loads = 0
    self._session = None

  def cases(self, split, categories, seed):
    rng = np.random.default_rng([seed, len(split)])
    out = []
    for i in range(6):
      c = COLORS[int(rng.integers(4))]
      filler = " ".join(rng.choice(["please", "the", "wall", "now", "room"], 40))
      out.append(Case(f"{split}_{i}", CATS[i % 3], c, f"{filler}. Paint it {c}."))
    return [c for c in out if not categories or c.category in categories]

  def session(self, path, dtype, batch, seed, center_keys=True):
    self.loads += 1
    if self._session is None:
      cfg = ModelConfig(arch="qwen2", vocab_size=self.tok.vocab_size, hidden=32, intermediate=48,
                        n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, rope_theta=1e6,
                        tie_embeddings=True)
      m = Loaded(cfg, random_model(cfg, seed=7), self.tok)
      gc = grammar_compiler(self.tok, cfg.vocab_size)
      self._session = E.Session(m, EnumEval(self.tok, gc), batch=batch, compiler=gc)
    return self._session


@pytest.fixture(scope="module")
def task():
  return EnumCampaign()


@pytest.fixture
def env(tmp_path, monkeypatch, task):
  monkeypatch.setenv("PASK_JAX_CACHE", str(tmp_path / "cache"))
  monkeypatch.setitem(C.TASKS, "enum", lambda: task)
  (tmp_path / "tiny.bin").write_bytes(b"tiny model weights")
  return tmp_path


PLAN = """
name = "t"
task = "enum"
seed = 3
batch = 4
max_tokens = 40
case_seconds = 10
load_seconds = 0

[models]
tiny = "{model}"

[methods.full]

[methods.h2o]
budgets = [0.5, 0.4]
knobs = {{ gen = 20.0, h2o = {{ sink = 2, recent = 8 }} }}

[splits.test]
split = "test"
cases = 1
"""


def table(md):
  """The rows of a report's first table (the quality table; the stability table follows)."""
  lines = md.splitlines()
  start = next(i for i, l in enumerate(lines) if l.startswith("| "))
  rows = []
  for l in lines[start + 2:]:
    if not l.startswith("| "):
      break
    rows.append(l)
  return rows


def write_plan(env, text=None, name="plan.toml", **fmt):
  p = env / name
  p.write_text((text or PLAN).format(model=env / "tiny.bin", **fmt))
  return str(p)


def counting_run(monkeypatch, clock=None, seconds=0.0):
  """E.run, counted (and advancing a fake clock by ``seconds`` per cell)."""
  real, calls = E.run, []

  def run(*a, **k):
    calls.append(a[1])
    out = real(*a, **k)
    if clock is not None:
      clock[0] += seconds
    return out

  monkeypatch.setattr(E, "run", run)
  return calls


def test_cells_run_resume_and_report(env, task, monkeypatch, capsys):
  plan = C.load_plan(write_plan(env), str(env / "results"))
  calls = counting_run(monkeypatch)
  out = C.run(plan, task=task, copy_to=str(env / "back"), log=lambda s: None)
  assert [len(x) for x in (out.ran, out.done_before, out.left, out.failed)] == [3, 0, 0, 0]
  assert len(calls) == 3
  for cell in out.ran:
    assert sorted(os.listdir(cell.dir)) == ["cases.jsonl", "cell.json"]
    doc = read_json(os.path.join(cell.dir, "cell.json"))
    rows = E.read_cases(cell.dir)
    assert doc["key"] == cell.key == C.cell_key(doc["material"])
    assert doc["n"] == len(rows) == 3 and {r["category"] for r in rows} == set(CATS)
    p = np.mean([r["passed"] for r in rows])
    assert doc["accuracy"] == pytest.approx(p)
    assert doc["se"] == pytest.approx(np.sqrt(p * (1 - p) / 3))
    assert doc["headline"]["n"] == 2 and doc["seed"] == 3
    assert doc["material"]["cases"] == sorted(f"{r['category']}/{r['id']}" for r in rows)
    assert doc["measured_B"]["total_B"] == pytest.approx(np.mean([r["total_B"] for r in rows]))
    assert len(doc["git"]["commit"]) == 40 and doc["jax"]["backend"] == "cpu"
    assert doc["timings"]["cell_s"] >= 0 and doc["labels"]["model"] == "tiny"
    copy = env / "back" / "t" / cell.key
    assert read_json(copy / "cell.json") == doc and (copy / "cases.jsonl").exists()
  assert task.loads >= 1
  # the same cases for every method: the split and its seed are the plan's
  assert len({json.dumps(read_json(os.path.join(c.dir, "cell.json"))["material"]["cases"])
              for c in out.ran}) == 1

  (env / "results" / "t" / (C.PARTIAL + "0123")).mkdir()   # left by a killed campaign
  again = C.run(plan, task=task, log=lambda s: None)
  assert not (env / "results" / "t" / (C.PARTIAL + "0123")).exists()
  assert len(again.ran) == 0 and len(again.done_before) == 3 and len(calls) == 3

  assert cli.main(["campaign", plan.path, "--results", str(env / "results"), "--dry-run"]) == 0
  listing = capsys.readouterr().out
  assert listing.count("   done  ") == 3 and "3 done, 0 to run" in listing

  # report over the plan's results folder, with a folder that is no run beside it (issue 27)
  (env / "results" / "t" / "tune").mkdir()
  (env / "results" / "t" / "tune" / "knobs.json").write_text("{}")
  assert cli.main(["report", plan.path, "--results", str(env / "results"),
                   "--out", str(env / "rep")]) == 0
  cap = capsys.readouterr()
  assert "skipped" in cap.err and "tune" in cap.err
  rows = table(cap.out)
  assert len(rows) == 3 and rows[0].startswith("| full ")
  doc = read_json(os.path.join(out.ran[0].dir, "cell.json"))
  h = doc["headline"]
  assert f"{100 * h['accuracy']:.2f} ± {100 * h['se']:.2f}" in rows[0]
  assert rows[0].split(" | ")[-2] == "2 / 3"     # n; b_HBM follows (Full KV: XLA's reads)
  assert float(rows[0].rstrip(" |").split(" | ")[-1]) >= 1.0
  assert (env / "rep" / "accuracy_vs_B.png").stat().st_size > 1000


def test_time_limit_runs_what_fits_and_a_later_run_the_rest(env, task, monkeypatch):
  plan = C.load_plan(write_plan(env), str(env / "results"))
  clock = [0.0]
  calls = counting_run(monkeypatch, clock, seconds=30.0)   # every cell "takes" 30 s
  log = []
  # 3 cases × case_seconds 10 = 30 s expected per cell: two fit in 65 s, the third does not
  out = C.run(plan, task=task, time_limit=65, clock=lambda: clock[0], log=log.append)
  assert len(out.ran) == 2 and len(out.left) == 1 and len(calls) == 2
  assert not out.left[0].done and not os.path.exists(out.left[0].dir)
  assert any("left for later" in m for m in log)
  # measured 10 s per case for h2o on this model: 30 s for the last cell, which 25 s cannot hold
  out2 = C.run(plan, task=task, time_limit=25, clock=lambda: clock[0], log=log.append)
  assert len(out2.ran) == 0 and len(out2.left) == 1
  out3 = C.run(plan, task=task, time_limit=35, clock=lambda: clock[0], log=log.append)
  assert [c.key for c in out3.ran] == [out.left[0].key] and len(out3.done_before) == 2
  assert len(calls) == 3


def test_interrupted_cell_leaves_no_cell_json_and_reruns(env, task, monkeypatch):
  plan = C.load_plan(write_plan(env), str(env / "results"))
  import pask_jax.decode as D
  real, n = D.generate, [0]

  def dies_in_second_cell(*a, **k):
    n[0] += 1
    if n[0] == 2:
      raise RuntimeError("killed mid-cell")
    return real(*a, **k)

  monkeypatch.setattr(D, "generate", dies_in_second_cell)
  with pytest.raises(RuntimeError, match="killed"):
    C.run(plan, task=task, log=lambda s: None)
  cs = C.cells(plan, task)
  assert [c.done for c in cs] == [True, False, False]
  assert not os.path.exists(cs[1].dir)
  assert not [d for d in os.listdir(plan.folder) if d.startswith(C.PARTIAL)]
  monkeypatch.setattr(D, "generate", real)

  # killed after the evaluator wrote the cases, while the cell's record is being put together
  def dies():
    raise KeyboardInterrupt

  monkeypatch.setattr(C, "_jax", dies)
  with pytest.raises(KeyboardInterrupt):
    C.run(plan, task=task, log=lambda s: None)
  assert [c.done for c in C.cells(plan, task)] == [True, False, False]
  assert sorted(os.listdir(plan.folder)) == [".gitignore", ".lock", cs[0].key]
  monkeypatch.undo()
  monkeypatch.setenv("PASK_JAX_CACHE", str(env / "cache"))
  out = C.run(plan, task=task, log=lambda s: None)
  assert [c.key for c in out.ran] == [c.key for c in cs[1:]] and len(out.done_before) == 1


def test_cell_key_follows_settings_not_plan_order(env, task):
  keys = lambda text, **kw: {(c.method.label, c.budget): c.key for c in C.cells(
      C.load_plan(write_plan(env, text, **kw), str(env / "r")), task)}
  base = keys(PLAN)
  assert len(set(base.values())) == 3
  reordered = PLAN.replace("[methods.full]\n", "").replace("budgets = [0.5, 0.4]",
                                                           "budgets = [0.4, 0.5]")
  reordered += "\n[methods.full]\n"
  assert keys(reordered) == base
  relabeled = PLAN.replace("tiny =", "small =").replace('name = "t"', 'name = "u"')
  assert keys(relabeled) == base                       # labels and plan name are not in the key
  assert keys(PLAN.replace("batch = 4", "batch = 2")) == base   # nor the batch size
  knob = keys(PLAN.replace("recent = 8", "recent = 16"))
  assert knob[("full", 1.0)] == base[("full", 1.0)]
  assert knob[("h2o", 0.5)] != base[("h2o", 0.5)] and knob[("h2o", 0.4)] != base[("h2o", 0.4)]
  longer = keys(PLAN.replace("max_tokens = 40", "max_tokens = 41"))
  assert not set(longer.values()) & set(base.values())
  other_cases = keys(PLAN.replace("cases = 1", "cases = 1\nskip = 1"))
  assert not set(other_cases.values()) & set(base.values())
  uncentered = keys(PLAN.replace('tiny = "{model}"', 'tiny = {{ model = "{model}", '
                                  'key_center = false }}'))
  assert not set(uncentered.values()) & set(base.values())   # key centering changes INT4 answers
  tri = PLAN + ("\n[methods.triaxial]\nbudgets = [0.3]\n"
                "knobs = {{ triaxial = {{ window = {w} }} }}\n")
  assert keys(tri, w=32)[("triaxial", 0.3)] != keys(tri, w=128)[("triaxial", 0.3)]
  # knobs tuned at each budget (pask-jax tune --budget 0.5 0.4): each cell reads its own file
  for b, r in ((0.5, 8), (0.4, 16)):
    (env / f"B{b:.2f}").mkdir()
    (env / f"B{b:.2f}" / "knobs.json").write_text(json.dumps(
        {"knobs": {"gen": 20.0, "h2o": {"sink": 2, "recent": r}}}))
  per = keys(PLAN.replace("knobs = {{ gen = 20.0, h2o = {{ sink = 2, recent = 8 }} }}",
                          f'knobs = "{env}/B{{{{budget:.2f}}}}/knobs.json"'))
  assert per[("h2o", 0.5)] == base[("h2o", 0.5)] and per[("h2o", 0.4)] == knob[("h2o", 0.4)]
  (env / "tiny.bin").write_bytes(b"other weights")
  assert not set(keys(PLAN).values()) & set(base.values())


def test_chunks_pool_into_one_row(env, task, capsys):
  plan = C.load_plan(write_plan(env, PLAN.replace("cases = 1", "chunk = 1").replace(
      "budgets = [0.5, 0.4]", "budgets = [0.5]")), str(env / "results"))
  cs = C.cells(plan, task)
  assert len(cs) == 4 and [c.part for c in cs] == [0, 0, 1, 1]
  assert {len(c.cases) for c in cs} == {3}
  C.run(plan, task=task, log=lambda s: None)
  md, _ = C.report([plan.folder], str(env / "rep"), log=lambda s: None)
  rows = table(md)
  assert len(rows) == 2 and all(r.split(" | ")[-2] == "4 / 6" for r in rows)
  assert rows[1].startswith("| h2o ") and rows[1].endswith(" | – |")   # masked: no kernel path


def test_report_of_a_plan_keeps_only_its_current_settings(env, task):
  one = PLAN.replace("budgets = [0.5, 0.4]", "budgets = [0.5]")
  plan = C.load_plan(write_plan(env, one), str(env / "results"))
  C.run(plan, task=task, log=lambda s: None)
  retuned = write_plan(env, one.replace("recent = 8", "recent = 16"), name="retuned.toml")
  notes = []
  md, _ = C.report([retuned], str(env / "rep"), results=str(env / "results"), log=notes.append)
  assert [r.split(" | ")[0] for r in table(md)] == ["| full"]
  assert any("left out 1 cells" in n for n in notes)
  md, _ = C.report([plan.folder], str(env / "rep2"), log=notes.append)   # the folder: every cell
  assert len([l for l in table(md) if l.startswith("| h2o ")]) == 1


def test_sampled_split_makes_a_cell_per_seed_and_runs_it_sampled(env, task, monkeypatch):
  """``sampling`` on a split: one cell per seed, the sampling in the key (greedy keys as
  before), each cell run at its temperature, top-p and seed, which its cell.json records."""
  one = PLAN.replace("budgets = [0.5, 0.4]", "budgets = [0.5]")
  greedy = C.cells(C.load_plan(write_plan(env, one), str(env / "r")), task)
  text = one + ("\n[splits.s]\nsplit = \"test\"\ncases = 1\n"
                "sampling = {{ temperature = 0.7, top_p = 0.9, seeds = [4, 5] }}\n")
  plan = C.load_plan(write_plan(env, text, name="s.toml"), str(env / "results"))
  cs = C.cells(plan, task)
  assert [c.key for c in cs[:2]] == [c.key for c in greedy]
  sampled = cs[2:]
  assert [(c.method.label, c.sample_seed) for c in sampled] == [
      ("full", 4), ("full", 5), ("h2o", 4), ("h2o", 5)]
  assert len({c.key for c in cs}) == 6 and sampled[0].slice_label == "s seed 4"
  assert sampled[1].material["sampling"] == {"temperature": 0.7, "top_p": 0.9, "seed": 5}
  # run (Full KV alone: the tiny model's cheapest runner) the sampled split only
  h2o = one[one.index("[methods.h2o]"):one.index("[splits.test]")]
  only = text.replace(h2o, "").replace("[splits.test]\nsplit = \"test\"\ncases = 1\n", "")
  only = only.replace("max_tokens = 40", "max_tokens = 12")   # sampled rows seldom stop early
  plan = C.load_plan(write_plan(env, only, name="only.toml"), str(env / "results"))
  calls = counting_run(monkeypatch)
  C.run(plan, task=task, log=lambda s: None)
  got = sorted((rc.method, rc.temperature, rc.top_p, rc.sample_seed) for rc in calls)
  assert got == [("full", 0.7, 0.9, 4), ("full", 0.7, 0.9, 5)]
  doc = read_json(os.path.join(C.cells(plan, task)[1].dir, "cell.json"))
  assert doc["sampling"] == {"temperature": 0.7, "top_p": 0.9, "seed": 5}
  md, _ = C.report([plan.folder], str(env / "rep"), log=lambda s: None)
  assert "| full seed 4 | – |" in md and "| full seed 5 | – |" in md   # one table: no title
  assert "**Seed disagreement**" in md and "| full | – | 2 | 3 |" in md


def test_unconstrained_split_runs_without_the_grammar(env, task, monkeypatch):
  """``constrained = false`` on a split: its cells carry it in their key (constrained keys as
  before) and run without the tool-call grammar; methods reading the parser's tags and the
  free-text workloads are refused in one line."""
  one = PLAN.replace("budgets = [0.5, 0.4]", "budgets = [0.5]")
  held = C.cells(C.load_plan(write_plan(env, one), str(env / "r")), task)
  text = one.replace("cases = 1\n", "cases = 1\nconstrained = false\n")
  plan = C.load_plan(write_plan(env, text, name="u.toml"), str(env / "results"))
  free = C.cells(plan, task)
  assert all(c.material["constrained"] is False for c in free)
  assert {c.key for c in free}.isdisjoint(c.key for c in held)
  assert all("constrained" not in c.material for c in held)
  monkeypatch.setattr(EnumEval, "tool_calls", True, raising=False)
  calls = counting_run(monkeypatch)
  C.run(plan, task=task, log=lambda s: None)
  assert sorted((rc.method, rc.constrained) for rc in calls) == [("full", False), ("h2o", False)]
  doc = read_json(os.path.join(free[0].dir, "cell.json"))
  assert doc["constrained"] is False
  for bad, why in [
      (text.replace("[methods.full]", "[methods.pask]\npolicy = \"demo\"\nbudgets = [0.5]"),
       "splits.test.constrained: method pask (methods.pask) reads the grammar's parser tags"),
      (text.replace('split = "test"', 'split = "test"\ntask = "w2"\nlength = 128'),
       "splits.test.constrained: task w2 has no tool-call grammar to leave out"),
      (PLAN.replace("cases = 1", "cases = 1\nconstrained = 0"),
       "splits.test.constrained: expected bool")]:
    with pytest.raises(C.PlanError, match=re.escape(why)):
      C.load_plan(write_plan(env, bad, name="bad.toml"), str(env / "results"))


def test_bad_plans_are_one_line_errors_naming_the_key(env, capsys):
  cases = [
      (PLAN.replace("cases = 1", "cases = 1\nsampling = {{ top_p = 0.9 }}"),
       "splits.test.sampling.temperature: missing"),
      (PLAN.replace("cases = 1", "cases = 1\nsampling = {{ temperature = 0.7, seeds = [1, 1] }}"),
       "splits.test.sampling.seeds: expected a non-empty list of distinct integers"),
      (PLAN.replace("cases = 1", "cases = 1\nsampling = {{ temperature = 0.7, top_k = 5 }}"),
       "splits.test.sampling.top_k: unknown key"),
      (PLAN.replace("[methods.full]", "[methods.lru]"), "methods.lru.method: unknown method"),
      (PLAN.replace('tiny = "{model}"', 'tiny = "/nowhere/model.gguf"'),
       "models.tiny: model not found"),
      (PLAN.replace('split = "test"', 'split = "train"'), "splits.test.split: expected cal"),
      (PLAN.replace("cases = 1", "cases = 0"), "splits.test.cases: expected a positive"),
      (PLAN.replace("cases = 1", "cases = 1\nids = [\"nope\"]"), "splits.test.ids: give either"),
      (PLAN.replace("cases = 1", "skip = 9"), "splits.test: selects no cases"),
      (PLAN.replace('split = "test"', 'split = "test"\nids = ["test_9"]').replace(
          "cases = 1", ""), "splits.test.ids: case 'test_9' is not in the test split"),
      (PLAN.replace("[methods.full]", "[methods.pask]\nbudgets = [0.5]"),
       "methods.pask.policy: missing"),
      (PLAN.replace("[methods.full]", "[methods.full]\nbudgets = [0.5]"),
       "methods.full.budgets: method full has no budget"),
      (PLAN.replace("[0.5, 0.4]", "[1.5]"), "methods.h2o.budgets:"),
      (PLAN.replace("[methods.full]", "[methods.full]\npolicy = \"demo\""),
       "methods.full.policy: only methods pask, rdr+tags, pask+ada take a policy"),
      (PLAN.replace("[methods.full]", "[methods.\"rdr+tags\"]\nbudgets = [0.5]"),
       "methods.rdr+tags.policy: missing (method rdr+tags needs a policy"),
      (PLAN.replace("seed = 3", "seed = 3\nsed = 4"), "plan.sed: unknown key"),
      (PLAN.replace("seed = 3", "seed = \"x\""), "plan.seed: expected int"),
      (PLAN.replace("[methods.full]", "[methods.int4]\nknobs = \"t/B{{budget:.2f}}.json\""),
       "methods.int4.knobs: file not found: t/B1.00.json (model tiny, B=1)"),
      (PLAN.replace("[methods.full]", "[methods.int4]\nknobs = \"t/{{bud}}.json\""),
       "methods.int4.knobs: bad pattern"),
      (PLAN.replace("[methods.full]", "[methods.int4]\nknobs = \"none.json\""),
       "methods.int4.knobs: file not found"),
      (PLAN + "]]", "not valid TOML"),
      # the long-context workloads: task, length and tail per split (or at the top)
      (PLAN.replace('split = "test"', 'split = "test"\ntask = "w2"'),
       "splits.test.length: missing (task w2 needs a prompt length"),
      (PLAN.replace('split = "test"', 'split = "test"\ntask = "w2"\nlength = 128\ntail = 8'),
       "splits.test.tail: only task w1 takes a tail"),
      (PLAN.replace('split = "test"', 'split = "test"\nlength = 512'),
       "splits.test.length: only tasks w1, w2, w3, w3mt take a length"),
      (PLAN.replace("seed = 3", "seed = 3\nlength = 512"), "plan.length: no split takes it"),
      (PLAN.replace('split = "test"', 'split = "test"\ntask = "w1"\nlength = 100\ntail = 99'),
       "splits.test.tail: a tail of 99 leaves no prompt in a document of 100 tokens"),
      (PLAN.replace('split = "test"', 'split = "test"\ntask = "w2"\nlength = 32'),
       "splits.test.length: expected an integer >= 64, got 32"),
      (PLAN.replace('split = "test"', 'split = "test"\ntask = "w4"'),
       "splits.test.task: expected one of bfcl, "),
      (PLAN.replace('split = "test"', 'split = "test"\nmax_tokens = 0'),
       "splits.test.max_tokens: expected a positive integer"),
      (PLAN.replace('split = "test"', 'split = "test"\ntask = "w2"\nlength = 128\n'
                    'categories = ["hop3"]'), "splits.test: W2 categories are hop1, hop2"),
  ]
  for text, msg in cases:
    p = write_plan(env, text)
    with pytest.raises(SystemExit) as e:
      cli.main(["campaign", p, "--results", str(env / "r"), "--dry-run"])
    got = str(e.value.code)
    assert msg in got and "\n" not in got and got.startswith("error: "), (msg, got)
  # the Spherical KV hybrids run under a PASK policy as pask does: planned, one cell per budget
  ok = PLAN.replace("[methods.full]", "[methods.full]\n\n[methods.\"rdr+tags\"]\nbudgets = [0.5]"
                    "\npolicy = \"demo\"\n\n[methods.sphkv-angle]")
  assert cli.main(["campaign", write_plan(env, ok), "--results", str(env / "r"), "--dry-run"]) == 0
  listing = capsys.readouterr().out
  assert "rdr+tags" in listing
  assert "tiny sphkv-angle test" in listing   # fixed rate: no budget, one cell at B = 1
  with pytest.raises(SystemExit, match="not found"):
    cli.main(["campaign", str(env / "missing.toml"), "--dry-run"])
  with pytest.raises(SystemExit):
    cli.main(["campaign", write_plan(env), "--time-limit", "soon"])
  assert "duration" in capsys.readouterr().err
  assert [C.parse_duration(s) for s in ("90", "90s", "10m", "1.5h")] == [90, 90, 600, 5400]


def test_report_skips_folders_that_are_not_runs(env, task, capsys):
  runs = env / "runs"
  s = task.session(None, "auto", 4, 0)
  E.run(s, E.RunConfig("full", 1.0, "test", max_tokens=40), str(runs / "full"), progress=False,
        cases=task.cases("test", None, 0)[:3])
  (runs / "tune").mkdir()
  (runs / "tune" / "knobs.json").write_text("{}")
  assert cli.main(["report", str(runs / "full"), str(runs / "tune"), "--out",
                   str(env / "rep")]) == 0
  cap = capsys.readouterr()
  assert f"skipped {runs / 'tune'}" in cap.err and "| full |" in cap.out
  with pytest.raises(SystemExit, match="no eval runs or campaign cells"):
    cli.main(["report", str(runs / "tune"), "--out", str(env / "rep")])


def test_bfcl_selection_is_the_evaluators_split():
  cats = ("simple_python", "multiple")
  every = C.BFCL().cases("test", cats, 0)
  split = C.Split("s", "test", cats, skip=2, cases=3)
  got, = C.select(split, every, 0)
  want = E.BFCLSuite(None, "qwen2", None).cases("test", cats, max_cases=3, skip=2)
  assert [c.id for c in got] == [c.id for c in want] and len(got) == 6
  assert {c.split for c in got} == {"test"}
  chunked = C.select(dataclasses.replace(split, chunk=2), every, 0)
  assert [len(p) for p in chunked] == [4, 2]
  per = lambda cs, cat: [c.id for c in cs if c.category == cat]
  for cat in cats:   # chunk i: cases 2i, 2i+1 of each category of the selection
    assert per(chunked[0], cat) == per(want, cat)[:2] and per(chunked[1], cat) == per(want, cat)[2:]


# ---- stability against Full KV (calibrate.stability), from hand-built cells ----------------------

def case_row(i, tokens, text=None, finish="stop", calls=True, category="simple_python",
             total_b=1.0):
  return {"id": f"c{i}", "category": category, "split": "test",
          "text": " ".join(map(str, tokens)) if text is None else text, "tokens": tokens,
          "gen_len": len(tokens), "finish": finish, "calls": [{"f": {}}] if calls else None,
          "passed": calls, "per_call": float(calls), "error": "", "prompt_len": 10,
          "kv_gen_len": len(tokens), "prefill_B": total_b, "decode_B": total_b,
          "total_B": total_b}


DENSE = [case_row(0, [1, 2, 3, 4]), case_row(1, [5, 6, 7, 8, 9, 10]), case_row(2, [1] * 10),
         case_row(3, [2] * 8)]
# c0 the same; c1 diverges at 1 and stops at 2 of 6 tokens (early, no call); c2 runs past dense
# (dense is its prefix: divergence at 10) into a loop; c3 diverges at 0; c9 has no dense twin
METHOD = [case_row(0, [1, 2, 3, 4], total_b=0.3), case_row(1, [5, 9], calls=False, total_b=0.3),
          case_row(2, [1] * 12, text="ab" * 12, finish="length", total_b=0.3),
          case_row(3, [3] + [2] * 7, total_b=0.3), case_row(9, [4], total_b=0.3)]


def test_stability_metrics_are_exact():
  from calibrate import stability as ST
  assert ST.compare(METHOD, DENSE, calls=True) == {
      "n": 4, "dtok_abs_median": pytest.approx(0.1), "dtok_mean": pytest.approx(-7 / 60),
      "disagree": 0.75, "diverge_median": 1.0, "by_tokens": True, "looping": 1,
      "early_stop": 1, "malformed": 1, "derailed": 0, "invalid": None}   # rows without 'valid'
  # schema validity (rows since the field): invalid counts the method's rows that say False
  vm = [{**r, "valid": r["calls"] is not None and r["id"] != "c3"} for r in METHOD]
  vd = [{**r, "valid": True} for r in DENSE]
  assert ST.compare(vm, vd, calls=True)["invalid"] == 2
  assert ST.compare(vm, vd, calls=False)["invalid"] is None
  assert ST.compare(vm[:1] + METHOD[1:], vd, calls=True)["invalid"] is None   # a row without
  other = [{**r, "calls": [{"g": {}}, {"f": {}}]} if r["id"] == "c3" else r for r in METHOD]
  assert ST.compare(other, DENSE, calls=True)["derailed"] == 1   # another course than dense's
  assert ST.compare(other, DENSE, calls=False)["derailed"] is None
  same = ST.compare(DENSE, DENSE, calls=False)
  assert same["disagree"] == 0 and same["diverge_median"] is None and same["malformed"] is None
  assert same["derailed"] is None
  assert same["dtok_abs_median"] == same["dtok_mean"] == 0 and same["looping"] == 0
  old = [{k: v for k, v in r.items() if k != "tokens"} for r in METHOD]   # cells before tokens
  o = ST.compare(old, DENSE, calls=True)
  assert o["disagree"] == 0.75 and o["diverge_median"] is None and not o["by_tokens"]
  assert ST.compare(METHOD[4:], DENSE, calls=True) is None
  assert [ST.first_divergence(a, b) for a, b in (([1, 2], [1, 2]), ([1, 2], [1, 3]),
                                                  ([1], [1, 2]), ([], [5]))] == [None, 1, 1, 0]
  assert ST.periodic_tail("xyabcabcab", 3) == 8 and ST.periodic_tail("ab", 5) == 2
  assert ST.looping("x" + "0123456789" * 4, "length")          # 4 periods of 10, 40 chars
  assert not ST.looping("x" + "0123456789" * 3, "length")      # 3 periods only
  assert not ST.looping("a" * 15, "length") and ST.looping("a" * 16, "length")   # 16 chars
  assert not ST.looping("a" * 40, "stop")                      # it stopped by itself
  with pytest.raises(ValueError, match="period must be >= 1"):
    ST.periodic_tail("abc", 0)


def hand_cell(root, method, budget, rows, task, sampling=None, constrained=True):
  material = {"task": task, "seed": 0, "model": {"sha256": "0" * 64, "dtype": "auto",
                                                  "key_center": True},
              "method": method, "budget": budget, "settings": {"max_tokens": 16},
              "split": "test", "cases": sorted(f"{r['category']}/{r['id']}" for r in rows)}
  if sampling is not None:
    material["sampling"] = sampling
  if not constrained:
    material["constrained"] = False
  key = C.cell_key(material)
  (root / key).mkdir(parents=True)
  (root / key / "cell.json").write_text(json.dumps({
      "key": key, "material": material, "method": method, "budget": budget, "task": task,
      "split": "test", "n_cases": len(rows),
      "labels": {"model": "m", "method": method, "split": "test", "part": None}}))
  with open(root / key / "cases.jsonl", "w") as f:
    for r in rows:
      f.write(json.dumps(r) + "\n")


def test_report_writes_stability_tables_from_stored_cells(tmp_path):
  """Per workload a table with its quality metric and the stability of every row against the
  Full-KV row of the same cases, from what the cells store: token ids where they have them,
  texts for cells written before (the committed ones)."""
  root = tmp_path / "cells"
  hand_cell(root, "full", 1.0, DENSE, "w3:L64")
  hand_cell(root, "spherical", 0.35, METHOD, "w3:L64")
  hand_cell(root, "h2o", 0.35, [{k: v for k, v in r.items() if k != "tokens"}
                                for r in METHOD[:2]], "w3:L64")
  hop = lambda rows: [{**r, "category": "hop1", "calls": None} for r in rows]
  hand_cell(root, "full", 1.0, hop(DENSE), "w2:L64")
  hand_cell(root, "spherical", 0.35, hop(METHOD), "w2:L64")
  md, files = C.report([str(root)], str(tmp_path / "rep"), log=lambda s: None)
  w2, w3 = md.split("## ")[1:]
  assert w2.startswith("m (auto), w2:L64 test") and "exact match (EM)" in w2
  assert w3.startswith("m (auto), w3:L64 test") and "AST accuracy" in w3
  assert "| spherical | 0.35 | 4 | 10.0% | -11.7% | 75.0% | 1 | 1 | 1 | 1 | 0 |" in w3
  assert "| h2o | 0.35 | 2 | 33.3% | -33.3% | 50.0% (text) | – | 0 | 1 | 1 | 0 |" in w3
  assert "| full | – | 4 | 0.0% | +0.0% | 0.0% | – | 0 | 0 | 0 | 0 |" in w3
  assert "| spherical | 0.35 | 4 | 10.0% | -11.7% | 75.0% | 1 | 1 | 1 | – | – |" in w2   # no calls
  assert "| measured B (prefill / decode / total) | EM ± s.e. | hop1 | n |" in w2
  assert "| spherical | 0.35 | 0.300 / 0.300 / 0.300 | 80.00 ± 17.89 | 80.00 | 5 |" in w2
  csv_ = (tmp_path / "rep" / "02-m_auto_w3_L64_test" / "stability.csv").read_text().splitlines()
  assert csv_[0] == "method,budget,n,dtok_abs_median,dtok_mean,disagree,diverge_median,looping," \
      "early_stop,malformed,derailed,invalid" and len(csv_) == 4
  assert all(os.path.getsize(f) > 1000 for f in files if f.endswith(".png"))
  only = C.report([str(root / next(p.name for p in root.iterdir()
                                   if "spherical" in (p / "cell.json").read_text()))],
                  str(tmp_path / "one"), log=lambda s: None)[0]
  assert "no Full-KV run (method full) in this table" in only


def test_unconstrained_cells_get_their_own_table_with_schema_validity(tmp_path):
  """Cells decoded without the grammar (``constrained = false``) form their own table (their
  Full KV is the unconstrained one), whose stability counts the schema-invalid outputs."""
  root = tmp_path / "cells"
  valid = lambda rows, bad=(): [{**r, "valid": r["id"] not in bad} for r in rows]
  hand_cell(root, "full", 1.0, valid(DENSE), "w3:L64")
  hand_cell(root, "full", 1.0, valid(DENSE, {"c1"}), "w3:L64", constrained=False)
  hand_cell(root, "spherical", 0.35, valid(METHOD, {"c1", "c2", "c3"}), "w3:L64",
            constrained=False)
  md, _ = C.report([str(root)], str(tmp_path / "rep"), log=lambda s: None)
  greedy, free = sorted(md.split("## ")[1:], key=lambda t: "unconstrained" in t)
  assert free.startswith("m (auto), w3:L64 test, unconstrained") and "spherical" in free
  assert "spherical" not in greedy
  assert "| full | – | 4 | 0.0% | +0.0% | 0.0% | – | 0 | 0 | 0 | 0 | 1 |" in free
  assert "| spherical | 0.35 | 4 | 10.0% | -11.7% | 75.0% | 1 | 1 | 1 | 1 | 0 | 3 |" in free


def test_seed_disagreement_is_exact():
  from calibrate import stability as ST
  s0 = [case_row(0, [1, 2]), case_row(1, [3]), case_row(2, [4, 4]), case_row(7, [9])]
  s1 = [case_row(0, [1, 2]), case_row(1, [5]), case_row(2, [4, 4])]
  s2 = [case_row(0, [1, 3]), case_row(1, [3]), case_row(2, [4, 4])]
  # over c0..c2 (c7 is not in every run): c0 differs under seed 2, c1 under seed 1
  assert ST.seed_disagreement([s0, s1, s2]) == {"seeds": 3, "n": 3, "disagree": 2 / 3}
  assert ST.seed_disagreement([s0, s1]) == {"seeds": 2, "n": 3, "disagree": 1 / 3}
  texts = [[{k: v for k, v in r.items() if k != "tokens"} for r in rs] for rs in (s0, s2)]
  assert ST.seed_disagreement(texts)["disagree"] == 1 / 3        # by text without token ids
  assert ST.seed_disagreement([s0]) is None and ST.seed_disagreement([s0, [case_row(5, [1])]]) \
      is None


def test_report_puts_sampled_cells_in_their_own_table_with_seed_disagreement(tmp_path):
  """Cells of a split with ``sampling``: their own table (the greedy one untouched), one row per
  seed, stability against Full KV's run of the same seed, and the seed disagreement of each
  (method, budget) beside Full KV's."""
  root = tmp_path / "cells"
  hand_cell(root, "full", 1.0, DENSE, "w3:L64")
  smp = lambda seed: {"temperature": 0.7, "top_p": 0.95, "seed": seed}
  d1 = [DENSE[0], case_row(1, [5, 6, 7]), DENSE[2], DENSE[3]]          # c1 differs by seed
  m0 = [DENSE[0], DENSE[1], DENSE[2], case_row(3, [7] * 8)]
  m1 = [case_row(0, [1, 2]), DENSE[1], case_row(2, [9] * 10), case_row(3, [7] * 8)]
  hand_cell(root, "full", 1.0, DENSE, "w3:L64", smp(0))
  hand_cell(root, "full", 1.0, d1, "w3:L64", smp(1))
  hand_cell(root, "spherical", 0.35, m0, "w3:L64", smp(0))
  hand_cell(root, "spherical", 0.35, m1, "w3:L64", smp(1))
  md, _ = C.report([str(root)], str(tmp_path / "rep"), log=lambda s: None)
  greedy, sampled = md.split("## ")[1:]
  assert greedy.startswith("m (auto), w3:L64 test\n") and "seed" not in greedy
  assert sampled.startswith("m (auto), w3:L64 test, sampled T=0.7 top-p 0.95")
  assert "| full seed 0 | – | 4 | 0.0% | +0.0% | 0.0% |" in sampled
  assert "| full seed 1 | – | 4 | 0.0% | +0.0% | 0.0% |" in sampled
  assert "| spherical seed 0 | 0.35 | 4 | 0.0% | +0.0% | 25.0% | 0 |" in sampled   # vs seed 0
  assert "| spherical seed 1 | 0.35 | 4 | 25.0% | +12.5% | 100.0% | 1 | 0 | 0 | 0 | 0 |" in sampled
  assert "**Seed disagreement**" in sampled and "**Seed disagreement**" not in greedy
  assert "| full | – | 2 | 4 | 25.0% | – |" in sampled
  assert "| spherical | 0.35 | 2 | 4 | 50.0% | +25.0 pts |" in sampled
  # without a Full-KV run the seed disagreement still shows (it needs none)
  alone = tmp_path / "alone"
  hand_cell(alone, "spherical", 0.35, m0, "w3:L64", smp(0))
  hand_cell(alone, "spherical", 0.35, m1, "w3:L64", smp(1))
  md, _ = C.report([str(alone)], str(tmp_path / "rep2"), log=lambda s: None)
  assert "no Full-KV run" in md and "| spherical | 0.35 | 2 | 4 | 50.0% | – |" in md


def test_report_tables_show_b_hbm_where_a_method_has_a_kernel_path(tmp_path):
  """The quality tables' last column, b_HBM: the mean over a row's cases for methods with a
  kernel path (Spherical KV, PASK, Full KV), a dash for the masked baselines and for cells
  written before it was recorded; W1's table has it too."""
  root = tmp_path / "cells"
  hbm = lambda rows, xs: [{**r, "b_HBM": x, "hbm_bytes_per_token": 1e6 * x}
                          for r, x in zip(rows, xs)]
  hand_cell(root, "full", 1.0, hbm(DENSE, [1.25, 1.5, 1.25, 1.0]), "w3:L64")
  hand_cell(root, "spherical", 0.35, hbm(METHOD, [0.5, 0.6, 0.7, 0.8, 0.9]), "w3:L64")
  hand_cell(root, "pask", 0.35, hbm(METHOD[:2], [0.4, 0.65]), "w3:L64")
  hand_cell(root, "h2o", 0.35, METHOD[:2], "w3:L64")
  md, _ = C.report([str(root)], str(tmp_path / "rep"), log=lambda s: None)
  assert "| n (simple+multiple / all) | b_HBM |" in md and "b_HBM: HBM bytes" in md
  rows = {r.split(" | ")[0][2:]: r for r in table(md)}
  assert rows["full"].endswith(" | 1.250 |") and rows["spherical"].endswith(" | 0.700 |")
  assert rows["pask"].endswith(" | 0.525 |") and rows["h2o"].endswith(" | – |")
  lm = [{"id": f"d{i}", "category": "w1", "nll": 2.0, "nll_first_half": 2.0,
         "nll_last_half": 2.0, "prompt_len": 50, "gen_len": 8, "kv_gen_len": 8, "prefill_B": 0.3,
         "decode_B": 0.3, "total_B": 0.3, "b_HBM": x} for i, x in enumerate((0.25, 0.35))]
  run = {"method": "spherical", "budget": 0.35, "categories": E.summarize_lm(lm),
         "length": 64, "tail": 8}
  assert run["categories"]["overall"]["b_HBM"] == pytest.approx(0.3)
  bare = [{k: v for k, v in lm[0].items() if k != "b_HBM"}]
  md = E.report(None, str(tmp_path / "lm"),
                runs=[run, {**run, "method": "h2o", "categories": E.summarize_lm(bare)}])
  assert "| length / tail | n | b_HBM |" in md
  assert "| 64 / 8 | 2 | 0.300 |" in md and "| 64 / 8 | 1 | – |" in md


def test_the_frontier_plan_sizes_its_cells_for_an_8_minute_call(monkeypatch):
  """examples/campaign_sph_frontier.toml (no model: its path and fingerprint stubbed): §4's
  methods, budgets, lengths and case counts, every cell expected within 8 minutes with the
  model's load."""
  monkeypatch.setattr(C, "model_path", lambda m: "/weights")
  monkeypatch.setattr(C, "fingerprint", lambda p: "0" * 64)
  plan = C.load_plan(os.path.join(os.path.dirname(__file__), "..", "examples",
                                  "campaign_sph_frontier.toml"), "/nonexistent")
  assert [m.spec for m in plan.models] == ["qwen2.5-coder-1.5b-instruct"]
  rho = (0.6, 0.45, 0.35, 0.25, 0.15)
  got = {m.label: (m.method, m.budgets, m.policy) for m in plan.methods}
  assert got == {"full": ("full", (1.0,), None), "paged-dense": ("pask", (1.0,), "all-high"),
                 "int4": ("int4", (1.0,), None), "streaming": ("streaming", rho, None),
                 "spherical": ("spherical", rho, None), "sphkv-rd": ("sphkv-rd", rho, None),
                 "sphkv-angle": ("sphkv-angle", (1.0,), None),
                 "sphkv-retain": ("sphkv-retain", rho, None),
                 "sphkv-quant": ("sphkv-quant", (1.0,), None),
                 "sphkv-gated": ("sphkv-gated", rho, None),
                 "sphkv-shared": ("sphkv-shared", (0.35, 0.15), None),
                 "sphkv-compact": ("sphkv-compact", (0.35, 0.25, 0.15), None),
                 "sphkv-flat": ("sphkv-flat", (0.35, 0.15), None),
                 "sphkv-recent4": ("sphkv-recent4", (0.35, 0.15), None),
                 "sphkv-retrieved": ("sphkv-retrieved", (0.35, 0.15), None)}
  cs = C.cells(plan)
  assert len({c.key for c in cs}) == len(cs)
  per: dict[str, set] = {}
  for c in cs:
    per.setdefault(c.material["task"], set()).update(x.id for x in c.cases)
  assert {k: len(v) for k, v in per.items()} == {
      "w1:L8192:K1024": 64, "w2:L8192": 600, "w3:L8192": 200,
      "w1:L32768:K1024": 64, "w2:L32000": 600, "w3:L32000": 200}
  est = C.Estimator(plan, [])
  assert max(est.seconds(c, loaded=False) for c in cs) <= 8 * 60


def test_the_schema_plan_is_the_frontier_w3_slice_unconstrained(monkeypatch):
  """examples/campaign_sph_schema.toml: the frontier plan's first W3 8K slice (the same cases),
  decoded without the grammar, by methods that do not read the parser's tags."""
  monkeypatch.setattr(C, "model_path", lambda m: "/weights")
  monkeypatch.setattr(C, "fingerprint", lambda p: "0" * 64)
  ex = os.path.join(os.path.dirname(__file__), "..", "examples")
  free = C.cells(C.load_plan(os.path.join(ex, "campaign_sph_schema.toml"), "/nonexistent"))
  front = C.cells(C.load_plan(os.path.join(ex, "campaign_sph_frontier.toml"), "/nonexistent"))
  w3 = lambda cs: {c.material["task"]: sorted(c.material["cases"]) for c in cs
                   if c.split.label == "w3-8k"}
  assert {c.material["constrained"] for c in free} == {False}
  assert {c.material["task"]: sorted(c.material["cases"]) for c in free} == w3(front)
  assert not {c.method.method for c in free} & set(E.TAGGED)


def test_committed_cells_still_report_with_stability(tmp_path):
  """Cells committed before token ids were stored (results/campaign/qwen15-bfcl): a Full-KV cell
  and a PASK cell of the same cases load and report, their disagreement compared by text."""
  root = os.path.join(os.path.dirname(__file__), "..", "results", "campaign", "qwen15-bfcl")
  docs = [read_json(os.path.join(root, k, "cell.json")) for k in sorted(os.listdir(root))
          if os.path.isfile(os.path.join(root, k, "cell.json"))]
  full = next(d for d in docs if d["material"]["method"] == "full")
  pask = next(d for d in docs if d["material"]["method"] == "pask"
              and d["material"]["cases"] == full["material"]["cases"])
  for d in (full, pask):
    shutil.copytree(os.path.join(root, d["key"]), tmp_path / "cells" / d["key"])
  md, _ = C.report([str(tmp_path / "cells")], str(tmp_path / "rep"), log=lambda s: None)
  n = len(full["material"]["cases"])
  ref = {r["id"]: r["text"] for r in E.read_cases(os.path.join(root, full["key"]))}
  differ = sum(r["text"] != ref[r["id"]] for r in E.read_cases(os.path.join(root, pask["key"])))
  assert f"| full | – | {n} | 0.0% | +0.0% | 0.0% (text) | – |" in md
  assert f"| pask | {pask['budget']:g} | {n} | " in md
  assert f" | {100 * differ / n:.1f}% (text) | – |" in md


def test_every_example_plan_loads():
  """Each plan under examples/ parses and names its methods and splits (policies may be
  calibrated later: their paths are read when a cell runs)."""
  import glob
  root = os.path.join(os.path.dirname(__file__), "..", "examples")
  paths = sorted(glob.glob(os.path.join(root, "campaign_*.toml")))
  assert len(paths) >= 5
  for path in paths:
    plan = C.load_plan(path)
    assert plan.name and plan.methods, path
