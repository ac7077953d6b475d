"""Function-calling grammar adapter (paper §3.3, Eq. 4, A.1, B.1): z_t = φ(s_{t-1}, y_t, s_t).

Per request, :class:`FCAdapter` owns nothing but observes the request's :class:`Matcher` around
``accept``.  The decode loop calls, for every sampled token::

    tag_ids, state_id = adapter.accept(matcher, token)   # int32[4] (Eq. 12 candidates), int

which accepts the token on the matcher (raising if the grammar rejects it) and returns the tags of
that transition.  Inputs, all already computed for constrained decoding or cheap:

* the jump-forward string before the token (``find_jump_forward_string``): the bytes the grammar
  forces.  A token byte beyond that forced prefix is a real choice;
* the jump-forward string after the token: empty ⇒ the frontier has reached a real choice;
* an incremental JSON scan of the accepted bytes against the tool schemas (the frontier alone
  cannot tell required from optional keys, nor which property a string belongs to);
* the XGrammar frontier after the token (rule names + element ids), only for the parser-state id
  of the reserve Γ (:mod:`pask_jax.grammar.frontier`).

Choices (Table 5 vocabulary, per byte of the token):

* class ``pure_scaffold``: JSON punctuation, whitespace, string quotes, the call object's own keys
  (``name``, ``arguments``) and the format's wrapper (fences, ``<tool_call>`` tags, list brackets).
  ``schema_bearing``: the function name, argument keys, and values whose set of spellings the
  schema fixes (``enum``/``const`` values and ``true``/``false``/``null``).  ``free_generation``:
  other argument values (free string contents, numbers).
* role ``dispatch_key``: function-name bytes; ``required``/``optional``: argument keys and values,
  from the schema's ``required`` — nested properties are ``required`` only when every enclosing
  property is (an optional argument's required sub-field is optional for the call); key bytes whose
  prefix still matches both a required and an optional property get both roles (candidates);
  ``scaffold_separator``: every ``pure_scaffold`` byte.
* state ``critical`` when the group's bytes include one past the forced prefix, ``boundary``
  otherwise (forced bytes carry no decision).
* next ``lookahead_critical`` when the jump-forward string after the token is empty and the matcher
  has not terminated (the next byte is a real choice), else ``no_lookahead``.
* A token whose bytes fall in several (class, role, state) groups — ``"}``, ``Tokyo"`` — gets one
  candidate per group, in byte order (Eq. 12); more than 4 groups are coarsened to their parents.
* A stop token gets ``[STOP, PAD, PAD, PAD]`` (it charges nothing, B.7).
* Schemas: ``properties``/``required``/``items``, with ``anyOf``/``oneOf``/``allOf`` branches
  merged; ``$ref`` is not followed (such values count as free, keys as optional).
* Rollback is not supported: the scan is forward-only (build a fresh adapter after a rollback).
  ``fork()`` copies the scan state, for a matcher forked at the same point.
"""
from __future__ import annotations

import copy
from typing import Any, Sequence

import numpy as np

from pask_jax import tags as T
from pask_jax.grammar.frontier import UNSEEN, Frontier, StateVocab

Cls, Role = T.Cls, T.FCRole
SCAF = (Cls.PURE_SCAFFOLD, Role.SCAFFOLD_SEPARATOR)
_WS = frozenset(b" \t\r\n")
_SCALAR = frozenset(b"0123456789+-.eEtrufalsn")


