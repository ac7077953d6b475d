"""W3's multi-turn episodes (calibrate/multiturn.py): the splits, rollouts against bfcl-eval's
simulated APIs scored by its multi-turn checker (the ground truth passes, a wrong call fails),
and episodes through the harness, the CLI and a campaign plan with a tiny random model."""
import ast
import os

import numpy as np
import pytest

from calibrate import evaluate as E
from calibrate import longctx as LC
from calibrate import multiturn as MT
from pask_jax.grammar.toolcall import render_calls
from pask_jax.testing import grammar_compiler, stored_tokenizer, tiny_qwen

pytestmark = pytest.mark.fast_compile

DATA = os.path.join(os.path.dirname(__file__), "data", "qwen_tokenizer.json.gz")


def _calls(strings):
  """BFCL's ground-truth call strings -> {"name", "arguments"}; None for one with positional
  arguments (our calls are keyword-only JSON objects)."""
  out = []
  for s in strings:
    t = ast.parse(s, mode="eval").body
    if t.args:
      return None
    out.append({"name": t.func.id,
                "arguments": {k.arg: ast.literal_eval(k.value) for k in t.keywords}})
  return out


def _oracle(ep, fmt="fenced_json", indent=2, takes_calls=True, name="oracle"):
  """A rollout fed the ground truth: per turn its calls in one answer (as the model writes
  them), then a text answer; None for an episode whose ground truth has positional calls."""
  turns = [_calls(t) for t in ep.ground_truth]
  if any(t is None for t in turns):
    return None
  r = MT.Rollout(ep, name, fmt=fmt, indent=indent, takes_calls=takes_calls)
  for t in turns:
    if t:
      r.feed(render_calls(t, fmt, indent), [1, 2], "stop")
    r.feed("Done.", [3], "stop")
  return r


def test_splits_are_seeded_disjoint_and_one_one_three():
  every = MT.load(seed=0)
  parts = {s: MT.load(split=s, seed=0) for s in ("cal", "dev", "test")}
  for cat in MT.CATEGORIES:
    n = [sum(e.category == cat for e in parts[s]) for s in ("cal", "dev", "test")]
    assert n == [40, 40, 120] and sum(e.category == cat for e in every) == 200
  ids = [{e.id for e in p} for p in parts.values()]
  assert not (ids[0] & ids[1] or ids[0] & ids[2] or ids[1] & ids[2])
  assert [e.id for e in MT.load(split="test", seed=0)] == [e.id for e in parts["test"]]
  assert {e.id for e in MT.load(split="test", seed=1)} != ids[2]
  with pytest.raises(ValueError, match="multi-turn categories are"):
    MT.load(["multi_turn_miss_func"])
  with pytest.raises(ValueError, match="unknown split 'train'"):
    MT.load(split="train")


def test_the_ground_truth_passes_and_a_wrong_call_fails():
  """Rollouts fed the ground truth pass bfcl-eval's checker (the calls executed as our answers
  carry them, the tool messages in the conversation); a wrong argument fails it; an answer
  without calls where the ground truth has some fails the turn."""
  eps = [e for e in MT.load(split="dev") if e.category == "multi_turn_base"][:12]
  ran = 0
  for i, ep in enumerate(eps):
    r = _oracle(ep, takes_calls=i % 2 == 0, name=f"oracle{i}")
    if r is None:
      continue
    assert r.done and r.answers == len(ep.turns) + sum(1 for t in ep.ground_truth if t)
    tools = [m for m in r.messages if m["role"] == "tool"]
    assert len(tools) == sum(len(t) for t in ep.ground_truth)
    assert all("Error during execution" not in m["content"] for m in tools)
    assert r.score() == {"passed": True, "error": ""}
    ran += 1
  assert ran >= 8
  ep = next(e for e in eps if _oracle(e, name="probe") is not None
            and any(_calls(t) and any(c["arguments"] for c in _calls(t))
                    for t in e.ground_truth))
  r = MT.Rollout(ep, "wrong", fmt="fenced_json", indent=2, takes_calls=True)
  for t in ep.ground_truth:
    calls = _calls(t)
    if calls:
      calls = [dict(c, arguments={k: (v + "_x" if isinstance(v, str) else v)
                                  for k, v in c["arguments"].items()}) for c in calls]
      r.feed(render_calls(calls, "fenced_json", 2), [1], "stop")
    r.feed("Done.", [3], "stop")
  assert not r.score()["passed"]
  quiet = MT.Rollout(ep, "quiet", fmt="fenced_json", indent=2, takes_calls=True)
  while not quiet.done:
    quiet.feed("I cannot help with that.", [5], "stop")
  s = quiet.score()
  assert not s["passed"] and "empty_turn_model_response" in s["error"]
  assert quiet.decoded == [[] for _ in ep.turns]


def test_a_cut_off_answer_ends_the_turn_and_the_step_limit_fails_the_episode():
  """A cut-off answer runs no call and ends its turn; a turn of more answers with calls than
  the limit ends the episode, failed, as BFCL forces the model to quit; instances are freed."""
  ep = MT.load(split="test")[0]
  r = MT.Rollout(ep, "cut", fmt="fenced_json", indent=2, takes_calls=True, max_steps=3)
  block = render_calls([{"name": "pwd", "arguments": {}}], "fenced_json", 2)
  r.feed(block, [1], "length")            # cut off: no call runs, the turn ends
  assert r.turn == 1 and r.decoded[0] == []
  for _ in range(3):
    assert not r.done
    r.feed(block, [1], "stop")
  assert r.done and r.stopped == "step limit" and r.decoded[1] == [["pwd()"]] * 3
  assert MT.held("cut_")
  s = r.score()
  assert not s["passed"] and "force_quit" in s["error"]
  assert not MT.held("cut_")


