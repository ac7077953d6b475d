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
"""
from __future__ import annotations

import json
import re
from typing import Any

from pask_jax.grammar.matcher import GrammarCompiler, GrammarError, Grammar, _xgr

FORMATS = ("fenced_json", "tool_call_tags", "json_list")
# Measured defaults per model family (see module docstring): (format, JSON indent); override per call.
DEFAULT_STYLE = {"qwen2": ("fenced_json", 2), "qwen3": ("tool_call_tags", None),
                 "llama": ("json_list", None)}
DEFAULT_FORMAT = {k: v[0] for k, v in DEFAULT_STYLE.items()}


def normalize_tools(tools: list[dict]) -> list[dict]:
  """Accept OpenAI style ``{"type": "function", "function": {...}}`` or bare function dicts."""
  out = []
  for t in tools:
    f = t.get("function", t) if isinstance(t, dict) else None
    if not isinstance(f, dict) or not isinstance(f.get("name"), str):
      raise GrammarError(f"a tool needs a string 'name': {t!r}")
    params = f.get("parameters") or {"type": "object", "properties": {}}
    out.append({"name": f["name"], "description": f.get("description", ""), "parameters": params})
  if not out:
    raise GrammarError("no tools given")
  return out


def call_schema(tools: list[dict]) -> dict:
  """JSON schema of one call object: ``{"name": const, "arguments": <tool parameters>}``."""
  alts = [{"type": "object",
           "properties": {"name": {"const": t["name"]}, "arguments": t["parameters"]},
           "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
  return alts[0] if len(alts) == 1 else {"anyOf": alts}


def _rename_root(ebnf: str, new: str) -> str:
  return re.sub(r"\broot\b", new, ebnf)


def _esc(s: str) -> str:
  return json.dumps(s)  # an EBNF string literal uses JSON escapes


def tool_call_grammar(compiler: GrammarCompiler, tools: list[dict], fmt: str,
                      max_calls: int = 8, indent: int | None = None) -> Grammar:
  """One to ``max_calls`` calls in ``fmt`` (BFCL's parallel cases need at most a handful).

  ``indent``: None for compact JSON (``", "`` and ``": "`` separators), or the pretty-print
  indentation the model uses.
  """
  if max_calls < 1:
    raise GrammarError("max_calls must be >= 1")
  if fmt not in FORMATS:
    raise GrammarError(f"unknown tool-call format {fmt!r}; choose one of {', '.join(FORMATS)}")
  tools = normalize_tools(tools)
  xgr = _xgr()
  try:
    call = str(xgr.Grammar.from_json_schema(json.dumps(call_schema(tools)), any_whitespace=False,
                                            strict_mode=True, indent=indent))
  except Exception as e:
    raise GrammarError(f"XGrammar cannot compile the tool schemas: {e}") from None
  call = _rename_root(call, "call")
  if fmt == "fenced_json":
    head = f'root ::= block ("\\n" block){{0,{max_calls - 1}}}\nblock ::= {_esc("```json" + chr(10))} call {_esc(chr(10) + "```")}\n'
  elif fmt == "tool_call_tags":
    head = (f'root ::= block ("\\n" block){{0,{max_calls - 1}}}\n'
            f'block ::= {_esc("<tool_call>" + chr(10))} call {_esc(chr(10) + "</tool_call>")}\n')
  else:
    head = f'root ::= "[" call (", " call){{0,{max_calls - 1}}} "]"\n'
  g = compiler.ebnf(head + call)
  g.kind, g.meta = "tool_calls", {"format": fmt, "tools": tools, "indent": indent}
  return g


_FENCE = re.compile(r"```(?:json)?\s*(.*?)```", re.S)
_TAG = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def parse_calls(text: str, fmt: str | None = None) -> list[dict[str, Any]]:
  """Calls written in any of :data:`FORMATS` (lenient: the constrained output is a subset).

  Returns ``[{"name": str, "arguments": dict}, ...]``; raises ValueError if nothing parses.
  """
  blobs: list[Any] = []
  for rx in (_TAG, _FENCE):
    for m in rx.finditer(text):
      try:
        blobs.append(json.loads(m.group(1)))
      except json.JSONDecodeError:
        pass
    if blobs:
      break
  if not blobs:
    try:
      blobs.append(json.loads(text.strip()))
    except json.JSONDecodeError:
      raise ValueError(f"no tool call could be parsed from {text[:200]!r}") from None
  calls = []
  for b in blobs:
    for c in (b if isinstance(b, list) else [b]):
      if isinstance(c, dict) and isinstance(c.get("name"), str):
        args = c.get("arguments", c.get("parameters", {}))
        calls.append({"name": c["name"], "arguments": args if isinstance(args, dict) else {}})
  if not calls:
    raise ValueError(f"no tool call could be parsed from {text[:200]!r}")
  return calls


def tools_system_prompt(tools: list[dict], fmt: str) -> str:
  """For chat templates that ignore ``tools``: describe them and the answer format in text."""
  tools = normalize_tools(tools)
  shape = {"fenced_json": 'a ```json block {"name": ..., "arguments": {...}} per call',
           "tool_call_tags": '<tool_call>{"name": ..., "arguments": {...}}</tool_call> per call',
           "json_list": 'a JSON list of {"name": ..., "arguments": {...}} objects'}[fmt]
  return ("You can call these functions:\n" + "\n".join(json.dumps(t) for t in tools)
          + f"\nAnswer with {shape}.")
