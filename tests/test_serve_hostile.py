"""Issue 16: hostile input cannot hurt the server (every failure mode of the issue, by number).

The shared loopback server of tests/serve_helpers.py; the official ``openai`` client where a
request is one the client can send, raw ``httpx`` / ``http.client`` where it cannot (malformed
bytes, keep-alive checks).
"""
import http.client
import json
import threading
import time

import httpx
import openai
import pytest

from serve_helpers import MODEL, WEATHER, idle, metrics, pages_all_free
from serve_helpers import client as make_client
from serve_helpers import server as start_server

URL = "/v1/chat/completions"
MSG = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def base():
  return start_server()[0]


@pytest.fixture(scope="module")
def client(base):
  return make_client(base)


def post(base, body, **kw):
  kw.setdefault("timeout", 60)
  if isinstance(body, (bytes, str)):
    return httpx.post(base + URL, content=body, headers={"content-type": "application/json"},
                      **kw)
  return httpx.post(base + URL, json=body, **kw)


def err(r, status, param="__any__", code="__any__"):
  assert r.status_code == status, r.text
  e = r.json()["error"]
  assert set(e) == {"message", "type", "param", "code"} and e["message"]
  assert "\n" not in e["message"] and "Traceback" not in e["message"]
  if param != "__any__":
    assert e["param"] == param, e
  if code != "__any__":
    assert e["code"] == code, e
  return e


# ---- 1. 5xx from user input ------------------------------------------------------------------

def test_nesting_bomb_is_a_400(base):
  bomb = b'{"model": "' + MODEL.encode() + b'", "messages": ' + b"[" * 5000 + b"]" * 5000 + b"}"
  e = err(post(base, bomb), 400, code="json_too_deep")
  assert "5001 levels" in e["message"] and "--max-json-depth" in e["message"]
  deep = {"model": MODEL, "messages": MSG, "metadata": {}}
  x = deep
  for _ in range(70):
    x["metadata"] = {}
    x = x["metadata"]
  err(post(base, deep), 400, code="json_too_deep")


def test_bracket_flood_in_a_message(base, client):
  """~1,000 brackets in a plain message: refused for length (256-token context) or answered;
  the labeller never recurses (its own test: test_prompt_spans.py)."""
  r = post(base, {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user",
                                                                  "content": "[" * 1200}]})
  assert r.status_code in (200, 400), r.text
  ok = client.chat.completions.create(model=MODEL, max_tokens=2, messages=[
      {"role": "user", "content": "[" * 40 + "{" * 40 + " ok?"}])
  assert ok.choices[0].finish_reason in ("stop", "length")


def test_body_size_limit_is_a_413_and_says_so(base):
  big = b'{"model": "x", "messages": "' + b"a" * (3 << 20) + b'"}'
  e = err(post(base, big), 413, code="request_too_large")
  assert "--max-body-bytes" in e["message"]
  good = json.dumps({"model": MODEL, "max_tokens": 1, "messages": MSG}).encode()
  (s1, _, sock1), (s2, _, sock2) = _same_socket_twice(base, big, good)
  assert (s1, s2) == (413, 200) and sock1 is sock2   # drained: the connection stays usable
  # A declared 1 GiB body is refused before it is read, and the connection closed.
  import socket
  host, port = base.removeprefix("http://").split(":")
  with socket.create_connection((host, int(port)), timeout=30) as sk:
    sk.sendall(f"POST {URL} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               f"Content-Length: {1 << 30}\r\n\r\n{{".encode())
    head = sk.recv(65536).decode("latin-1").lower()
  assert head.startswith("http/1.1 413") and "connection: close" in head


# ---- 2. keep-alive after an error --------------------------------------------------------------

def _same_socket_twice(base, first: bytes, second: bytes):
  host, port = base.removeprefix("http://").split(":")
  conn = http.client.HTTPConnection(host, int(port), timeout=60)
  out = []
  for body in (first, second):
    conn.request("POST", URL, body=body, headers={"content-type": "application/json"})
    r = conn.getresponse()
    out.append((r.status, json.loads(r.read() or b"{}"), conn.sock))
  conn.close()
  return out


def test_keep_alive_survives_errors(base):
  good = json.dumps({"model": MODEL, "max_tokens": 1, "messages": MSG}).encode()
  for bad in (b"{not json", b'{"model": "x"}',
              json.dumps({"model": "nope", "messages": MSG}).encode(),
              b"[" * 6000):
    (s1, _, sock1), (s2, body, sock2) = _same_socket_twice(base, bad, good)
    assert 400 <= s1 < 500 and s2 == 200, (bad[:30], s1, s2, body)
    assert sock1 is sock2 and sock2 is not None   # one connection, not reset and reopened


def test_keep_alive_survives_a_server_bug(base):
  """A bug (an exception escaping a handler) is an OpenAI-style 500 and the same keep-alive
  connection serves the next request (it used to be reset: uvicorn closed the socket after the
  re-raised exception)."""
  _, _, app = start_server()
  prep = app.state.prep
  real = prep.plan

  def boom(body):
    if body.user == "boom":
      raise RuntimeError("injected bug")
    return real(body)

  prep.plan = boom
  try:
    bad = json.dumps({"model": MODEL, "max_tokens": 1, "messages": MSG, "user": "boom"}).encode()
    good = json.dumps({"model": MODEL, "max_tokens": 1, "messages": MSG}).encode()
    (s1, b1, sock1), (s2, _, sock2) = _same_socket_twice(base, bad, good)
  finally:
    prep.plan = real
  assert s1 == 500 and b1["error"]["type"] == "server_error" and "RuntimeError" in \
      b1["error"]["message"]
  assert s2 == 200 and sock1 is sock2


# ---- 3. $ref in a tool's parameters --------------------------------------------------------

CITY = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "$defs": {"City": {"enum": ["Paris", "Rome"]}},
    "properties": {"city": {"$ref": "#/$defs/City"}}, "required": ["city"]}}}