@pytest.fixture(scope="module")
def session():
  m = tiny_qwen(stored_tokenizer(DATA), seed=int(np.random.default_rng().integers(1 << 30)))
  gc = grammar_compiler(m.tokenizer, m.cfg.vocab_size)   # shared by the process's tests
  return E.Session(m, LC.suite("w3mt", m, gc, length=4096), batch=2, compiler=gc)


def test_episodes_run_in_the_harness(session, tmp_path):
  """A tiny random model's episode: every turn answered, rows with the
  checker's verdict, the answers' tokens in order and the measured B as the token-weighted mean
  over the answers; the summary's task names the workload."""
  meta = E.run(session, E.RunConfig("full", 1.0, "test", max_cases=1, max_tokens=4,
                                    categories=("multi_turn_base",)),
               str(tmp_path / "full"), progress=False)
  rows = E.read_cases(str(tmp_path / "full"))
  assert meta["task"] == "w3mt:L4096" and meta["n_cases"] == 1
  assert [r["category"] for r in rows] == ["multi_turn_base"]
  for r in rows:
    assert r["answers"] >= r["turns_run"] and r["turns_run"] == r["turns"] or \
        r["finish"] == "context full"
    assert r["gen_len"] == len(r["tokens"]) and 0 < r["gen_len"] <= 4 * r["answers"]
    assert r["total_B"] == pytest.approx(1.0) and isinstance(r["passed"], bool)
    assert len(r["calls"]) == r["turns"]
  assert meta["categories"]["overall"]["accuracy"] == np.mean([r["passed"] for r in rows])
  short = E.Session(session.m, LC.suite("w3mt", session.m, session.compiler, length=2048),
                    batch=2, compiler=session.compiler)
  meta = E.run(short, E.RunConfig("full", 1.0, "test", max_cases=1, max_tokens=4,
                                  categories=("multi_turn_base",)), str(tmp_path / "short"),
               progress=False)   # its first conversation (~2.8K tokens) does not fit 2048
  r, = E.read_cases(str(tmp_path / "short"))
  assert r["finish"] == "context full" and r["answers"] == 0 and not r["passed"]
  assert not MT.held("full_")
  with pytest.raises(ValueError, match="decode under their tool-call grammar"):
    E.run(session, E.RunConfig("full", 1.0, "test", max_cases=1, constrained=False), None,
          progress=False)


def test_stubs_and_names():
  from pask_jax import cli
  assert cli.LONG_TASKS == LC.TASKS and cli.UNCONSTRAINED_TASKS == E.UNCONSTRAINED_TASKS
  assert LC.name_of("w3mt", 16384) == "w3mt:L16384"
  got = LC.stubs("w3mt", "dev", ["multi_turn_base"], seed=0)
  assert [e.id for e in got] == [e.id for e in MT.load(["multi_turn_base"], split="dev")]


def test_a_campaign_plan_names_episode_cells_without_a_model(tmp_path, monkeypatch):
  """A plan split ``task = "w3mt"``: its cells name the episodes of the split (no model loaded),
  keyed by the workload with its length; unconstrained is refused (the answers are already free
  text or calls)."""
  from calibrate import campaign as C
  monkeypatch.setattr(C, "model_path", lambda m: "/weights")
  monkeypatch.setattr(C, "fingerprint", lambda p: "0" * 64)
  text = """name = "mt"
[models]
q = "qwen2.5-coder-0.5b-instruct"
[methods.full]
[splits.mt]
task = "w3mt"
length = 16384
split = "test"
cases = 3
"""
  p = tmp_path / "mt.toml"
  p.write_text(text)
  cs = C.cells(C.load_plan(str(p), str(tmp_path / "r")))
  assert [c.material["task"] for c in cs] == ["w3mt:L16384"]
  ids = cs[0].material["cases"]
  first = [f"{e.category}/{e.id}" for c in MT.CATEGORIES
           for e in MT.load([c], split="test")[:3]]
  assert sorted(ids) == sorted(first)
  p.write_text(text + "constrained = false\n")
  with pytest.raises(C.PlanError, match="task w3mt has no tool-call grammar to leave out"):
    C.load_plan(str(p), str(tmp_path / "r"))


def test_the_episodes_plan_fits_its_cells_in_an_8_minute_call(monkeypatch):
  """examples/campaign_sph_episodes.toml: W3's episodes for G5, greedy and three seeds of the same
  episodes, every cell expected within 8 minutes with the model's load."""
  from calibrate import campaign as C
  monkeypatch.setattr(C, "model_path", lambda m: "/weights")
  monkeypatch.setattr(C, "fingerprint", lambda p: "0" * 64)
  plan = C.load_plan(os.path.join(os.path.dirname(__file__), "..", "examples",
                                  "campaign_sph_episodes.toml"), "/nonexistent")
  cs = C.cells(plan)
  assert {c.material["task"] for c in cs} == {"w3mt:L16384"}
  greedy = [c for c in cs if c.sample_seed is None]
  assert len(cs) == 4 * len(greedy) and len({c.key for c in cs}) == len(cs)
  assert {len(c.cases) for c in cs} == {20}
  est = C.Estimator(plan, [])
  assert max(est.seconds(c, loaded=False) for c in cs) <= 8 * 60
