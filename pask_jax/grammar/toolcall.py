"""Tool-call grammars in the format a model actually writes, and the parser for its output.

The format is a per-model choice (measure the model first):

* ``fenced_json`` — one or more blocks ```` ```json\n{"name": …, "arguments": {…}}\n``` ````
  separated by a newline.  Qwen2.5-Coder-0.5B-Instruct answers a tools prompt this way, with the
  JSON pretty-printed at indent 2 (measured with ``scripts/measure_tool_format.py``: 37 greedy
  tokens, first token ```` ``` ```` at log-prob -1.1); its ``<tool_call>`` rows are untrained
  (log-prob about -22 where a call starts), so forcing them would push it off its distribution.
* ``tool_call_tags`` — Qwen's template format: ``<tool_call>\n{…}\n</tool_call>`` blocks.
* ``json_list`` — a bare JSON array of call objects (models whose template ignores tools).

Each call object is constrained by the declared tools' JSON schemas (``anyOf`` over tools, the
name as a ``const``), so every accepted output parses into calls naming declared tools.

``tool_call_grammar(..., choice="required")`` makes the whole answer calls; ``choice="auto"``
allows free text in which a call block starts at the format's trigger (XGrammar's triggered
structural tags), scanned by :class:`AutoFCAdapter`.  ``check=True`` (the server) runs every
``parameters`` schema through :mod:`pask_jax.grammar.schema_check` and resolves its ``$ref``s
against the parameters themselves (:func:`call_schema` moves their ``$defs`` to the root under
``tool{i}.NAME`` and rewrites the pointers; they used to resolve against the call wrapper).  The
default ``check=False`` keeps the grammars the calibrated policies were made with byte for byte:
of the 8,726 tool schemas in BFCL's data files (all categories, converted by calibrate.bfcl), the
check leaves 8,624 unchanged, rewrites 99 (optional ``boolean`` properties whose ``enum`` lists
strings admit no value and are dropped) and refuses 3 (the same flaw on a required property).
"""
from __future__ import annotations

import functools
import json
import re
from typing import Any

from pask_jax import tags as T
from pask_jax.grammar.fc_adapter import FCAdapter
from pask_jax.grammar.matcher import Grammar, GrammarCompiler, GrammarError, schema_ebnf
from pask_jax.grammar.schema_check import scoped

FORMATS = ("fenced_json", "tool_call_tags", "json_list")
# Measured defaults per model family (see module docstring): (format, JSON indent); override per
# call.
DEFAULT_STYLE = {"qwen2": ("fenced_json", 2), "qwen3": ("tool_call_tags", None),
                 "llama": ("json_list", None)}
DEFAULT_FORMAT = {k: v[0] for k, v in DEFAULT_STYLE.items()}


def normalize_tools(tools: list[dict], check: bool = True) -> list[dict]:
  """Accept OpenAI style ``{"type": "function", "function": {...}}`` or bare function dicts.

  With ``check`` (the default) every ``parameters`` schema goes through
  :func:`~pask_jax.grammar.schema_check.prepare` (refused unless XGrammar enforces it exactly;
  its ``$ref``s resolve against the parameters themselves), and duplicate names are refused.
  """
  from pask_jax.grammar.schema_check import prepare
  if not isinstance(tools, list):
    raise GrammarError("tools must be a list")
  out, seen = [], set()
  for i, t in enumerate(tools):
    f = t.get("function", t) if isinstance(t, dict) else None
    if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
      raise GrammarError(f"tools[{i}]: a tool needs a non-empty string 'name'")
    if f["name"] in seen:
      raise GrammarError(f"tools[{i}]: duplicate tool name {f['name']!r}")
    seen.add(f["name"])
    params = f.get("parameters")
    if params is None:
      params = {"type": "object", "properties": {}}
    if check:
      where = f"tools[{i}].function.parameters" if "function" in t else f"tools[{i}].parameters"
      params = prepare(params, where)
    out.append({"name": f["name"], "description": f.get("description") or "",
                "parameters": params})
  if not out:
    raise GrammarError("no tools given")
  return out


def call_schema(tools: list[dict]) -> dict:
  """JSON schema of one call object: ``{"name": const, "arguments": <tool parameters>}``."""
  defs: dict = {}
  alts = [{"type": "object",
           "properties": {"name": {"const": t["name"]},
                          "arguments": scoped(t["parameters"], f"tool{i}", defs)},
           "required": ["name", "arguments"], "additionalProperties": False}
          for i, t in enumerate(tools)]
  out = alts[0] if len(alts) == 1 else {"anyOf": alts}
  if defs:
    out = dict(out, **{"$defs": defs})
  return out


