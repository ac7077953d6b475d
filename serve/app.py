"""The OpenAI-compatible ASGI app (FastAPI) over :class:`serve.engine.Engine`.

Routes: POST /v1/chat/completions, GET /v1/models, GET /health, GET /metrics (Prometheus text).

Choices:

* Bodies are validated by hand (not pydantic models) so every bad input gets an OpenAI-style
  ``{"error": {"message", "type", "param", "code"}}`` body with status 400: malformed JSON, a
  missing or mistyped field, an invalid or uncompilable schema, an unknown tool in tool_choice,
  a prompt over capacity, max_tokens <= 0.  Only an engine failure is a 5xx.
* ``temperature`` defaults to 0 (greedy), not OpenAI's 1: reproducible answers.
* ``tools`` with ``tool_choice`` absent, "auto" or "required" constrain the answer to the
  tool-call grammar (one to eight calls): a small model under a grammar that also allowed free
  text would rarely call, so "auto" behaves like "required" here.  A named function restricts
  the grammar to that tool; "none" decodes free text.  Chat templates that ignore ``tools`` get
  the tools described in a system message (as ``pask-jax generate`` does).  The answer is parsed
  with ``parse_calls`` into ``message.tool_calls`` (finish_reason "tool_calls").
* ``response_format`` {type: json_schema} compiles the schema with XGrammar ({type: json_object}
  uses the schema ``{"type": "object"}``); tools and response_format together are refused.
* ``usage`` carries the OpenAI counts plus ``pask``: the request's ledger (prompt/decode KV
  payload in bits, measured B, R/L/H action counts per layer group and in total).
* Streaming (SSE): text deltas as they decode; with tools the call is sent as one
  ``tool_calls`` delta at the end (the JSON is only parseable when complete); the final chunk
  carries finish_reason and usage; then ``data: [DONE]``.
* A client that disconnects (stream or not) cancels its request: the engine frees its slot and
  pages at the next iteration.
"""
from __future__ import annotations

import asyncio
import json
import math
import threading
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from pask_jax import tags as T
from pask_jax.decode import Tracker
from serve.engine import Engine, Request

ROLES = ("system", "user", "assistant", "tool", "developer")


class BadRequest(Exception):
  def __init__(self, message: str, param: str | None = None, code: str | None = None,
               status: int = 400):
    super().__init__(message)
    self.message, self.param, self.code, self.status = message, param, code, status


def error_body(message: str, kind: str = "invalid_request_error", param=None, code=None) -> dict:
  return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _err(e: BadRequest) -> JSONResponse:
  return JSONResponse(error_body(e.message, param=e.param, code=e.code), status_code=e.status)


def _finite(x):
  """JSON has no NaN: ratios of empty requests become null."""
  if isinstance(x, float) and not math.isfinite(x):
    return None
  if isinstance(x, dict):
    return {k: _finite(v) for k, v in x.items()}
  return x


def _num(body: dict, name: str, default, lo: float, hi: float, integer: bool = False):
  v = body.get(name)
  if v is None:
    return default
  if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
    raise BadRequest(f"'{name}' must be {'an integer' if integer else 'a number'}", name)
  if not lo <= v <= hi:
    raise BadRequest(f"'{name}' must be in [{lo}, {hi}], got {v}", name)
  return v


def _text(content, where: str) -> str:
  if content is None or isinstance(content, str):
    return content or ""
  if isinstance(content, list):
    parts = []
    for p in content:
      if not (isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)):
        raise BadRequest("only text content parts are supported", where)
      parts.append(p["text"])
    return "".join(parts)
  raise BadRequest("'content' must be a string or a list of text parts", where)


def _messages(body: dict) -> list[dict]:
  msgs = body.get("messages")
  if not isinstance(msgs, list) or not msgs:
    raise BadRequest("'messages' must be a non-empty list", "messages",
                     "missing_required_parameter" if msgs is None else None)
  out = []
  for i, m in enumerate(msgs):
    where = f"messages[{i}]"
    if not isinstance(m, dict) or m.get("role") not in ROLES:
      raise BadRequest(f"{where} needs a 'role' in {ROLES}", where)
    text = _text(m.get("content"), where + ".content")
    if m["role"] == "assistant" and m.get("tool_calls"):
      # Earlier calls go back into the transcript as the JSON the model would have written.
      if not isinstance(m["tool_calls"], list):
        raise BadRequest("'tool_calls' must be a list", where + ".tool_calls")
      calls = [{"name": c["function"].get("name"), "arguments": c["function"].get("arguments")}
               for c in m["tool_calls"] if isinstance(c, dict) and isinstance(c.get("function"), dict)]
      text = (text + "\n" if text else "") + json.dumps(calls)
    out.append({"role": "system" if m["role"] == "developer" else m["role"], "content": text})
  return out


