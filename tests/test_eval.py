"""The evaluation harness end to end on a tiny random model with a synthetic enum task (exact
oracle), every method; tuning, report and CLI errors."""
import csv
import dataclasses
import json
import os

import numpy as np
import pytest

from models import Loaded, ModelConfig, random_model
from calibrate import evaluate as E
from pask_jax import policy as P
from pask_jax.grammar import tool_call_grammar
from pask_jax.prompt import Prompt

from pask_jax.testing import grammar_compiler, stored_tokenizer

pytestmark = pytest.mark.fast_compile

DATA = os.path.join(os.path.dirname(__file__), "data", "qwen_tokenizer.json.gz")
RNG = np.random.default_rng()
COLORS = ["red", "green", "blue", "amber"]
TOOL = {"type": "function", "function": {"name": "paint", "description": "Paint the wall",
                                         "parameters": {"type": "object", "properties": {
                                             "color": {"type": "string", "enum": COLORS}},
                                             "required": ["color"]}}}


@dataclasses.dataclass
class Case:
  id: str
  category: str
  target: str
  text: str


class EnumTask:
  """One tool with an enum argument; a case passes iff the call is exactly paint(color=target)."""
  name = "enum"

  def __init__(self, tok, compiler):
    self.tok = tok
    self.grammar = tool_call_grammar(compiler, [TOOL], "json_list", max_calls=1)
    self.seed = int(RNG.integers(1 << 30))

  def cases(self, split, categories=None, max_cases=None, skip=0):
    rng = np.random.default_rng([self.seed, len(split)])
    cats = ["simple_python", "multiple", "parallel"]
    out = []
    for i in range(6):
      c = COLORS[int(rng.integers(4))]
      filler = " ".join(rng.choice(["please", "the", "wall", "now", "colour", "room"],
                                   int(rng.integers(60, 100))))
      out.append(Case(f"{split}_{i}", cats[i % 3], c, f"{filler}. Paint it {c}."))
    return E.cap_per_category(out, max_cases, skip)   # the harness's own per-category cut

  def prepare(self, cases, prompt_labels):
    from pask_jax.prompt import encode
    out = []
    for c in cases:
      ids, tags = encode(self.tok, c.text, prompt_labels)
      out.append(Prompt(c.text, ids, tags, self.grammar, case=c))
    return out

  def score(self, case, text, complete):
    if not complete:
      return {"calls": None, "passed": False, "per_call": 0.0, "error": "incomplete"}
    calls = json.loads(text)
    ok = calls == [{"name": "paint", "arguments": {"color": case.target}}]
    return {"calls": calls, "passed": ok, "per_call": float(ok), "error": ""}


@pytest.fixture(scope="module")
def session():
  tok = stored_tokenizer(DATA)
  cfg = ModelConfig(arch="qwen2", vocab_size=tok.vocab_size, hidden=32, intermediate=48,
                    n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, rope_theta=1e6,
                    tie_embeddings=True)
  m = Loaded(cfg, random_model(cfg, seed=int(RNG.integers(1 << 30))), tok)
  gc = grammar_compiler(tok, cfg.vocab_size)
  return E.Session(m, EnumTask(tok, gc), batch=4, compiler=gc)


@pytest.fixture(scope="module")
def runs(session, tmp_path_factory):
  root = tmp_path_factory.mktemp("runs")
  pol = root / "policy"
  P.save(P.demo(session.cfg, tokenizer_hash=session.tok.hash()), pol)
  out = {}
  full = E.run(session, E.RunConfig("full", 1.0, "test", max_tokens=48), str(root / "full"),
               progress=False)
  gen = full["categories"]["overall"]["gen_len"]
  knobs = {"gen": gen, "h2o": {"sink": 2, "recent": 8}, "mikv": {"sink": 2, "recent": 8},
           "snapkv": {"obs": 8}, "rocketkv": {"obs": 8, "kernel": 31}, "streaming": {"sink": 4}}
  for m in ("pask", "streaming", "h2o", "snapkv", "mikv", "int4", "rocketkv"):
    if m == "int4":  # streaming's window: the two uniform policies share one compiled step
      knobs["int4"] = {"sink": 4, "window": out["streaming"]["settings"]["window"]}
    rc = E.RunConfig(m, 0.5, "test", max_tokens=48, policy=str(pol) if m == "pask" else None,
                     knobs=knobs)
    out[m] = E.run(session, rc, str(root / m), progress=False)
  out["full"] = full
  return root, out


def rows(d):
  with open(os.path.join(d, "cases.jsonl")) as f:
    return [json.loads(l) for l in f]


def test_every_method_scored_by_the_exact_oracle(session, runs):
  root, out = runs
  cases = {c.id: c for c in session.task.cases("test")}
  for m, meta in out.items():
    rs = rows(root / m)
    assert len(rs) == 6 and {r["id"] for r in rs} == set(cases)
    for r in rs:
      call = json.loads(r["text"]) if r["finish"] == "stop" else None
      want = call is not None and call[0]["arguments"]["color"] == cases[r["id"]].target
      assert r["passed"] == want and r["category"] == cases[r["id"]].category
      assert r["prompt_len"] > 50 and 0 < r["total_B"] <= 1.0
    c = meta["categories"]
    assert c["overall"]["accuracy"] == pytest.approx(np.mean([r["passed"] for r in rs]))
    assert c["simple+multiple"]["n"] == 4 and c["parallel"]["n"] == 2
    with open(root / m / "summary.csv") as f:
      got = {r["category"]: r for r in csv.DictReader(f)}
    assert set(got) == {"simple_python", "multiple", "parallel", "simple+multiple", "overall"}
    assert float(got["overall"]["total_B"]) == pytest.approx(c["overall"]["total_B"], abs=1e-4)


def test_measured_budgets(runs):
  _, out = runs
  b = {m: meta["categories"]["overall"] for m, meta in out.items()}
  assert b["full"]["total_B"] == 1.0
  for m in ("h2o", "mikv"):   # matched by construction
    assert abs(b[m]["total_B"] - 0.5) <= 0.01, m
  for m in ("streaming", "snapkv", "rocketkv"):   # matched through the generated-length estimate
    assert abs(b[m]["total_B"] - 0.5) <= 0.03, m
  for m in ("snapkv", "rocketkv"):
    assert b[m]["decode_B"] == 1.0 and b[m]["prefill_B"] < 0.5, m
  assert 0.3 < b["int4"]["total_B"] < 0.5          # m(L)/m(H) = (4·16+32)/(16·16) = 0.375, d=8
  assert b["pask"]["total_B"] < 1.0