def test_tool_defs_are_resolved_against_the_parameters(client):
  r = client.chat.completions.create(model=MODEL, max_tokens=40, tools=[CITY],
                                     tool_choice="required",
                                     messages=[{"role": "user", "content": "Weather in Rome?"}])
  ch = r.choices[0]
  assert ch.finish_reason == "tool_calls", ch
  assert json.loads(ch.message.tool_calls[0].function.arguments)["city"] in ("Paris", "Rome")


@pytest.mark.parametrize("ref,why", [("#/properties/name", "points nowhere"),
                                     ("#/$defs/Nope", "points nowhere"),
                                     ("https://example.com/x.json", "only local")])
def test_tool_refs_that_point_outside_the_parameters(base, ref, why):
  tool = {"type": "function", "function": {"name": "f", "parameters": {
      "type": "object", "properties": {"x": {"$ref": ref}}, "required": ["x"]}}}
  e = err(post(base, {"model": MODEL, "messages": MSG, "tools": [tool],
                      "tool_choice": "required"}), 400, "tools", "invalid_schema")
  assert why in e["message"] and "tools[0].function.parameters" in e["message"]


# ---- 4. unsatisfiable schemas ----------------------------------------------------------------

UNSAT = [{"not": {}},
         {"allOf": [{"type": "string"}, {"type": "integer"}]},
         {"type": "object", "required": ["a"], "additionalProperties": False},
         {"type": "object", "properties": {"a": {"type": "string", "const": 3}},
          "required": ["a"]}]


@pytest.mark.parametrize("schema", UNSAT, ids=[json.dumps(s)[:30] for s in UNSAT])
def test_unsatisfiable_schemas_are_refused_up_front(base, schema):
  rf = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
  e = err(post(base, {"model": MODEL, "messages": MSG, "response_format": rf}), 400,
          "response_format", "invalid_schema")
  assert "unsatisfiable" in e["message"]
  tool = {"type": "function", "function": {"name": "f", "parameters": {
      "type": "object", "properties": {"v": schema}, "required": ["v"]}}}
  e = err(post(base, {"model": MODEL, "messages": MSG, "tools": [tool]}), 400, "tools",
          "invalid_schema")
  assert "unsatisfiable" in e["message"]


def test_unenforceable_keyword_is_refused(base):
  rf = {"type": "json_schema", "json_schema": {"name": "a", "schema": {
      "type": "array", "items": {"type": "integer"}, "uniqueItems": True}}}
  e = err(post(base, {"model": MODEL, "messages": MSG, "response_format": rf}), 400,
          "response_format", "invalid_schema")
  assert "'uniqueItems' is not supported" in e["message"]


# ---- 5/6. nothing expensive before the length check; compilation off the critical path --------

