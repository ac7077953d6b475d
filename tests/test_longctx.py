"""The long-context workloads W1–W3 (calibrate/longctx.py): the pinned corpus, the generators'
determinism and shape, the teacher-forced NLL through the runners' forced-token path (equal to a
whole-sequence forward under Full KV), W2's needles and exact match, W3's padding and checker,
the CLI's one-line errors, and a W1 + W2 campaign plan end to end (run, resume, report)."""
import json
import os

import numpy as np
import pytest

from calibrate import evaluate as E
from calibrate import longctx as LC
from models import Loaded, ModelConfig, random_model
from pask_jax import cli
from pask_jax.testing import full_logprobs, stored_tokenizer

pytestmark = pytest.mark.fast_compile

DATA = os.path.join(os.path.dirname(__file__), "data", "qwen_tokenizer.json.gz")


@pytest.fixture(scope="module")
def tok():
  return stored_tokenizer(DATA)


@pytest.fixture(scope="module")
def loaded(tok):
  cfg = ModelConfig(arch="qwen2", vocab_size=tok.vocab_size, hidden=32, intermediate=48,
                    n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, rope_theta=1e6,
                    tie_embeddings=True)
  return Loaded(cfg, random_model(cfg, seed=3), tok)


def test_corpus_is_pinned_and_a_wrong_or_missing_one_is_one_line(monkeypatch):
  text = LC.corpus()
  assert text.startswith("# ---- bfcl_eval/") and len(text) > 1_000_000
  LC.corpus.cache_clear()
  monkeypatch.setattr(LC, "CORPUS_SHA256", "0" * 64)
  with pytest.raises(LC.CorpusError, match=r"sha256 19bef969c5171333…, not the pinned 0{16}…") \
      as e:
    LC.corpus()
  assert "\n" not in str(e.value)
  monkeypatch.setattr(LC, "_package_dir", lambda: None)
  with pytest.raises(LC.CorpusError, match="pip install --no-deps bfcl-eval==2026.3.23"):
    LC.corpus()
  LC.corpus.cache_clear()


def test_w1_documents_are_seeded_and_exactly_long(tok):
  s = LC.LMSuite(tok, length=200, tail=16, seed=1)
  a, b = s.cases("test", max_cases=3), s.cases("test", max_cases=3)
  assert [c.ids for c in a] == [c.ids for c in b] and all(len(c.ids) == 200 for c in a)
  assert len({tuple(c.ids) for c in a}) == 3
  assert a[0].ids != s.cases("dev", max_cases=1)[0].ids
  assert s.cases("test", max_cases=1, skip=2)[0].ids == a[2].ids
  fed, tgt = s.forced(a[0])
  assert len(fed) == len(tgt) == 16 and fed[1:] == tgt[:-1] and tgt[-1] == a[0].ids[-1]
  assert s.prompt_ids(a[0]) + fed == a[0].ids[:-1]
  with pytest.raises(ValueError, match="--tail 198 leaves no prompt"):
    LC.LMSuite(tok, length=200, tail=198)


def test_w1_nll_is_the_teacher_forced_nll_and_w2_runs_in_the_harness(loaded, tmp_path,
                                                                    monkeypatch):
  """Full KV through the forced-token path = one whole-sequence forward; W2 (free generation,
  exact match) through the same session's runner."""
  # W1's prompt (211) and W2's (<= 200) share the prefill bucket of 256: one prefill compile
  suite = LC.LMSuite(loaded.tokenizer, length=224, tail=12, seed=0)
  s = E.Session(loaded, suite, batch=2, compiler=object())
  meta = E.run(s, E.RunConfig("full", 1.0, "test", max_cases=2), str(tmp_path / "full"))
  rows = E.read_cases(str(tmp_path / "full"))
  assert meta["n_cases"] == 2 and meta["tail"] == 12 and meta["categories"]["w1"]["n"] == 2
  c = suite.cases("test", max_cases=1)[0]
  lp = full_logprobs(loaded.model, c.ids)                       # the first document (eager: 1 s)
  assert rows[0]["nll"] == pytest.approx(-np.mean([lp[t - 1, c.ids[t]] for t in range(212, 224)]),
                                         abs=2e-3)
  assert rows[1]["nll"] != rows[0]["nll"]
  for r in rows:
    assert r["prompt_len"] == 224 - 12 - 1 and r["total_B"] == 1.0
  assert (tmp_path / "full" / "summary.csv").read_text().startswith(
      "method,budget,split,category,n,nll,ppl")
  s.task = LC.NeedleSuite(loaded.tokenizer, length=200, seed=0)
  qa = E.run(s, E.RunConfig("full", 1.0, "test", max_cases=1, max_tokens=8), None,
             progress=False)
  assert qa["task"] == "w2:L200" and qa["categories"]["overall"]["n"] == 2
  assert set(qa["categories"]) == {"hop1", "hop2", "overall"}
  # a runner that reads segments gets W2's document marks (Spherical KV's retrieved weight)
  seen = []

  def spy(runner, tok, prompts, **kw):
    seen.append(kw.get("prompt_segments"))
    return generate(runner, tok, prompts, **kw)

  import pask_jax.decode as D
  generate = D.generate
  monkeypatch.setattr(D, "generate", spy)
  E.run(s, E.RunConfig("sphkv-retrieved", 0.35, "test", max_cases=1, max_tokens=2), None,
        progress=False)
  E.run(s, E.RunConfig("full", 1.0, "test", max_cases=1, max_tokens=2), None, progress=False)
  assert len(seen) == 2 and seen[1] is None
  assert all(m.dtype == bool and 0 < m.sum() < len(m) for m in seen[0])