def test_masked_methods_at_b1_reproduce_full(session, runs, tmp_path):
  root, _ = runs
  ref = {r["id"]: r["text"] for r in rows(root / "full")}
  for m in ("h2o", "snapkv", "mikv"):
    meta = E.run(session, E.RunConfig(m, 1.0, "test", max_tokens=48,
                                      knobs={"gen": 0, m: {"sink": 2}}), str(tmp_path / m),
                 progress=False)
    assert {r["id"]: r["text"] for r in rows(tmp_path / m)} == ref, m
    assert meta["categories"]["overall"]["total_B"] == 1.0


def test_report_table_and_plot(runs, tmp_path):
  root, out = runs
  md = E.report([str(root / m) for m in out], str(tmp_path))
  lines = [l for l in md.splitlines() if l.startswith("| ") and "target B" not in l]
  assert len(lines) == len(out)
  assert lines[0].startswith("| full ") and (tmp_path / "accuracy_vs_B.png").stat().st_size > 1000
  with pytest.raises(ValueError, match="summary.json"):
    E.report([str(tmp_path / "nope")], str(tmp_path))


def test_report_marks_runs_over_their_budget(runs, tmp_path):
  root, out = runs
  loaded = {r["method"]: r for r in E.load_runs([str(root / m) for m in ("full", "h2o")])}
  spent = loaded["h2o"]["categories"]["overall"]["total_B"]
  within = {**loaded["h2o"], "budget": round(spent - E.B_SLACK / 2, 4)}
  over = {**loaded["h2o"], "method": "snapkv", "budget": round(spent - 2 * E.B_SLACK, 4)}
  md = E.report(None, str(tmp_path), runs=[loaded["full"], within, over])
  rows = {l.split(" | ")[0][2:]: l for l in md.splitlines() if l.startswith("| ")}
  assert "**over**" in rows["snapkv"] and "**over**" not in rows["h2o"]
  assert "**over**" not in rows["full"] and "more than 0.02" in md
  assert not E.over_budget(loaded["full"]) and E.over_budget(over)


def test_tune_on_dev_only(session, tmp_path):
  grid = {"h2o": {"sink": [2], "recent": [4, 8]}}
  res = E.tune(session, ["h2o"], 0.5, grid=grid, split="dev", max_cases=3, max_tokens=48,
               out=str(tmp_path), progress=False)
  assert res["knobs"]["h2o"]["recent"] in (4, 8) and res["knobs"]["gen"] > 0
  assert len(res["log"]) == 3 and (tmp_path / "knobs.json").exists()
  assert E.read_knobs(str(tmp_path / "knobs.json"))["h2o"]["sink"] == 2
  with pytest.raises(ValueError, match="test split"):
    E.tune(session, ["h2o"], 0.5, split="test")


def test_tune_checks_methods_first_and_resumes(session, tmp_path, monkeypatch):
  grid = {"h2o": {"sink": [2], "recent": [4, 8]}}
  calls = []
  real = E.run

  def counted(s, rc, *a, **k):
    own = rc.knobs.get(rc.method) if rc.knobs else None
    calls.append((rc.method, rc.budget, json.dumps(own, sort_keys=True) if own else ""))
    if len(calls) == cut_after:
      raise KeyboardInterrupt   # a device call's time limit, in the middle of the search
    return real(s, rc, *a, **k)

  monkeypatch.setattr(E, "run", counted)
  kw = dict(grid=grid, split="dev", max_cases=2, max_tokens=32, progress=False)
  cut_after = 0
  with pytest.raises(ValueError, match="no tuning grid for 'int4'"):
    E.tune(session, ["h2o", "int4"], 0.5, out=str(tmp_path), **kw)
  assert not calls and not list(tmp_path.iterdir())
  # two budgets: one Full-KV run; cut short after the first budget's first grid point
  cut_after = 3
  with pytest.raises(KeyboardInterrupt):
    E.tune(session, ["h2o"], [0.5, 0.6], out=str(tmp_path), **kw)
  part = json.loads((tmp_path / "B0.50" / "knobs.json").read_text())
  assert part["complete"] is False and [r["method"] for r in part["log"]] == ["full", "h2o"]
  assert not (tmp_path / "B0.60").exists()
  calls.clear()
  cut_after = 0
  res = E.tune(session, ["h2o"], [0.5, 0.6], out=str(tmp_path), **kw)
  # only the three points still missing were measured; nothing of Full KV again
  assert [c[:2] for c in calls] == [("h2o", 0.5), ("h2o", 0.6), ("h2o", 0.6)]
  for r, b in zip(res, (0.5, 0.6)):
    on_disk = json.loads((tmp_path / f"B{b:.2f}" / "knobs.json").read_text())
    assert on_disk["complete"] is True and on_disk["budget"] == b and len(on_disk["log"]) == 3
    assert on_disk["knobs"] == json.loads(json.dumps(r["knobs"]))
    assert r["knobs"]["h2o"]["recent"] in (4, 8) and r["knobs"]["gen"] == res[0]["knobs"]["gen"]
  # a larger grid measures only its new point; a fresh run measures everything again
  calls.clear()
  big = {"h2o": {"sink": [2], "recent": [4, 8, 16]}}
  E.tune(session, ["h2o"], 0.5, out=str(tmp_path / "B0.50"), **{**kw, "grid": big})
  assert [c[2] for c in calls] == [json.dumps({"recent": 16, "sink": 2}, sort_keys=True)]
  # another method tuned into the same folder later: h2o's knobs stay
  calls.clear()
  both = {**big, "streaming": {"sink": [2]}}
  r = E.tune(session, ["streaming"], 0.5, out=str(tmp_path / "B0.50"), **{**kw, "grid": both})
  assert [c[0] for c in calls] == ["streaming"] and r["knobs"]["streaming"]["sink"] == 2
  assert r["knobs"]["h2o"]["sink"] == 2 and r["knobs"]["h2o"]["recent"] in (4, 8, 16)
  calls.clear()
  E.tune(session, ["h2o"], 0.5, out=str(tmp_path / "B0.50"), resume=False, **kw)
  assert [c[0] for c in calls] == ["full", "h2o", "h2o"]