def test_long_hostile_prompt_is_refused_before_tokenizing_or_labelling(base, monkeypatch):
  """A 400 KB message of ``{x`` (18.7 s to refuse when labelling ran first, quadratically) is
  refused from its byte length: neither the tokenizer nor the prompt labeller sees it."""
  from pask_jax.grammar import prompt_spans

  def boom(*a, **k):
    raise AssertionError("an over-long prompt reached tokenizing / labelling")
  monkeypatch.setattr(prompt_spans, "encode", boom)
  monkeypatch.setattr(prompt_spans, "labels", boom)
  err(post(base, {"model": MODEL, "max_tokens": 4, "messages": [
      {"role": "user", "content": "{x" * 200_000}]}), 400, "messages", "context_length_exceeded")


def test_length_check_comes_before_grammar_compilation(base):
  grammars = start_server()[2].state.grammars
  before = grammars.snapshot()["misses"]
  wide = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(300)}}
  err(post(base, {"model": MODEL, "max_tokens": 4, "messages": [
      {"role": "user", "content": "word " * 400}],
      "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": wide}}}),
      400, "messages", "context_length_exceeded")
  assert grammars.snapshot()["misses"] == before


def test_slow_schema_does_not_block_small_ones(base, client):
  """A large schema compiling in the large lane (~4 s alone here) while a small, never-seen tool
  set compiles and answers in the small lane; ``pask_grammar_compiling`` counts the jobs in
  progress (an idle server has none)."""
  wide = {"type": "object", "properties": {f"q{i}": {"type": "string"} for i in range(900)}}
  slow = {"model": MODEL, "max_tokens": 2, "messages": MSG, "response_format": {
      "type": "json_schema", "json_schema": {"name": "w", "schema": wide}}}
  res = {}

  def run_slow():
    r = post(base, slow, timeout=120)
    res["status"], res["body"] = r.status_code, r.text

  th = threading.Thread(target=run_slow)
  th.start()
  time.sleep(0.5)
  tool = {"type": "function", "function": {"name": "lookup_%d" % time.time_ns(), "parameters": {
      "type": "object", "properties": {"q": {"type": "string", "maxLength": 4}},
      "required": ["q"]}}}
  r = client.chat.completions.create(model=MODEL, max_tokens=3, tools=[tool],
                                     tool_choice="required", messages=MSG)
  overtook = "status" not in res           # the small one answered while the large one compiled
  compiling = []
  while th.is_alive():
    compiling.append(metrics(base)["pask_grammar_compiling"])
    time.sleep(0.05)
  th.join(120)
  assert max(compiling, default=0) >= 1 and metrics(base)["pask_grammar_compiling"] == 0, compiling
  assert r.choices[0].message.tool_calls or r.choices[0].finish_reason == "length"
  assert res["status"] == 200, res
  assert overtook, res


def test_compile_time_limit_kills_the_worker():
  """A compile over the limit is stopped (its worker process killed and restarted) and the
  request refused; the pool keeps compiling afterwards."""
  import asyncio

  from models import gguf_io, registry
  from models.tokenizer import Tokenizer
  from serve.grammars import CompileError, GrammarPool
  tok = Tokenizer.from_gguf_metadata(gguf_io.read(registry.smollm2_path()).meta)
  pool = GrammarPool(tok, tok.vocab_size, timeout_s=1.0)
  wide = {"type": "object", "properties": {f"r{i}": {"type": "string"} for i in range(1500)}}

  async def go():
    await pool.get({"kind": "json_schema", "schema": {"type": "boolean"}})   # workers up
    with pytest.raises(CompileError, match="longer than 1 s"):
      await pool.get({"kind": "json_schema", "schema": wide})
    misses = pool.stats["misses"]
    with pytest.raises(CompileError, match="longer than 1 s"):   # remembered: refused at once
      await pool.get({"kind": "json_schema", "schema": wide})
    assert pool.stats["misses"] == misses                       # ... without compiling again
    return await pool.get({"kind": "json_schema", "schema": {"type": "integer"}})

  try:
    g = asyncio.run(go())
  finally:
    pool.close()
  assert g.kind == "json_schema"            # the pool keeps compiling after a killed worker
  assert pool.stats["timeouts"] == 1


# ---- 8. unclear 400s -------------------------------------------------------------------------