class Preparer:
  """Validates a chat-completions body and builds the engine request (prompt ids and labels,
  grammar matcher, adapter).  Runs in worker threads; grammar compilation is serialized."""

  def __init__(self, engine: Engine, tokenizer, cfg, default_max_tokens: int = 256):
    self.engine, self.tok, self.cfg = engine, tokenizer, cfg
    from pask_jax import policy as P
    self.state_vocab = P.state_vocab(engine.policy)   # parser-state ids of the reserve Γ
    self.default_max_tokens = default_max_tokens
    self.lock = threading.Lock()
    self._gc = None

  @property
  def gc(self):
    from pask_jax.grammar import GrammarCompiler
    if self._gc is None:
      self._gc = GrammarCompiler(self.tok, self.cfg.vocab_size)
    return self._gc

  def __call__(self, body: Any) -> tuple[Request, dict]:
    from pask_jax.grammar import (DEFAULT_STYLE, GrammarError, normalize_tools, tool_call_grammar,
                                  tools_system_prompt)
    from pask_jax.grammar.prompt_spans import label_prompt
    if not isinstance(body, dict):
      raise BadRequest("the request body must be a JSON object")
    if not isinstance(body.get("model"), str):
      raise BadRequest("'model' must be a string", "model", "missing_required_parameter")
    messages = _messages(body)
    if body.get("n", 1) != 1:
      raise BadRequest("only n=1 is supported", "n")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
      raise BadRequest("'stream' must be a boolean", "stream")
    # Default greedy (OpenAI's default is 1): reproducible answers from a small model.
    temperature = float(_num(body, "temperature", 0.0, 0, 2))
    top_p = float(_num(body, "top_p", 1.0, 0, 1))
    if top_p <= 0:
      raise BadRequest("'top_p' must be > 0", "top_p")
    seed = int(_num(body, "seed", 0, -2**63, 2**64 - 1, integer=True)) % 2**32
    mt_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _num(body, mt_name, None, -2**31, 2**31, integer=True)
    if max_tokens is not None and max_tokens <= 0:
      raise BadRequest(f"'{mt_name}' must be positive, got {max_tokens}", mt_name)
    tools, fmt, grammar = body.get("tools"), None, None
    choice = body.get("tool_choice")
    rf = body.get("response_format")
    if tools is not None and choice != "none" and isinstance(rf, dict) \
        and rf.get("type", "text") != "text":
      raise BadRequest("tools and response_format cannot be combined", "response_format")
    try:
      if tools is not None and choice != "none":
        if not isinstance(tools, list) or not tools:
          raise BadRequest("'tools' must be a non-empty list", "tools")
        try:
          tools = normalize_tools(tools)
        except GrammarError as e:
          raise BadRequest(str(e), "tools") from None
        if isinstance(choice, dict):
          name = (choice.get("function") or {}).get("name")
          keep = [t for t in tools if t["name"] == name]
          if not keep:
            raise BadRequest(f"tool_choice names an unknown tool {name!r}", "tool_choice")
          tools = keep
        elif choice not in (None, "auto", "required"):
          raise BadRequest("tool_choice must be 'none', 'auto', 'required' or a function",
                           "tool_choice")
        fmt, indent = DEFAULT_STYLE.get(self.cfg.arch, ("json_list", None))
        with self.lock:
          grammar = tool_call_grammar(self.gc, tools, fmt, indent=indent)
      elif tools is not None:
        tools = None   # tool_choice "none": free text, tools not shown
      if rf is not None:
        grammar = self._response_format(rf)
    except GrammarError as e:
      raise BadRequest(str(e), "response_format" if rf is not None else "tools",
                       "invalid_schema") from None
    takes_tools = bool(self.tok.chat_template) and "tools" in self.tok.chat_template
    if tools and not takes_tools:
      messages.insert(0, {"role": "system", "content": tools_system_prompt(tools, fmt)})
    try:
      text = self.tok.apply_chat_template(messages, tools=tools if takes_tools else None)
    except Exception as e:  # noqa: BLE001 — a template may raise on odd role orders
      raise BadRequest(f"the chat template rejected these messages: {e}", "messages") from None
    ids, tags = label_prompt(self.tok, text)
    n = len(ids)
    room = self.engine.context - n
    if max_tokens is None:
      if room <= 0:
        raise BadRequest(f"the prompt has {n} tokens; the server's context is "
                         f"{self.engine.context}", "messages", "context_length_exceeded")
      max_tokens = min(self.default_max_tokens, room)
    why = self.engine.fits_ever(n, max_tokens)
    if why:
      raise BadRequest(why, "messages", "context_length_exceeded")
    tracker = Tracker(grammar)
    if tools and grammar is not None:
      from pask_jax.grammar.fc_adapter import FCAdapter
      tracker = Tracker(grammar, FCAdapter(grammar, self.tok, vocab=self.state_vocab))
    req = Request(ids=ids, tags=tags, max_tokens=max_tokens, tracker=tracker,
                  temperature=temperature, top_p=top_p, seed=seed)
    return req, {"stream": stream, "tools": bool(tools), "fmt": fmt,
                 "include_usage": bool((body.get("stream_options") or {}).get("include_usage",
                                                                               True))}

  def _response_format(self, rf):
    if not isinstance(rf, dict):
      raise BadRequest("'response_format' must be an object", "response_format")
    kind = rf.get("type")
    if kind == "text":
      return None
    if kind == "json_object":
      schema = {"type": "object"}
    elif kind == "json_schema":
      js = rf.get("json_schema")
      if not isinstance(js, dict) or not isinstance(js.get("schema"), dict):
        raise BadRequest("response_format.json_schema.schema must be an object",
                         "response_format", "invalid_schema")
      schema = js["schema"]
      try:
        import jsonschema   # a schema that is not a schema is refused before XGrammar sees it
        jsonschema.validators.validator_for(schema).check_schema(schema)
      except ImportError:
        pass
      except Exception as e:  # noqa: BLE001 — jsonschema.SchemaError and friends
        raise BadRequest(f"invalid JSON schema: {str(e).splitlines()[0]}", "response_format",
                         "invalid_schema") from None
    else:
      raise BadRequest("response_format.type must be text, json_object or json_schema",
                       "response_format")
    with self.lock:
      return self.gc.json_schema(schema)


