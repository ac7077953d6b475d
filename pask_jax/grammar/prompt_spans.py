"""Prompt-span labels for the prefill companion (paper §3.6, A.3, Table 6).

Per prompt the decode loop calls once::

    ids, tags = label_prompt(tokenizer, text)   # ids == tokenizer.encode(text); tags int32[T, 4]

Deterministic span matching over the rendered prompt text, no general parser:

* Everything starts as ``protected_content``.
* **Tool-schema JSON**: at every ``{``/``[`` the text is tried as a JSON value
  (``json.JSONDecoder.raw_decode``); a value that is a tool (``{"name": str, "parameters": dict}``,
  optionally wrapped as ``{"type": "function", "function": {...}}``) or a list of tools is a
  validated span.  This finds Qwen's ``<tools>`` lines, a system-message list, or a JSON array
  alike.  Invalid or unrecognized JSON keeps the default.
* **SQLite DDL**: each ``CREATE TABLE ... ( ... )[;]`` statement that SQLite itself accepts
  (executed in an in-memory database) is a validated span.
* Inside a validated span, everything is ``schema_scaffold`` (punctuation, quotes, whitespace,
  structural keys, keywords) except (Table 6):

  - tools: the function ``name`` value → ``function_name``; keys of a ``properties`` object and the
    entries of ``required`` → ``parameter_key``; values of ``type`` inside ``parameters`` (and of
    ``format``/``pattern``/numeric and length bounds) → ``type_constraint``; ``enum``/``const``
    values → ``enum_constraint``; ``description``/``title`` values → ``schema_description``.
    String contents only: the quotes stay scaffold.  ``default`` values stay scaffold.
  - DDL: the table name → ``function_name``; column names → ``parameter_key``; the declared type
    (words and its ``(n)``) → ``type_constraint``; constraint keywords and literals (PRIMARY KEY,
    NOT NULL, UNIQUE, REFERENCES, DEFAULT x, CHECK, FOREIGN KEY, ...) → ``enum_constraint``;
    identifiers inside a constraint keep identifier labels (a referenced table →
    ``function_name``, columns in parentheses → ``parameter_key``).

* Token labels: the distinct labels of a token's characters (tokenizers' offsets), in text order,
  as candidates (Eq. 12; a token crossing a boundary, e.g. ``{"`` + key, gets both).  A BOS the
  tokenizer prepends, and special tokens, are ``protected_content`` unless they lie in a span.
"""
from __future__ import annotations

import bisect
import json
import re
import sqlite3

import numpy as np

from pask_jax import tags as T

P = T.PromptLabel
_DEC = json.JSONDecoder()
_TYPEY = {"type", "format", "pattern", "minimum", "maximum", "exclusiveMinimum",
          "exclusiveMaximum", "multipleOf", "minLength", "maxLength", "minItems", "maxItems"}


# ---- tool JSON ------------------------------------------------------------------------------

def _tool_fn(x) -> dict | None:
  if not isinstance(x, dict):
    return None
  f = x.get("function") if x.get("type") == "function" and isinstance(x.get("function"), dict) \
      else x
  if isinstance(f.get("name"), str) and isinstance(f.get("parameters"), dict):
    return f
  return None


def is_tools(x) -> bool:
  """A tool, or a non-empty list of tools (the validation of A.3)."""
  if isinstance(x, list):
    return bool(x) and all(_tool_fn(t) is not None for t in x)
  return _tool_fn(x) is not None