_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _rename_root(ebnf: str, new: str) -> str:
  """``ebnf`` with its rule ``root`` named ``new``: rule names only, never the text inside a
  string literal or a character class (a tool's property or enum value "root" stays "root")."""
  out, i, n = [], 0, len(ebnf)
  while i < n:
    c = ebnf[i]
    if c in "\"[":
      close, j = ('"' if c == '"' else "]"), i + 1
      while j < n and ebnf[j] != close:
        j += 2 if ebnf[j] == "\\" else 1
      out.append(ebnf[i:j + 1])
      i = j + 1
    elif (m := _NAME.match(ebnf, i)):
      out.append(new if m.group() == "root" else m.group())
      i = m.end()
    else:
      out.append(c)
      i += 1
  return "".join(out)


def _esc(s: str) -> str:
  return json.dumps(s)  # an EBNF string literal uses JSON escapes


# Per format: (block begin, block end, separator between blocks, separator between calls inside
# one block or None when a block holds one call).
BLOCKS = {"fenced_json": ("```json\n", "\n```", "\n", None),
          "tool_call_tags": ("<tool_call>\n", "\n</tool_call>", "\n", None),
          "json_list": ("[", "]", None, ", ")}
# The free-text trigger of each block in tool_choice "auto" (a prefix of the block's begin).
TRIGGERS = {"fenced_json": "```json", "tool_call_tags": "<tool_call>", "json_list": "["}


def _call_ebnf(tools: list[dict], indent: int | None) -> str:
  try:
    call = schema_ebnf(json.dumps(call_schema(tools)), indent)
  except Exception as e:
    from pask_jax.grammar.errors import xgrammar_message
    raise GrammarError(f"XGrammar cannot compile the tool schemas: {xgrammar_message(e)}") \
        from None
  return _rename_root(call, "call")


def tool_call_grammar(compiler: GrammarCompiler, tools: list[dict], fmt: str,
                      max_calls: int = 8, indent: int | None = None,
                      choice: str = "required", check: bool = True) -> Grammar:
  """Tool calls in ``fmt``: ``choice="required"`` — the answer is one to ``max_calls`` calls
  (BFCL's parallel cases need at most a handful); ``choice="auto"`` — free text in which a call
  block starts at the format's trigger (:data:`TRIGGERS`; XGrammar's triggered structural tags),
  any number of blocks, or at most one when ``max_calls == 1`` (then nothing may follow it).

  ``indent``: None for compact JSON (``", "`` and ``": "`` separators), or the pretty-print
  indentation the model uses.  ``check``: run the parameters through the schema check (see
  :func:`normalize_tools`).
  """
  if max_calls < 1:
    raise GrammarError("max_calls must be >= 1")
  if fmt not in FORMATS:
    raise GrammarError(f"unknown tool-call format {fmt!r}; choose one of {', '.join(FORMATS)}")
  if choice not in ("required", "auto"):
    raise GrammarError(f"unknown tool choice {choice!r}")
  tools = normalize_tools(tools, check=check)
  call = _call_ebnf(tools, indent)
  begin, end, between, inner = BLOCKS[fmt]
  meta = {"format": fmt, "tools": tools, "indent": indent, "choice": choice,
          "max_calls": max_calls, "begin": begin, "end": end}
  if choice == "auto":
    from xgrammar.structural_tag import (GrammarFormat, StructuralTag, TagFormat,
                                         TriggeredTagsFormat)
    content = call if inner is None else (
        f"root ::= call ({_esc(inner)} call){{0,{max_calls - 1}}}\n" + call)
    if inner is None:
      content = "root ::= call\n" + call
    tag = StructuralTag(format=TriggeredTagsFormat(
        triggers=[TRIGGERS[fmt]], stop_after_first=max_calls == 1,
        tags=[TagFormat(begin=begin, content=GrammarFormat(grammar=content), end=end)]))
    g = compiler.structural_tag(tag.model_dump(mode="json"))
    g.kind, g.meta = "tool_calls", meta
    return g
  if inner is None:
    head = (f"root ::= block ({_esc(between)} block){{0,{max_calls - 1}}}\n"
            f"block ::= {_esc(begin)} call {_esc(end)}\n")
  else:
    head = f"root ::= {_esc(begin)} call ({_esc(inner)} call){{0,{max_calls - 1}}} {_esc(end)}\n"
  g = compiler.ebnf(head + call)
  g.kind, g.meta = "tool_calls", meta
  return g