def _usage(result: dict) -> dict:
  led = _finite(result["ledger"])
  totals = {a: sum(g[a] for part in ("prefill_counts", "decode_counts")
                   for g in led[part].values()) for a in T.ACTION_NAMES}
  n_p, n_c = result["prompt_tokens"], len(result["tokens"])
  return {"prompt_tokens": n_p, "completion_tokens": n_c, "total_tokens": n_p + n_c,
          "pask": {"prompt_kv_bits": led["prefill_bits"], "decode_kv_bits": led["decode_bits"],
                   "full_kv_bits": led["full_kv_bits"], "measured_B": led["measured_B"],
                   "prefill_B": led["prefill_B"], "decode_B": led["decode_B"],
                   "actions": totals, "prefill_counts": led["prefill_counts"],
                   "decode_counts": led["decode_counts"], "overflow": result["overflow"]}}


def _message(result: dict, meta: dict) -> tuple[dict, str]:
  """(assistant message, finish_reason) of a finished request."""
  from pask_jax.grammar import parse_calls
  text, finish = result["text"], result["finish"]
  if meta["tools"]:
    try:
      calls = parse_calls(text, meta["fmt"])
    except ValueError:
      calls = []   # cut by max_tokens: the text is returned as content
    if calls:
      tc = [{"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
             "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}}
            for c in calls]
      return {"role": "assistant", "content": None, "tool_calls": tc}, (
          "tool_calls" if finish == "stop" else finish)
  return {"role": "assistant", "content": text}, finish


def create_app(engine: Engine, tokenizer, cfg, *, model_name: str = "pask-jax",
               default_max_tokens: int = 256) -> FastAPI:
  app = FastAPI(title="pask-jax", docs_url=None, redoc_url=None)
  prep = Preparer(engine, tokenizer, cfg, default_max_tokens)
  http = {"requests": 0, "bad_requests": 0, "server_errors": 0, "disconnects": 0}
  app.state.engine, app.state.http = engine, http

  @app.exception_handler(Exception)
  async def _unhandled(request, exc):   # a bug in a handler: 500 with an OpenAI body
    http["server_errors"] += 1
    return JSONResponse(error_body(f"internal error: {exc!r}", "server_error"), status_code=500)

  @app.get("/health")
  async def health():
    if not engine.alive:
      return JSONResponse({"status": "error", "detail": repr(engine.crashed)}, status_code=503)
    return {"status": "ok"}

  @app.get("/v1/models")
  async def models():
    return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                        "owned_by": "pask-jax"}]}

  @app.get("/metrics")
  async def metrics():
    return PlainTextResponse(_prometheus(engine, http),
                             media_type="text/plain; version=0.0.4; charset=utf-8")

  @app.post("/v1/chat/completions")
  async def chat(request: HTTPRequest):
    http["requests"] += 1
    try:
      raw = await request.body()
      try:
        body = json.loads(raw)
      except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"malformed JSON body: {e}") from None
      try:
        req, meta = await asyncio.to_thread(prep, body)
      except (KeyError, TypeError, AttributeError, ValueError) as e:
        # A shape the checks above did not foresee is still the client's input, not our 5xx.
        raise BadRequest(f"invalid request: {e!r}") from None
      if not engine.alive:
        return JSONResponse(error_body("the engine is not running", "server_error"), 503)
      loop = asyncio.get_running_loop()
      q: asyncio.Queue = asyncio.Queue()
      req.emit = lambda kind, payload: loop.call_soon_threadsafe(q.put_nowait, (kind, payload))
      try:
        engine.submit(req)
      except ValueError as e:
        raise BadRequest(str(e), "messages", "context_length_exceeded") from None
    except BadRequest as e:
      http["bad_requests"] += 1
      return _err(e)
    cid, created = "chatcmpl-" + uuid.uuid4().hex[:24], int(time.time())
    if meta["stream"]:
      return StreamingResponse(_stream(req, q, meta, cid, created, model_name, http),
                               media_type="text/event-stream",
                               headers={"Cache-Control": "no-cache"})
    kind = None
    try:
      while True:
        try:
          kind, payload = await asyncio.wait_for(q.get(), timeout=0.25)
        except asyncio.TimeoutError:
          if await request.is_disconnected():
            http["disconnects"] += 1
            req.cancel()
            return JSONResponse(error_body("client disconnected"), status_code=499)
          continue
        if kind == "error":
          http["server_errors"] += 1
          return JSONResponse(error_body(payload, "server_error"), status_code=500)
        if kind == "done":
          break
    finally:
      if kind != "done":
        req.cancel()
    msg, finish = _message(payload, meta)
    return {"id": cid, "object": "chat.completion", "created": created, "model": model_name,
            "choices": [{"index": 0, "message": msg, "finish_reason": finish, "logprobs": None}],
            "usage": _usage(payload)}

  return app