def test_tune_never_buys_accuracy_with_bytes_over_the_budget():
  grid = {"h2o": {"sink": [2], "recent": [4, 8, 64]}}
  full = {"method": "full", "knobs": "{}", "accuracy": 0.9, "total_B": 1.0, "gen": 30.0}
  pt = lambda r, acc, b: {"method": "h2o", "knobs": json.dumps({"recent": r, "sink": 2}),
                          "accuracy": acc, "headline": acc, "total_B": b, "gen": 20.0 + r}
  ident = {"cases": ["a/1", "a/2"]}
  pick = lambda log: E.tune_result(log, ["h2o"], 0.33, "dev", grid, ident, True)["knobs"]["h2o"]
  # recent 64 is the most accurate only because its protected floor spends B 0.40
  assert pick([full, pt(4, 0.70, 0.33), pt(8, 0.75, 0.345), pt(64, 0.85, 0.40)])["recent"] == 8
  # none within the budget: the closest B, not the most accurate
  assert pick([full, pt(4, 0.70, 0.37), pt(64, 0.85, 0.40)])["recent"] == 4
  # a point measured for another grid (kept in the log) is not chosen
  assert pick([full, pt(4, 0.70, 0.33), pt(16, 0.99, 0.33)])["recent"] == 4


def test_bad_input(session, tmp_path):
  from pask_jax import cli
  base = ["eval", "--out", str(tmp_path)]
  for extra, msg in ((["--method", "lru"], "unknown method"),
                     (["--method", "pask"], "needs --policy"),
                     (["--method", "h2o", "--budget", "0"], "(0, 1]"),
                     (["--method", "h2o", "--budget", "1.5"], "(0, 1]")):
    with pytest.raises(SystemExit) as e:
      cli.main(base + extra)
    assert msg in str(e.value.code)
  other = ModelConfig(arch="llama", vocab_size=97, hidden=64, intermediate=96, n_layers=3,
                      n_heads=4, n_kv_heads=2, head_dim=16)
  P.save(P.demo(other), tmp_path / "pol")
  with pytest.raises(ValueError, match="another model"):
    E.run(session, E.RunConfig("pask", 0.5, "test", policy=str(tmp_path / "pol"), max_tokens=8),
          None, progress=False)
  with pytest.raises(ValueError, match="not found"):
    E.run(session, E.RunConfig("pask", 0.5, "test", policy=str(tmp_path / "missing"),
                               max_tokens=8), None, progress=False)


def test_slices_merge_into_the_whole_run(session, runs, tmp_path):
  root, out = runs
  a = E.run(session, E.RunConfig("h2o", 0.5, "test", max_cases=1, max_tokens=48,
                                 knobs={"h2o": {"sink": 2, "recent": 8}}),
            str(tmp_path / "a"), progress=False)
  b = E.run(session, E.RunConfig("h2o", 0.5, "test", max_tokens=48, skip_cases=1,
                                 knobs={"h2o": {"sink": 2, "recent": 8}}),
            str(tmp_path / "b"), progress=False)
  ra, rb = E.read_cases(str(tmp_path / "a")), E.read_cases(str(tmp_path / "b"))
  assert len(ra) == 3 and len(rb) == 3 and not {r["id"] for r in ra} & {r["id"] for r in rb}
  from pask_jax import cli
  assert cli.main(["merge", str(tmp_path / "a"), str(tmp_path / "b"), "--out",
                   str(tmp_path / "m")]) == 0
  m = json.load(open(tmp_path / "m" / "summary.json"))
  rows = E.read_cases(str(tmp_path / "m"))
  assert m["n_cases"] == 6 and {r["id"] for r in rows} == {c.id for c in session.task.cases("test")}
  assert m["categories"] == json.loads(json.dumps(E.summarize(ra + rb)))
  n = lambda d: d["categories"]["overall"]["n"]
  acc = lambda d: d["categories"]["overall"]["accuracy"]
  assert acc(m) == pytest.approx((n(a) * acc(a) + n(b) * acc(b)) / 6)
  assert len(m["settings_by_slice"]) == 2
  assert m["measured_B"] == m["categories"]["overall"]["total_B"]   # of the pooled cases
  with pytest.raises(ValueError, match="in both"):
    E.merge([str(tmp_path / "a"), str(tmp_path / "a")], str(tmp_path / "x"))
  with pytest.raises(ValueError, match="method"):
    E.merge([str(tmp_path / "a"), str(root / "full")], str(tmp_path / "x"))
  with pytest.raises(SystemExit, match="no summary.json"):
    cli.main(["merge", str(tmp_path / "nope"), "--out", str(tmp_path / "x")])


def test_batches_fit_the_cases_and_progress_is_per_case(session, runs, monkeypatch):
  import pask_jax.decode as D
  assert [E.batch_size(n, 64) for n in (4, 64, 65, 70, 200)] == [4, 64, 33, 35, 50]
  assert E.batch_size(6, 4) == 3
  inside = {"now": False}
  real = D.generate

  def spy(*a, **k):
    inside["now"] = True
    try:
      return real(*a, **k)
    finally:
      inside["now"] = False

  monkeypatch.setattr(D, "generate", spy)

  class Bar:
    def __init__(self, total, desc):
      self.total, self.steps, self.closed = total, [], False

    def update(self, n):
      self.steps.append((n, inside["now"]))

    def close(self):
      self.closed = True

  bars = []
  monkeypatch.setattr(session, "batch", 64)
  meta = E.run(session, E.RunConfig("full", 1.0, "test", max_tokens=48), None,
               progress=lambda **kw: bars.append(Bar(**kw)) or bars[-1])
  assert meta["batch"] == 6 == meta["n_cases"]          # not padded to --batch 64
  assert session.runners[("full", 6)].batch == 6
  bar, = bars
  assert bar.total == 6 and bar.closed
  assert bar.steps == [(1, True)] * 6                   # one case at a time, while decoding
  # the answers do not depend on the batching (the fixture's runs used 2 batches of 3); b_HBM
  # does (the weights' bytes are shared by the batch's rows)
  kv = lambda c: {k: {f: x for f, x in d.items() if f not in ("b_HBM", "hbm_bytes_per_token")}
                  for k, d in c.items()}
  assert runs[1]["full"]["batch"] == 3
  assert kv(meta["categories"]) == kv(runs[1]["full"]["categories"])
  o6, o3 = meta["categories"]["overall"], runs[1]["full"]["categories"]["overall"]
  assert o6["hbm_bytes_per_token"] < o3["hbm_bytes_per_token"] and o6["b_HBM"] > o3["b_HBM"]