class JsonLabeler:
  """Labels the characters of one valid JSON value (tool schemas) in ``lab``."""

  def __init__(self, text: str, lab: np.ndarray):
    self.s, self.lab = text, lab

  def ws(self, i):
    s = self.s
    while i < len(s) and s[i] in " \t\r\n":
      i += 1
    return i

  def string(self, i, label):
    """``s[i] == '"'``; label the contents; return (end, decoded)."""
    val, end = _DEC.raw_decode(self.s, i)
    if label != P.SCHEMA_SCAFFOLD:
      self.lab[i + 1:end - 1] = label
    return end, val

  def value(self, i, ctx):
    """ctx: (key, in_schema, key_is_param, in_array)."""
    s = self.s
    i = self.ws(i)
    c = s[i]
    key, in_schema, is_param = ctx
    if c == "{":
      props = (key == "properties" and in_schema and not is_param)
      schema = in_schema or (key == "parameters" and not is_param)
      i = self.ws(i + 1)
      if s[i] == "}":
        return i + 1
      while True:
        k0 = self.ws(i)
        i, k = self.string(k0, P.PARAMETER_KEY if props else P.SCHEMA_SCAFFOLD)
        i = self.ws(i)
        i = self.value(i + 1, (k, schema, props))  # skip ':'
        i = self.ws(i)
        if s[i] == "}":
          return i + 1
        i += 1  # ','
    if c == "[":
      i = self.ws(i + 1)
      if s[i] == "]":
        return i + 1
      while True:
        i = self.value(i, (("[]", key), in_schema, is_param))
        i = self.ws(i)
        if s[i] == "]":
          return i + 1
        i += 1
    label = self.scalar_label(ctx)
    if c == '"':
      return self.string(i, label)[0]
    _, end = _DEC.raw_decode(s, i)
    self.lab[i:end] = label
    return end

  @staticmethod
  def scalar_label(ctx):
    key, in_schema, is_param = ctx
    if is_param:  # a property named like a keyword whose value is a scalar: not a schema field
      return P.SCHEMA_SCAFFOLD
    if isinstance(key, tuple):  # array element: the array's key decides
      k = key[1]
      if k in ("enum",) and in_schema:
        return P.ENUM_CONSTRAINT
      if k == "required" and in_schema:
        return P.PARAMETER_KEY
      if k == "type" and in_schema:
        return P.TYPE_CONSTRAINT
      return P.SCHEMA_SCAFFOLD
    if key in ("description", "title"):
      return P.SCHEMA_DESCRIPTION
    if not in_schema:
      return P.FUNCTION_NAME if key == "name" else P.SCHEMA_SCAFFOLD
    if key in _TYPEY:
      return P.TYPE_CONSTRAINT
    if key == "const":
      return P.ENUM_CONSTRAINT
    return P.SCHEMA_SCAFFOLD


_TOK = re.compile(r'[ \t\n\r]*(?:(")|(-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?)'
                  r'|(true|false|null)|([{}\[\]:,]))')
_STR = re.compile(r'"(?:[^"\\\x00-\x1f]+|\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4}))*"')
_OPEN = re.compile(r"[\[{]")
MAX_DEPTH = 128   # JSON nested deeper than this is not searched for tools (stays protected)


class _Budget(Exception):
  pass


class _Scanner:
  """Where the JSON value at each ``{``/``[`` of a text ends (-1: none), in linear time.

  One iterative pass per starting bracket, memoized for every container it opens: a container
  nested in a value parses the same on its own (JSON is context-free), so a container once
  closed — or left open when its parse failed — is never scanned again.  Brackets inside
  strings are scanned fresh; a total budget of tokens (a small multiple of the text length)
  bounds even adversarial texts, after which the rest stays ``protected_content``."""

  def __init__(self, text: str):
    self.s, self.memo = text, {}
    self.budget = 4 * len(text) + 10_000

  def end(self, j: int) -> int:
    e = self.memo.get(j)
    return self._scan(j) if e is None else e

  def _scan(self, j: int) -> int:
    s, memo = self.s, self.memo
    stack: list[tuple[int, bool]] = []
    expect, pos = "value", j
    while True:
      self.budget -= 1
      if self.budget < 0:
        raise _Budget
      m = _TOK.match(s, pos)
      if m is None:
        break
      q, num, lit, p = m.groups()
      t0 = m.start(m.lastindex)
      if expect in ("value", "value_or_close"):
        if p is not None and p in "{[":
          e = memo.get(t0)
          if e is not None and t0 != j:
            if e < 0:
              break
            pos = e
          elif len(stack) >= MAX_DEPTH:
            break
          else:
            stack.append((t0, p == "{"))
            expect, pos = ("key_or_close" if p == "{" else "value_or_close"), m.end()
            continue
        elif p == "]" and expect == "value_or_close":
          pos = self._close(stack, m.end())
        elif q:
          sm = _STR.match(s, t0)
          if sm is None:
            break
          pos = sm.end()
        elif num or lit:
          pos = m.end()
        else:
          break
      elif expect in ("key", "key_or_close"):
        if p == "}" and expect == "key_or_close":
          pos = self._close(stack, m.end())
        elif q:
          sm = _STR.match(s, t0)
          if sm is None:
            break
          expect, pos = "colon", sm.end()
          continue
        else:
          break
      elif expect == "colon":
        if p != ":":
          break
        expect, pos = "value", m.end()
        continue
      else:   # comma_or_close
        obj = stack[-1][1]
        if p == ",":
          expect, pos = ("key" if obj else "value"), m.end()
          continue
        if p != ("}" if obj else "]"):
          break
        pos = self._close(stack, m.end())
      if not stack:
        return pos
      expect = "comma_or_close"
    for start, _ in stack:
      memo[start] = -1
    memo.setdefault(j, -1)
    return -1

  def _close(self, stack, end: int) -> int:
    start, _ = stack.pop()
    self.memo[start] = end
    return end


