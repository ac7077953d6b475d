"""Requests to prompts for the OpenAI server: the checks of a chat or completion request, the
rendering (through :func:`pask_jax.prompt.render`), the length check, labels and trackers."""
from __future__ import annotations

import json
import math
from typing import Any


from pask_jax.options import DEFAULT_MAX_TOKENS, TOOL_FORMATS
from pask_jax.prompt import one_line
from pask_jax.tracker import Tracker
from serve.engine import Engine
from serve.protocol import (ChatCompletionRequest, CompletionRequest)

MAX_CALLS = 8   # calls per answer with parallel_tool_calls (BFCL's parallel cases need a few)
# ``--tool-call-parser`` -> the format of pask_jax.grammar.toolcall that both the grammar and the
# parser of the answer follow: the names every front end accepts (pask_jax.options.TOOL_FORMATS).
# ``hermes`` is vLLM's name for Qwen2.5's / Hermes'
# ``<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>`` blocks (``tool_call_tags``, its
# pask-jax name, is the same format); fenced_json and json_list have no vLLM parser.  None: the
# measured per-family default (pask_jax.grammar.DEFAULT_STYLE).
TOOL_CALL_PARSERS = TOOL_FORMATS


class BadRequest(Exception):
  def __init__(self, message: str, param: str | None = None, code: str | None = None,
               status: int = 400, kind: str = "invalid_request_error"):
    super().__init__(message)
    self.message, self.param, self.code, self.status, self.kind = (message, param, code, status,
                                                                   kind)


def finite(x):
  """JSON has no NaN: ratios of empty requests become null."""
  if isinstance(x, float) and not math.isfinite(x):
    return None
  if isinstance(x, dict):
    return {k: finite(v) for k, v in x.items()}
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

  def __init__(self, engine: Engine, tokenizer, cfg, grammars, *,
               default_max_tokens: int = DEFAULT_MAX_TOKENS,
               tool_format: str | None = None, template: str | None = None):
    from pask_jax import policy as P
    from pask_jax.prompt import style, takes_calls
    self.engine, self.tok, self.cfg, self.grammars = engine, tokenizer, cfg, grammars
    self.style = style(cfg.arch, tool_format)
    self.template = template   # a chat template (text) in place of the tokenizer's, or None
    self.vocab = min(cfg.vocab_size, len(tokenizer.token_bytes()))
    self.state_vocab = P.state_vocab(engine.policy)   # parser-state ids of the reserve Γ
    self.default_max_tokens = default_max_tokens
    self.takes_calls = takes_calls(tokenizer, template)
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
      raise BadRequest(f"the chat template rejected these messages: {one_line(e)}",
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

