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
import codecs
import contextlib
import copy
import json
import math
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pask_jax import actions as Act
from pask_jax.prompt import Prompt
from pask_jax.tracker import Tracker
from serve.engine import Engine, Request
from serve.guard import Auth, Guard
from serve.metrics import Metrics
from serve.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                            TokenizeRequest, error_body, validation_error)

MAX_CALLS = 8   # calls per answer with parallel_tool_calls (BFCL's parallel cases need a few)
# ``--tool-call-parser`` -> the format of pask_jax.grammar.toolcall that both the grammar and the
# parser of the answer follow.  ``hermes`` is vLLM's name for Qwen2.5's / Hermes'
# ``<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>`` blocks; the other two have no
# vLLM parser.  None: the measured per-family default (pask_jax.grammar.DEFAULT_STYLE).
TOOL_CALL_PARSERS = {"hermes": "tool_call_tags", "fenced_json": "fenced_json",
                     "json_list": "json_list"}


def load_chat_template(value: str) -> str:
  """``--chat-template``, resolved as vLLM does: a readable file is read; otherwise a value
  holding ``{``, ``}`` or a newline is the template itself (its ``\\n`` escapes decoded, so a
  template fits on one line).  ValueError with a one-line message otherwise."""
  try:
    with open(value, encoding="utf-8") as f:
      text = f.read()
  except (OSError, UnicodeDecodeError) as e:
    if any(c in value for c in "{}\n"):
      return codecs.decode(value, "unicode_escape") if value.isascii() else value
    why = e.strerror if isinstance(e, OSError) else "not UTF-8 text"
    raise ValueError(f"--chat-template {value!r} is neither a readable file ({why}) nor a "
                     "template (it has no '{')") from None
  if not text.strip():
    raise ValueError(f"--chat-template {value!r} is an empty file")
  return text


def with_chat_template(tokenizer, template: str):
  """A copy of ``tokenizer`` whose only (default) chat template is ``template``; ValueError if
  it cannot render a one-message conversation."""
  tok = copy.copy(tokenizer)
  tok.chat_template, tok.chat_templates = template, {"default": template}
  try:
    tok.apply_chat_template([{"role": "user", "content": "hi"}])
  except Exception as e:  # noqa: BLE001 — jinja2 raises many kinds; all are a bad template
    raise ValueError(f"--chat-template cannot render a one-message conversation: "
                     f"{_one_line(e)}") from None
  return tok


class BadRequest(Exception):
  def __init__(self, message: str, param: str | None = None, code: str | None = None,
               status: int = 400, kind: str = "invalid_request_error"):
    super().__init__(message)
    self.message, self.param, self.code, self.status, self.kind = (message, param, code, status,
                                                                   kind)


def _finite(x):
  """JSON has no NaN: ratios of empty requests become null."""
  if isinstance(x, float) and not math.isfinite(x):
    return None
  if isinstance(x, dict):
    return {k: _finite(v) for k, v in x.items()}
  return x


class Plan:
  """What a validated request turns into before the engine sees it."""

  def __init__(self):
    self.messages: list[dict] = []
    self.tools: list[dict] | None = None     # OpenAI tools as the user sent them (for templates)
    self.fmt, self.indent = None, None
    self.job: dict | None = None              # the grammar job (serve.grammars)
    self.calls = False                        # the answer is parsed for tool calls
    self.whole = False                        # the grammar constrains the whole answer


