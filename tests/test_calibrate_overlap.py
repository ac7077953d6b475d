"""Calibration's overlapped generate loop (calibrate.stack.generate_overlapped) gives exactly what
the synchronous loop (pask_jax.decode.generate) gives on a policy stack: tokens, text, finish,
the trackers' tag and parser-state records, and every ledger field (the R/L/H action counts per
group, n_gen, live and peak payload) — for rows that end on a stop token (fed before the host
saw it), by completing the grammar, and by length, greedy and sampled."""
import threading

import numpy as np
import pytest

from pask_jax.testing.fixtures import smollm2
from models import ModelConfig, random_model
from pask_jax import decode as dec
from pask_jax import policy as P
from pask_jax import actions as Act
from pask_jax import tags as T
from pask_jax.grammar import GrammarCompiler

from calibrate import stack as S, tasks

CAP = 256
N_REQ = 4


@pytest.fixture(scope="module")
def setup():
  tok = smollm2().tokenizer
  cfg = ModelConfig(arch="llama", vocab_size=smollm2().cfg.vocab_size, hidden=64,
                    intermediate=96, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=16,
                    rope_theta=10000.0, tie_embeddings=True)
  model = random_model(cfg, seed=0)
  task = tasks.SyntheticTask(tok, GrammarCompiler(tok, cfg.vocab_size), N_REQ, seed=0)
  tmpl = P.all_high(cfg, sink=2, window=4)
  ids = [T.fc(c) for c in T.Cls]
  G = tmpl.n_groups

  def pol(action, floor, b_d):
    ent = {i: P.Entry(list(action), list(floor)) for i in ids}
    return P.build(ent, cfg, n_groups=G, b_d=b_d, b_p=1.0, sink=2, window=4, adapter="fc")
  pols = [tmpl,
          pol([Act.R, Act.H, Act.H], [Act.R, Act.H, Act.H], 1.0),       # release group 0
          pol([Act.L] * G, [Act.L] * G, 1.0),                  # INT4 everywhere
          pol([Act.H] * G, [Act.R] * G, 0.35)]                 # the controller demotes to a budget
  runner = S.StackRunner(model, tmpl, n_policies=len(pols), n_requests=N_REQ, capacity=CAP)
  runner.use(S.stack(pols))
  return runner, task, tok


def both(runner, task, tok, sampling, share, threaded):
  from calibrate.shared import Forest
  V, N = runner.V, runner.N
  prompts = [r.ids for _ in range(V) for r in task.requests]
  ptags = [r.tags for _ in range(V) for r in task.requests]
  out = []
  for loop in (dec.generate, S.generate_overlapped):
    if share:
      forest = Forest(task.tracker)
      trackers = [forest.row(i) for _ in range(V) for i in range(N)]
    else:
      trackers = [task.tracker(i) for _ in range(V) for i in range(N)]
    runner.launcher.threaded = threaded and loop is S.generate_overlapped
    inner, where = runner.forward, set()

    def spy(*args):   # where each forward is launched
      where.add(threading.current_thread().name.split("_")[0])
      return inner(*args)
    runner.forward = spy
    select, sizes = runner.select_rows, []

    def spy_rows(logits, masks, rows, *a, **k):   # the mask rows each pick uploads
      sizes.append((masks.shape[0], len(set(np.asarray(rows).tolist()))))
      return select(logits, masks, rows, *a, **k)
    runner.select_rows = spy_rows
    try:
      res = loop(runner, tok, prompts, trackers=trackers, prompt_tags=ptags, sampling=sampling)
    finally:
      runner.launcher.threaded, runner.forward, runner.select_rows = False, inner, select
    if loop is S.generate_overlapped:
      assert where == ({"pask-launch"} if threaded else {threading.current_thread().name})
      # one mask row per distinct parser state (shared: the V copies of a request start at one
      # node), padded to a power of two of at least 8, never more than B
      B = runner.batch
      assert sizes[0] == ((8, N) if share else (B, B))
      assert all(u <= n <= B and (n == B or n >= 8 and n & (n - 1) == 0) for n, u in sizes)
    out.append((res, trackers))
  return out


