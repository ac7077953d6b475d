"""XGrammar's parser frontier, and the parser-state id of the reserve Γ (docs/DESIGN.md).

XGrammar exposes the Earley frontier (the states of the last parsing step) only through the
private ``GrammarMatcher._debug_print_internal_state()`` string, e.g.::

  There are 4 steps in history. Last step: [
  ParserState(rule_id=1, sequence_id=8, element_id=8, rule_start_pos=0, sub_element_id=0),
  ]

That format is private, so this module is pinned to the XGrammar versions it was checked on
(:data:`SUPPORTED`); any other version, or a string that does not parse, raises
:class:`FrontierError` with a message saying what to re-check (``tests/test_frontier.py`` is the
guard).  Rule names come from ``compiled.grammar.serialize_json()["rules"][rule_id][0]``.

State key (choice): the sorted, de-duplicated ``(rule name, element id)`` pairs of the frontier,
written ``name:element|name:element``.  Rule *names* rather than rule ids so that keys survive a
re-numbering of rules; ``sequence_id``/``rule_start_pos``/``sub_element_id`` are left out (the
start position grows with the output, so it would make every key unique; the sequence id is
implied by the element id within a rule).  A :class:`StateVocab` built at calibration maps keys to
small ints; an unseen key maps to -1, the pooled reserve.
"""
from __future__ import annotations

import hashlib
import json
import re
from typing import Iterable, NamedTuple

SUPPORTED = ("0.2.8", "0.2.9")
UNSEEN = -1

_HEAD = re.compile(r"There are \d+ steps in history\. Last step: \[")
_PAIR = re.compile(r"rule_id=(-?\d+), sequence_id=-?\d+, element_id=(-?\d+),")
_STATE = re.compile(r"ParserState\(rule_id=(-?\d+), sequence_id=(-?\d+), element_id=(-?\d+), "
                    r"rule_start_pos=(-?\d+), sub_element_id=(-?\d+)\)")


class FrontierError(RuntimeError):
  """XGrammar's private frontier is not available in the format this module was written for."""


class ParserState(NamedTuple):
  rule_id: int
  sequence_id: int
  element_id: int
  rule_start_pos: int
  sub_element_id: int


def xgrammar_version() -> str:
  import importlib.metadata
  return importlib.metadata.version("xgrammar")


def check_version(version: str | None = None) -> None:
  v = version or xgrammar_version()
  if v not in SUPPORTED:
    raise FrontierError(
        f"xgrammar {v} is installed, but the parser-frontier reader is pinned to "
        f"{', '.join(SUPPORTED)}: it parses the private "
        "GrammarMatcher._debug_print_internal_state() "
        "string. Re-check that format (tests/test_frontier.py) and add the version to "
        "pask_jax.grammar.frontier.SUPPORTED, or install xgrammar==0.2.9.")


def parse(text: str) -> list[ParserState]:
  """The last step's parser states from the debug string (raises FrontierError if unrecognized)."""
  head = _HEAD.search(text)
  if head is None:
    raise FrontierError("unrecognized XGrammar internal-state string (no 'Last step: [' header): "
                        f"{text[:200]!r}")
  body = text[head.end():]
  end = body.find("]")
  if end < 0:
    raise FrontierError(f"unterminated XGrammar frontier list: {text[:200]!r}")
  body = body[:end]
  states = [ParserState(*map(int, m.groups())) for m in _STATE.finditer(body)]
  if not states and "ParserState" in body:
    raise FrontierError(f"XGrammar ParserState fields changed: {body[:200]!r}")
  return states


def rule_names(compiled) -> list[str]:
  """Rule names by rule id of a compiled grammar (``xgrammar.CompiledGrammar``)."""
  rules = json.loads(compiled.grammar.serialize_json())["rules"]
  if not rules or not isinstance(rules[0], list) or not isinstance(rules[0][0], str):
    raise FrontierError(f"unrecognized XGrammar rule serialization: {str(rules)[:200]}")
  return [r[0] for r in rules]


class Frontier:
  """Reads the frontier of one matcher (``xgrammar.GrammarMatcher``) of a compiled grammar."""

  def __init__(self, compiled):
    check_version()
    self.names = rule_names(compiled)
    self._keys: dict[frozenset, str] = {}   # frontier (rule id, element id) pairs -> key

  def states(self, xm) -> list[ParserState]:
    return parse(xm._debug_print_internal_state())

  def key(self, xm) -> str:
    """The state key: sorted unique ``name:element`` pairs joined by ``|`` ("" when empty)."""
    # Hot path (once per accepted token): the key depends only on the (rule, element) pairs, so
    # read just those and memoize; a new pair set (or a malformed string) takes the full,
    # checked parse().
    text = xm._debug_print_internal_state()
    head = _HEAD.search(text)
    end = text.find("]", head.end()) if head is not None else -1
    ids = frozenset(_PAIR.findall(text, head.end(), end)) if end >= 0 else None
    key = self._keys.get(ids)
    if key is None:
      names = self.names
      pairs = {(names[s.rule_id] if 0 <= s.rule_id < len(names) else f"#{s.rule_id}",
                s.element_id) for s in parse(text)}
      key = "|".join(f"{n}:{e}" for n, e in sorted(pairs))
      if ids:   # not the empty set: an unrecognized state format must keep reaching parse()
        self._keys[ids] = key
    return key


def key_hash(key: str) -> int:
  """A stable 63-bit hash of a state key (for compact records; not Python's salted ``hash``)."""
  return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") >> 1


class StateVocab:
  """State key -> small int id, built at calibration; unseen keys -> :data:`UNSEEN` (-1).

  ``grow=True`` (calibration) assigns the next id to a new key; ``grow=False`` (serving) never
  changes the vocabulary.  Ids are dense from 0 in first-seen order, so Γ is an array.
  """

  def __init__(self, keys: Iterable[str] = (), grow: bool = False):
    self.ids: dict[str, int] = {}
    for k in keys:
      self.ids.setdefault(k, len(self.ids))
    self.grow = grow

  def __len__(self) -> int:
    return len(self.ids)

  def __call__(self, key: str) -> int:
    i = self.ids.get(key)
    if i is None:
      if not self.grow:
        return UNSEEN
      i = self.ids[key] = len(self.ids)
    return i

  def keys(self) -> list[str]:
    return sorted(self.ids, key=self.ids.get)

  def to_json(self) -> str:
    return json.dumps({"keys": self.keys(), "xgrammar": list(SUPPORTED)})

  @classmethod
  def from_json(cls, text: str) -> "StateVocab":
    return cls(json.loads(text)["keys"])