class Adapter:
  """Shared machinery: forced prefix, per-byte scan, grouping into candidates, state id.

  Subclasses give ``_feed(byte) -> tags | None | Word`` and ``_pack(cls, role, crit, nxt)``.
  """

  def __init__(self, grammar, tokenizer: Any, *, vocab: StateVocab | None = None,
               stop_ids: Sequence[int] | None = None):
    self.grammar = grammar
    self.tb = tokenizer if isinstance(tokenizer, (list, tuple)) else tokenizer.token_bytes()
    self.stop_ids = frozenset(stop_ids if stop_ids is not None else tokenizer.stop_ids)
    self.vocab = vocab
    self.frontier = _frontier(grammar) if vocab is not None else None
    self.last_key: str | None = None

  def accept(self, matcher, token: int) -> tuple[np.ndarray, int]:
    """Accept ``token`` on ``matcher`` and return (tag candidates int32[4], parser-state id)."""
    token = int(token)
    if token in self.stop_ids:
      if not matcher.accept(token):
        raise RuntimeError(f"grammar rejected stop token {token}")
      return T.candidates(T.STOP), self._state_id(matcher)
    before = matcher.m.find_jump_forward_string().encode()
    if not matcher.accept(token):
      raise RuntimeError(f"grammar rejected token {token} ({self.tb[token]!r})")
    after = matcher.m.find_jump_forward_string()
    nxt = T.Next.LOOKAHEAD_CRITICAL if not after and not matcher.m.is_terminated() \
        else T.Next.NO_LOOKAHEAD
    return self._tag(self.tb[token], before, nxt), self._state_id(matcher)

  def fork(self) -> "Adapter":
    """An independent adapter in the same scan state (to pair with a forked matcher).

    Heavy shared parts (token bytes, grammar, tool schemas, state vocabulary) are shared; the
    per-request scan state is copied by :meth:`_copy_state`."""
    new = copy.copy(self)
    self._copy_state(new)
    return new

  def _copy_state(self, new: "Adapter") -> None:
    raise NotImplementedError(f"{type(self).__name__} cannot fork")

  def tag_bytes(self, data: bytes, forced: bytes = b"",
                nxt: T.Next = T.Next.NO_LOOKAHEAD) -> np.ndarray:
    """Tags of bytes fed without a matcher (tests, offline labeling of reference outputs)."""
    return self._tag(data, forced, nxt)

  def _tag(self, data: bytes, before: bytes, nxt) -> np.ndarray:
    n_forced = 0
    for a, b in zip(before, data):
      if a != b:
        break
      n_forced += 1
    per = [self._feed(c) for c in data]
    groups: dict[tuple, bool] = {}   # (cls, role) -> has an unforced byte; insertion = byte order
    for i, tg in enumerate(per):
      if tg is None:  # attaches to the next tagged byte of the token, else the previous, else idle
        tg = next((t for t in per[i + 1:] if t is not None), None)
        if tg is None:
          tg = next((t for t in reversed(per[:i]) if t is not None), None)
        if tg is None:
          tg = self._idle()
      if not isinstance(tg, tuple):
        tg = tg.tags()
      for cr in (tg if isinstance(tg[0], tuple) else (tg,)):
        groups[cr] = groups.get(cr, False) or i >= n_forced
    ids = list(dict.fromkeys(self._pack(c, r, crit, nxt) for (c, r), crit in groups.items()))
    return T.candidates(*coarsen(ids))

  def _state_id(self, matcher) -> int:
    if self.vocab is None:
      return UNSEEN
    self.last_key = self.frontier.key(matcher.m)
    return self.vocab(self.last_key)

  def state_key(self, matcher) -> str:
    """The frontier key of the matcher's current state (calibration collects these)."""
    fr = self.frontier or _frontier(self.grammar)
    return fr.key(matcher.m)

  def _idle(self):
    return SCAF


def _frontier(grammar) -> Frontier:
  """One frontier reader per grammar (reading the rule names costs ~40 ms on a tool grammar)."""
  fr = getattr(grammar, "_pask_frontier", None)
  if fr is None:
    fr = grammar._pask_frontier = Frontier(grammar.compiled)
  return fr


def coarsen(ids: list[int]) -> list[int]:
  """More than N_CAND candidates: replace them by their parents (drop next, then state, role)."""
  for _ in range(3):
    if len(ids) <= T.N_CAND:
      return ids
    ids = list(dict.fromkeys(T.parents(i)[1] if len(T.parents(i)) > 1 else i for i in ids))
  return ids[:T.N_CAND]


# ---- JSON scan against the tool schemas -----------------------------------------------------

def _merged(schema: Any) -> tuple[dict, set]:
  """(properties, required) of an object schema, merging anyOf/oneOf/allOf branches."""
  if not isinstance(schema, dict):
    return {}, set()
  props = dict(schema.get("properties") or {})
  req = set(schema.get("required") or ())
  for k in ("anyOf", "oneOf", "allOf"):
    for br in schema.get(k) or ():
      p, r = _merged(br)
      for name, sub in p.items():
        props.setdefault(name, sub)
      req |= r
  return props, req


def _items(schema: Any) -> Any:
  if not isinstance(schema, dict):
    return None
  if "items" in schema:
    return schema["items"]
  for k in ("anyOf", "oneOf"):
    for br in schema.get(k) or ():
      if isinstance(br, dict) and "items" in br:
        return br["items"]
  return None


def _value_cls(schema: Any, literal: bool) -> Cls:
  if literal:
    return Cls.SCHEMA_BEARING
  if isinstance(schema, dict) and ("enum" in schema or "const" in schema):
    return Cls.SCHEMA_BEARING
  return Cls.FREE_GENERATION


class _Frame:
  __slots__ = ("kind", "ctx", "schema", "role", "key", "props", "req", "tool")

  def __init__(self, kind, ctx, schema=None, role=None):
    self.kind, self.ctx, self.schema, self.role = kind, ctx, schema, role
    self.key = None
    self.tool = None
    self.props, self.req = _merged(schema) if ctx == "args" else ({}, set())

  def copy(self) -> "_Frame":
    new = object.__new__(_Frame)
    for k in _Frame.__slots__:   # props/req/schema are never mutated after construction
      setattr(new, k, getattr(self, k))
    return new