# threaded: the overlapped loop's forward launched on the launch thread (pask_jax.launch)
@pytest.mark.parametrize("max_tokens, temperature, share, threaded", [
    (64, 0.0, True, True), (64, 0.0, False, False), (14, 0.0, True, False),
    (40, 0.8, True, True)])
def test_overlapped_equals_synchronous(setup, max_tokens, temperature, share, threaded):
  runner, task, tok = setup
  sampling = dec.Sampling(max_tokens=max_tokens, temperature=temperature, seed=3)
  (ra, ta), (rb, tb) = both(runner, task, tok, sampling, share, threaded)
  assert len(ra) == len(rb) == runner.batch
  for x, y, tx, ty in zip(ra, rb, ta, tb):
    assert y.tokens == x.tokens and y.text == x.text and y.finish == x.finish
    assert y.ledger == x.ledger     # every field: counts per group and action, live, peak
    np.testing.assert_array_equal(np.asarray(ty.tags), np.asarray(tx.tags))
    assert ty.states == tx.states
  finishes = {x.finish for x in ra}
  if max_tokens == 14:
    assert finishes == {"length"}
  else:
    assert "stop" in finishes       # the speculatively fed last token is exercised
  # The stack really intervenes: some rows spend R or L actions on generated tokens, and the
  # policies' outputs are not all the same.
  low = sum(c["R"] + c["L"] for x in ra for c in x.ledger["decode_counts"].values())
  assert low > 0
  assert len({tuple(x.tokens) for x in ra}) > N_REQ


def test_overlapped_reports_host_timers(setup):
  runner, task, tok = setup
  timers = {}
  prompts = [r.ids for _ in range(runner.V) for r in task.requests]
  trackers = [task.tracker(i) for _ in range(runner.V) for i in range(runner.N)]
  res = S.generate_overlapped(runner, tok, prompts, trackers=trackers,
                              sampling=dec.Sampling(max_tokens=10), timers=timers)
  assert set(timers) == {"launch_s", "wait_s", "host_s", "steps"}
  longest = max(len(r.tokens) for r in res)
  assert 0 < longest <= timers["steps"] <= longest + 1   # one forward per token (+ a stop's)
  assert all(timers[k] > 0 for k in ("launch_s", "wait_s", "host_s"))


def test_overlapped_rejects_bad_input(setup):
  runner, task, tok = setup
  with pytest.raises(ValueError, match="prompts for a runner of batch"):
    S.generate_overlapped(runner, tok, [], trackers=[])
  with pytest.raises(dec.CapacityError, match="capacity"):
    S.generate_overlapped(runner, tok, [[1] * CAP], trackers=[task.tracker(0)])
  with pytest.raises(ValueError, match="2 trackers for 1 prompts"):
    S.generate_overlapped(runner, tok, [[1, 2]], trackers=[task.tracker(0)] * 2)