def test_w1_slices_merge_and_report(tmp_path):
  """W1 runs over disjoint document slices pool into one run (``pask-jax merge``); the report
  gives W1 runs their NLL table."""
  meta = {"method": "spherical", "budget": 0.35, "split": "test", "model_identity": {},
          "task": "w1:L64:K8", "max_tokens": 8, "settings": {"sink": 4}, "wall_s": 1.0}
  row = lambda i, nll: {"id": f"w1_test_{i}", "category": "w1", "nll": nll,
                        "nll_first_half": nll, "nll_last_half": nll, "prompt_len": 55,
                        "gen_len": 8, "kv_gen_len": 8, "prefill_B": 0.3, "decode_B": 0.4,
                        "total_B": 0.31}
  for k, rows in enumerate([[row(0, 1.0), row(1, 2.0)], [row(2, 3.0)]]):
    E.write_lm(str(tmp_path / f"s{k}"), rows, {**meta, "categories": E.summarize_lm(rows)})
  assert cli.main(["merge", str(tmp_path / "s0"), str(tmp_path / "s1"), "--out",
                   str(tmp_path / "m")]) == 0
  m = E.load_runs([str(tmp_path / "m")])[0]
  assert m["n_cases"] == 3 and m["categories"]["overall"]["nll"] == pytest.approx(2.0)
  assert m["measured_B"] == pytest.approx(0.31)
  md = E.report([str(tmp_path / "m")], str(tmp_path / "r"))      # W1's own table and plot
  assert "| spherical | 0.35 | 0.300 / 0.400 / 0.310 | 2.0000 | 7.389 | ? / ? | 3 |" in md
  assert (tmp_path / "r" / "report.md").exists()


def test_w2_cells_needles_and_exact_match(tok):
  s = LC.NeedleSuite(tok, length=600, seed=0)
  cs = s.cases("test", max_cases=9)
  assert len(cs) == 18 and {c.category for c in cs} == {"hop1", "hop2"}
  hop1 = [c for c in cs if c.category == "hop1"]
  assert {(c.position, c.distractors) for c in hop1} == {
      (p, k) for p in LC.POSITIONS for k in LC.DISTRACTORS}
  c = next(c for c in cs if c.category == "hop2" and c.distractors == 4)
  asked = c.needles[0].split(" is ")[0].removeprefix("The access code of ")
  assert c.needles[1].endswith(f"reports to {asked}.") and len(c.needles) == 6
  for d in c.needles[2:]:   # near duplicates: one letter changed, own code
    dn = d.split(" is ")[0].removeprefix("The access code of ")
    assert len(dn) == len(asked) and sum(x != y for x, y in zip(dn, asked)) == 1
  ps = s.prepare(cs, False)
  for p, c in zip(ps, cs):
    assert 0.8 * 600 <= len(p.ids) <= 600 + 8 and all(n in p.text for n in c.needles)
    # the document is the retrieved segment: one run of tokens holding every needle, not the
    # instruction or the question
    m = p.retrieved
    assert m.dtype == bool and m.shape == (len(p.ids),) and p.ids == tok.encode(p.text)
    on = np.flatnonzero(m)
    assert on.size and np.all(np.diff(on) == 1) and 0 < on[0] and on[-1] < len(p.ids) - 1
    doc = tok.decode([p.ids[i] for i in on])
    assert all(n in doc for n in c.needles) and "Question" not in doc
    assert "Read the document" not in doc and "<document>" not in doc
  from pask_jax.prompt import encode   # with labels: the same ids and marks, encode's tags
  lab = s.prepare(cs[:1], True)[0]
  assert lab.ids == ps[0].ids and np.array_equal(lab.retrieved, ps[0].retrieved)
  np.testing.assert_array_equal(lab.tags, encode(tok, lab.text, True)[1])
  late = next(c for c in hop1 if c.position == "late")
  early = next(c for c in hop1 if c.position == "early")
  depth = lambda c: c.text.index(c.needles[0]) / len(c.text)
  assert depth(early) < 0.35 < 0.65 < depth(late)
  assert s.cases("test", ["hop2"], max_cases=2)[1].needles == \
      [c for c in cs if c.category == "hop2"][1].needles
  assert s.score(c, f"The code is {c.answer}.", True)["passed"]
  assert not s.score(c, f"{c.answer}1", True)["passed"]
  assert not s.score(c, "no idea", True)["passed"]
  with pytest.raises(ValueError, match="W2 categories are hop1, hop2"):
    s.cases("test", ["hop3"])


