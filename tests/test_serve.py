"""serve/: the OpenAI-compatible server over the continuous-batching PASK engine.

The shared loopback server of tests/serve_helpers.py (demo policy, 4 slots, 256-token context,
20-page pools); clients are the official ``openai`` package and ``httpx``.  Request-surface
rows (issue 15) are in test_serve_openai.py, hostile input (issue 16) in test_serve_hostile.py.
"""
import concurrent.futures as cf
import json
import random

import httpx
import jsonschema
import openai
import pytest

from pask_jax.decode import PaskRunner, Sampling, generate
from serve_helpers import (HI_PAGES, MODEL, TIMEOUT, WEATHER, idle, metrics,
                           pages_all_free)
from serve_helpers import client as make_client
from serve_helpers import server as start_server


@pytest.fixture(scope="module")
def server():
  base, engine, _ = start_server()
  return base, engine


@pytest.fixture(scope="module")
def client(server):
  return make_client(server[0])


_metrics, _idle = metrics, idle


def test_models_health_and_metrics(server):
  base, _ = server
  assert httpx.get(base + "/health", timeout=10).json() == {"status": "ok"}
  ids = [m["id"] for m in httpx.get(base + "/v1/models", timeout=10).json()["data"]]
  assert ids == [MODEL, "smollm2"]
  m = _idle(base)
  assert pages_all_free(m) and m["pask_engine_up"] == 1


def test_all_high_reserves_no_int4_pages(server):
  """The default policy stores everything H: it never needs INT4 pages and its pool is one
  page; the worst case of a request is every token beyond the window in one pool."""
  from pask_jax import policy as P
  from serve.engine import Engine
  _, engine = server
  pol = P.resolve("all-high", engine.cfg, tokenizer_hash=engine.tok.hash())
  e = Engine(engine.model, engine.tok, pol, slots=2, context=256)
  assert (e.hi_total, e.lo_total) == (2 * 16, 1)
  assert e.worst_case(100, 20) == (6, 0) and e.worst_case(10, 5) == (0, 0)
  assert engine.worst_case(100, 20) == (6, 6)   # demo can emit L: either pool


def test_tool_call(server, client):
  r = client.chat.completions.create(
      model=MODEL, max_tokens=60, tools=WEATHER, tool_choice="required",
      messages=[{"role": "user", "content": "What is the weather like in Paris?"}])
  ch = r.choices[0]
  assert ch.finish_reason == "tool_calls"
  call = ch.message.tool_calls[0]
  assert call.type == "function" and call.function.name == "get_weather"
  args = json.loads(call.function.arguments)
  assert isinstance(args["city"], str)
  pask = r.usage.model_extra["pask"]
  assert 0 < pask["measured_B"] < 1 and pask["overflow"] is False
  assert pask["actions"]["R"] > 0 and pask["actions"]["L"] > 0 and pask["actions"]["H"] > 0
  # Every prompt token and every decode token fed back is charged once per layer group (the
  # last generated token never enters the cache).
  n_tokens = r.usage.prompt_tokens + r.usage.completion_tokens
  assert sum(pask["actions"].values()) in (3 * (n_tokens - 1), 3 * n_tokens)
  assert pask["prompt_kv_bits"] + pask["decode_kv_bits"] == pytest.approx(
      pask["measured_B"] * pask["full_kv_bits"])


def test_tool_call_streamed(client):
  """SSE with tools: one ``tool_calls`` delta once the call is complete, then finish_reason."""
  calls, finish = [], None
  for c in client.chat.completions.create(
      model=MODEL, max_tokens=60, tools=WEATHER, stream=True,
      tool_choice={"type": "function", "function": {"name": "get_weather"}},
      messages=[{"role": "user", "content": "Is it raining in Tokyo?"}]):
    if c.choices:
      calls += c.choices[0].delta.tool_calls or []
      finish = c.choices[0].finish_reason or finish
  assert finish == "tool_calls" and len(calls) >= 1
  assert calls[0].function.name == "get_weather" and calls[0].index == 0
  assert isinstance(json.loads(calls[0].function.arguments)["city"], str)