async def _stream(req: Request, q: asyncio.Queue, meta: dict, cid: str, created: int,
                  model_name: str, http: dict):
  def chunk(delta: dict, finish=None, usage=None) -> str:
    c = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model_name,
         "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}
    if usage is not None:
      c["usage"] = usage
    return f"data: {json.dumps(c)}\n\n"

  finished = False
  try:
    yield chunk({"role": "assistant", "content": ""})
    while True:
      kind, payload = await q.get()
      if kind == "delta":
        if not meta["tools"]:
          yield chunk({"content": payload})
      elif kind == "error":
        finished = True
        http["server_errors"] += 1
        yield f"data: {json.dumps(error_body(payload, 'server_error'))}\n\n"
        return
      else:   # done (a cancelled request never reaches here: its client is gone)
        finished = True
        msg, finish = _message(payload, meta)
        if meta["tools"]:
          if msg.get("tool_calls"):
            yield chunk({"tool_calls": [dict(tc, index=i) for i, tc in enumerate(msg["tool_calls"])]})
          else:
            yield chunk({"content": msg["content"]})
        yield chunk({}, finish, _usage(payload) if meta["include_usage"] else None)
        yield "data: [DONE]\n\n"
        return
  finally:
    if not finished:   # the client went away mid-stream (the generator was closed/cancelled)
      http["disconnects"] += 1
      req.cancel()