@pytest.mark.parametrize("body,param,text", [
    (b'{"model": "M", "messages": [{"role": "user", "content": "\\ud800 x"}]}', None,
     "lone UTF-16 surrogate"),
    ({"model": MODEL, "messages": MSG, "stream": True, "stream_options": "x"}, "stream_options",
     "stream_options"),
    ({"model": MODEL, "messages": MSG, "tools": WEATHER,
      "tool_choice": {"type": "function", "function": "get_weather"}}, "tool_choice.function",
     "tool_choice.function"),
    ({"model": MODEL, "messages": MSG, "tool_choice": "sometimes", "tools": WEATHER},
     "tool_choice", "tool_choice"),
])
def test_clear_400s(base, body, param, text):
  if isinstance(body, bytes):
    body = body.replace(b'"M"', json.dumps(MODEL).encode())
  e = err(post(base, body), 400, param)
  assert text in e["message"], e


def test_deep_response_format_is_a_clear_400(base):
  s = {"type": "string"}
  for _ in range(150):
    s = {"type": "object", "properties": {"a": s}}
  e = err(post(base, {"model": MODEL, "messages": MSG, "response_format": {
      "type": "json_schema", "json_schema": {"name": "d", "schema": s}}}), 400)
  assert "recursion" not in e["message"] and "levels deep" in e["message"]


def test_404_405_413_bodies_are_openai_style(base):
  e = err(httpx.post(base + "/v1/embeddings", json={}, timeout=10), 404)
  assert e["message"] == "Invalid URL (POST /v1/embeddings)" and e["type"] == \
      "invalid_request_error"
  e = err(httpx.get(base + URL, timeout=10), 405)
  assert "GET" in e["message"]
  with pytest.raises(openai.NotFoundError) as exc:
    make_client(base).models.retrieve("nope")
  assert exc.value.body["code"] == "model_not_found"


def test_xgrammar_errors_carry_no_cpp_location(base):
  rf = {"type": "json_schema", "json_schema": {"name": "a", "schema": {
      "type": "integer", "minimum": 5, "maximum": 3}}}
  e = err(post(base, {"model": MODEL, "messages": MSG, "response_format": rf}), 400,
          "response_format")
  assert "minimum greater than maximum" in e["message"]
  assert ".cc:" not in e["message"] and "[" not in e["message"].split(":")[0]


def test_afterwards_nothing_leaked(base):
  m = idle(base)
  assert pages_all_free(m)
  assert m['pask_requests_total{outcome="error"}'] == 0
  assert httpx.get(base + "/health", timeout=10).json() == {"status": "ok"}


def test_worker_gate_serves_waiters_on_other_event_loops():
  """A grammar pool shared by apps on different event loops (``create_app(grammars=)``; each
  uvicorn server has its own loop): a compile waiting for a lane's worker on one loop gets it
  when a compile on another loop gives it back, first come first served, and a waiter cancelled
  while waiting loses nothing (an asyncio.Semaphore bound itself to the first loop that waited
  and failed the other's wait: "bound to a different event loop", a 500)."""
  import asyncio

  from serve.grammars import Gate

  gate = Gate(["w0"])
  order: list = []
  held = threading.Event()

  def on_loop(coro):
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("r", asyncio.run(coro)))
    t.start()
    return t, out

  async def holder():
    w = await gate.take()
    order.append(("a", w))
    held.set()
    await asyncio.sleep(0.3)
    gate.give(w)

  async def waiter(name, cancel_after=None):
    held.wait(5)
    task = asyncio.ensure_future(gate.take())
    if cancel_after is not None:
      await asyncio.sleep(cancel_after)
      task.cancel()
      with pytest.raises(asyncio.CancelledError):
        await task
      order.append((name, "cancelled"))
      return
    w = await asyncio.wait_for(task, 10)
    order.append((name, w))
    gate.give(w)

  threads = [on_loop(holder())]
  held.wait(5)
  threads.append(on_loop(waiter("c", cancel_after=0.05)))   # waits, then gives up
  time.sleep(0.1)
  threads.append(on_loop(waiter("b")))
  for t, _ in threads:
    t.join(15)
    assert not t.is_alive()
  assert order == [("a", "w0"), ("c", "cancelled"), ("b", "w0")]
  assert asyncio.run(asyncio.wait_for(gate.take(), 5)) == "w0"   # given back, not lost