def test_json_schema(client):
  schema = {"type": "object", "properties": {
      "answer": {"type": "boolean"}, "color": {"enum": ["blue", "red", "green"]},
      "count": {"type": "integer", "minimum": 0, "maximum": 9}},
      "required": ["answer", "color", "count"], "additionalProperties": False}
  r = client.chat.completions.create(
      model=MODEL, max_tokens=40, messages=[{"role": "user", "content": "Is the sky blue?"}],
      response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
  assert r.choices[0].finish_reason == "stop"
  jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def test_greedy_stream_equals_non_stream(client):
  kw = dict(model=MODEL, max_tokens=12, temperature=0,
            messages=[{"role": "user", "content": "Name three colors."}])
  full = client.chat.completions.create(**kw)
  parts, finish, usage = [], None, None
  for c in client.chat.completions.create(stream=True, stream_options={"include_usage": True},
                                          **kw):
    if c.choices:
      parts.append(c.choices[0].delta.content or "")
      finish = c.choices[0].finish_reason or finish
    usage = c.usage or usage
  assert "".join(parts) == full.choices[0].message.content and full.choices[0].message.content
  assert finish == full.choices[0].finish_reason
  assert usage.completion_tokens == full.usage.completion_tokens


def test_matches_single_sequence_generate(server):
  """Two requests decoded side by side in the batched paged cache give exactly the tokens of
  ``decode.generate`` on a batch-1 PaskRunner with its dense page layout."""
  base, engine = server
  prompts = ["What is 2+2?", "Write a haiku about the sea."]
  body = lambda p: {"model": MODEL, "max_tokens": 10, "messages": [{"role": "user", "content": p}]}
  with cf.ThreadPoolExecutor(2) as ex:
    outs = list(ex.map(lambda p: httpx.post(base + "/v1/chat/completions", json=body(p),
                                            timeout=TIMEOUT).json(), prompts))
  tok = engine.tok
  runner = PaskRunner(engine.model, engine.policy, batch=1, capacity=256)   # dense pages
  from pask_jax.grammar.prompt_spans import label_prompt
  for p, out in zip(prompts, outs):
    ids, tags = label_prompt(tok, tok.apply_chat_template([{"role": "user", "content": p}]))
    ref = generate(runner, tok, [ids], prompt_tags=[tags], sampling=Sampling(max_tokens=10))[0]
    assert out["choices"][0]["message"]["content"] == ref.text
    assert out["usage"]["completion_tokens"] == len(ref.tokens)
    assert out["usage"]["pask"]["measured_B"] == ref.ledger["measured_B"]


BAD = [
    ("malformed json", b'{"model": MODEL, "messages": [', 400, None),
    ("not an object", b'[1, 2]', 400, None),
    ("missing messages", {"model": MODEL}, 400, "messages"),
    ("missing model", {"messages": [{"role": "user", "content": "hi"}]}, 400, "model"),
    ("bad role", {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, 400,
     "messages[0]"),
    ("tool_calls not a list", {"model": MODEL, "messages": [
        {"role": "assistant", "content": None, "tool_calls": "x"}]}, 400,
     "messages[0].tool_calls"),
    ("content not text", {"model": MODEL, "messages": [{"role": "user", "content": 5}]}, 400,
     "messages[0].content"),
    ("n 2", {"model": MODEL, "n": 2, "messages": [{"role": "user", "content": "hi"}]}, 400, "n"),
    ("max_tokens 0", {"model": MODEL, "max_tokens": 0,
                      "messages": [{"role": "user", "content": "hi"}]}, 400, "max_tokens"),
    ("max_tokens -3", {"model": MODEL, "max_tokens": -3,
                       "messages": [{"role": "user", "content": "hi"}]}, 400, "max_tokens"),
    ("max_tokens str", {"model": MODEL, "max_tokens": "5",
                        "messages": [{"role": "user", "content": "hi"}]}, 400, "max_tokens"),
    ("temperature 9", {"model": MODEL, "temperature": 9,
                       "messages": [{"role": "user", "content": "hi"}]}, 400, "temperature"),
    ("invalid schema", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                        "response_format": {"type": "json_schema", "json_schema": {
                            "name": "a", "schema": {"type": "nonsense"}}}}, 400,
     "response_format"),
    ("uncompilable schema", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                             "response_format": {"type": "json_schema", "json_schema": {
                                 "name": "a", "schema": {"type": "object", "properties": {
                                     "a": {"$ref": "#/$defs/missing"}}}}}}, 400,
     "response_format"),
    ("unknown tool", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                      "tools": WEATHER, "tool_choice": {"type": "function",
                                                        "function": {"name": "nope"}}}, 400,
     "tool_choice"),
    ("tool without name", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                           "tools": [{"type": "function", "function": {}}]}, 400,
     "tools[0].function.name"),
    ("prompt over capacity", {"model": MODEL, "max_tokens": 8,
                              "messages": [{"role": "user", "content": "word " * 400}]}, 400,
     "messages"),
    ("prompt + max_tokens over capacity", {"model": MODEL, "max_tokens": 250,
                                           "messages": [{"role": "user", "content": "hi"}]},
     400, "messages"),
]


@pytest.mark.parametrize("name,body,status,param", BAD, ids=[b[0] for b in BAD])
def test_bad_input(server, name, body, status, param):
  base, _ = server
  kw = {"content": body} if isinstance(body, bytes) else {"json": body}
  r = httpx.post(base + "/v1/chat/completions", timeout=30,
                 headers={"content-type": "application/json"}, **kw)
  assert r.status_code == status, r.text
  err = r.json()["error"]
  assert err["type"] == "invalid_request_error" and err["message"] and err["param"] == param
  if "capacity" in name:
    assert err["code"] == "context_length_exceeded"


