"""The OpenAI-compatible ASGI app (FastAPI) over :class:`serve.engine.Engine`.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (plain text, no chat template),
``GET /v1/models``, ``GET /v1/models/{id}``, ``POST /tokenize`` and ``POST /detokenize``
(vLLM's shapes), ``GET /health``, ``GET /metrics`` (prometheus_client; :mod:`serve.metrics`).
With ``api_key`` every route but ``/health`` and ``/metrics`` needs ``Authorization: Bearer``
(:class:`serve.guard.Auth`).  ``chat_template`` replaces the model's template;
``tool_call_parser`` picks the tool-call format (:data:`TOOL_CALL_PARSERS`).

The request path, in order (nothing expensive before the length check):

1. :class:`serve.guard.Guard`: body size, JSON nesting depth, lone surrogates, error boundary;
   then, with an API key, :class:`serve.guard.Auth` (401).
2. FastAPI validates the body against :class:`serve.protocol.ChatCompletionRequest` (one
   pydantic layer); every 4xx — validation, 404, 405, 413, 429 — has an OpenAI-style body
   ``{"error": {"message", "type", "param", "code"}}``.
3. ``model`` must be a served name (``--served-model-name``), else 404 ``model_not_found``.
4. The transcript is rendered with the chat template (:func:`pask_jax.prompt.render`, the path
   the Python API and the BFCL harness use) and tokenized (worker threads); a prompt
   that cannot fit (prompt + max_tokens > context, or more pages than the pools hold) is
   refused here, before any grammar is compiled or the prompt labelled.
5. The grammar (``response_format`` or the tool-call grammar) comes from
   :class:`serve.grammars.GrammarPool`: cached, compiled in worker processes, time-limited.
6. Prompt-span labels (linear time); the prepared :class:`pask_jax.prompt.Prompt` becomes the
   engine's request (``Request.of``).

Choices:

* ``temperature`` defaults to 0 (greedy), not OpenAI's 1: reproducible answers.
* ``tools``: ``tool_choice`` "auto" (the default with tools) lets the model answer in text or call:
  free text until the format's trigger (XGrammar's triggered structural tags), then the call
  block is constrained by the tools' schemas; "required" constrains the whole answer to one or
  more calls; a named function to exactly one call of it; "none" decodes free text (the tools
  still reach a chat template that renders them, as vLLM does).  ``parallel_tool_calls: false``
  allows at most one call.  Templates that ignore ``tools`` get them described in a system
  message.  Calls come back in ``message.tool_calls`` (finish_reason "tool_calls"), the text
  around them in ``content``.
* Past turns: assistant ``tool_calls`` reach the template with ``arguments`` parsed into objects
  (as vLLM does: tool templates expect mappings, so nothing is encoded twice; arguments that are
  not a JSON object are a 400); a template that cannot render ``tool_calls`` gets the calls
  written into the assistant text in the model's format.  A ``role: "tool"`` message must answer
  an earlier call id (as OpenAI requires) and reaches the template with its ``tool_call_id``
  (and the function ``name``).
* ``stop`` works on the text (also across token boundaries), is not included in the output,
  and ends with finish_reason "stop"; it is refused together with a grammar that constrains the
  whole answer (``response_format``, ``tool_choice`` "required" or named), whose output it would
  cut into something invalid.
* ``logprobs`` / ``top_logprobs`` (<= 20): log-softmax of the grammar-masked logits before
  temperature, computed on the device in the sampling step.  Entries cover the tokens of the
  returned text (a stop sequence's tokens are dropped with it).
* ``usage`` carries the OpenAI counts plus ``pask``: the request's ledger (prompt/decode KV
  payload in bits, measured B, R/L/H action counts per layer group and in total).  Streams carry
  usage only with ``stream_options.include_usage`` (a last chunk with empty ``choices``).
* A client that disconnects (stream or not) cancels its request: the engine frees its slot and
  pages at the next iteration.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pask_jax.options import DEFAULT_MAX_TOKENS, ENGINE
from pask_jax.prompt import Prompt, load_chat_template, with_chat_template
from pask_jax.tracker import Tracker
from serve.engine import Engine, Request, check_lo_format
from serve.guard import Auth, Guard
from serve.metrics import Metrics
from serve.prepare import TOOL_CALL_PARSERS, BadRequest, Preparer
from serve.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                            TokenizeRequest, error_body, validation_error)
from serve.respond import Responder, observe, sse_chunks, stream_text, usage_of

def create_app(engine: Engine, tokenizer, cfg, *, model_name: str | list[str] = "pask-jax",
               default_max_tokens: int = DEFAULT_MAX_TOKENS, grammars=None,
               max_body_bytes: int = 2 << 20, max_json_depth: int = 64,
               grammar_timeout_s: float = 10.0,
               api_key: str | list[str] | None = None, chat_template: str | None = None,
               tool_call_parser: str | None = None) -> FastAPI:
  """The app.  ``model_name``: the served name(s); responses use the first.  ``grammars``: a
  :class:`serve.grammars.GrammarPool` (default: one is started here).  ``api_key``: the key(s)
  a request must bear (:class:`serve.guard.Auth`).  ``chat_template``: a template (text) that
  replaces the model's.  ``tool_call_parser``: a name of :data:`TOOL_CALL_PARSERS` (None: the
  model family's format)."""
  names = [model_name] if isinstance(model_name, str) else list(model_name)
  if tool_call_parser is not None and tool_call_parser not in TOOL_CALL_PARSERS:
    raise ValueError(f"unknown tool-call parser {tool_call_parser!r}; choose one of "
                     f"{', '.join(TOOL_CALL_PARSERS)}")
  if chat_template is not None:
    tokenizer = with_chat_template(tokenizer, chat_template)
  keys = [api_key] if isinstance(api_key, str) else list(api_key or ())
  if grammars is None:
    from serve.grammars import GrammarPool
    grammars = GrammarPool(tokenizer, cfg.vocab_size, timeout_s=grammar_timeout_s)
  metrics = Metrics(engine, grammars, model_name=names[0])

  @contextlib.asynccontextmanager
  async def lifespan(app):
    yield
    grammars.close()   # the compile workers go with the server

  app = FastAPI(title="pask-jax", docs_url=None, redoc_url=None, openapi_url=None,
                lifespan=lifespan)
  if keys:   # inside the Guard: it reads the body first, so the connection stays usable
    app.add_middleware(Auth, keys=keys)
  app.add_middleware(Guard, max_body_bytes=max_body_bytes, max_json_depth=max_json_depth,
                     on_error=lambda e: metrics.http.labels("500").inc())
  prep = Preparer(engine, tokenizer, cfg, grammars, default_max_tokens=default_max_tokens,
                  tool_format=TOOL_CALL_PARSERS.get(tool_call_parser), template=chat_template)
  app.state.engine, app.state.prep, app.state.grammars = engine, prep, grammars
  app.state.metrics = metrics

  def err(status: int, body: dict, headers=None) -> JSONResponse:
    return JSONResponse(body, status_code=status, headers=headers)

  @app.exception_handler(RequestValidationError)
  async def _invalid(request, exc):
    body, status = validation_error(list(exc.errors()))
    if request.url.path in ("/v1/chat/completions", "/v1/completions"):
      metrics.http.labels(str(status)).inc()
    return err(status, body)

  @app.exception_handler(StarletteHTTPException)
  async def _http(request, exc):
    if exc.status_code == 404:
      msg = f"Invalid URL ({request.method} {request.url.path})"
    elif exc.status_code == 405:
      msg = f"Method {request.method} is not allowed for {request.url.path}"
    else:
      msg = str(exc.detail)
    return err(exc.status_code, error_body(msg, code={404: "not_found",
                                                      405: "method_not_allowed"}.get(
                                                          exc.status_code)),
               getattr(exc, "headers", None))

  @app.exception_handler(BadRequest)
  async def _bad(request, exc: BadRequest):
    metrics.http.labels(str(exc.status)).inc()
    return err(exc.status, error_body(exc.message, exc.kind, exc.param, exc.code))

  @app.get("/health")
  async def health():
    if not engine.alive:
      return JSONResponse({"status": "error", "detail": repr(engine.crashed)}, status_code=503)
    return {"status": "ok"}

  def card(name):
    return {"id": name, "object": "model", "created": 0, "owned_by": "pask-jax",
            "max_model_len": engine.context}

  @app.get("/v1/models")
  async def models():
    return {"object": "list", "data": [card(n) for n in names]}

  @app.get("/v1/models/{name:path}")
  async def model(name: str):
    if name not in names:
      raise BadRequest(f"The model `{name}` does not exist.", "model", "model_not_found", 404)
    return card(name)

  @app.get("/metrics")
  async def metrics_route(request: HTTPRequest):
    data, ctype = metrics.render(request.headers.get("accept", ""))
    return Response(data, media_type=ctype)

  def check_model(name: str | None) -> None:
    if name is not None and name not in names:
      raise BadRequest(f"The model `{name}` does not exist.", "model", "model_not_found", 404)

  def submit(req: Request, param: str) -> asyncio.Queue:
    """Hand ``req`` to the engine; its events arrive on the returned queue."""
    if not engine.alive:
      raise BadRequest("the engine is not running", None, None, 503, "server_error")
    loop = asyncio.get_running_loop()
    q: asyncio.Queue = asyncio.Queue()
    req.emit = lambda kind, payload: loop.call_soon_threadsafe(q.put_nowait, (kind, payload))
    try:
      engine.submit(req)
    except ValueError as e:
      raise BadRequest(str(e), param, "context_length_exceeded") from None
    return q

  async def outcome(req: Request, q: asyncio.Queue, request: HTTPRequest):
    """The engine's result of a non-streamed request, or the error response (client gone: 499,
    engine failure: 500)."""
    kind, payload = None, None
    try:
      while True:
        try:
          kind, payload = await asyncio.wait_for(q.get(), timeout=0.25)
        except asyncio.TimeoutError:
          if await request.is_disconnected():
            metrics.disconnects.inc()
            req.cancel()
            return err(499, error_body("client disconnected"))
          continue
        if kind == "error":
          metrics.http.labels("500").inc()
          return err(500, error_body(payload, "server_error"))
        if kind == "done":
          return payload
    finally:
      if kind != "done":
        req.cancel()

  @app.post("/v1/chat/completions")
  async def chat(body: ChatCompletionRequest, request: HTTPRequest):
    t_arrive = time.perf_counter()
    check_model(body.model)
    if not engine.alive:
      raise BadRequest("the engine is not running", None, None, 503, "server_error")
    p = prep.plan(body)
    text, ids, offsets, max_tokens = await asyncio.to_thread(prep.prompt, p, body)
    grammar = None
    if p.job is not None:
      from serve.grammars import CompileBusy, CompileError
      try:
        grammar = await grammars.get(p.job)
      except CompileError as e:
        param = "tools" if p.job["kind"] == "tools" else "response_format"
        raise BadRequest(str(e), param, "invalid_schema") from None
      except CompileBusy as e:
        raise BadRequest(str(e), None, "rate_limit_exceeded", 429, "rate_limit_error") from None
    tags = await asyncio.to_thread(prep.labels, text, offsets)
    prompt = Prompt(text, ids, tags, grammar, p.tools, p.fmt)
    req = Request.of(prompt, max_tokens, prep.tracker(grammar, p),
                     temperature=float(body.temperature or 0.0),
                     top_p=float(body.top_p if body.top_p is not None else 1.0),
                     seed=int(body.seed or 0) % 2**32, stop=tuple(body.stop or ()),
                     logprobs=(body.top_logprobs or 0) if body.logprobs else None)
    q = submit(req, "messages")
    resp = Responder(prep.tok, p.fmt, p.calls)
    meta = {"id": "chatcmpl-" + uuid.uuid4().hex[:24], "created": int(time.time()),
            "model": names[0], "t_arrive": t_arrive, "logprobs": body.logprobs}
    if body.stream:
      usage = bool(body.stream_options and body.stream_options.include_usage)
      metrics.http.labels("200").inc()
      return StreamingResponse(sse_chunks(req, q, resp, meta, usage, metrics),
                               media_type="text/event-stream",
                               headers={"Cache-Control": "no-cache"})
    payload = await outcome(req, q, request)
    if isinstance(payload, Response):
      return payload
    observe(metrics, payload, t_arrive)
    metrics.http.labels("200").inc()
    payload["want_logprobs"] = body.logprobs
    msg, finish = resp.message(payload)
    return {"id": meta["id"], "object": "chat.completion", "created": meta["created"],
            "model": names[0], "system_fingerprint": None,
            "choices": [{"index": 0, "message": msg, "finish_reason": finish,
                         "logprobs": resp.logprobs(payload)}],
            "usage": usage_of(payload)}

  @app.post("/v1/completions")
  async def completions(body: CompletionRequest, request: HTTPRequest):
    t_arrive = time.perf_counter()
    check_model(body.model)
    if not engine.alive:
      raise BadRequest("the engine is not running", None, None, 503, "server_error")
    text, ids, offsets, max_tokens = await asyncio.to_thread(prep.completion, body)
    tags = await asyncio.to_thread(prep.labels, text, offsets)
    req = Request.of(Prompt(text, ids, tags), max_tokens, Tracker(None),
                     temperature=float(body.temperature or 0.0),
                     top_p=float(body.top_p if body.top_p is not None else 1.0),
                     seed=int(body.seed or 0) % 2**32, stop=tuple(body.stop or ()),
                     logprobs=body.logprobs)
    q = submit(req, "prompt")
    resp = Responder(prep.tok, "json_list", False)
    echo = (body.prompt if isinstance(body.prompt, str) else prep.tok.decode(ids)) \
        if body.echo else ""
    meta = {"id": "cmpl-" + uuid.uuid4().hex[:24], "created": int(time.time()),
            "model": names[0], "t_arrive": t_arrive, "logprobs": body.logprobs, "echo": echo}
    if body.stream:
      usage = bool(body.stream_options and body.stream_options.include_usage)
      metrics.http.labels("200").inc()
      return StreamingResponse(stream_text(req, q, resp, meta, usage, metrics),
                               media_type="text/event-stream",
                               headers={"Cache-Control": "no-cache"})
    payload = await outcome(req, q, request)
    if isinstance(payload, Response):
      return payload
    observe(metrics, payload, t_arrive)
    metrics.http.labels("200").inc()
    payload["want_logprobs"] = body.logprobs
    return {"id": meta["id"], "object": "text_completion", "created": meta["created"],
            "model": names[0], "system_fingerprint": None,
            "choices": [{"index": 0, "text": echo + payload["text"],
                         "finish_reason": payload["finish"],
                         "logprobs": resp.text_logprobs(payload)}],
            "usage": usage_of(payload)}

  @app.post("/tokenize")
  async def tokenize(body: TokenizeRequest):
    check_model(body.model)
    if body.prompt is not None:
      text = body.prompt
    else:
      chat = ChatCompletionRequest.model_construct(model=names[0], messages=body.messages,
                                                   tools=body.tools)
      p = prep.plan(chat)
      text = await asyncio.to_thread(prep.render, p,
                                     add_generation_prompt=body.add_generation_prompt,
                                     continue_final_message=body.continue_final_message)
    ids = await asyncio.to_thread(prep.tokenize, text, body.add_special_tokens)
    strs = [prep.tok.tok.id_to_token(i) for i in ids] if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": engine.context, "tokens": ids,
            "token_strs": strs}

  @app.post("/detokenize")
  async def detokenize(body: DetokenizeRequest):
    check_model(body.model)
    ids = prep.check_ids(body.tokens, "tokens")
    return {"prompt": await asyncio.to_thread(prep.tok.decode, ids, False)}

  return app