def json_spans(text: str, lab: np.ndarray) -> None:
  """Label every tool-schema JSON value of ``text`` (the first valid value at each bracket, as
  ``raw_decode`` would take it; a value that is not tools is searched inside).  Linear time."""
  sc = _Scanner(text)
  hits = [m.start() for m in re.finditer(r'"parameters"', text)]
  i, n = 0, len(text)
  try:
    while i < n:
      m = _OPEN.search(text, i)
      if m is None:
        return
      j = m.start()
      e = sc.end(j)
      # A tool needs a "parameters" key: only such values are decoded and checked.
      k = bisect.bisect_left(hits, j)
      if e < 0 or k == len(hits) or hits[k] >= e:
        i = j + 1
        continue
      try:
        val = json.loads(text[j:e])
      except (ValueError, RecursionError):
        i = j + 1
        continue
      if is_tools(val):
        lab[j:e] = P.SCHEMA_SCAFFOLD
        JsonLabeler(text, lab).value(j, (None, False, False))
        i = e
      else:
        i = j + 1  # a non-tool JSON value may still contain a tool list deeper in
  except _Budget:
    return


# ---- SQLite DDL -----------------------------------------------------------------------------

_CREATE = re.compile(r"\bCREATE\s+(?:TEMP(?:ORARY)?\s+)?TABLE\b", re.I)
_LEX = re.compile(r"""\s+|"(?:[^"]|"")*"|`[^`]*`|\[[^\]]*\]|'(?:[^']|'')*'|[A-Za-z_][\w$]*|"""
                  r"""[-+]?\d+(?:\.\d+)?|.""", re.S)
_CONSTRAINT_KW = {"PRIMARY", "KEY", "NOT", "NULL", "UNIQUE", "REFERENCES", "DEFAULT", "CHECK",
                  "COLLATE", "AUTOINCREMENT", "FOREIGN", "CONSTRAINT", "ON", "DELETE", "UPDATE",
                  "CASCADE", "SET", "RESTRICT", "NO", "ACTION", "ASC", "DESC", "CONFLICT",
                  "GENERATED", "ALWAYS", "AS", "STORED", "VIRTUAL", "DEFERRABLE", "INITIALLY",
                  "DEFERRED", "IMMEDIATE", "MATCH"}
_TABLE_CONSTRAINT = {"PRIMARY", "FOREIGN", "UNIQUE", "CHECK", "CONSTRAINT"}


def _statement_end(text: str, start: int, limit: int | None = None) -> int | None:
  """End of the CREATE TABLE statement at ``start`` (after ')' and an optional ';'), looking no
  further than ``limit`` (the next CREATE TABLE: statements do not nest, and the bound keeps a
  text of unclosed statements linear)."""
  depth, i, n = 0, start, len(text)
  for m in _LEX.finditer(text, start, n if limit is None else limit):
    tok = m.group()
    if tok == "(":
      depth += 1
    elif tok == ")":
      depth -= 1
      if depth == 0:
        i = m.end()
        k = i
        while k < n and text[k] in " \t":
          k += 1
        return k + 1 if k < n and text[k] == ";" else i
    elif tok == ";" and depth == 0:
      return None
  return None


def _valid_ddl(stmt: str) -> bool:
  con = sqlite3.connect(":memory:")
  try:
    con.execute(stmt.rstrip().rstrip(";"))
    return True
  except sqlite3.Error:
    return False
  finally:
    con.close()


def _set_ident(lab, m, label):
  """Label an identifier token's name (without its quotes)."""
  a, b = m.span()
  if m.group()[0] in "\"`[":
    a, b = a + 1, b - 1
  lab[a:b] = label