_FENCE = re.compile(r"```(?:json)?\s*(.*?)```", re.S)
_TAG = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def _call_objects(text: str, strict: bool = False) -> list[Any]:
  """The JSON values an answer's call blocks hold, flattened (a block may hold a list): the
  ``<tool_call>`` blocks, else the fenced blocks, else the whole text as JSON.  Raises ValueError
  when none parses; with ``strict`` also when a block is not closed or does not parse (the
  lenient reading skips such blocks)."""
  blobs: list[Any] = []
  for rx, opener in ((_TAG, "<tool_call>"), (_FENCE, "```")):
    found = rx.findall(text)
    # an opener without its closer (a fence is its own closer: an odd count leaves one open)
    opened = text.count(opener) if opener == "<tool_call>" else -(-text.count(opener) // 2)
    if strict and len(found) < opened:
      raise ValueError("a call block is not closed")
    for i, b in enumerate(found):
      try:
        blobs.append(json.loads(b))
      except json.JSONDecodeError:
        if strict:
          raise ValueError(f"call block {i} does not parse as JSON") from None
    if blobs or strict and opened:
      break
  if not blobs:
    try:
      blobs.append(json.loads(text.strip()))
    except json.JSONDecodeError:
      raise ValueError(f"no tool call could be parsed from {text[:200]!r}") from None
  return [c for b in blobs for c in (b if isinstance(b, list) else [b])]


def parse_calls(text: str, fmt: str | None = None) -> list[dict[str, Any]]:
  """Calls written in any of :data:`FORMATS` (lenient: the constrained output is a subset).

  Returns ``[{"name": str, "arguments": dict}, ...]``; raises ValueError if nothing parses.
  """
  calls = []
  for c in _call_objects(text):
    if isinstance(c, dict) and isinstance(c.get("name"), str):
      args = c.get("arguments", c.get("parameters", {}))
      calls.append({"name": c["name"], "arguments": args if isinstance(args, dict) else {}})
  if not calls:
    raise ValueError(f"no tool call could be parsed from {text[:200]!r}")
  return calls


@functools.lru_cache(maxsize=512)
def _validator(schema_json: str):
  import jsonschema
  schema = json.loads(schema_json)
  return jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)(
      schema)


def call_problem(tools: list[dict], text: str) -> str | None:
  """Why ``text`` is not a schema-valid tool-call answer for ``tools`` (OpenAI-style or bare
  function dicts), or None when it is: its call blocks (as :func:`parse_calls` finds them) hold at
  least one call, every block opened is closed and parses as JSON, and every call is an object
  naming one of the tools with an ``arguments`` (or ``parameters``) object that validates
  against the tool's ``parameters`` JSON schema as given
  (``jsonschema``; no rewriting).  What an unconstrained run is scored by beside the checker
  (docs/SPHERICAL_KV.md §4, schema validity); a grammar-constrained answer that was not cut off
  always passes."""
  try:
    objs = _call_objects(text, strict=True)
  except ValueError as e:
    return "no call block parses as JSON" if str(e).startswith("no tool call") else str(e)
  if not objs:
    return "no call"
  params = {}
  for t in tools:
    f = t.get("function", t)
    params[f["name"]] = f.get("parameters") or {"type": "object", "properties": {}}
  for i, c in enumerate(objs):
    if not isinstance(c, dict) or not isinstance(c.get("name"), str):
      return f"call {i}: not an object with a string 'name'"
    if c["name"] not in params:
      return f"call {i}: unknown tool {c['name']!r}"
    args = c.get("arguments", c.get("parameters"))
    if not isinstance(args, dict):
      return f"call {i} ({c['name']}): arguments are not an object"
    err = next(iter(_validator(json.dumps(params[c["name"]], sort_keys=True)).iter_errors(args)),
               None)
    if err is not None:
      loc = "".join(f"/{p}" for p in err.absolute_path)
      return f"call {i} ({c['name']}): arguments#{loc}: {err.message[:200]}"
  return None