def test_missing_bfcl_eval_is_one_line_naming_the_install(tmp_path, monkeypatch):
  import importlib.util
  from pask_jax import cli, platform
  real = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec",
                      lambda name, *a: None if name == "bfcl_eval" else real(name, *a))
  monkeypatch.setattr(platform, "load_model",
                      lambda *a: pytest.fail("model loaded before the check"))
  for argv in (["eval", "--method", "full", "--out", str(tmp_path)],
               ["tune", "--out", str(tmp_path)], ["calibrate", "--out", str(tmp_path)]):
    with pytest.raises(SystemExit) as e:
      cli.main(argv)
    msg = str(e.value.code)
    assert "pip install --no-deps bfcl-eval==2026.3.23" in msg and "\n" not in msg
  from calibrate import bfcl
  with pytest.raises(bfcl.BFCLMissing, match="not installed"):
    bfcl.load(["simple_python"])


def test_plot_has_binomial_error_bars_and_fitted_axes(tmp_path):
  mk = lambda m, b, acc, n, tb: {"method": m, "budget": b, "categories": {
      "simple+multiple": {"accuracy": acc, "n": n}, "overall": {"total_B": tb}}}
  runs = [mk("full", 1.0, 0.6, 160, 1.0), mk("h2o", 0.33, 0.3, 160, 0.27),
          mk("h2o", 0.5, 0.45, 160, 0.5), mk("pask", 0.33, 0.55, 80, 0.31),
          mk("pask", 0.6, 0.58, 80, 0.6)]
  drawn = E.plot_runs(runs, str(tmp_path / "p.png"))
  assert (tmp_path / "p.png").stat().st_size > 1000
  xs, ys, es = drawn["series"]["PASK"]
  assert ys == pytest.approx([55.0, 58.0]) and xs == [0.31, 0.6]
  assert es == pytest.approx([100 * np.sqrt(0.55 * 0.45 / 80), 100 * np.sqrt(0.58 * 0.42 / 80)])
  assert drawn["series"]["Full KV"][2] == [pytest.approx(100 * np.sqrt(0.24 / 160))]
  lo, hi = drawn["xlim"]
  assert 0.2 < lo < 0.27 and 0.6 < hi < 0.7                 # fitted to 0.27..0.6, not 0..1.05
  ylo, yhi = drawn["ylim"]
  assert 20 < ylo < 30 - 100 * np.sqrt(0.21 / 160) and 60 + 100 * np.sqrt(0.24 / 160) < yhi < 70


QWEN_POLICY = os.path.join(os.path.dirname(__file__), "..", "policies",
                           "qwen2.5-coder-0.5b-instruct-bfcl")


def test_pask_budget_picks_the_policy_variant_or_is_refused(tmp_path):
  var = E.policy_variants(QWEN_POLICY)
  assert sorted(var) == [0.33, 0.4, 0.5, 0.6]
  d, b = E.pick_policy(QWEN_POLICY, 0.33)
  assert os.path.basename(d) == "B0.33" and b == 0.33
  assert E.pick_policy(QWEN_POLICY, 0.4)[0] == var[0.4]
  assert E.pick_policy(var[0.6], 0.6) == (var[0.6], 0.6)      # a variant named directly
  for where, budget, msg in ((QWEN_POLICY, 0.45, "no variant for --budget 0.45: its variants "
                              "are for B 0.33, 0.40, 0.50, 0.60"),
                             (QWEN_POLICY, None, "give --budget one of 0.33"),
                             (var[0.6], 0.33, "its own target B is 0.6"),
                             ("demo", 0.33, "its own target B is 0.5"),
                             ("all-high", 0.5, "its own target B is 1")):
    with pytest.raises(ValueError, match=msg):
      E.pick_policy(where, budget)
  assert E.pick_policy("demo", None) == ("demo", 0.5)
  assert E.pick_policy("demo", 0.5) == ("demo", 0.5)
  # a policy whose decode and prefill budgets differ states no target: only "as it is"
  P.save(P.demo(b_d=0.0, b_p=0.5), tmp_path / "own")
  assert E.pick_policy(str(tmp_path / "own"), None) == (str(tmp_path / "own"), None)
  with pytest.raises(ValueError, match="states no target B"):
    E.pick_policy(str(tmp_path / "own"), 0.5)
  with pytest.raises(ValueError, match="not found"):
    E.pick_policy(str(tmp_path / "missing"), 0.5)


def test_eval_cli_refuses_a_budget_the_policy_cannot_honour(tmp_path, monkeypatch):
  from pask_jax import cli, platform
  monkeypatch.setattr(platform, "load_model",
                      lambda *a: pytest.fail("model loaded before the check"))
  for pol, budget, msg in (("demo", "0.33", "--budget 0.33 cannot be honoured with policy demo"),
                           (QWEN_POLICY, "0.45", "no variant for --budget 0.45"),
                           (QWEN_POLICY, None, "give --budget one of")):
    argv = ["eval", "--method", "pask", "--policy", pol, "--out", str(tmp_path)]
    with pytest.raises(SystemExit) as e:
      cli.main(argv + (["--budget", budget] if budget else []))
    assert msg in str(e.value.code) and "\n" not in str(e.value.code)


def test_pask_runs_the_variant_and_labels_requested_and_measured_b(session, runs, tmp_path):
  root, out = runs
  assert out["pask"]["budget"] == 0.5        # the saved demo: B_D = B_P = 0.5
  for meta in out.values():
    assert meta["measured_B"] == meta["categories"]["overall"]["total_B"]
  assert json.load(open(root / "pask" / "summary.json"))["measured_B"] == \
      out["pask"]["measured_B"]
  pols = tmp_path / "pols"
  for b in (0.3, 0.5):
    P.save(P.demo(session.cfg, tokenizer_hash=session.tok.hash(), b_d=b, b_p=b), pols / f"B{b:.2f}")
  meta = E.run(session, E.RunConfig("pask", 0.3, "test", max_tokens=48, max_cases=1,
                                    policy=str(pols)), str(tmp_path / "v"), progress=False)
  assert meta["settings"]["policy"] == str(pols / "B0.30") and meta["budget"] == 0.3
  assert meta["settings"]["b_d"] == pytest.approx(0.3)
  P.save(P.demo(session.cfg, tokenizer_hash=session.tok.hash(), b_d=0.0, b_p=0.5),
         tmp_path / "own")
  own = E.run(session, E.RunConfig("pask", None, "test", max_tokens=48, max_cases=1,
                                   policy=str(tmp_path / "own")), str(tmp_path / "o"),
              progress=False)
  assert own["budget"] is None and 0 < own["measured_B"] < 1
  md = E.report([str(tmp_path / "v"), str(tmp_path / "o")], str(tmp_path / "r"))
  line = {l.split(" | ")[1]: l for l in md.splitlines()[2:] if l.startswith("| ")}
  assert "| pask | 0.30 | " in md and "| pask | policy's own | " in md
  assert f"/ {own['measured_B']:.3f} |" in line["policy's own"]