def _label_ddl(text: str, start: int, end: int, lab: np.ndarray) -> None:
  lab[start:end] = P.SCHEMA_SCAFFOLD
  toks = [m for m in _LEX.finditer(text, start, end) if not m.group().isspace()]
  i = 0
  while i < len(toks) and toks[i].group() != "(":  # CREATE TABLE [IF NOT EXISTS] name
    i += 1
  if i > 0:
    _set_ident(lab, toks[i - 1], P.FUNCTION_NAME)
  depth, item_start, mode, after_ref = 0, True, "name", False
  for m in toks[i:]:
    t = m.group()
    up = t.upper()
    if t == "(":
      depth += 1
      if depth == 1:
        item_start, mode = True, "name"
      continue
    if t == ")":
      depth -= 1
      continue
    if t == "," and depth == 1:
      item_start, mode, after_ref = True, "name", False
      continue
    if t in ",;.":
      continue
    ident = t[0] in "\"`[" or re.match(r"[A-Za-z_]", t)
    if depth == 1 and item_start:
      item_start = False
      if up in _TABLE_CONSTRAINT:
        mode = "constraint"
        lab[m.start():m.end()] = P.ENUM_CONSTRAINT
      else:
        _set_ident(lab, m, P.PARAMETER_KEY)
        mode = "type"
      continue
    if mode == "type" and depth == 1 and up in _CONSTRAINT_KW:
      mode = "constraint"
    if mode == "type":
      lab[m.start():m.end()] = P.TYPE_CONSTRAINT  # type words and their (n[, m])
      continue
    # constraint: keywords and literals → enum; identifiers keep identifier labels
    if ident and up not in _CONSTRAINT_KW:
      _set_ident(lab, m, P.PARAMETER_KEY if depth >= 2 or not after_ref else P.FUNCTION_NAME)
    else:
      lab[m.start():m.end()] = P.ENUM_CONSTRAINT
    after_ref = up == "REFERENCES" or (after_ref and not ident)


def _ddl_spans(text: str, lab: np.ndarray) -> None:
  starts = [m.start() for m in _CREATE.finditer(text)]
  for a, nxt in zip(starts, starts[1:] + [None]):
    if lab[a] != P.PROTECTED_CONTENT:
      continue  # inside a span already labeled
    end = _statement_end(text, a, nxt)
    if end is not None and _valid_ddl(text[a:end]):
      _label_ddl(text, a, end, lab)


# ---- public API -----------------------------------------------------------------------------

def char_labels(text: str) -> np.ndarray:
  """PromptLabel value of every character of ``text`` (int8[len(text)])."""
  lab = np.full((len(text),), int(P.PROTECTED_CONTENT), np.int8)
  json_spans(text, lab)
  _ddl_spans(text, lab)
  return lab


def spans(text: str) -> list[tuple[int, int, P]]:
  """Maximal runs ``(start, end, label)`` of :func:`char_labels` (for reading and tests)."""
  lab = char_labels(text)
  out, a = [], 0
  for i in range(1, len(text) + 1):
    if i == len(text) or lab[i] != lab[a]:
      out.append((a, i, P(int(lab[a]))))
      a = i
  return out


def token_candidates(lab: np.ndarray, offsets) -> np.ndarray:
  """Char labels + token offsets → ``int32[T, 4]`` prompt tag candidates."""
  ids = {int(v): T.prompt(P(v)) for v in P}
  rows = []
  for a, b in offsets:
    seen = list(dict.fromkeys(int(v) for v in lab[a:b])) or [int(P.PROTECTED_CONTENT)]
    rows.append([ids[v] for v in seen[:T.N_CAND]])
  return T.stack_candidates(rows)


def encode(tokenizer, text: str) -> tuple[list[int], list[tuple[int, int]]]:
  """``(ids, char offsets)`` of ``text`` as the model sees it (``ids == tokenizer.encode``)."""
  enc = tokenizer.tok.encode(text, add_special_tokens=False)
  ids, offsets = list(enc.ids), list(enc.offsets)
  if tokenizer.add_bos and tokenizer.bos_id is not None and ids[:1] != [tokenizer.bos_id]:
    ids, offsets = [tokenizer.bos_id] + ids, [(0, 0)] + offsets
  return ids, offsets


def labels(text: str, offsets, tokenizer=None) -> np.ndarray:
  """Prompt tag candidates ``int32[len(offsets), 4]`` for the tokens of :func:`encode`."""
  return token_candidates(char_labels(text), offsets)


def label_prompt(tokenizer, text: str) -> tuple[list[int], np.ndarray]:
  """``(ids, tags)``: ``ids == tokenizer.encode(text)``, ``tags`` int32[len(ids), 4]."""
  ids, offsets = encode(tokenizer, text)
  return ids, labels(text, offsets)