def split_calls(text: str, fmt: str) -> tuple[str | None, list[dict[str, Any]]]:
  """``(content, calls)`` of an answer in ``fmt`` that may mix free text and call blocks (what
  :func:`tool_call_grammar` admits for either choice): every complete block whose JSON parses
  into calls is taken out; the rest is the content (None when only whitespace).  A cut-off
  block stays in the content (as written: a stream sends the same text)."""
  begin, end, _, inner = BLOCKS[fmt]
  dec = json.JSONDecoder()
  calls: list[dict[str, Any]] = []
  rest, i = [], 0
  while True:
    j = text.find(begin, i)
    if j < 0:
      rest.append(text[i:])
      break
    start = j if inner is not None else j + len(begin)
    try:
      val, k = dec.raw_decode(text, start)
    except ValueError:
      rest.append(text[i:j + len(begin)])
      i = j + len(begin)
      continue
    if inner is None:
      if not text.startswith(end, k):
        rest.append(text[i:j + len(begin)])
        i = j + len(begin)
        continue
      k += len(end)
    got = [c for c in (val if isinstance(val, list) else [val])
           if isinstance(c, dict) and isinstance(c.get("name"), str)
           and isinstance(c.get("arguments", {}), dict)]
    if not got:
      rest.append(text[i:k])
      i = k
      continue
    calls += [{"name": c["name"], "arguments": c.get("arguments", {})} for c in got]
    rest.append(text[i:j])
    i = k
  content = "".join(rest)
  return (content if content.strip() else None), calls


def render_calls(calls: list[dict[str, Any]], fmt: str, indent: int | None = None) -> str:
  """Calls written in ``fmt`` as the grammar writes them (for transcripts of templates that
  cannot render ``tool_calls`` themselves)."""
  begin, end, between, inner = BLOCKS[fmt]
  one = [json.dumps({"name": c["name"], "arguments": c["arguments"]}, indent=indent,
                    ensure_ascii=False) for c in calls]
  if inner is not None:
    return begin + inner.join(one) + end
  return between.join(begin + c + end for c in one)


class AutoFCAdapter(FCAdapter):
  """:class:`FCAdapter` for ``tool_choice="auto"`` grammars: bytes of free text get the free
  generation tag (as a request without tools would); a call block starts when the free text
  completes the block's begin string (the bytes of that token are wrapper scaffold; earlier
  tokens of a multi-token begin keep their free tag — they were emitted as text), is scanned by
  the FCAdapter from the begin on, and ends with the block's end string once its JSON has
  closed."""

  def __init__(self, grammar, tokenizer, **kw):
    self.begin = grammar.meta["begin"].encode()
    self.end = grammar.meta["end"].encode()
    super().__init__(grammar, tokenizer, **kw)

  def reset(self) -> None:
    super().reset()
    self.mode, self.tail, self.opened = "free", b"", False

  def _copy_state(self, new) -> None:
    super()._copy_state(new)

  def _pack(self, c, r, crit, nxt):
    return T.fc(c) if r == 0 else super()._pack(c, r, crit, nxt)

  def _feed(self, c: int):
    if self.mode == "free":
      self.tail = (self.tail + bytes([c]))[-len(self.begin):]
      if self.tail != self.begin:
        return _FREE
      FCAdapter.reset(self)
      self.mode, self.tail, self.opened = "call", b"", False
      for b in self.begin[:-1]:
        FCAdapter._feed(self, b)
    tag = FCAdapter._feed(self, c)
    self.tail = (self.tail + bytes([c]))[-len(self.end):]
    self.opened = self.opened or bool(self.stack)
    if self.opened and not self.stack and self.instr is None and self.tail == self.end:
      self.mode, self.tail = "free", b""
    return tag


_FREE = (T.Cls.FREE_GENERATION, 0)


def adapter_for(grammar, tokenizer, **kw) -> FCAdapter:
  """The structural-tag adapter of a :func:`tool_call_grammar` grammar (either choice)."""
  cls = AutoFCAdapter if grammar.meta.get("choice") == "auto" else FCAdapter
  return cls(grammar, tokenizer, **kw)


def tools_system_prompt(tools: list[dict], fmt: str, choice: str = "required") -> str:
  """For chat templates that ignore ``tools``: describe them and the answer format in text."""
  tools = normalize_tools(tools, check=False)
  shape = {"fenced_json": 'a ```json block {"name": ..., "arguments": {...}} per call',
           "tool_call_tags": '<tool_call>{"name": ..., "arguments": {...}}</tool_call> per call',
           "json_list": 'a JSON list of {"name": ..., "arguments": {...}} objects'}[fmt]
  head = "You can call these functions:\n" + "\n".join(json.dumps(t) for t in tools)
  if choice == "auto":
    return head + f"\nTo call functions, answer with {shape}; otherwise answer in text."
  return head + f"\nAnswer with {shape}."