def test_spherical_runs_in_the_harness_and_reports_measured_b(session, tmp_path):
  """Spherical KV through the harness (RDR plan, tier pools, reference attention): scored rows
  and a measured B (metadata counted) that does not exceed the requested one."""
  knobs = {"spherical": {"sink": 2, "window": 8}}
  meta = E.run(session, E.RunConfig("spherical", 0.5, "test", max_tokens=24, knobs=knobs),
               str(tmp_path / "s"), progress=False)
  rs = rows(tmp_path / "s")
  assert len(rs) == 6 and all(r["method"] == "spherical" for r in rs)
  for r in rs:
    assert r["prompt_len"] > 50 and r["kv_gen_len"] >= 0
    assert 0.3 < r["prefill_B"] <= 0.5 + 1e-6 and 0.3 < r["total_B"] <= 0.5 + 1e-6
  assert meta["settings"] == {"gen": 48.0, "sink": 2, "window": 8}
  assert 0.3 < meta["measured_B"] <= 0.5 + 1e-6
  for bad in (0.0, 1.5, float("nan")):
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
      E.check_config(E.RunConfig("spherical", bad, "test"))
  for kw, msg in ((dict(temperature=-0.1), "temperature must be >= 0"),
                  (dict(temperature=float("nan")), "temperature must be >= 0"),
                  (dict(temperature=0.7, top_p=0.0), r"top_p must be in \(0, 1\]"),
                  (dict(top_p=1.5), r"top_p must be in \(0, 1\]")):
    with pytest.raises(ValueError, match=msg) as e:
      E.check_config(E.RunConfig("full", 1.0, "test", **kw))
    assert "\n" not in str(e.value)


def test_a_jsonl_task_runs_in_the_harness_at_a_requested_budget(session, runs, tmp_path):
  """A user's JSONL task (issue 27: calibrate on it, then evaluate at a budget) through the
  harness on this file's session: tool-call and JSON-schema cases, PASK at the demo policy's
  0.5, rows scored as calibration scores them (calibrate.tasks.check_answer), measured B
  beside the requested one, a report row."""
  from calibrate import tasks
  root, _ = runs
  colors = list(RNG.permutation(COLORS))
  lines = [{"id": f"p{i}", "messages": [{"role": "user", "content": f"Paint it {c}."}],
            "tools": [TOOL], "expected": [{"name": "paint", "arguments": {"color": c}}]}
           for i, c in enumerate(colors[:2])]
  lines.insert(1, {"id": "s", "messages": [{"role": "user", "content": "A color?"}],
                   "schema": {"enum": colors}, "scorer": "json_valid"})
  data = tmp_path / "mine.jsonl"
  data.write_text("".join(json.dumps(l) + "\n" for l in lines))
  cases = tasks.read_jsonl(str(data))
  own = session.task
  session.task = E.JsonlSuite(cases, session.tok, session.cfg.arch, session.compiler,
                              name="jsonl:mine.jsonl")
  try:
    meta = E.run(session, E.RunConfig("pask", 0.5, "test", max_tokens=24,
                                      policy=str(root / "policy")), str(tmp_path / "j"),
                 progress=False)
  finally:
    session.task = own
  assert meta["task"] == "jsonl:mine.jsonl" and meta["budget"] == 0.5 and meta["n_cases"] == 3
  assert 0 < meta["measured_B"] == meta["categories"]["overall"]["total_B"] <= 1
  assert set(meta["categories"]) == {"tools", "schema", "overall"}
  got = rows(tmp_path / "j")
  assert [r["id"] for r in got] == ["p0", "s", "p1"]
  from pask_jax.prompt import style
  for r, c in zip(got, cases):
    want = tasks.check_answer(c, r["text"], r["finish"] == "stop", style(session.cfg.arch)[0])
    assert (r["passed"], r["per_call"], r["error"]) == \
        (want["passed"], want["per_call"], want["error"])
  assert any(r["finish"] == "stop" for r in got)
  md = E.report([str(tmp_path / "j")], str(tmp_path / "r"))
  assert "| pask | 0.50 | " in md


# --- Spherical KV ablations and hybrids (pask_jax.spherical.variants) --------------------------

SPH_KNOBS = {m: {"sink": 2, "window": 8} for m in ("sphkv-rd", "sphkv-angle", "sphkv-retain",
                                                    "sphkv-quant", "rdr+tags", "pask+ada",
                                                    "sphkv-shared", "sphkv-compact")}


@pytest.fixture(scope="module")
def sph_runs(session, tmp_path_factory):
  """Every Spherical KV ablation and hybrid through the harness: one case per category, a few
  tokens (compiles dominate), the fixed-rate ones at a budget above their rate."""
  root = tmp_path_factory.mktemp("sph")
  pol = root / "policy"
  P.save(P.demo(session.cfg, n_groups=2, tokenizer_hash=session.tok.hash()), pol)
  # the fixed-rate ablations at a budget above their rate (at D = 8 the metadata is 14 % of
  # dense: A42 measures 0.86, A2 0.83); RDR+tags where the demo policy's floors fit (its
  # protection mask is checked at a binding budget below)
  budgets = {"sphkv-rd": 0.5, "sphkv-angle": 0.9, "sphkv-retain": 0.5, "sphkv-quant": 0.9,
             "rdr+tags": 0.95, "pask+ada": 0.5, "sphkv-shared": 0.5, "sphkv-compact": 0.5}
  out = {}
  for m, b in budgets.items():
    rc = E.RunConfig(m, b, "test", max_tokens=6, max_cases=1, knobs=SPH_KNOBS,
                     policy=str(pol) if m in ("rdr+tags", "pask+ada") else None)
    out[m] = E.run(session, rc, str(root / m), progress=False)
  return root, out, pol



def _sph_runner(session, method, batch=3):
  return session.runners[(("spherical", method, 2, 8), batch)]