def _prometheus(engine: Engine, http: dict) -> str:
  s = engine.snapshot()
  g = lambda k: s.get(k, 0)
  lines = []

  def metric(name, kind, help_, samples):
    lines.append(f"# HELP pask_{name} {help_}")
    lines.append(f"# TYPE pask_{name} {kind}")
    for labels, v in samples:
      lab = "{" + ",".join(f'{k}="{x}"' for k, x in labels.items()) + "}" if labels else ""
      lines.append(f"pask_{name}{lab} {v}")

  metric("http_requests_total", "counter", "chat completion requests received",
         [({}, http["requests"])])
  metric("http_bad_requests_total", "counter", "requests refused with 4xx", [({}, http["bad_requests"])])
  metric("http_server_errors_total", "counter", "requests answered with 5xx",
         [({}, http["server_errors"])])
  metric("client_disconnects_total", "counter", "clients gone before their answer",
         [({}, http["disconnects"])])
  metric("requests_total", "counter", "requests finished by the engine, by outcome",
         [({"outcome": o}, g("requests_" + o)) for o in ("stop", "length", "cancelled", "error")])
  metric("prompt_tokens_total", "counter", "prompt tokens of finished requests", [({}, g("prompt_tokens"))])
  metric("completion_tokens_total", "counter", "generated tokens of finished requests",
         [({}, g("completion_tokens"))])
  metric("tpot_seconds_sum", "counter", "sum of per-request mean time per output token",
         [({}, g("tpot_s_sum"))])
  metric("tpot_seconds_count", "counter", "requests in tpot_seconds_sum", [({}, g("tpot_count"))])
  metric("decode_steps_total", "counter", "batched decode steps", [({}, g("decode_steps"))])
  metric("decode_step_seconds_total", "counter", "time in decode steps", [({}, g("decode_step_s"))])
  metric("decode_rows_total", "counter", "active rows summed over decode steps", [({}, g("decode_rows"))])
  metric("prefill_seconds_total", "counter", "time in prefills", [({}, g("prefill_s"))])
  metric("preemptions_total", "counter",
         "running requests preempted because a KV pool ran dry (re-prefilled later)",
         [({}, g("preemptions"))])
  metric("admission_blocked_total", "counter",
         "engine iterations where the queue head waited for pages while a slot was free",
         [({"reason": "pages"}, g("admission_blocked_pages"))])
  metric("queue_depth", "gauge", "requests waiting for a slot and pages", [({}, g("queue_depth"))])
  metric("running", "gauge", "requests holding a slot", [({}, g("running"))])
  metric("slots", "gauge", "decode batch slots", [({}, g("slots"))])
  for tier, key in (("bf16", "hi"), ("int4", "lo")):
    total, free = g(key + "_total"), g(key + "_free")
    metric(f"pages_used_{tier}", "gauge",
           f"{tier} pool pages held by requests (its scarcest layer group)",
           [({"pool": tier}, total - free)])
    metric(f"pages_free_{tier}", "gauge", f"{tier} pool pages free", [({"pool": tier}, free)])
  full = g("full_kv_bits")
  metric("measured_B", "gauge", "aggregate measured B of finished requests (payload / Full KV)",
         [({}, g("payload_bits") / full if full else "NaN")])
  metric("kv_payload_bits_total", "counter", "scheduled KV payload of finished requests",
         [({}, g("payload_bits"))])
  metric("kv_full_bits_total", "counter", "Full-KV payload for the same lengths", [({}, full)])
  metric("actions_total", "counter", "R/L/H actions over prompt and decode tokens and groups",
         [({"action": a}, g("actions_" + a)) for a in T.ACTION_NAMES])
  metric("overflow_total", "counter", "requests whose cache dropped an entry (should be 0)",
         [({}, g("overflow"))])
  metric("engine_up", "gauge", "1 while the engine thread runs", [({}, int(engine.alive))])
  return "\n".join(lines) + "\n"


def build(model: str | None = None, policy: str = "all-high", *, slots: int = 4,
          context: int = 1024, page: int = 16, hi_pages: int | None = None,
          lo_pages: int | None = None, kv_memory_gb: float | None = None,
          gpu_memory_utilization: float | None = None, kv_mix=None,
          preemption: str = "replay", dtype: str = "auto", default_max_tokens: int = 256,
          warmup: bool = True):
  """Load a model, resolve a policy, start an engine; -> (app, engine).  Pool sizing:
  :func:`serve.engine.size_pools` (``engine.sizing.describe()`` says what was chosen)."""
  import jax
  import jax.numpy as jnp

  from models import load
  from pask_jax import policy as pol_mod
  dt = {"auto": jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16,
        "float32": jnp.float32, "bfloat16": jnp.bfloat16}[dtype]
  m = load(model, dtype=dt)
  if m.tokenizer is None:
    raise ValueError("this checkpoint has no tokenizer.json; the server needs one")
  pol = pol_mod.resolve(policy, m.cfg, tokenizer_hash=m.tokenizer.hash())
  engine = Engine(m.model, m.tokenizer, pol, slots=slots, context=context, page=page,
                  hi_pages=hi_pages, lo_pages=lo_pages,
                  kv_bytes=None if kv_memory_gb is None else int(kv_memory_gb * 1e9),
                  gpu_memory_utilization=gpu_memory_utilization,
                  mix=None if kv_mix is None else tuple(kv_mix), preemption=preemption)
  if warmup:
    engine.warmup()
  engine.start()
  name = model or "smollm2-135m-instruct"
  return create_app(engine, m.tokenizer, m.cfg, model_name=name,
                    default_max_tokens=default_max_tokens), engine