def test_stack_equals_each_policy_alone_on_int4_prompts():
  """Policies whose prefill plan puts the prompt at INT4 (every prompt floor L under a B_P below
  the INT4 cost of the prompt; floors R with a small B_P; floors L with H bought by priority, and
  decode compression), stacked over requests of different prompt lengths with the last policy
  chunk padded, generate exactly what each generates alone through PaskRunner in an ordinary
  batch (the eval harness's path): tokens, texts, finishes and ledgers.  Fresh random model,
  priorities and prompt lengths on every run (the seed is in the failure message)."""
  import dataclasses

  from pask_jax.grammar.toolcall import tools_system_prompt
  from pask_jax.prompt import encode, render
  seed = int(np.random.SeedSequence().entropy % 2**31)
  rng = np.random.default_rng(seed)
  tok = smollm2().tokenizer
  cfg = ModelConfig(arch="llama", vocab_size=smollm2().cfg.vocab_size, hidden=64,
                    intermediate=96, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=16,
                    rope_theta=10000.0, tie_embeddings=True)
  model = random_model(cfg, seed=seed)
  n = 4
  task = tasks.SyntheticTask(tok, GrammarCompiler(tok, cfg.vocab_size), n, seed=seed)
  for i, r in enumerate(task.requests):     # prompt lengths ~150 .. ~400 tokens
    system = tools_system_prompt(r.tools, r.fmt) + " Note." * int(rng.integers(0, 120))
    text = render(tok, [{"role": "system", "content": system},
                        {"role": "user", "content": f"Switch to eco mode, request {i}."}])
    ids, tags = encode(tok, text, labels=True)
    task.requests[i] = dataclasses.replace(r, text=text, ids=ids, tags=tags)
  task.expected = [[{"name": "set_mode", "arguments": {"mode": "eco", "level": "low"}}]] * n
  G, sink, window = 3, 2, 4
  prio = lambda: rng.uniform(0.0, 1.0, (G, 2)).tolist()

  def pol(prompt_floor, b_p, decode_floor=None, b_d=1.0):
    ent = {T.prompt(lb): P.Entry([prompt_floor] * G, [prompt_floor] * G, prio())
           for lb in T.PromptLabel}
    if decode_floor is not None:
      ent.update({T.fc(c): P.Entry([Act.H] * G, [decode_floor] * G, prio()) for c in T.Cls})
    return P.build(ent, cfg, n_groups=G, b_d=b_d, b_p=b_p, sink=sink, window=window,
                   adapter="fc+prompt")

  pols = [pol(Act.L, 0.1), pol(Act.R, 0.15), pol(Act.L, 0.35, Act.R, 0.3)]
  tmpl = P.all_high(cfg, sink=sink, window=window)
  mt = 16
  stacked = S.run_stack(S.runner_factory(model, tmpl, 512), task, pols, rows=2 * n,
                        max_tokens=mt)
  runner = dec.PaskRunner(model, tmpl, batch=n, capacity=512)
  counts = {a: 0 for a in "RLH"}
  for p, outs in zip(pols, stacked):
    runner.policy = p
    alone = dec.generate(runner, tok, [r.ids for r in task.requests],
                         trackers=[task.tracker(i) for i in range(n)],
                         prompt_tags=[r.tags for r in task.requests],
                         sampling=dec.Sampling(max_tokens=mt))
    for i, (x, y) in enumerate(zip(outs, alone)):
      where = f"seed {seed}, policy b_p={float(p.b_p)}, request {i}"
      assert x.case == i and x.prompt_len == len(task.requests[i].ids), where
      assert (x.tokens, x.text, x.finish) == (y.tokens, y.text, y.finish), where
      assert x.ledger == y.ledger, where
      for c in x.ledger["prefill_counts"].values():
        for a in counts:
          counts[a] += c[a]
  assert min(counts.values()) > 0, counts          # the prompts were released, INT4 and BF16
  assert len({len(r.ids) for r in task.requests}) > 1


@pytest.mark.fast_compile
def test_stack_step_bench_writes_its_row(tmp_path):
  """``bench/stack_step.py`` on a tiny shape: one row with the stacked step's times (CUPTI
  says why it is missing off a GPU), and the kernel grouping it reports under ``--cupti``."""
  import json

  from bench import stack_step
  out = tmp_path / "row.jsonl"
  assert stack_step.main(["--shape", "tiny", "--policies", "2", "--requests", "3", "--prompt",
                          "20", "--capacity", "48", "--steps", "2", "--policy", "int4",
                          "--states", "2", "--cupti", "--out", str(out)]) == 0
  (row,) = [json.loads(x) for x in out.read_text().splitlines()]
  assert (row["rows"], row["states"], row["policy"]) == (6, 2, "int4")
  assert "CUPTI" in row["forward_cupti_error"] and "CUPTI" in row["pick_cupti_error"]
  for k in ("chained_ms", "forward_ms", "forward_launch_ms", "pick_ms", "pick_launch_ms"):
    assert row[k] > 0, k
  groups = stack_step.groups([("fusion_12", 1.0), ("fusion_3", 0.5), ("gemm", 2.0)])
  assert groups == [("gemm", 2.0, 1), ("fusion_#", 1.5, 2)]