def test_sph_variants_run_in_the_harness_and_report_measured_b(session, sph_runs):
  """Each ablation / hybrid through the harness: scored rows, every (token, group, head) in one
  place, measured B within the budget; the fixed-rate ablations (angle-only, quant-only) put
  every non-sink item at their one tier with nothing dropped (no RD allocation) and measure
  exactly that tier's bytes; retention-only keeps only {drop, A4}."""
  from pallas_kernels import spherical
  root, out, _ = sph_runs
  G, H, sink = 2, session.cfg.n_kv_heads, 2
  for m, meta in out.items():
    rs = rows(root / m)
    assert len(rs) == 3 and all(r["method"] == m for r in rs), m
    assert meta["settings"]["sink"] == sink and meta["settings"]["window"] == 8
    # PASK+ADA runs PASK's budgets, whose floors may beat them (reported as a deficit)
    fits = m != "pask+ada"
    assert 0 < meta["measured_B"] <= (meta["budget"] + 1e-6 if fits else 1.0)
    r_ = _sph_runner(session, m)
    cost, dense = r_.cost.astype(np.float64), r_.dense.astype(np.float64)
    for r in rs:
      n = r["prompt_len"] + r["kv_gen_len"]
      it = r["items"]
      assert sum(it.values()) == n * G * H, (m, it)          # every item lives in one place
      assert it["bf16"] >= sink * G * H
      if fits:
        assert 0.0 < r["total_B"] <= meta["budget"] + 1e-6, (m, r["total_B"])
        assert r["deficit_bytes"] == 0.0
      if m in ("sphkv-angle", "sphkv-quant"):
        lay = {"sphkv-angle": "A42", "sphkv-quant": "A2"}[m]
        assert it == {"drop": 0, lay: (n - sink) * G * H, "bf16": sink * G * H}
        bf16 = H * dense + spherical.POSITION_BYTES + spherical.TABLE_ENTRY_BYTES / 16
        want = (sink * bf16.sum() + (n - sink) * H * cost[:, 1].sum()) / (n * H * dense.sum())
        assert r["total_B"] == pytest.approx(want, rel=1e-6)
      elif m == "sphkv-retain":
        assert set(it) == {"drop", "A4", "bf16"} and it["drop"] > 0 and it["A4"] > 0
      elif m == "pask+ada":   # H in the BF16 pool, L at the tier, R dropped
        assert set(it) == {"drop", "A4/int4", "bf16"} and it["A4/int4"] > 0
        assert it["bf16"] > sink * G * H
      elif m == "sphkv-compact":   # INT4 values below the top tier; the budget binds
        assert set(it) == {"drop", "A42/int4", "A4/int4", "A4", "bf16"} and it["drop"] > 0
        assert it["A42/int4"] + it["A4/int4"] > 0
      elif m == "sphkv-rd":   # the paper ladder under RDR: the budget binds: down-tier, drop
        assert set(it) == {"drop", "A2", "A42", "A4", "bf16"} and it["drop"] > 0
        assert it["A2"] + it["A42"] > 0
      else:
        assert set(it) == {"drop", "A2", "A42", "A4", "bf16"}
  assert _sph_runner(session, "sphkv-rd").read == "reconstruct"
  # shared tiers: one route per (token, group), within the budget
  r_ = _sph_runner(session, "sphkv-shared")
  assert r_.heads == "shared" and _sph_runner(session, "sphkv-rd").heads == "own"
  (_, _, _, plan, _), lengths = _sph_state(session, r_, 0.5)
  route = np.asarray(plan.route)
  assert np.all(route == route[..., :1])
  assert np.any(route[0, sink:lengths[0] - 8, :, 0] == 0)   # the budget binds: whole tokens go
  assert np.all(np.asarray(plan.bytes) <= np.asarray(plan.budget) * (1 + 1e-6))
  # below their rate the fixed-rate ablations still drop nothing (no RD allocation: RDR would
  # drop to fit) and report what the rate spends beyond the budget
  for m in ("sphkv-angle", "sphkv-quant"):
    r_ = _sph_runner(session, m)
    (_, _, _, plan, _), lengths = _sph_state(session, r_, 0.3)
    route, deficit = np.asarray(plan.route), np.asarray(plan.deficit)
    for b, n in enumerate(lengths[:3]):
      assert np.all(route[b, :sink] == 2) and np.all(route[b, sink:n] == 1)
      want = np.asarray(plan.bytes[b]) - 0.3 * n * H * r_.dense
      np.testing.assert_allclose(deficit[b], want, rtol=1e-5)
      assert np.all(deficit[b] > 0)
  from pask_jax.spherical import variants as SV
  pol = P.resolve(str(sph_runs[2]), session.cfg, tokenizer_hash=session.tok.hash())
  bad = [(lambda: _sph_runner(session, "rdr+tags").configure(0.5), "need a PASK policy"),
         (lambda: _sph_runner(session, "sphkv-angle").configure(0.5, pol), "only configures"),
         (lambda: SV.Variant("x", layouts=("A2", "A4"), plan="fixed"), "one tier"),
         (lambda: SV.Variant("x", layouts=("A2", "A4"), values=("int4",)), "one value format"),
         (lambda: SV.Variant("x", layouts=("A4",), plan="fixed", heads="shared"),
          "need plan 'rdr'"),
         (lambda: SV.Variant("x", heads="all"), "heads must be one of"),
         (lambda: SV.variant("sphkv"), "unknown Spherical KV method")]
  for f, msg in bad:
    with pytest.raises(ValueError, match=msg) as e:
      f()
    assert "\n" not in str(e.value)
  with pytest.raises(ValueError, match="needs --policy") as e:
    E.check_config(E.RunConfig("rdr+tags", 0.5, "test"))
  assert "\n" not in str(e.value)


def test_sampled_runs_are_seeded_and_say_so(session, tmp_path):
  """``temperature`` > 0: the run samples with its seed (the same seed, the same tokens) and its
  summary records the sampling; a greedy run's has none."""
  rc = lambda **kw: E.RunConfig("full", 1.0, "test", max_tokens=10, max_cases=1, **kw)
  a = E.run(session, rc(temperature=1.0, top_p=0.9, sample_seed=3), str(tmp_path / "a"),
            progress=False)
  E.run(session, rc(temperature=1.0, top_p=0.9, sample_seed=3), str(tmp_path / "b"),
        progress=False)
  assert a["sampling"] == {"temperature": 1.0, "top_p": 0.9, "seed": 3}
  assert [r["tokens"] for r in rows(tmp_path / "a")] == [r["tokens"] for r in rows(tmp_path / "b")]
  assert "sampling" not in E.run(session, rc(), None, progress=False)


def _sph_state(session, runner, budget, policy=None, tags=None):
  from pask_jax.decode import pad_prompts
  preps = session.task.prepare(session.task.cases("test", max_cases=1), prompt_labels=True)
  tokens, lengths = pad_prompts([p.ids for p in preps], runner.batch, runner.capacity)
  tags = [p.tags for p in preps] if tags is None else tags
  return runner.configure(budget, policy).prefill(tokens, lengths, tags), lengths