class Preparer:
  """Builds the engine request of a validated body (see the module docstring)."""

  def __init__(self, engine: Engine, tokenizer, cfg, grammars, *, default_max_tokens: int = 256,
               tool_format: str | None = None, template: str | None = None):
    from pask_jax import policy as P
    from pask_jax.prompt import style
    self.engine, self.tok, self.cfg, self.grammars = engine, tokenizer, cfg, grammars
    self.style = style(cfg.arch, tool_format)
    self.template = template   # a chat template (text) in place of the tokenizer's, or None
    self.vocab = min(cfg.vocab_size, len(tokenizer.token_bytes()))
    self.state_vocab = P.state_vocab(engine.policy)   # parser-state ids of the reserve Γ
    self.default_max_tokens = default_max_tokens
    self.takes_calls = "tool_calls" in (template or tokenizer.chat_template or "")
    # No token is longer than this many bytes: a text of n bytes has at least n / this tokens,
    # so an obviously over-long prompt is refused before it is tokenized.
    self.max_token_bytes = max(1, max(len(b) for b in tokenizer.token_bytes()))

  # --- 1. structure (cheap, on the event loop) --------------------------------------------

  def plan(self, body: ChatCompletionRequest) -> Plan:
    p = Plan()
    choice = body.tool_choice
    rf = body.response_format
    if body.tools is None and choice not in (None, "none"):
      raise BadRequest("'tool_choice' is only allowed when 'tools' are specified", "tool_choice")
    if body.tools is not None and not body.tools:
      raise BadRequest("'tools' must not be empty (omit it instead)", "tools")
    p.fmt, p.indent = self.style
    json_rf = rf is not None and rf.type != "text"
    if body.tools and choice != "none":
      if json_rf:
        raise BadRequest("'tools' and a JSON 'response_format' cannot be combined (use "
                         "tool_choice 'none' to answer in JSON)", "response_format")
      p.tools = [t.model_dump(exclude_none=True) for t in body.tools]
      names = [t.function.name for t in body.tools]
      if len(set(names)) != len(names):
        raise BadRequest("tool names must be unique", "tools")
      mode = "auto" if choice in (None, "auto") else "required"
      max_calls = 1 if body.parallel_tool_calls is False else MAX_CALLS
      only = None
      if choice not in (None, "auto", "required"):
        only = choice.function.name
        if only not in names:
          raise BadRequest(f"tool_choice names an unknown tool {only!r}", "tool_choice")
        max_calls = 1
      p.job = {"kind": "tools", "tools": p.tools, "only": only, "fmt": p.fmt,
               "indent": p.indent, "max_calls": max_calls, "choice": mode}
      p.calls, p.whole = True, mode == "required"
    else:
      if body.tools:
        p.tools = [t.model_dump(exclude_none=True) for t in body.tools]   # choice "none"
      if json_rf:
        schema = {"type": "object"} if rf.type == "json_object" else rf.json_schema.schema_
        p.job = {"kind": "json_schema", "schema": schema,
                 "where": "response_format.json_schema.schema"}
        p.whole = True
    if body.stop and p.whole:
      raise BadRequest("'stop' cannot be combined with a grammar that constrains the whole "
                       "answer (response_format, or tool_choice 'required' / a function): a "
                       "cut would break its schema", "stop")
    p.messages = self.messages(body, p)
    return p

  def messages(self, body: ChatCompletionRequest, p: Plan) -> list[dict]:
    from pask_jax.grammar.toolcall import render_calls
    out: list[dict] = []
    ids: dict[str, str] = {}   # tool call id -> function name
    for i, m in enumerate(body.messages):
      where = f"messages[{i}]"
      role = "system" if m.role == "developer" else m.role
      d: dict[str, Any] = {"role": role, "content": m.content}
      if getattr(m, "name", None) is not None:
        d["name"] = m.name
      if m.role == "assistant":
        calls = []
        for j, c in enumerate(m.tool_calls or ()):
          w = f"{where}.tool_calls[{j}].function.arguments"
          try:
            args = json.loads(c.function.arguments) if c.function.arguments.strip() else {}
          except json.JSONDecodeError as e:
            raise BadRequest(f"{w} is not valid JSON: {e.msg}", w) from None
          if not isinstance(args, dict):
            raise BadRequest(f"{w} must encode a JSON object", w)
          ids[c.id] = c.function.name
          calls.append({"id": c.id, "type": "function",
                        "function": {"name": c.function.name, "arguments": args}})
        if calls and self.takes_calls:
          d["tool_calls"] = calls
        elif calls:   # the template cannot render calls: write them as the model would
          text = render_calls([c["function"] for c in calls], p.fmt, p.indent)
          d["content"] = (m.content + "\n" if m.content else "") + text
        if d["content"] is None:
          d["content"] = ""
      elif m.role == "tool":
        if m.tool_call_id not in ids:
          raise BadRequest(f"{where}: a 'tool' message must answer a tool call of an earlier "
                           f"assistant message; no call has id {m.tool_call_id!r}",
                           f"{where}.tool_call_id")
        d["tool_call_id"] = m.tool_call_id
        d["name"] = ids[m.tool_call_id]
      out.append(d)
    return out

  # --- 2. prompt (worker thread) ------------------------------------------------------------

  def render(self, p: Plan, **kw) -> str:
    """The transcript rendered by :func:`pask_jax.prompt.render` (``kw``: apply_chat_template's
    options).  A template that ignores ``tools`` gets the callable ones (those ``tool_choice``
    allows; none with "none") described in a system message."""
    from pask_jax.prompt import render
    shown, mode = [], "required"
    if p.job is not None and p.job["kind"] == "tools":
      mode = p.job["choice"]
      shown = [t for t in p.job["tools"] if p.job["only"] in (None, t["function"]["name"])]
    try:
      return render(self.tok, p.messages, tools=p.tools, fmt=p.fmt, describe=shown, choice=mode,
                    template=self.template, **kw)
    except Exception as e:  # noqa: BLE001 — a template may raise on odd role orders
      raise BadRequest(f"the chat template rejected these messages: {_one_line(e)}",
                       "messages") from None

  def prompt(self, p: Plan, body: ChatCompletionRequest) -> tuple[str, list[int], list, int]:
    """(text, ids, offsets, max_tokens); BadRequest when it cannot fit."""
    text = self.render(p)
    ids, offsets, max_tokens = self.fit(text, body.max_completion_tokens or body.max_tokens,
                                        "messages")
    return text, ids, offsets, max_tokens

  def completion(self, body: CompletionRequest) -> tuple[str, list[int], list, int]:
    """(text, ids, offsets, max_tokens) of a completions prompt (a string or token ids)."""
    if isinstance(body.prompt, str):
      ids, offsets, max_tokens = self.fit(body.prompt, body.max_tokens, "prompt")
      return body.prompt, ids, offsets, max_tokens
    ids = self.check_ids(body.prompt, "prompt")
    text, offsets = self.token_text(ids)
    _, _, max_tokens = self.fit(text, body.max_tokens, "prompt", ids, offsets)
    return text, ids, offsets, max_tokens

  def tokenize(self, text: str, special: bool = True) -> list[int]:
    """The ids the server would feed the model for ``text``; ``special=False``: without the
    BOS the model's tokenizer adds."""
    from pask_jax.grammar.prompt_spans import encode
    if special:
      return encode(self.tok, text)[0]
    return list(self.tok.tok.encode(text, add_special_tokens=False).ids)

  def check_ids(self, ids: list[int], param: str) -> list[int]:
    bad = next((i for i in ids if not 0 <= i < self.vocab), None)
    if bad is not None:
      raise BadRequest(f"'{param}' holds the token id {bad}, outside this model's vocabulary "
                       f"[0, {self.vocab})", param)
    return list(ids)

  def token_text(self, ids: list[int]) -> tuple[str, list[tuple[int, int]]]:
    """The text of token ids and each token's character span (for prompt labels), in linear
    time: bytes that are not UTF-8 become one character each (surrogateescape)."""
    tb = self.tok.token_bytes()
    raw = b"".join(tb[i] for i in ids)
    text = raw.decode("utf-8", "surrogateescape")
    char = [0] * (len(raw) + 1)   # byte position -> index of the character holding it
    pos = 0
    for c, ch in enumerate(text):
      n = len(ch.encode("utf-8", "surrogateescape"))
      char[pos:pos + n] = [c] * n
      pos += n
    char[len(raw)] = len(text)
    offsets, pos = [], 0
    for i in ids:
      n = len(tb[i])
      offsets.append((char[pos], char[pos + n - 1] + 1 if n else char[pos]))
      pos += n
    return text, offsets

  def fit(self, text: str, max_tokens: int | None, param: str, ids=None, offsets=None):
    """(ids, offsets, max_tokens) of a prompt (tokenized here unless ``ids`` are given);
    BadRequest ``context_length_exceeded`` when it cannot fit, checked on a lower bound of the
    token count before tokenizing."""
    from pask_jax.grammar.prompt_spans import encode
    if ids is None:
      least = -(-len(text.encode("utf-8", "surrogatepass")) // self.max_token_bytes)
      if least + (max_tokens or 1) > self.engine.context:
        raise BadRequest(self.too_long(least, max_tokens, param, "at least "), param,
                         "context_length_exceeded")
      ids, offsets = encode(self.tok, text)
    n = len(ids)
    if n + (max_tokens or 1) > self.engine.context:
      raise BadRequest(self.too_long(n, max_tokens, param), param, "context_length_exceeded")
    if max_tokens is None:
      max_tokens = min(self.default_max_tokens, self.engine.context - n)
    why = self.engine.fits_ever(n, max_tokens)
    if why:
      raise BadRequest(why, param, "context_length_exceeded")
    return ids, offsets, max_tokens

  def too_long(self, n: int, max_tokens: int | None, param: str, least: str = "") -> str:
    ctx = self.engine.context
    if max_tokens is None:
      verb = "have" if param == "messages" else "has"
      return (f"This model's maximum context length is {ctx} tokens. However, the {param} "
              f"{verb} {least}{n} tokens, which leaves no room for a completion. Please reduce "
              f"the length of the {param}.")
    return (f"This model's maximum context length is {ctx} tokens. However, you requested "
            f"{least}{n + max_tokens} tokens ({least}{n} in the {param}, {max_tokens} in the "
            f"completion: max_tokens). Please reduce the length of the {param} or max_tokens.")

  def labels(self, text: str, offsets: list):
    from pask_jax.grammar.prompt_spans import labels
    return labels(text, offsets, self.tok)

  def tracker(self, grammar, p: Plan) -> Tracker:
    if grammar is None:
      return Tracker(None)
    if p.calls:
      from pask_jax.grammar.toolcall import adapter_for
      return Tracker(grammar, adapter_for(grammar, self.tok, vocab=self.state_vocab))
    return Tracker(grammar)


def _one_line(e: BaseException) -> str:
  return " ".join(str(e).split())[:300] or type(e).__name__


# ---- responses ----------------------------------------------------------------------------

def _usage(result: dict) -> dict:
  led = _finite(result["ledger"])
  totals = {a: sum(g[a] for part in ("prefill_counts", "decode_counts")
                   for g in led[part].values()) for a in Act.NAMES}
  n_p, n_c = result["prompt_tokens"], len(result["tokens"])
  return {"prompt_tokens": n_p, "completion_tokens": n_c, "total_tokens": n_p + n_c,
          "pask": {"prompt_kv_bits": led["prefill_bits"], "decode_kv_bits": led["decode_bits"],
                   "full_kv_bits": led["full_kv_bits"], "measured_B": led["measured_B"],
                   "prefill_B": led["prefill_B"], "decode_B": led["decode_B"],
                   "actions": totals, "prefill_counts": led["prefill_counts"],
                   "decode_counts": led["decode_counts"], "overflow": result["overflow"]}}


class Responder:
  """Turns engine results into OpenAI messages, logprobs and stream chunks."""

  def __init__(self, tok, fmt: str, calls: bool):
    self.tok, self.fmt, self.calls = tok, fmt, calls

  def message(self, result: dict) -> tuple[dict, str]:
    """(assistant message, finish_reason) of a finished request."""
    from pask_jax.grammar.toolcall import split_calls
    text, finish = result["text"], result["finish"]
    if self.calls:
      content, calls = split_calls(text, self.fmt)
      if calls:
        tc = [{"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
               "function": {"name": c["name"],
                            "arguments": json.dumps(c["arguments"], ensure_ascii=False)}}
              for c in calls]
        return ({"role": "assistant", "content": content, "tool_calls": tc, "refusal": None},
                "tool_calls" if finish == "stop" else finish)
    return {"role": "assistant", "content": text, "refusal": None}, finish

  def kept(self, result: dict) -> list[tuple[int, float, list, int]] | None:
    """(token, logprob, alternatives, character offset) of the tokens that start inside the
    returned text (a stop sequence's tokens go with it); None without logprobs."""
    lps = result.get("logprobs")
    if lps is None or result.get("want_logprobs") is None:
      return None
    toks = result["tokens"][:len(lps)]
    out, n_text = [], len(result["text"])
    for k in range(len(toks)):
      at = len(self.tok.decode(toks[:k])) if k else 0
      if at >= n_text and k > 0:
        break
      out.append((toks[k], lps[k][0], lps[k][1], at))
    return out

  def logprobs(self, result: dict) -> dict | None:
    """Chat completions' ``logprobs``."""
    kept = self.kept(result)
    if kept is None:
      return None
    tb = self.tok.token_bytes()
    entry = lambda i, lp: {"token": tb[i].decode("utf-8", "replace"), "logprob": lp,
                           "bytes": list(tb[i])}
    content = [{**entry(t, lp), "top_logprobs": [entry(i, v) for i, v in alts]}
               for t, lp, alts, _ in kept]
    return {"content": content, "refusal": None}

  def text_logprobs(self, result: dict) -> dict | None:
    """Completions' (legacy) ``logprobs``: tokens, token_logprobs, top_logprobs (token text ->
    logprob; tokens of the same text collapse, as in OpenAI's format), text_offset."""
    kept = self.kept(result)
    if kept is None:
      return None
    tb = self.tok.token_bytes()
    text = lambda i: tb[i].decode("utf-8", "replace")
    return {"tokens": [text(t) for t, *_ in kept],
            "token_logprobs": [lp for _, lp, _, _ in kept],
            "top_logprobs": [{text(i): v for i, v in alts} for _, _, alts, _ in kept],
            "text_offset": [at for *_, at in kept]}


# ---- the app ------------------------------------------------------------------------------

def create_app(engine: Engine, tokenizer, cfg, *, model_name: str | list[str] = "pask-jax",
               default_max_tokens: int = 256, grammars=None, max_body_bytes: int = 2 << 20,
               max_json_depth: int = 64, grammar_timeout_s: float = 10.0,
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
  metrics = Metrics(engine, grammars)

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
    _observe(metrics, payload, t_arrive)
    metrics.http.labels("200").inc()
    payload["want_logprobs"] = body.logprobs
    msg, finish = resp.message(payload)
    return {"id": meta["id"], "object": "chat.completion", "created": meta["created"],
            "model": names[0], "system_fingerprint": None,
            "choices": [{"index": 0, "message": msg, "finish_reason": finish,
                         "logprobs": resp.logprobs(payload)}],
            "usage": _usage(payload)}

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
      return StreamingResponse(_stream_text(req, q, resp, meta, usage, metrics),
                               media_type="text/event-stream",
                               headers={"Cache-Control": "no-cache"})
    payload = await outcome(req, q, request)
    if isinstance(payload, Response):
      return payload
    _observe(metrics, payload, t_arrive)
    metrics.http.labels("200").inc()
    payload["want_logprobs"] = body.logprobs
    return {"id": meta["id"], "object": "text_completion", "created": meta["created"],
            "model": names[0], "system_fingerprint": None,
            "choices": [{"index": 0, "text": echo + payload["text"],
                         "finish_reason": payload["finish"],
                         "logprobs": resp.text_logprobs(payload)}],
            "usage": _usage(payload)}

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


def _observe(metrics: Metrics, result: dict, t_arrive: float) -> None:
  now = time.perf_counter()
  metrics.e2e.observe(now - t_arrive)
  if result.get("ttft_s") is not None:
    metrics.ttft.observe(result["ttft_s"])
  if result.get("tpot_s") is not None:
    metrics.tpot.observe(result["tpot_s"])
  if result.get("queue_s") is not None:
    metrics.queue.observe(result["queue_s"])


async def sse_chunks(req: Request, q: asyncio.Queue, resp: Responder, meta: dict, usage: bool,
                     metrics: Metrics):
  """SSE chunks.  Text deltas stream as they decode; with tools, the text before a call block
  streams too (the tail that could begin the block's trigger is held back), the calls arrive
  as ``tool_calls`` deltas once complete."""
  from pask_jax.grammar.toolcall import BLOCKS, TRIGGERS

  def chunk(delta: dict, finish=None, logprobs=None, choices=True, use=None) -> str:
    c = {"id": meta["id"], "object": "chat.completion.chunk", "created": meta["created"],
         "model": meta["model"], "system_fingerprint": None,
         "choices": [{"index": 0, "delta": delta, "finish_reason": finish,
                      "logprobs": logprobs}] if choices else []}
    if usage:
      c["usage"] = use
    return f"data: {json.dumps(c, ensure_ascii=False)}\n\n"

  trigger = TRIGGERS[resp.fmt] if resp.calls else None
  begin = BLOCKS[resp.fmt][0] if resp.calls else None
  text, sent, held = "", 0, False   # held: a call block has begun, content streaming stopped
  finished = False
  try:
    yield chunk({"role": "assistant", "content": ""})
    while True:
      kind, payload = await q.get()
      if kind == "delta":
        text += payload
        if not resp.calls:
          yield chunk({"content": payload})
          sent = len(text)
          continue
        if held:
          continue
        j = min((i for i in (text.find(trigger, sent), text.find(begin, sent)) if i >= 0),
                default=-1)
        if j >= 0:
          held = True
          safe = j
        else:
          safe = len(text) - max((k for k in range(min(len(trigger) - 1, len(text)), 0, -1)
                                  if text.endswith(trigger[:k])), default=0)
        if safe > sent:
          yield chunk({"content": text[sent:safe]})
          sent = safe
      elif kind == "error":
        finished = True
        metrics.http.labels("500").inc()
        yield f"data: {json.dumps(error_body(payload, 'server_error'))}\n\n"
        return
      else:   # done (a cancelled request never reaches here: its client is gone)
        finished = True
        _observe(metrics, payload, meta["t_arrive"])
        payload["want_logprobs"] = meta["logprobs"]
        msg, finish = resp.message(payload)
        lp = resp.logprobs(payload)
        if resp.calls:
          content = msg.get("content") or ""
          streamed = text[:sent]
          if content.startswith(streamed) and len(content) > len(streamed):
            yield chunk({"content": content[len(streamed):]})
          if msg.get("tool_calls"):
            yield chunk({"tool_calls": [dict(tc, index=i)
                                        for i, tc in enumerate(msg["tool_calls"])]})
        elif sent < len(payload["text"]):
          yield chunk({"content": payload["text"][sent:]})
        yield chunk({}, finish, lp)
        if usage:
          yield chunk({}, choices=False, use=_usage(payload))
        yield "data: [DONE]\n\n"
        return
  finally:
    if not finished:   # the client went away mid-stream (the generator was closed/cancelled)
      metrics.disconnects.inc()
      req.cancel()


async def _stream_text(req: Request, q: asyncio.Queue, resp: Responder, meta: dict, usage: bool,
                       metrics: Metrics):
  """SSE chunks of a completion (``text_completion`` objects): the echoed prompt, the text
  deltas as they decode, then a chunk with the finish_reason and logprobs."""

  def chunk(text: str, finish=None, logprobs=None, choices=True, use=None) -> str:
    c = {"id": meta["id"], "object": "text_completion", "created": meta["created"],
         "model": meta["model"], "system_fingerprint": None,
         "choices": [{"index": 0, "text": text, "finish_reason": finish,
                      "logprobs": logprobs}] if choices else []}
    if usage:
      c["usage"] = use
    return f"data: {json.dumps(c, ensure_ascii=False)}\n\n"

  sent, finished = 0, False
  try:
    if meta["echo"]:
      yield chunk(meta["echo"])
    while True:
      kind, payload = await q.get()
      if kind == "delta":
        sent += len(payload)
        yield chunk(payload)
      elif kind == "error":
        finished = True
        metrics.http.labels("500").inc()
        yield f"data: {json.dumps(error_body(payload, 'server_error'))}\n\n"
        return
      else:   # done
        finished = True
        _observe(metrics, payload, meta["t_arrive"])
        payload["want_logprobs"] = meta["logprobs"]
        if sent < len(payload["text"]):
          yield chunk(payload["text"][sent:])
        yield chunk("", payload["finish"], resp.text_logprobs(payload))
        if usage:
          yield chunk("", choices=False, use=_usage(payload))
        yield "data: [DONE]\n\n"
        return
  finally:
    if not finished:
      metrics.disconnects.inc()
      req.cancel()


def build(model: str | None = None, policy: str = "all-high", *, slots: int = 4,
          context: int = 1024, page: int = 16, hi_pages: int | None = None,
          lo_pages: int | None = None, kv_memory_gb: float | None = None,
          gpu_memory_utilization: float | None = None, kv_mix=None,
          preemption: str = "replay", dtype: str = "auto", default_max_tokens: int = 256,
          warmup: bool = True, served_model_name: list[str] | None = None,
          max_body_bytes: int = 2 << 20, max_json_depth: int = 64,
          grammar_timeout_s: float = 10.0, prefill_chunk: int = 512,
          prefill_share: float = 1 / 3, api_key: str | list[str] | None = None,
          chat_template: str | None = None, tool_call_parser: str | None = None):
  """Load a model, resolve a policy, start an engine; -> (app, engine).  Pool sizing:
  :func:`serve.engine.size_pools` (``engine.sizing.describe()`` says what was chosen).
  ``chat_template``: a file path or a template (:func:`load_chat_template`); the other options
  as for :func:`create_app`."""
  import jax
  import jax.numpy as jnp

  from models import load
  from pask_jax import policy as pol_mod
  from serve.grammars import GrammarPool
  if tool_call_parser is not None and tool_call_parser not in TOOL_CALL_PARSERS:
    raise ValueError(f"unknown tool-call parser {tool_call_parser!r}; choose one of "
                     f"{', '.join(TOOL_CALL_PARSERS)}")
  template = None if chat_template is None else load_chat_template(chat_template)
  dt = {"auto": jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16,
        "float32": jnp.float32, "bfloat16": jnp.bfloat16}[dtype]
  m = load(model, dtype=dt, need_tokenizer=True)   # refused before any weight loads
  if m.tokenizer is None:
    raise ValueError("this checkpoint has no tokenizer.json; the server needs one")
  tok = m.tokenizer if template is None else with_chat_template(m.tokenizer, template)
  pol = pol_mod.resolve(policy, m.cfg, tokenizer_hash=m.tokenizer.hash())
  # The compile workers start (import XGrammar) while the engine compiles its step.
  grammars = GrammarPool(m.tokenizer, m.cfg.vocab_size, timeout_s=grammar_timeout_s)
  engine = Engine(m.model, m.tokenizer, pol, slots=slots, context=context, page=page,
                  hi_pages=hi_pages, lo_pages=lo_pages,
                  kv_bytes=None if kv_memory_gb is None else int(kv_memory_gb * 1e9),
                  gpu_memory_utilization=gpu_memory_utilization,
                  mix=None if kv_mix is None else tuple(kv_mix), preemption=preemption,
                  prefill_chunk=prefill_chunk, prefill_share=prefill_share)
  if warmup:
    engine.warmup()
  engine.start()
  names = served_model_name or [model or "smollm2-135m-instruct"]
  app = create_app(engine, tok, m.cfg, model_name=names,
                   default_max_tokens=default_max_tokens, grammars=grammars,
                   max_body_bytes=max_body_bytes, max_json_depth=max_json_depth,
                   api_key=api_key, tool_call_parser=tool_call_parser)
  return app, engine