class FCAdapter(Adapter):
  """Tags of tool-call outputs in every format of :mod:`pask_jax.grammar.toolcall`.

  ``grammar``: the Grammar of :func:`tool_call_grammar` (its ``meta["tools"]`` gives the schemas;
  or pass ``tools=``).  ``tokenizer``: a Tokenizer or its ``token_bytes()`` list (then give
  ``stop_ids``).  ``vocab``: a :class:`StateVocab` for parser-state ids (None → always -1, and the
  frontier is not read at all).
  """

  def __init__(self, grammar, tokenizer, *, tools: list[dict] | None = None,
               vocab: StateVocab | None = None, stop_ids: Sequence[int] | None = None):
    super().__init__(grammar, tokenizer, vocab=vocab, stop_ids=stop_ids)
    tools = tools if tools is not None else grammar.meta["tools"]
    self.tools = {t["name"]: t.get("parameters") or {} for t in tools}
    self.reset()

  def reset(self) -> None:
    self.stack: list[_Frame] = []
    self.instr = None        # None, "key" or "value"
    self.esc = False
    self.buf = bytearray()   # the current string's bytes
    self.str_tag: Any = SCAF
    self.scalar = None       # tag of the number/literal being scanned

  def _copy_state(self, new: "FCAdapter") -> None:
    new.stack = [f.copy() for f in self.stack]
    new.buf = bytearray(self.buf)

  def _pack(self, c, r, crit, nxt):
    return T.fc(c, r, T.FCState.CRITICAL if crit else T.FCState.BOUNDARY, nxt)

  # Per byte: the (class, role) tag, or a tuple of them when a key prefix is ambiguous.
  def _feed(self, c: int):
    if self.instr is not None:
      if self.esc:
        self.esc = False
      elif c == 0x5C:  # backslash
        self.esc = True
      elif c == 0x22:  # closing quote
        self._end_string()
        return SCAF
      self.buf.append(c)
      return self._key_tag() if self.instr == "key" else self.str_tag
    if self.scalar is not None:
      if c in _SCALAR:
        return self.scalar
      self.scalar = None
    st = self.stack
    if c in _WS:
      return SCAF
    if not st:
      if c == 0x7B:  # "{" outside any JSON: a call object
        st.append(_Frame("o", "call"))
      elif c == 0x5B:
        st.append(_Frame("a", "wrap"))
      return SCAF
    top = st[-1]
    if c in b"}]":
      st.pop()
      return SCAF
    if c in b",:":
      if c == 0x2C and top.kind == "o":
        top.key = None
      return SCAF
    if top.kind == "o" and top.key is None:  # a key starts
      if c == 0x22:
        self.instr, self.buf = "key", bytearray()
      return SCAF
    return self._value(c, top)

  def _child(self, top: _Frame):
    """(ctx, schema, role) of the value about to start in ``top``."""
    if top.ctx == "wrap":
      return "call", None, None
    if top.ctx == "call":
      if top.key == b"name":
        return "name", None, None
      if top.key == b"arguments":
        return "args", self.tools.get(top.tool), None
      return "scaf", None, None
    if top.kind == "a":
      return "args", _items(top.schema), top.role
    name = top.key.decode("utf-8", "replace")
    sub = top.props.get(name)
    req = name in top.req and top.role in (None, Role.REQUIRED)
    return "args", sub, Role.REQUIRED if req else Role.OPTIONAL

  def _value(self, c: int, top: _Frame):
    ctx, schema, role = self._child(top)
    if c == 0x7B:
      self.stack.append(_Frame("o", "call" if ctx == "call" else ctx, schema, role))
      return SCAF
    if c == 0x5B:
      self.stack.append(_Frame("a", ctx, schema, role))
      return SCAF
    if ctx == "name":
      tag = (Cls.SCHEMA_BEARING, Role.DISPATCH_KEY)
    elif ctx == "scaf" or role is None:
      tag = SCAF
    else:
      tag = (_value_cls(schema, c != 0x22 and c not in b"-0123456789"), role)
    if c == 0x22:
      self.instr, self.buf, self.str_tag = "value", bytearray(), tag
      return SCAF
    self.scalar = tag
    return tag

  def _key_tag(self):
    top = self.stack[-1]
    if top.ctx != "args":
      return SCAF
    parent_req = top.role in (None, Role.REQUIRED)
    pre = bytes(self.buf).decode("utf-8", "ignore")
    roles = {Role.REQUIRED if (k in top.req and parent_req) else Role.OPTIONAL
             for k in top.props if k.startswith(pre)} or {Role.OPTIONAL}
    out = tuple((Cls.SCHEMA_BEARING, r) for r in sorted(roles))
    return out[0] if len(out) == 1 else out

  def _end_string(self):
    top = self.stack[-1] if self.stack else None
    if self.instr == "key" and top is not None:
      top.key = bytes(self.buf)
    elif top is not None and top.ctx == "call" and top.key == b"name":
      top.tool = bytes(self.buf).decode("utf-8", "replace")
    self.instr = None