def test_sph_rd_reads_the_same_storage_by_reconstruction(session, sph_runs):
  """A1 (sphkv-rd) keeps A0's storage and plan but attends over keys rebuilt to dense BF16:
  its attention equals the angle-domain read of the same state to BF16 rounding, and the tiers
  it rebuilds carry real weight (leaving them out changes the output)."""
  import jax
  import jax.numpy as jnp
  import pallas_kernels
  from pask_jax import cache as pcache
  from pask_jax.spherical import cache as scache
  r = _sph_runner(session, "sphkv-rd")
  (_, cache, sph, plan, _), _ = _sph_state(session, r, 0.5)
  assert sum(int(np.sum(np.asarray(x))) for x in sph.length) > 0   # items live in the tiers
  cfg = session.cfg
  q = jax.random.normal(jax.random.key(int(RNG.integers(1 << 30))),
                        (r.batch, cfg.n_heads, cfg.head_dim), jnp.float32).astype(jnp.bfloat16)

  @jax.jit
  def three(cache, sph, layer):
    g = pcache.group_array(cache)[layer]
    window, hi, lo, maps = pcache.kernel_inputs(cache.layers, cache, g)
    want = pallas_kernels.decode_attention(q, window, hi, lo, maps, layer=layer,
                                           sph=scache.sph_inputs(sph, g), backend="reference")
    got = r.attend_reconstructed(q, window, hi, lo, maps, layer, sph, g)
    base = pallas_kernels.decode_attention(q, window, hi, lo, maps, layer=layer,
                                           backend="reference")
    return want, got, base

  for layer in range(cfg.n_layers):
    want, got, base = (np.asarray(x, np.float32) for x in three(cache, sph, jnp.int32(layer)))
    scale = np.max(np.abs(want))
    np.testing.assert_allclose(got, want, atol=2e-2 * scale)
    assert np.max(np.abs(base - want)) > 10 * np.max(np.abs(got - want))


def _random_tags(session, ids, floor, action, seed=0):
  """Random tag candidates per prompt token of the sph_runs prompts (mostly one of ``ids``,
  some several, some none) and, per token and group, the floor PASK resolves them to (one
  candidate: its floor; several: the max of their actions and floors; none: H)."""
  from pask_jax import tags as T
  # its own generator: the module's RNG is shared, so its draws depended on which tests ran first
  rng = np.random.default_rng(seed)
  preps = session.task.prepare(session.task.cases("test", max_cases=1), prompt_labels=True)
  tags, floors = [], []
  for p in preps:
    n = len(p.ids)
    c = np.full((n, T.N_CAND), T.PAD, np.int32)
    k = rng.choice([0, 1, 1, 1, 1, 1, 1, 1, 2, 3], n)       # candidates per token
    f = np.full((n, floor.shape[1]), 2, np.int64)
    for t in range(n):
      c[t, :k[t]] = v = rng.choice(ids, k[t], replace=False)
      if len(v) == 1:
        f[t] = floor[v[0]]
      elif len(v) > 1:
        f[t] = np.max(np.maximum(floor[v], action[v]), axis=0)
    tags.append(c)
    floors.append(f)
  return tags, floors


def test_rdr_tags_protects_exactly_the_floor_h_items_besides_rdr_own(session, sph_runs):
  """RDR+tags: a (token, group) whose PASK floor is H (the policy's floors, resolved as PASK
  resolves candidates: one -> its floor, several -> max of actions and floors, none -> H) joins
  RDR's own protected set on every head and lands at the top tier; at decode a floor-H token
  takes the top tier though the balance cannot pay it (debt), another token does not."""
  import jax
  import jax.numpy as jnp
  from pask_jax import tags as T
  from pask_jax.grammar.matcher import new_bitmask
  _, _, pol_dir = sph_runs
  r = _sph_runner(session, "rdr+tags")
  pol = P.resolve(str(pol_dir), session.cfg, tokenizer_hash=session.tok.hash())
  floor, action = np.asarray(pol.floor), np.asarray(pol.action)
  ids = sorted(P.demo_entries(2))
  tags, floors = _random_tags(session, ids, floor, action)
  want = [f == 2 for f in floors]
  # RDR's own protection: a policy of no H floors (and no candidate-less token, which PASK
  # resolves to H whatever the table says)
  no_h = pol.replace(floor=jnp.zeros_like(pol.floor), action=jnp.zeros_like(pol.action))
  some = [np.where((c == T.PAD).all(-1, keepdims=True) & (np.arange(T.N_CAND) == 0), ids[0], c)
          for c in tags]
  (_, _, _, own, _), lengths = _sph_state(session, r, 0.6, no_h, some)
  (_, cache, sph, plan, rho), _ = _sph_state(session, r, 0.6, pol, tags)
  K = len(r.tiers)
  own_p, prot, route = np.asarray(own.prot), np.asarray(plan.prot), np.asarray(plan.route)
  extra = stays = 0
  for b, fh in enumerate(want):
    n = int(lengths[b])
    region = slice(r.sink, n - r.window)
    exp = own_p[b, region] | fh[region][..., None]
    np.testing.assert_array_equal(prot[b, region], exp)
    assert not prot[b, :r.sink].any() and not prot[b, n - r.window:].any()
    assert np.all(route[b, region][exp] == K)
    extra += int(np.sum(exp & ~own_p[b, region]))
    stays += int(np.sum(own_p[b, region] & ~fh[region][..., None]))
    assert fh[region].any() and not fh[region].all()
  # RDR's own protection stays beside the floors: counted over the batch, as on one row the
  # random model's own set may fall inside the (dense) floor-H items
  assert extra > 0 and stays > 0
  # decode: row 0 a floor-H tag (dispatch key: HH), row 1 free generation (LL), row 2 none (H)
  B = r.batch
  tag_ids = np.full((B, T.N_CAND), T.PAD, np.int32)
  tag_ids[0, 0] = T.fc(T.Cls.SCHEMA_BEARING, T.FCRole.DISPATCH_KEY)
  tag_ids[1, 0] = T.fc(T.Cls.FREE_GENERATION)
  temp, top_p = jnp.zeros((B,), jnp.float32), jnp.ones((B,), jnp.float32)
  nxt = jnp.asarray(RNG.integers(1, session.cfg.vocab_size, B), jnp.int32)
  _, state = r.advance((cache, sph, rho, jnp.asarray(lengths), plan.deficit), nxt,
                       jnp.asarray(tag_ids), jnp.full((B,), -1, jnp.int32),
                       jnp.ones((B,), bool), jnp.asarray(new_bitmask(B, session.cfg.vocab_size)),
                       jax.random.key(0), temp, top_p)
  s = state[1]
  slot = np.asarray(lengths) % r.window
  route, prot, bal = (np.asarray(x) for x in (s.route, s.prot, s.balance))
  for b, forced in ((0, True), (1, False), (2, True)):
    assert np.all(prot[b, slot[b]] == forced), b
    if forced:
      assert np.all(route[b, slot[b]] == K) and np.all(bal[b] < 0)   # charged as debt
    else:
      assert np.all(route[b, slot[b]] < K) and np.all(bal[b] >= 0)