def build(model: str | None = None, policy: str = ENGINE.policy, *, slots: int = ENGINE.slots,
          context: int = ENGINE.context, page: int = ENGINE.page, hi_pages: int | None = None,
          lo_pages: int | None = None, kv_memory_gb: float | None = None,
          gpu_memory_utilization: float | None = None, kv_mix=None,
          preemption: str = ENGINE.preemption, dtype: str = "auto",
          default_max_tokens: int = DEFAULT_MAX_TOKENS, warmup: bool = True,
          served_model_name: list[str] | None = None, max_body_bytes: int = 2 << 20,
          max_json_depth: int = 64, grammar_timeout_s: float = 10.0,
          prefill_chunk: int = ENGINE.prefill_chunk, prefill_share: float = ENGINE.prefill_share,
          api_key: str | list[str] | None = None, chat_template: str | None = None,
          tool_call_parser: str | None = None, center_keys: bool = True,
          lo_format: str = ENGINE.lo_format, lo_page: int | None = ENGINE.lo_page,
          tensor_parallel_size: int = ENGINE.tensor_parallel_size):
  """Load a model, resolve a policy, start an engine; -> (app, engine).  Pool sizing:
  :func:`serve.engine.size_pools` (``engine.sizing.describe()`` says what was chosen).  The
  engine options' defaults are ``pask-jax serve``'s and ``start_engine``'s
  (:data:`pask_jax.options.ENGINE`).
  ``chat_template``: a file path or a template (:func:`pask_jax.prompt.load_chat_template`, as
  the API's ``chat_template="..."``); the other options as for :func:`create_app`;
  ``center_keys``: :mod:`models.center` (default on); ``lo_format``, ``lo_page``: the INT4
  pool's storage format and rows per page (:class:`serve.engine.Engine`);
  ``tensor_parallel_size``: the first that many local devices (``pask_jax.mesh.serving_mesh``;
  the KV budget per device)."""
  import jax
  import jax.numpy as jnp

  from models import load
  from pask_jax import mesh as tp
  from pask_jax import policy as pol_mod
  from serve.grammars import GrammarPool
  if tool_call_parser is not None and tool_call_parser not in TOOL_CALL_PARSERS:
    raise ValueError(f"unknown tool-call parser {tool_call_parser!r}; choose one of "
                     f"{', '.join(TOOL_CALL_PARSERS)}")
  check_lo_format(lo_format, page, "auto", lo_page)   # before any weight loads
  tp.serving_mesh(tensor_parallel_size)               # the device count, before any weight loads
  template = None if chat_template is None else load_chat_template(chat_template)
  dt = {"auto": jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16,
        "float32": jnp.float32, "bfloat16": jnp.bfloat16}[dtype]
  m = load(model, dtype=dt, need_tokenizer=True,   # refused before any weight loads
           center_keys=center_keys)
  if m.tokenizer is None:
    raise ValueError("this checkpoint has no tokenizer.json; the server needs one")
  tok = m.tokenizer if template is None else with_chat_template(m.tokenizer, template)
  mesh = tp.serving_mesh(tensor_parallel_size, m.cfg)  # the heads split over the devices
  pol = pol_mod.resolve(policy, m.cfg, tokenizer_hash=m.tokenizer.hash())
  # The compile workers start (import XGrammar) while the engine compiles its step.
  grammars = GrammarPool(m.tokenizer, m.cfg.vocab_size, timeout_s=grammar_timeout_s)
  engine = Engine(m.model, m.tokenizer, pol, slots=slots, context=context, page=page,
                  hi_pages=hi_pages, lo_pages=lo_pages,
                  kv_bytes=None if kv_memory_gb is None else int(kv_memory_gb * 1e9),
                  gpu_memory_utilization=gpu_memory_utilization,
                  mix=None if kv_mix is None else tuple(kv_mix), preemption=preemption,
                  prefill_chunk=prefill_chunk, prefill_share=prefill_share,
                  lo_format=lo_format, lo_page=lo_page, mesh=mesh)
  if warmup:
    engine.warmup()
  engine.start()
  names = served_model_name or [model or "smollm2-135m-instruct"]
  app = create_app(engine, tok, m.cfg, model_name=names,
                   default_max_tokens=default_max_tokens, grammars=grammars,
                   max_body_bytes=max_body_bytes, max_json_depth=max_json_depth,
                   api_key=api_key, tool_call_parser=tool_call_parser)
  return app, engine