def test_w3_pads_with_distractor_tools_and_scores_the_original(tok):
  from calibrate import bfcl
  s = LC.BFCLLongSuite(tok, "qwen2", None, length=1200, seed=0)
  cs = s.cases("test", max_cases=1)
  assert [c.category for c in cs] == ["simple_python", "multiple"]
  for c in cs:
    orig = s.original[c.id]
    names = [f["name"] for f in c.functions]
    assert len(names) > len(orig.functions) + 3 and len(set(names)) == len(names)
    assert all(f in c.functions for f in orig.functions)
    n = len(tok.encode(bfcl.render(c, tok, s.fmt)))
    assert 0.85 * 1200 <= n <= 1200
    assert bfcl.check(orig, bfcl.reference_calls(orig))[0]
  text = '[{"name": "nope", "arguments": {}}]'
  assert s.score(cs[0], text, True) == bfcl.score(s.original[cs[0].id], text, fmt=s.fmt)


def test_stubs_build_the_cases_eval_runs(tok):
  """A campaign names a workload's cases without a model (LC.stubs) and builds them when the cell
  runs (``materialize``): the very cases ``pask-jax eval --task w1|w2|w3`` runs."""
  w1 = LC.LMSuite(tok, length=200, tail=16, seed=1)
  st = LC.stubs("w1", "test", seed=1)
  assert len(st) == LC.W1_DOCUMENTS and st[3].id == "w1_test_3"
  assert [c.ids for c in w1.materialize(st[2:4])] == \
      [c.ids for c in w1.cases("test", max_cases=2, skip=2)]
  w2 = LC.NeedleSuite(tok, length=600, seed=1)
  st = LC.stubs("w2", "dev", ["hop2"], seed=1)
  assert len(st) == LC.W2_PROMPTS and {s.category for s in st} == {"hop2"}
  assert w2.materialize(st[4:5]) == w2.cases("dev", ["hop2"], max_cases=1, skip=4)
  w3 = LC.BFCLLongSuite(tok, "qwen2", None, length=1200, seed=0)
  st = LC.stubs("w3", "test", seed=0)
  want = w3.cases("test", max_cases=1)
  got = w3.materialize([next(c for c in st if c.category == k) for k in LC.W3_CATEGORIES])
  assert [(c.id, c.functions) for c in got] == [(c.id, c.functions) for c in want]
  for bad, why in ((("w1", "test", ["x"]), "W1 has the one category w1"),
                   (("w3", "test", ["parallel"]), "W3 categories are simple_python, multiple"),
                   (("w2", "train"), "unknown split 'train'")):
    with pytest.raises(ValueError, match=why):
      LC.stubs(*bad)


@pytest.mark.parametrize("argv,why", [
    (["--task", "bfcl", "--length", "512"], "--length and --tail apply to --task w1, w2, w3"),
    (["--task", "w1", "--length", "100", "--tail", "99"], "--tail 99 leaves no prompt"),
    (["--task", "w2", "--length", "32"], "--length must be an integer >= 64"),
])
def test_cli_errors_are_one_line(argv, why):
  with pytest.raises(SystemExit) as e:
    cli.main(["eval", "--method", "full", "--out", "/nonexistent/x", *argv])
  assert why in str(e.value.code) and "\n" not in str(e.value.code)