def test_pask_ada_runs_pask_s_controller_with_l_at_the_tier(session, sph_runs):
  """PASK+ADA: PASK's prefill plan and decode controller, with m(L) the tier's bytes; H items in
  the BF16 pool, L items at the A4 / INT4-value tier (never INT4 K), R dropped; floors hold."""
  import jax
  import jax.numpy as jnp
  from pask_jax import actions as Act
  from pask_jax import tags as T
  from pask_jax.grammar.matcher import new_bitmask
  _, _, pol_dir = sph_runs
  r = _sph_runner(session, "pask+ada")
  H = session.cfg.n_kv_heads
  (ts,) = r.tiers
  assert (ts.layout, ts.values) == ("A4", "int4")
  pol = P.resolve(str(pol_dir), session.cfg, tokenizer_hash=session.tok.hash())
  cost, mine = np.asarray(pol.cost), np.asarray(r.configure(0.5, pol).tag_policy.cost)
  np.testing.assert_array_equal(mine[[Act.R, Act.H]], cost[[Act.R, Act.H]])
  np.testing.assert_allclose(mine[Act.L], 8 * H * ts.bytes * np.asarray(r.layers_per_group))
  assert np.all(mine[Act.L] < cost[Act.L] * 1.01)     # A4 + INT4 V: INT4 K+V's bytes or less
  tags, floors = _random_tags(session, sorted(P.demo_entries(2)), np.asarray(pol.floor),
                              np.asarray(pol.action))
  (_, cache, sph, plan, rho), lengths = _sph_state(session, r, 0.5, pol, tags)
  route = np.asarray(plan.route)
  assert sum(int(np.sum(np.asarray(x))) for x in sph.length) > 0   # L items live in the tier
  for b, f in enumerate(floors):
    n = int(lengths[b])
    rt = route[b, :n]
    assert np.all(rt == rt[..., :1])                          # one decision for all heads
    assert np.all(rt[f == Act.H] == 2) and np.all(rt[f == Act.L] >= 1)   # floors hold
    assert np.all(route[b, n:] == 0)
  # decode: a dispatch key (action and floor H) -> BF16 pool; free generation (L) -> the tier
  B = r.batch
  tag_ids = np.full((B, T.N_CAND), T.PAD, np.int32)
  tag_ids[0, 0] = T.fc(T.Cls.SCHEMA_BEARING, T.FCRole.DISPATCH_KEY)
  tag_ids[1, 0] = T.fc(T.Cls.FREE_GENERATION)
  tag_ids[2, 0] = T.fc(T.Cls.FREE_GENERATION)
  active = np.array([True, True, False])
  nxt = jnp.asarray(RNG.integers(1, session.cfg.vocab_size, B), jnp.int32)
  bal0 = np.asarray(sph.balance)
  _, state = r.advance((cache, sph, rho, jnp.asarray(lengths), plan.deficit), nxt,
                       jnp.asarray(tag_ids), jnp.full((B,), -1, jnp.int32), jnp.asarray(active),
                       jnp.asarray(new_bitmask(B, session.cfg.vocab_size)), jax.random.key(0),
                       jnp.zeros((B,), jnp.float32), jnp.ones((B,), jnp.float32))
  s = state[1]
  slot = np.asarray(lengths) % r.window
  got = np.asarray(s.route)[np.arange(B), slot]                 # [B, G, H]
  assert np.all(got[0] == 2) and np.all(got[1] == 1)
  bal = np.asarray(s.balance)
  allow = float(pol.b_d * pol.c_full)
  np.testing.assert_allclose(bal[1], bal0[1] + allow - mine[Act.L].sum(), rtol=1e-5)
  np.testing.assert_allclose(bal[2], bal0[2], rtol=1e-6)        # inactive: no charge


class ToolTask(EnumTask):
  """EnumTask as a tool-call task (bfcl, w3): may run unconstrained; scored for schema validity
  by pask_jax.grammar.call_problem like calibrate.bfcl.score."""
  name = "enum-tools"
  tool_calls = True

  def score(self, case, text, complete):
    from pask_jax.grammar import call_problem
    valid = complete and call_problem([TOOL], text) is None
    try:
      sc = super().score(case, text, complete)
    except json.JSONDecodeError:
      sc = {"calls": None, "passed": False, "per_call": 0.0, "error": "unparseable"}
    return {**sc, "valid": valid}


def test_unconstrained_runs_leave_the_grammar_out_and_score_schema_validity(session, tmp_path):
  """``constrained=False``: the same cases decoded without the tool-call grammar (the random
  model's free text is no call), each row saying whether it is schema-valid; under the grammar
  every complete answer is.  Methods that read the parser's tags and tasks without a tool-call
  grammar are refused in one line."""
  task = ToolTask(session.tok, session.compiler)
  s = E.Session(session.m, task, batch=4, compiler=session.compiler)
  rc = lambda **kw: E.RunConfig("full", 1.0, "test", max_tokens=24, max_cases=1, **kw)
  free = E.run(s, rc(constrained=False), str(tmp_path / "free"), progress=False)
  held = E.run(s, rc(), str(tmp_path / "held"), progress=False)
  fr, hr = rows(tmp_path / "free"), rows(tmp_path / "held")
  assert free["constrained"] is False and "constrained" not in held
  assert all(r["valid"] for r in hr if r["finish"] == "stop")
  assert [r["tokens"] for r in fr] != [r["tokens"] for r in hr]
  assert all(r["valid"] == (r["finish"] == "stop" and
                            _problem(r["text"]) is None) for r in fr)
  assert free["categories"]["overall"]["valid"] == pytest.approx(np.mean([r["valid"] for r in fr]))
  with pytest.raises(ValueError, match="reads the grammar's parser tags"):
    E.check_config(E.RunConfig("pask", 0.5, policy="demo", constrained=False))
  with pytest.raises(ValueError, match="no tool-call grammar to leave out"):
    E.run(session, rc(constrained=False), None, progress=False)


def _problem(text):
  from pask_jax.grammar import call_problem
  return call_problem([TOOL], text)