def test_bad_input_through_openai_client_then_still_serving(server, client):
  with pytest.raises(openai.BadRequestError) as e:
    client.chat.completions.create(model=MODEL, max_tokens=0,
                                   messages=[{"role": "user", "content": "hi"}])
  assert e.value.status_code == 400
  r = client.chat.completions.create(model=MODEL, max_tokens=3,
                                     messages=[{"role": "user", "content": "hi"}])
  assert r.usage.completion_tokens >= 1
  assert httpx.get(server[0] + "/health", timeout=10).status_code == 200


def test_admission_waits_for_pages(server):
  """Three long prompts whose prompt plans need more than the 20-page pools hold together (the
  demo policy keeps prompt text H in the upper layer groups): with four slots free, at least
  one of them must wait in the queue for pages; all complete and every page comes back."""
  base, engine = server
  before = _metrics(base)["pask_admission_blocked_total"]
  long = "Tell me about the sea. " * 28
  body = {"model": MODEL, "max_tokens": 6, "messages": [{"role": "user", "content": long}]}
  n = len(engine.tok.encode(engine.tok.apply_chat_template(body["messages"])))
  d, d_lo = engine.worst_case(n, 6)
  assert HI_PAGES // 3 < d <= HI_PAGES and d_lo == d
  with cf.ThreadPoolExecutor(3) as ex:
    rs = list(ex.map(lambda _: httpx.post(base + "/v1/chat/completions", json=body,
                                          timeout=TIMEOUT), range(3)))
  assert [r.status_code for r in rs] == [200] * 3
  m = _idle(base)
  assert m["pask_admission_blocked_total"] > before
  assert pages_all_free(m)


def _load_one(base: str, i: int, rng: random.Random) -> tuple[str, int]:
  """One load-test client: (kind, status) — status 0 for a client that hung up on purpose."""
  url = base + "/v1/chat/completions"
  kind = rng.choices(["malformed", "stream_drop", "slow_drop", "json", "text"],
                     [20, 10, 5, 15, 50])[0]
  msgs = [{"role": "user", "content": rng.choice(["Hi!", "What is 3+5?", "Name a fruit.",
                                                  "Say something nice."])}]
  if kind == "malformed":
    bad = rng.choice([b'{"model": MODEL, "messages": [', b'{"model": MODEL}', json.dumps(
        {"model": MODEL, "messages": msgs, "max_tokens": -1}).encode(), json.dumps(
        {"model": MODEL, "messages": msgs, "tools": WEATHER,
         "tool_choice": {"type": "function", "function": {"name": "nope"}}}).encode()])
    return kind, httpx.post(url, content=bad, timeout=30).status_code
  body = {"model": MODEL, "messages": msgs, "max_tokens": rng.randint(2, 8), "seed": i,
          "temperature": rng.choice([0, 0.8])}
  if kind == "json":
    body["response_format"] = {"type": "json_object"}
  if kind == "stream_drop":   # read the first chunk or two, then hang up
    with httpx.stream("POST", url, json=dict(body, stream=True, max_tokens=8),
                      timeout=TIMEOUT) as r:
      for j, _ in zip(range(2), r.iter_lines()):
        pass
      return kind, 0
  if kind == "slow_drop":     # a non-streaming client that gives up before the answer
    try:
      httpx.post(url, json=dict(body, max_tokens=8), timeout=0.3)
    except httpx.TimeoutException:
      pass
    return kind, 0
  r = httpx.post(url, json=body, timeout=TIMEOUT)
  if r.status_code == 200:
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
  return kind, r.status_code


def test_load_no_5xx_and_every_page_back(server):
  """40 requests, 8 concurrent, ~20% malformed, some clients hanging up mid-stream or before a
  non-streamed answer: no 5xx, malformed ones get 400, and afterwards the pools are full again;
  the decode step compiled once for the whole module."""
  base, engine = server
  before = _idle(base)
  rng = random.Random(0)
  seeds = [random.Random(rng.random()) for _ in range(40)]
  with cf.ThreadPoolExecutor(8) as ex:
    res = list(ex.map(lambda a: _load_one(base, *a), enumerate(seeds)))
  kinds = {k for k, _ in res}
  assert {"malformed", "text", "stream_drop"} <= kinds
  for kind, status in res:
    assert status < 500, (kind, status)
    assert status == (400 if kind == "malformed" else 0 if kind.endswith("drop") else 200)
  m = _idle(base)
  assert pages_all_free(m)
  assert m.get('pask_http_requests_total{code="500"}', 0) == before.get(
      'pask_http_requests_total{code="500"}', 0)
  assert m['pask_requests_total{outcome="error"}'] == before['pask_requests_total{outcome="error"}']
  assert m["pask_cache_overflows_total"] == 0
  assert m["pask_client_disconnects_total"] > before["pask_client_disconnects_total"]
  # one compile of the batched step, ever (the overlapped forward, or the serial step)
  assert engine.runner.traces["fwd" if engine.overlap else "step"] == 1
  assert httpx.get(base + "/health", timeout=10).json() == {"status": "ok"}
