"""serve/engine: memory-sized pools, admission by the prompt plan, pages on demand, preemption.

A tiny random llama (3 layers, one per layer group) with SmolLM2's real vocabulary, so the
tool-call grammar and its structural-tag adapter are the real ones; the engine is driven on the
test thread (``run_until_idle``).  Pools are made too small for all running requests on purpose,
so that preemption happens, and every such run is compared with an unconstrained one (the same
requests one at a time: no pool pressure) and, for the PASK policy, with ``decode.generate`` on a
dense batch-1 cache.  Engines are shared between tests (each leaves its engine idle and clean).
"""
import functools
import math
import threading

import numpy as np
import pytest

from models import ModelConfig, random_model
from pask_jax import policy as P
from pask_jax import actions as Act
from pask_jax import tags as T
from pask_jax.decode import PaskRunner, Runner, Sampling, generate
from pask_jax.grammar import FCAdapter, tool_call_grammar
from pask_jax.grammar.prompt_spans import label_prompt
from pask_jax.testing import grammar_compiler, smollm2_tokenizer
from pask_jax.tracker import Tracker
from serve.engine import (DenseEngine, Engine, Request, check_lo_format, expected_mix, page_bytes,
                          reachable, size_pools)

pytestmark = pytest.mark.fast_compile

CFG = ModelConfig(arch="llama", vocab_size=49152, hidden=64, intermediate=128, n_layers=3,
                  n_heads=4, n_kv_heads=2, head_dim=16, tie_embeddings=True)
PAGE, CTX, SLOTS = 4, 192, 4
# A tool whose call cannot end before max_tokens (64 rows at least): every request decodes to
# its length, so page demand is known and the tight pools below must preempt.
ROW = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                        "days": {"type": "integer", "minimum": 1, "maximum": 9}},
       "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"name": "log_weather", "parameters": {"type": "object", "properties": {
    "rows": {"type": "array", "items": ROW, "minItems": 64}}, "required": ["rows"]}}]


def tok():
  return smollm2_tokenizer()


@functools.lru_cache(maxsize=None)
def model():
  return random_model(CFG, seed=0)


@functools.lru_cache(maxsize=None)
def prefiller():
  """One batch-1 prefill runner for every engine here (its compiled buckets are shared)."""
  import jax.numpy as jnp
  return Runner(model(), batch=1, capacity=CTX, cache_dtype=jnp.bfloat16)


@functools.lru_cache(maxsize=None)
def grammar():
  return tool_call_grammar(grammar_compiler(tok(), CFG.vocab_size), TOOLS, "json_list")


@functools.lru_cache(maxsize=None)
def pol(name):
  if name == "all-high":
    return P.all_high(CFG, window=8, sink=2)
  if name == "sparse":
    # Prompt text R at its floor, promoted to L by the prefill budget (about 2/3 of it); free
    # generation L or R: most entries need an INT4 page or none, few a BF16 page.
    prio = [[1.0, 0.5]] * 3
    ents = {T.prompt(T.PromptLabel.PROTECTED_CONTENT): P.Entry([Act.L] * 3, [Act.R] * 3, prio),
            T.fc(T.Cls.FREE_GENERATION): P.Entry([Act.L] * 3, [Act.R] * 3, prio)}
    return P.build(ents, CFG, b_d=0.2, b_p=0.2, window=8, sink=2)
  return P.build(P.demo_entries(3), CFG, b_d=0.5, b_p=0.5, window=8, sink=2)


@functools.lru_cache(maxsize=None)
def engine(policy, hi=None, lo=None, dense=False, lo_page=None):
  """One engine per configuration, shared by the tests (each leaves it idle and clean)."""
  cls = DenseEngine if dense else Engine
  kw = {} if lo_page is None else dict(lo_page=lo_page)
  return cls(model(), tok(), pol(policy), slots=SLOTS, context=CTX, page=PAGE, hi_pages=hi,
             lo_pages=lo, prefiller=prefiller(), **kw)