# ---- the workloads in campaign plans -------------------------------------------------------------

W_PLAN = """
name = "w"
seed = 0
batch = 2

[models]
tiny = "{model}"

[methods.full]

[methods.h2o]
budgets = [0.5]

[splits.w1]
task = "w1"
length = 224
tail = 12
split = "test"
cases = 2

[splits.w2]
task = "w2"
length = 200
max_tokens = 8
split = "test"
cases = 1
"""


def test_w1_w2_campaign_runs_resumes_and_reports(loaded, tmp_path, monkeypatch, capsys):
  """A plan naming W1 and W2 (each with its length) runs end to end on the tiny model through the
  campaign's own workload sessions; a rerun skips every cell; the report gives each workload its
  table (NLL for W1, EM for W2, stability against Full KV for W2)."""
  from calibrate import campaign as C

  class Tiny(C.Workload):   # the real adapter, with the tiny model for the file's weights
    def load(self, path, dtype, center_keys):
      return loaded

    def compiler(self, m):
      return object()   # W1 and W2 build no grammar

  monkeypatch.setenv("PASK_JAX_CACHE", str(tmp_path / "cache"))
  for w in ("w1", "w2"):
    monkeypatch.setitem(C.TASKS, w, lambda w=w: Tiny(w))
  (tmp_path / "tiny.bin").write_bytes(b"tiny model weights")
  path = tmp_path / "plan.toml"
  path.write_text(W_PLAN.format(model=tmp_path / "tiny.bin"))
  plan = C.load_plan(str(path), str(tmp_path / "results"))
  assert [(s.task, s.length, s.tail, s.max_tokens) for s in plan.splits] == \
      [("w1", 224, 12, 12), ("w2", 200, None, 8)]
  out = C.run(plan, log=lambda s: None)
  assert len(out.ran) == 4 and not out.failed and not out.left
  docs = {(c.split.task, c.method.method): json.load(open(os.path.join(c.dir, "cell.json")))
          for c in out.ran}
  w1 = docs["w1", "full"]
  assert w1["material"]["task"] == "w1:L224:K12" and w1["material"]["seed"] == 0
  assert w1["material"]["cases"] == ["w1/w1_test_0", "w1/w1_test_1"]
  assert w1["material"]["settings"]["max_tokens"] == 12 and w1["accuracy"] is None
  rows = E.read_cases(out.ran[0].dir)
  assert [r["prompt_len"] for r in rows] == [224 - 12 - 1] * 2
  assert w1["nll"] == pytest.approx(np.mean([r["nll"] for r in rows]))
  w2 = docs["w2", "h2o"]
  assert w2["material"]["task"] == "w2:L200" and w2["n"] == 2
  assert {r["id"] for r in E.read_cases(out.ran[3].dir)} == {"w2_test_hop1_0", "w2_test_hop2_0"}
  assert all(len(r["tokens"]) == r["gen_len"] for r in E.read_cases(out.ran[3].dir))

  again = C.run(plan, log=lambda s: None)
  assert not again.ran and len(again.done_before) == 4
  other = C.cells(C.load_plan(str(path), str(tmp_path / "results")))
  assert all(c.done for c in other)
  path.write_text(W_PLAN.format(model=tmp_path / "tiny.bin").replace("length = 200",
                                                                     "length = 240"))
  moved = C.cells(C.load_plan(str(path), str(tmp_path / "results")))
  assert [c.done for c in moved] == [True, True, False, False]   # W2 at another length: new cells

  assert cli.main(["report", plan.folder, "--out", str(tmp_path / "rep")]) == 0
  md = capsys.readouterr().out
  assert "w1:L224:K12 test" in md and "w2:L200 test" in md and "EM ± s.e." in md
  assert f"| full | – | 1.000 / 1.000 / 1.000 | {w1['nll']:.4f} |" in md
  stab = md[md.index("Stability vs Full KV"):]
  assert "| full | – | 2 | 0.0% | +0.0% | 0.0% |" in stab and "| h2o | 0.5 | 2 |" in stab
  sections = sorted(p.name for p in (tmp_path / "rep").iterdir() if p.is_dir())
  assert len(sections) == 2
  assert (tmp_path / "rep" / sections[0] / "nll_vs_B.png").stat().st_size > 1000
  assert (tmp_path / "rep" / sections[1] / "accuracy_vs_B.png").stat().st_size > 1000
  assert (tmp_path / "rep" / sections[1] / "stability.csv").read_text().startswith(
      "method,budget,n,dtok_abs_median")