def tight(policy, lo_page=None):
  """The engine whose pools hold the largest request alone (its worst case: every token beyond
  the window in that pool) but not all running ones at once."""
  worst = lambda pg: max(-(-(len(r.ids) + r.max_tokens - pol(policy).window) // pg)
                         for r in requests())
  return engine(policy, worst(PAGE) + 1,
                worst(lo_page or PAGE) + 1 if reachable(pol(policy))[1] else None,
                lo_page=lo_page)


def requests(n=5, tools=True):
  out = []
  for i in range(n):
    text = tok().apply_chat_template(
        [{"role": "user", "content": "Weather in Paris? " * (1 + i % 3)}])
    ids, tags = label_prompt(tok(), text)
    tr = Tracker(grammar(), FCAdapter(grammar(), tok())) if tools else Tracker()
    out.append(Request(ids=ids, tags=tags, max_tokens=28 + 4 * i, tracker=tr))
  return out


def long_request(max_tokens: int, **kw) -> Request:
  """A prompt of about 150 tokens (three pieces of 64, five of 32)."""
  text = tok().apply_chat_template([{"role": "user", "content": "Weather in Paris? " * 30}])
  ids, tags = label_prompt(tok(), text)
  return Request(ids=ids, tags=tags, max_tokens=max_tokens, **kw)


def run(e, reqs):
  """Submit ``reqs`` to engine ``e`` at once -> (results in order, streamed text per request)."""
  e.reset_metrics()
  done, text = {}, {}
  for r in reqs:
    def emit(kind, payload, r=r):
      if kind == "delta":
        text[r.rid] = text.get(r.rid, "") + payload
      else:
        assert kind == "done", payload
        done[r.rid] = payload
    r.emit = emit
    e.submit(r)
  e.run_until_idle(max_iterations=5000)
  return [done[r.rid] for r in reqs], [text.get(r.rid, "") for r in reqs]


@functools.lru_cache(maxsize=None)
def reference(policy):
  """The unconstrained run: the same requests one at a time (each alone fits the pools: no
  pressure, no preemption; and a batch composition unlike the preempted run's)."""
  e = tight(policy)
  res = []
  for r in requests():
    res.append(run(e, [r])[0][0])
    assert e.m["preemptions"] == 0
  check_clean(e)
  return res


def is_call(text):
  """``text`` follows the tool-call grammar's forced prefix (as far as both go)."""
  head = '[{"name": "log_weather", "arguments": {"rows": [{"city": "'
  n = min(len(text), len(head))
  return n >= 20 and text[:n] == head[:n]


def check_clean(e):
  """Every page back, nothing running, no cache overflow, each decode step kind compiled at most
  once (``fwd``: the overlapped forward; ``step``: the serial step, e.g. under recompute)."""
  assert e.idle() and not e.active.any()
  assert (e.pages.top == np.array(e.pages.totals)[:, None]).all(), e.pages.top
  assert (e.pages.npg == 0).all() and (e.count == 0).all()
  for X in range(2):   # the free lists hold every id exactly once per group
    for g in range(e.G):
      assert sorted(e.pages.free[X][g, :e.pages.top[X, g]].tolist()) == list(
          range(e.pages.totals[X]))
  assert e.m["overflow"] == 0 and e.m["requests_error"] == 0
  assert e.traces["step"] <= 1 and e.traces["fwd"] <= 1 and e.traces["step"] + e.traces["fwd"]




# ---- sizing -----------------------------------------------------------------------------------

def test_size_pools_splits_the_budget_by_the_expected_mix():
  p = pol("demo")
  hb, lb = page_bytes(CFG, PAGE)
  assert (hb, lb) == (2 * 3 * PAGE * 2 * 16 * 2, 3 * PAGE * 2 * (16 + 4))
  budget = 2_000_000
  s = size_pools(CFG, p, slots=SLOTS, context=CTX, page=PAGE, kv_bytes=budget)
  h, l = s.mix
  assert s.source == "budget" and s.total_bytes <= budget
  assert budget - s.total_bytes < hb + lb   # nothing left that would buy another page
  # bytes per pool in proportion to h·(BF16 bytes) : l·(INT4 bytes)
  share = s.hi_pages * hb / s.pool_bytes
  assert share == pytest.approx(h * hb / (h * hb + l * lb), abs=hb / s.pool_bytes)
  # Full KV through the same pools: everything in BF16, the INT4 pool one unused page
  f = size_pools(CFG, pol("all-high"), slots=SLOTS, context=CTX, page=PAGE, kv_bytes=budget)
  assert f.mix == (1.0, 0.0) and f.lo_pages == 1 and f.total_bytes <= budget
  assert f.hi_pages * hb > budget - f.fixed_bytes - hb - lb
  # the same memory holds more PASK requests than Full KV ones
  assert s.requests_fit(CTX) > f.requests_fit(CTX) >= 1
  assert "BF16 pool" in s.describe() and f"{s.hi_pages:,} pages" in s.describe()
  # overrides and errors
  o = size_pools(CFG, p, slots=SLOTS, context=CTX, page=PAGE, kv_bytes=budget, lo_pages=50)
  assert o.lo_pages == 50 and o.total_bytes <= budget
  m = size_pools(CFG, p, slots=SLOTS, context=CTX, page=PAGE, kv_bytes=budget, mix=(0.5, 0.5))
  assert m.mix == (0.5, 0.5) and m.mix_source == "given"
  with pytest.raises(ValueError, match="too small for 4 slots"):
    size_pools(CFG, p, slots=SLOTS, context=CTX, page=PAGE, kv_bytes=10_000)
  with pytest.raises(ValueError, match="kv mix"):
    size_pools(CFG, p, slots=SLOTS, context=CTX, page=PAGE, kv_bytes=budget, mix=(0, 0))
  # without a budget: every slot at full context (the old default), INT4 only if L is reachable
  d = size_pools(CFG, pol("all-high"), slots=SLOTS, context=CTX, page=PAGE)
  assert (d.hi_pages, d.lo_pages) == (SLOTS * CTX // PAGE, 1)


def test_size_pools_with_int4_pages_of_their_own_size():
  """INT4 pages of ``lo_page`` rows (the Mosaic GPU kernel's 64 or 128) beside BF16 pages of
  ``page``: the budget splits by the bytes per entry, so each pool holds the same entries as
  with equal pages; tables, worst cases and expected pages count each pool's own page."""
  from serve.engine import slot_bytes, worst_pages
  p, budget, lp = pol("demo"), 2_000_000, 3 * PAGE
  eq = size_pools(CFG, p, slots=SLOTS, context=CTX, page=PAGE, kv_bytes=budget)
  s = size_pools(CFG, p, slots=SLOTS, context=CTX, page=PAGE, kv_bytes=budget, lo_page=lp)
  assert s.pages == (PAGE, lp) and eq.pages == (PAGE, PAGE) and s.total_bytes <= budget
  assert s.lo_page_bytes == page_bytes(CFG, lp)[1] == 3 * eq.lo_page_bytes
  assert s.hi_page_bytes == eq.hi_page_bytes
  # entries per pool as with equal pages (the fixed tables differ by a few hundred bytes)
  assert abs(s.hi_pages - eq.hi_pages) <= 2 and abs(s.lo_pages * lp - eq.lo_pages * PAGE) <= 2 * lp
  w = dict(window=8, n_groups=3, context=CTX)
  assert slot_bytes(CFG, page=PAGE, lo_page=PAGE, **w) == slot_bytes(CFG, page=PAGE, **w)
  n_hi, n_lo = CTX // PAGE, CTX // lp
  assert (slot_bytes(CFG, page=PAGE, lo_page=lp, **w) - slot_bytes(CFG, page=PAGE, **w)
          == 3 * 4 * (n_lo - n_hi))            # shorter INT4 tables, the same positions
  t = 100 - int(p.window)
  assert worst_pages(p, 100, PAGE, lp) == (-(-t // PAGE), -(-t // lp))
  assert s.request_pages(100) == (math.ceil(s.mix[0] * t / PAGE) + 1,
                                  math.ceil(s.mix[1] * t / lp) + 1)
  assert f"{s.lo_pages:,} pages x {lp} tokens" in s.describe()


def test_expected_mix_rules():
  assert expected_mix(pol("all-high"))[:2] == (1.0, 0.0)
  h, l, why = expected_mix(pol("demo"))
  rho = float(np.asarray(pol("demo").cost)[Act.L].sum() / np.asarray(pol("demo").cost)[Act.H].sum())
  assert h == pytest.approx((0.5 - rho) / (1 - rho)) and l == pytest.approx(1 - h)
  assert "B=0.50" in why
  rec = P.build(P.demo_entries(3), CFG, b_d=0.3, b_p=0.3, extra={"kv_mix": [0.1, 0.8]})
  assert expected_mix(rec) == (0.1, 0.8, "policy record extra.kv_mix")
  assert reachable(pol("all-high")) == (True, False) and reachable(pol("demo")) == (True, True)


def test_gpu_memory_utilization_needs_a_reporting_device():
  with pytest.raises(ValueError, match="--kv-memory"):
    Engine(model(), tok(), pol("all-high"), slots=1, context=64, page=PAGE,
           gpu_memory_utilization=0.5, prefiller=prefiller())


# ---- admission and allocation by real demand ----------------------------------------------------

@pytest.mark.parametrize("lo_page", [None, 3 * PAGE])
def test_pages_follow_the_prompt_plan_and_the_device_tables(lo_page):
  """After admission a slot holds exactly the pages of its prompt plan's window-leaving
  entries; at every step (preemptions included) the host mirror — entries and page table per
  pool, group and slot — equals the device cache, and a page is taken exactly when its first
  entry is materialized; also with INT4 pages of their own size."""
  e = tight("demo", lo_page)
  assert tuple(e.pages.pages) == (PAGE, lo_page or PAGE) == e.sizing.pages
  assert e.step.state[0].lo_page == (lo_page or PAGE)
  e.reset_metrics()
  rs = requests()
  for r in rs:
    e.submit(r)
  e._iterate()   # admission + prefill, then one decode step (at most one eviction per slot)
  for r in [r for r in e.running if r is not None]:
    done = r.prompt_plan[:len(r.ids) - e.window]
    for X, code in enumerate((Act.H, Act.L)):
      extra = e.pages.lens[X, :, r.slot] - (done == code).sum(0)
      assert ((extra == 0) | (extra == 1)).all()
  for _ in range(2000):
    if e.idle():
      break
    e._iterate()
    cache = e.step.state[0]
    lens = np.stack([np.asarray(cache.hi_len), np.asarray(cache.lo_len)])
    tables = [np.asarray(cache.hi_pages), np.asarray(cache.lo_pages)]
    for b in range(SLOTS):
      if e.running[b] is None:
        assert (lens[:, :, b] == 0).all() and (e.pages.npg[:, :, b] == 0).all()
        continue
      assert (lens[:, :, b] == e.pages.lens[:, :, b]).all()
      for X in range(2):
        for g in range(e.G):
          k = e.pages.npg[X, g, b]
          assert k == -(-e.pages.lens[X, g, b] // e.pages.pages[X])
          assert (tables[X][g, b, :k] == e.pages.tbl[X][g, b, :k]).all()
          assert (tables[X][g, b, k:] == e.pages.totals[X]).all()
  assert e.m["preemptions"] > 0
  check_clean(e)


def test_admission_by_prompt_plan_admits_more_than_worst_case_reservation():
  """Pools where the old reservation (every token beyond the window, in BOTH pools) admits one
  request at a time: admission by the prompt plan + pages on demand run several at once."""
  rs = requests(4, tools=False)
  worst = max(-(-(len(r.ids) + r.max_tokens - 8) // PAGE) for r in rs)
  hi = lo = int(1.9 * worst)     # the old rule: 2 x worst > 1.9 x worst -> one at a time
  e = engine("sparse", hi, lo)
  res, _ = run(e, rs)
  check_clean(e)
  assert all(x["finish"] in ("stop", "length") for x in res)
  assert e.m["decode_rows"] / e.m["decode_steps"] > 1.5   # they decoded side by side


# ---- preemption -------------------------------------------------------------------------------

@pytest.mark.parametrize("policy", ["all-high", "demo"])
def test_pool_too_small_still_completes_with_the_same_greedy_text(policy):
  """A pool too small for all running requests: preemption happens, every request completes
  with the tokens of an unconstrained run (tool calls under the real grammar), its streamed
  text equals the final text (nothing re-sent), and every page comes back."""
  ref = reference(policy)
  e = tight(policy)   # preemption="replay", the default
  res, streamed = run(e, requests())
  assert e.m["preemptions"] > 0 and e.m["resumed"] == e.m["preemptions"]
  assert sum(x["preemptions"] for x in res) == e.m["preemptions"]
  assert e.m["replay_steps"] > 0
  check_clean(e)
  for a, b, s in zip(ref, res, streamed):
    assert b["tokens"] == a["tokens"] and b["finish"] == a["finish"]
    assert s == b["text"]
  for a, b in zip(ref, res):   # decisions and payload exactly as unpreempted
    assert b["ledger"]["measured_B"] == a["ledger"]["measured_B"]
    assert b["ledger"]["decode_counts"] == a["ledger"]["decode_counts"]
  assert all(x["finish"] == "length" for x in res)
  assert all(is_call(x["text"]) for x in res)


def test_recompute_keeps_decisions_and_budget_under_a_compressing_policy():
  """preemption="recompute": prompt + generated tokens are re-prefilled with the actions they
  were given, balance and ledger restored.  Every request completes under its grammar, nothing
  is re-sent, the tokens generated before a preemption are kept, the ledger counts every token
  once; only the continuation may differ (the generated tokens' K/V are recomputed at full
  precision instead of through the compressed cache)."""
  ref = reference("demo")
  e = tight("demo")
  e.preemption = "recompute"   # a host-side rule: the same compiled engine
  try:
    res, streamed = run(e, requests())
  finally:
    e.preemption = "replay"
  assert e.m["preemptions"] > 0 and e.traces["restore"] == 1 and e.m["replay_steps"] == 0
  check_clean(e)
  for a, b, s in zip(ref, res, streamed):
    assert s == b["text"] and b["finish"] == "length" and len(b["tokens"]) == len(a["tokens"])
    assert is_call(b["text"])
    assert b["ledger"]["n_prompt"] == a["ledger"]["n_prompt"]
    assert b["ledger"]["n_gen"] == a["ledger"]["n_gen"] == len(b["tokens"]) - 1


def test_cancel_a_preempted_request_in_the_queue():
  e = tight("all-high")
  e.reset_metrics()
  rs, seen = requests(tools=False), {}
  for r in rs:
    r.emit = lambda kind, payload, r=r: seen.setdefault(r.rid, []).append(kind)
    e.submit(r)
  for _ in range(500):
    e._iterate()
    gone = [r for r in e.waiting if r.preemptions]
    if gone:
      gone[0].cancel()
      break
  assert gone, "no preemption happened"
  e.run_until_idle(max_iterations=2000)
  check_clean(e)
  assert seen[gone[0].rid][-1] == "done" and e.m["requests_cancelled"] == 1
  assert all(seen[r.rid][-1] == "done" for r in rs)


def test_allocation_overhead_is_measured():
  """Host admission + page bookkeeping is timed per step (bench_serving reports it as a share of
  the step: 1-2% on the H200, bench/RESULTS.md); tests do not assert wall-clock times."""
  e = tight("demo")
  run(e, requests())
  assert e.m["decode_steps"] > 0 and e.m["alloc_s"] > 0 and e.m["admit_s"] > 0


# ---- the plain-XLA dense engine -----------------------------------------------------------------

def test_dense_engine_matches_dense_generate():
  rs = requests(2, tools=False)
  e = engine("all-high", dense=True)
  res, _ = run(e, rs)
  assert e.overlap and e.traces["fwd"] == 1 and e.traces["step"] == 0 and e.idle()
  for r, x in zip(rs, res):
    ref = generate(prefiller(), tok(), [r.ids], sampling=Sampling(max_tokens=r.max_tokens))[0]
    assert x["tokens"] == ref.tokens and x["ledger"] is None
  with pytest.raises(ValueError, match="over the KV budget"):
    DenseEngine(model(), tok(), pol("all-high"), slots=SLOTS, context=CTX, page=PAGE,
                kv_bytes=1000, prefiller=prefiller())


def test_pask_engine_matches_single_sequence_generate():
  """Paged, on-demand pages in a shared batch == ``decode.generate`` on a dense batch-1 PASK
  cache (tokens and measured B)."""
  p = pol("demo")
  runner = PaskRunner(model(), p, batch=1, capacity=CTX, page=PAGE)
  for r, x in list(zip(requests(), reference("demo")))[:2]:
    ref = generate(runner, tok(), [r.ids], trackers=[r.tracker], prompt_tags=[r.tags],
                   sampling=Sampling(max_tokens=r.max_tokens))[0]
    assert x["tokens"] == ref.tokens
    assert x["ledger"]["measured_B"] == ref.ledger["measured_B"]


def test_int4_pool_format_serves_the_same_tokens():
  """``lo_format="int4"`` (what the Mosaic GPU kernel reads) through the engine: the same tokens
  and measured B as the bytes pool for a batch that fills the INT4 pool; a format no kernel
  reads is one line before anything compiles."""
  want = run(engine("sparse"), requests())[0]
  for lo_page in (None, 16):    # INT4 pages of the BF16 pool's 4 rows, and of 16 (as 64 or 128)
    e = Engine(model(), tok(), pol("sparse"), slots=SLOTS, context=CTX, page=PAGE,
               prefiller=prefiller(), lo_format="int4", lo_page=lo_page)
    assert e.step.state[0].lo_format == "int4" and e.step.state[0].lo_page == (lo_page or PAGE)
    got = run(e, requests())[0]
    assert e.m["lo_used_peak"] > 0 and e.m["actions_L"] > 0          # the INT4 pool was used
    for x, y in zip(got, want):
      assert x["tokens"] == y["tokens"]
      assert x["ledger"]["measured_B"] == y["ledger"]["measured_B"]
    check_clean(e)
  with pytest.raises(ValueError, match="^lo_format must be 'auto', 'bytes' or 'int4', got 'u4'$"):
    Engine(model(), tok(), pol("sparse"), slots=SLOTS, context=CTX, page=PAGE,
           prefiller=prefiller(), lo_format="u4")
  with pytest.raises(ValueError, match="^the TPU kernel reads the 'bytes' INT4 format only"):
    check_lo_format("int4", 128, "tpu")


def test_int4_pool_on_the_gpu_gets_pages_the_mosaic_kernel_reads(monkeypatch):
  """``check_lo_format`` -> (format, INT4 rows per page): "int4" on a Hopper GPU in pages of 128
  unless the BF16 pages are a multiple of 64 or ``lo_page`` says otherwise; "auto" is "int4"
  where the Mosaic GPU kernel runs and takes the model, "bytes" in the BF16 pool's pages
  elsewhere; what no kernel reads is one line."""
  import types

  import jax
  assert check_lo_format("auto", 16, "auto") == ("bytes", 16)          # this CPU
  assert check_lo_format("int4", 16, "auto") == ("int4", 16)           # the reference reads it
  assert check_lo_format("bytes", 16, "auto", 32) == ("bytes", 32)
  qwen = types.SimpleNamespace(head_dim=128, n_heads=32, n_kv_heads=8)
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  for cc, auto in (("9.0", ("int4", 128)), ("8.0", ("bytes", 16))):
    monkeypatch.setattr(jax, "devices", lambda *a, cc=cc: [types.SimpleNamespace(
        platform="gpu", compute_capability=cc)])
    assert check_lo_format("auto", 16, "auto") == auto
    assert check_lo_format("auto", 16, "auto", cfg=qwen) == auto
    assert check_lo_format("auto", 16, "auto", cfg=CFG) == ("bytes", 16)   # head dim 16
  with pytest.raises(ValueError, match="Mosaic GPU kernel only, which needs Hopper"):
    check_lo_format("int4", 16, "auto")                                   # on the sm_80 above
  monkeypatch.setattr(jax, "devices", lambda *a: [types.SimpleNamespace(
      platform="gpu", compute_capability="9.0")])
  assert check_lo_format("auto", 16, "reference") == ("bytes", 16)
  assert check_lo_format("auto", 64, "auto") == ("int4", 64)
  assert check_lo_format("int4", 16, "auto") == ("int4", 128)
  assert check_lo_format("int4", 64, "auto") == ("int4", 64)
  assert check_lo_format("int4", 16, "gpu", 192) == ("int4", 192)
  assert check_lo_format("bytes", 16, "auto") == ("bytes", 16)
  with pytest.raises(ValueError, match="needs INT4 pages of a multiple of 64 tokens .* got 16$"):
    check_lo_format("int4", 16, "auto", 16)
  with pytest.raises(ValueError, match="head dim of a multiple of 64 .* this model has 16 and 2"):
    check_lo_format("int4", 16, "auto", cfg=CFG)
  with pytest.raises(ValueError, match="^lo_format must be 'auto', 'bytes' or 'int4', got 'u4'$"):
    check_lo_format("u4", 16, "auto")
  monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
  assert check_lo_format("auto", 16, "auto") == ("bytes", 16)
  with pytest.raises(ValueError, match="^the TPU kernel reads the 'bytes' INT4 format only"):
    check_lo_format("int4", 128, "auto")


# ---- overlap: the host's work runs while the device computes the previous step -----------------

@pytest.mark.parametrize("policy", ["sparse", "demo"])
def test_overlap_equals_the_serial_engine(policy, monkeypatch):
  """The overlapped engine (controller one step late, tokens fed before the host sees them) gives
  what the serial engine gives: the same tokens and text, the same ledger (every decision count,
  n_gen, measured B), the same actions for every cached position, and the same pages — also when
  preemptions (replay) happen and requests end on a stop token, so the speculative feeds of the
  last tokens are exercised."""
  short = grammar_compiler(tok(), CFG.vocab_size).ebnf('root ::= "yes" | "no" | "maybe so"')

  def reqs():   # tool calls that run to their length, and short answers that end on a stop token
    out = requests(5)
    for i, r in enumerate(requests(3, tools=False)):
      r.tracker, r.max_tokens = Tracker(short), 8 + i
      out.insert(1 + 2 * i, r)
    return out
  e = tight(policy)
  got = {}
  for ov, thread in ((False, False), (True, False), (True, True)):
    e.step.threaded = thread
    rs, acts = reqs(), {}

    def spy(r, finish, error=None, e=e, acts=acts, fin=type(e)._finish):   # actions at the end
      acts[r.rid] = e.pages.acts[r.slot, :e.count[r.slot]].copy()
      fin(e, r, finish, error)
    fwd_logits = []

    threads = set()

    def fwd(*args, inner=e.step._fwd, seen=fwd_logits, threads=threads):   # the forwards' logits
      out = inner(*args)
      seen.append(out[0][0])
      threads.add(threading.current_thread().name.split("_")[0])
      return out
    with monkeypatch.context() as mp:
      mp.setattr(e, "overlap_wanted", ov)
      mp.setattr(e, "_finish", spy)
      mp.setattr(e.step, "_fwd", fwd)
      assert e.overlap == ov and e.window >= 3
      res, streamed = run(e, rs)
    check_clean(e)
    # each forward wrote its logits into the previous forward's logits buffer (donated: one
    # address per step, pask_jax.recycle), after the pick had read them
    if ov:
      assert len(fwd_logits) > 10
      assert all(x.is_deleted() for x in fwd_logits[:-1]) and not fwd_logits[-1].is_deleted()
      assert threads == ({"pask-launch"} if thread else {threading.current_thread().name})
    else:
      assert not fwd_logits
    got[ov, thread] = res, streamed, [acts[r.rid] for r in rs], e.m["preemptions"]
  e.step.threaded = False
  # The forward launched on the launch thread changes nothing: tokens, text, ledgers, pages and
  # actions are those of the overlapped engine without it.
  assert _same(got[True, True], got[True, False])
  (a, sa, aa, pa), (b, sb, ab, pb) = got[False, False], got[True, True]
  if policy == "demo":   # its tight pools preempt (replay) in both modes; "sparse"'s do not
    assert pa > 0 and pb > 0, (pa, pb)
  assert e.traces["fwd"] == 1 and e.traces["step"] == 1
  assert any(x["finish"] == "stop" for x in b)   # short answers end on a stop token
  for x, y in zip(a, b):
    assert y["tokens"] == x["tokens"] and y["text"] == x["text"] and y["finish"] == x["finish"]
    for k in ("prefill_counts", "decode_counts", "n_prompt", "n_gen", "measured_B"):
      assert y["ledger"][k] == x["ledger"][k], k
    # A stop token was fed (never decided): the window token it displaced may take a page.
    extra = int(y["finish"] == "stop")
    assert all(0 <= q - p <= extra for p, q in zip(x["pages"], y["pages"])), (x, y)
  assert sa == sb
  # The actions of every cached position, as the host mirrors them; the overlapped engine reads
  # a step's decisions two steps later, so its mirror lags by up to 3 positions at the end.
  for x, y in zip(aa, ab):
    n = len(x) - 3
    assert len(y) - len(x) in (0, 1) and n > 8 and (x[:n] == y[:n]).all()


def _same(x, y) -> bool:
  """Equal results of two engine runs (results, streams, per-request actions, preemptions)."""
  (a, sa, aa, pa), (b, sb, ab, pb) = x, y
  keys = ("tokens", "text", "finish", "pages")
  return (sa == sb and pa == pb and len(a) == len(b) == len(aa) == len(ab)
          and all(r[k] == q[k] for r, q in zip(a, b) for k in keys)
          and all(r["ledger"] == q["ledger"] for r, q in zip(a, b))
          and all(p.shape == q.shape and (p == q).all() for p, q in zip(aa, ab)))


def test_the_launch_thread_joins_before_the_state_is_used(monkeypatch):
  """With ``threaded`` on, ``forward`` returns while its launch runs on the launch thread; the
  state is the launch's output whenever the engine thread reads or replaces it, and a launch's
  error is raised on the engine thread."""
  import time as _time
  e = tight("sparse")
  step = e.step
  step.threaded = True
  where, old = [], step.state

  class Acts:   # the decided actions: their copy to the host is started on the launch thread
    copies = 0

    def copy_to_host_async(self):
      self.copies += 1
      where.append(threading.current_thread().name)
  acts = Acts()

  def slow(*args):
    _time.sleep(0.2)
    where.append(threading.current_thread().name)
    return ("logits", acts), ("new state",)
  monkeypatch.setattr(step, "_fwd", slow)
  host = np.zeros((e.slots, 9), np.int32)
  grow = (np.zeros((e.G, e.slots), np.int32),) * 2
  t0 = _time.perf_counter()
  f = step.forward(None, host, grow)
  assert _time.perf_counter() - t0 < 0.15 and not f.done()
  assert step.state == ("new state",) and f.result() == ("logits", acts)
  assert len(where) == 2 and all(w.startswith("pask-launch") for w in where)
  assert acts.copies == 1
  step.early_actions = False   # the A/B setting: no early copy
  step.forward(None, host, grow).result()
  assert acts.copies == 1
  step.early_actions = True

  def broken(*args):
    raise ValueError("launch failed")
  monkeypatch.setattr(step, "_fwd", broken)
  f = step.forward(None, host, grow)
  with pytest.raises(ValueError, match="launch failed"):
    step.state
  with pytest.raises(ValueError, match="launch failed"):
    f.result()
  with pytest.raises(ValueError, match="launch failed"):   # and at every later use: the engine
    step.state = old                                        # fails, it does not carry on
  step._pending = None   # (the test's own reset)
  step.threaded = False
  step.state = old
  assert not step.threaded and step.state is old


# ---- chunked prefill: a long prompt does not stall the running streams -------------------------

def test_long_prompt_is_prefilled_in_chunks_between_decode_steps(monkeypatch):
  """With ``prefill_chunk=64`` a prompt of several chunks is prefilled over several iterations,
  each also running a decode step of the requests already decoding; every request completes
  under its grammar with the text of an engine that prefills it whole, and every page comes
  back."""
  def reqs():
    out = requests(2)
    out.append(long_request(24, tracker=Tracker(grammar(), FCAdapter(grammar(), tok()))))
    assert len(out[-1].ids) > 128   # at least three chunks of 64
    return out

  got = {}
  e = engine("demo")   # the piece size is a host-side rule: one compiled engine for both runs
  assert e.sched.prefill_chunk == 512
  for chunk in (512, 64):
    monkeypatch.setattr(e.sched, "prefill_chunk", chunk)
    rs = reqs()
    done = {}
    for r in rs:
      r.emit = lambda kind, payload, r=r: done.__setitem__(r.rid, (kind, payload)) \
          if kind != "delta" else None
    for r in rs[:2]:
      e.submit(r)
    for _ in range(4):   # the short requests are decoding
      e._iterate()
    e.submit(rs[2])
    interleaved = 0
    for _ in range(2000):
      if e.idle():
        break
      before = e.m["decode_steps"]
      e._iterate()
      interleaved += e.sched.prefilling is rs[2] and e.m["decode_steps"] > before
    assert all(done[r.rid][0] == "done" for r in rs), done
    check_clean(e)
    got[chunk] = [done[r.rid][1] for r in rs], interleaved
  (whole, n_whole), (chunked, n_chunked) = got[512], got[64]
  # prefilled over >= 2 iterations, a decode step after each piece (the pieces per iteration
  # follow the time budget: about one decode step)
  assert n_whole == 0 and n_chunked >= 1
  for a, b in zip(whole, chunked):
    assert is_call(b["text"]) and b["finish"] == a["finish"]
    assert b["tokens"] == a["tokens"]


# ---- scheduling: short prompts pass a long one, whose pieces are paced ------------------------

class EveryKthStep:
  """A stand-in for :class:`serve.schedule.PrefillPacer` that allows one long-prompt piece every
  ``k`` decode steps (the real pacer decides from wall-clock times; tested on its own)."""

  def __init__(self, k):
    self.k, self.steps, self.credit = k, 0, 0.0

  def step(self, dt):
    self.steps += 1

  def ready(self):
    return self.steps % self.k == 0

  def spent(self, dt):
    self.steps += 1   # not ready again at the same step


def test_short_prompts_pass_a_long_prefill_whose_pieces_are_paced(monkeypatch):
  """While a long prompt (several 64-token pieces) is being prefilled beside decoding streams,
  (1) its pieces run only when the pacer allows, with decode steps between them; (2) a short
  prompt that arrives is admitted and gets its first token before the long prefill ends; (3) a
  second long prompt waits for the first, and a short one that arrives after it goes first;
  and every request ends with the tokens of an engine that prefills each prompt whole."""
  def long_req(words):
    text = tok().apply_chat_template([{"role": "user", "content": words * 30}])
    ids, tags = label_prompt(tok(), text)
    assert 128 < len(ids) <= CTX - 12   # three pieces of 64
    return Request(ids=ids, tags=tags, max_tokens=12,
                   tracker=Tracker(grammar(), FCAdapter(grammar(), tok())))

  def reqs():
    short = requests(3)   # with the two long ones, 5 requests for 4 slots
    return short[:1], long_req("Weather in Paris? "), short[1], long_req("Rain in Oslo? "), \
        short[2]

  e = engine("demo")
  got = {}
  for chunk in (512, 64):
    monkeypatch.setattr(e.sched, "prefill_chunk", chunk)
    monkeypatch.setattr(e.sched, "pacer", EveryKthStep(3))
    calls = []   # the long prompts' runs: (request, decode steps so far, pieces run, busy)

    def paced(r, busy, real=e._prefill_some, calls=calls):
      long, steps, before = r is e.sched.prefilling, e.m["decode_steps"], e.sched.pre_pieces
      out = real(r, busy)
      if long:
        calls.append((r, steps, e.sched.pre_pieces - before, busy))
      return out
    monkeypatch.setattr(e, "_prefill_some", paced)
    early, L1, S1, L2, S2 = reqs()
    everyone = early + [L1, S1, L2, S2]
    done = {}
    for r in everyone:
      r.emit = lambda kind, payload, r=r: done.__setitem__(r.rid, (kind, payload)) \
          if kind != "delta" else None
    for r in early:
      e.submit(r)
    for _ in range(3):   # the first one decodes
      e._iterate()
    e.submit(L1)
    e._iterate()
    passed = None
    if chunk == 64:
      assert e.sched.prefilling is L1   # in progress: one piece so far
      e.submit(S1)
      e.submit(L2)
      e.submit(S2)
      # S1 and S2 are admitted and prefilled past L1's remaining pieces (an iteration admits
      # short prompts for about one decode step's time); L2 waits for L1 while S2, behind it,
      # takes the last free slot
      for _ in range(3):
        e._iterate()
      passed = (e.sched.prefilling is L1, S1.out != [], S2.out != [], L2.slot is None)
    else:
      for r in (S1, L2, S2):
        e.submit(r)
    for _ in range(3000):
      if e.idle():
        break
      e._iterate()
    assert all(done[r.rid][0] == "done" for r in everyone), done
    check_clean(e)
    got[chunk] = [done[r.rid][1] for r in everyone], calls, passed
  (whole, _, _), (chunked, calls, passed) = got[512], got[64]
  assert passed == (True, True, True, True), passed
  for a, b in zip(whole, chunked):
    assert b["finish"] == a["finish"] and b["tokens"] == a["tokens"]
  # Each long prompt's pieces (as many as hold its tokens: none is all padding): beside decoding
  # streams one at a time, at least 2 decode steps apart (the stand-in pacer allows one every
  # 3rd step); L2's only after L1's.
  assert [r for r, *_ in calls] == sorted([r for r, *_ in calls], key=lambda r: r is L2)
  for L in (L1, L2):
    mine = [(steps, n, busy) for r, steps, n, busy in calls if r is L]
    assert sum(n for _, n, _ in mine) == -(-len(L.ids) // 64), calls
    at = [steps for steps, n, busy in mine if busy]
    assert all(n == 1 for _, n, busy in mine if busy) and len(at) >= 2, mine
    assert all(b - a >= 2 for a, b in zip(at, at[1:])), at


@pytest.mark.parametrize("chunk", [64, 128, 256, 512])
def test_prefill_buckets_pad_little_and_never_a_whole_piece(chunk):
  """A prompt of one piece pads to at most a third more than it holds (from 32 tokens on); a
  longer one to whole pieces, none of them all padding (a 146-token prompt in pieces of 64 used
  to pad to 256: a fourth piece of nothing)."""
  from serve.engine import PREFILL_BUCKETS, PREFILL_CHUNKS, bucket
  assert set(PREFILL_CHUNKS) <= set(PREFILL_BUCKETS)
  for n in range(1, 4 * chunk + 1):
    Tn = bucket(n, chunk)
    assert Tn >= n
    if n <= chunk:
      assert Tn in PREFILL_BUCKETS and Tn <= chunk, (n, Tn)
      assert n <= 32 or Tn - n < Tn / 3, (n, Tn)
    else:
      assert Tn % chunk == 0 and Tn - n < chunk, (n, Tn)
  assert bucket(33, 64) == 48 and bucket(146, 64) == 192 and bucket(146, 512) == 192


def test_warmup_compiles_every_prefill_bucket_up_to_the_context(monkeypatch):
  """After :meth:`Engine.warmup` no prompt that fits the context (here 192 tokens: buckets 32,
  48, 64, 96, 128 and 192) compiles a prefill, plan or insert on the engine thread, where every
  running stream would wait for it.  (The engine is shared with other tests, which may have
  compiled some buckets already: the warm-up's own requests are checked too.)"""
  from serve.engine import bucket
  e = engine("demo")
  sent = []
  real = e.submit
  monkeypatch.setattr(e, "submit", lambda r: sent.append(len(r.ids)) or real(r))
  e.warmup(max_prompt=60)   # only the buckets of prompts up to 60 tokens
  assert sorted({bucket(n) for n in sent}) == [32, 48, 64], sent
  with pytest.raises(ValueError, match="max_prompt must be None or a positive int"):
    e.warmup(max_prompt=0)
  sent.clear()
  e.warmup()
  assert sorted({bucket(n) for n in sent}) == [32, 48, 64, 96, 128, 192], sent
  assert all(n + 2 <= CTX for n in sent)
  jitted = (e.dense.prefill, e.step._plan, e.step._insert, e.step._first)
  compiled = [f._cache_size() for f in jitted]
  reqs = []
  for words in (0, 4, 16, 30):   # one prompt per bucket: 32, 48, 96, 192 (30-151 tokens)
    text = tok().apply_chat_template([{"role": "user", "content": "Rain in Oslo? " * words}])
    ids, tags = label_prompt(tok(), text)
    reqs.append(Request(ids=ids, tags=tags, max_tokens=4))
  assert sorted(bucket(len(r.ids)) for r in reqs) == [32, 48, 96, 192]
  res, _ = run(e, reqs)
  assert all(x["finish"] in ("stop", "length") for x in res), res
  assert [f._cache_size() for f in jitted] == compiled
  check_clean(e)


def test_no_piece_right_after_a_short_prefill(monkeypatch):
  """A long prompt's piece never runs in the iteration that prefilled a short prompt (the short
  one's first decode step would wait for it), however the pacer's readiness falls — until the
  long prompt has waited ``STARVE_STEPS`` decode steps.  (Pieces of 32 tokens here: more of
  them than the context holds pieces of 64.)"""
  from serve.engine import STARVE_STEPS
  e = engine("demo")
  monkeypatch.setattr(e.sched, "prefill_chunk", 32)
  monkeypatch.setattr(e.sched, "pacer", EveryKthStep(3))
  stream = requests(1)[0]
  stream.max_tokens = 60
  long = long_request(4)
  ids, tags = long.ids, long.tags
  assert len(ids) > 4 * 32
  shorts = [Request(ids=ids[:20 + i], tags=tags[:20 + i], max_tokens=2) for i in range(8)]
  runs = []   # (short or piece, decode steps so far, steps since the last piece)

  def paced(r, busy, real=e._prefill_some):
    if r is not e.sched.prefilling:
      runs.append(("short", e.m["decode_steps"], e.sched.since_piece))
    elif busy:
      runs.append(("piece", e.m["decode_steps"], e.sched.since_piece))
    return real(r, busy)
  monkeypatch.setattr(e, "_prefill_some", paced)
  e.submit(stream)
  for _ in range(3):
    e._iterate()
  e.submit(long)
  e._iterate()
  for i in range(400):
    if e.idle():
      break
    if i % 3 == 0 and shorts:   # a short prompt every third iteration: all pacer phases
      e.submit(shorts.pop())
    e._iterate()
  assert e.idle() and not shorts
  kinds = [k for k, *_ in runs]
  assert kinds.count("short") >= 8 and kinds.count("piece") >= 3, runs
  for (k0, s0, _), (k1, s1, waited) in zip(runs, runs[1:]):
    if k0 == "short" and k1 == "piece":
      assert s1 > s0 or waited >= STARVE_STEPS, runs
  check_clean(e)


def test_an_idle_long_prefill_leaves_nothing_running_when_a_request_arrives(monkeypatch):
  """With nothing decoding, a long prompt's pieces run back to back until a request arrives;
  then nothing of the long prefill is left running on the device (with the next piece already
  queued, the new request waited for two pieces)."""
  import jax
  e = engine("demo")
  monkeypatch.setattr(e.sched, "prefill_chunk", 64)
  long, short = long_request(2), requests(1, tools=False)[0]
  short.max_tokens = 2
  seen = []

  def prefill(r, rows, real=e._prefill):
    real(r, rows)
    if r is long:
      pieces = r.pre[0]

      def spy():
        for logits, dense in pieces:
          seen.append(dense)
          if len(seen) == 1:
            e.submit(short)   # arrives while the first piece is done and the rest would run
          yield logits, dense
      r.pre = (spy(),) + r.pre[1:]
  monkeypatch.setattr(e, "_prefill", prefill)
  e.submit(long)
  e._iterate()
  assert len(seen) == 1 and e.sched.prefilling is long and e.inbox == [short]
  assert all(x.is_ready() for x in jax.tree.leaves(seen[0]))
  e.run_until_idle()
  assert long.out and short.out
  check_clean(e)


class NeverReady(EveryKthStep):
  def ready(self):
    return False


def test_a_long_prefill_is_not_starved(monkeypatch):
  """With a pacer that never allows a piece (a flood of short prompts drains its credit), a
  long prompt beside a decoding stream still gets a piece every ``STARVE_STEPS`` decode steps
  and completes."""
  from serve.engine import STARVE_STEPS
  e = engine("demo")
  monkeypatch.setattr(e.sched, "prefill_chunk", 64)
  monkeypatch.setattr(e.sched, "pacer", NeverReady(1))
  stream = requests(1)[0]
  stream.max_tokens = 100
  long = long_request(4)
  done = {}
  for r in (stream, long):
    r.emit = lambda kind, payload, r=r: done.__setitem__(r.rid, kind) if kind != "delta" else None
  at = []   # decode steps done at each run of the long prompt's pieces beside the stream

  def paced(r, busy, real=e._prefill_some):
    if r is e.sched.prefilling and busy:
      at.append(e.m["decode_steps"])
    return real(r, busy)
  monkeypatch.setattr(e, "_prefill_some", paced)
  e.submit(stream)
  for _ in range(3):
    e._iterate()
  e.submit(long)
  for _ in range(3000):
    if e.idle():
      break
    e._iterate()
  assert done == {stream.rid: "done", long.rid: "done"}, done
  assert len(at) >= 3 and all(b - a >= STARVE_STEPS for a, b in zip(at, at[1:])), at
  check_clean(e)


def test_warmup_compiles_every_sampling_variant_of_the_picks():
  """``warmup(sampling=True)``: each (sampled, top-p, log-probs) combination of the picks is
  compiled before serving, so a first sampled request with log-probs compiles nothing; and an
  emptied slot asks for no sampling branch."""
  e = tight("sparse")
  e.warmup(max_prompt=1, sampling=True)
  sizes = e.step._pick_rows._cache_size(), e.step._first._cache_size()
  assert sizes == (6, 6)
  r = requests(2)
  r[0].temperature, r[0].top_p, r[0].logprobs = 0.7, 0.8, 2
  res, _ = run(e, r)
  assert all(x["finish"] in ("stop", "length") for x in res)
  assert (e.step._pick_rows._cache_size(), e.step._first._cache_size()) == sizes
  assert not e.batch.temp.any() and (e.batch.top_p == 1).all() and not e.batch.want_lp.any()


def test_page_pressure_does_not_stall_a_prompt_prefilled_in_pieces():
  """A long prompt prefilled in pieces and a younger short request that outgrows the pages: the
  short one is preempted (page pressure), and the long prompt's pieces go on under the pressure,
  so both complete (the engine spun forever when pressure also stopped the pieces)."""
  from serve.engine import Engine
  e = Engine(model(), tok(), pol("all-high"), slots=4, context=CTX, page=PAGE, hi_pages=40,
             lo_pages=1, prefiller=prefiller())
  e.sched.prefill_chunk = 32
  e.sched.pacer.ready = lambda: False   # pieces only when starved: the order is not the clock's
  long = long_request(4)
  short = Request(ids=[tok().encode("hi")[0]] * 5, max_tokens=60)
  got = {}
  for r in (long, short):
    r.emit = lambda k, p, r=r: got.setdefault(r.rid, []).append(k) if k != "delta" else None
    e.submit(r)
  e.run_until_idle(max_iterations=3000)
  assert e.m["preemptions"] >= 1
  assert got[long.rid][-1] == "done" and got[short.rid][-1] == "done"
  assert len(short.out) == 60 and e.running == [None] * 4
