"""Function-calling adapter: golden token-by-token tags with the real Qwen2.5 and SmolLM2
vocabularies.

Goldens are written by hand from the rules in pask_jax/grammar/fc_adapter.py's docstring (forced
prefix from the jump-forward string, roles from the schema), not produced by the adapter.
Code: class P/B/F (pure_scaffold, schema_bearing, free_generation), role s/r/o/d
(scaffold_separator, required, optional, dispatch_key), state b/c, next L/N; "+" joins candidates.
"""
import functools
import os
import time

import pytest

from pask_jax.testing import grammar_compiler, smollm2_grammars, stored_tokenizer

from pask_jax import tags as T
from pask_jax.grammar import FORMATS, tool_call_grammar
from pask_jax.grammar.fc_adapter import FCAdapter, coarsen
from pask_jax.grammar.frontier import StateVocab

DATA = os.path.join(os.path.dirname(__file__), "data", "qwen_tokenizer.json.gz")
_C = {"P": T.Cls.PURE_SCAFFOLD, "B": T.Cls.SCHEMA_BEARING, "F": T.Cls.FREE_GENERATION}
_R = {"s": T.FCRole.SCAFFOLD_SEPARATOR, "r": T.FCRole.REQUIRED, "o": T.FCRole.OPTIONAL,
      "d": T.FCRole.DISPATCH_KEY}
_S = {"b": T.FCState.BOUNDARY, "c": T.FCState.CRITICAL}
_N = {"L": T.Next.LOOKAHEAD_CRITICAL, "N": T.Next.NO_LOOKAHEAD}

WEATHER = {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"},
                                     "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city"]}}
TIME = {"name": "get_time",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string"}},
                       "required": ["tz"]}}
FLIGHT = {"name": "book_flight", "parameters": {"type": "object", "properties": {
    "passenger": {"type": "object", "properties": {"name": {"type": "string"},
                                                   "age": {"type": "integer"}},
                  "required": ["name"]},
    "seat": {"type": "string", "enum": ["aisle", "window"]}}, "required": ["passenger"]}}


def code(c: str) -> list[int]:
  """'Bd c N+Ps b N' -> tag ids."""
  out = []
  for part in c.split("+"):
    cr, s, n = part.split()
    out.append(T.fc(_C[cr[0]], _R[cr[1]], _S[s], _N[n]))
  return out


@functools.lru_cache(maxsize=None)
def qwen():
  tok = stored_tokenizer(DATA)
  return tok, grammar_compiler(tok)




def run(tok, gc, tools, fmt, indent, text, vocab=None):
  g = tool_call_grammar(gc, tools, fmt, indent=indent)
  ad, m = FCAdapter(g, tok, vocab=vocab), g.matcher()
  rows = []
  for i in tok.encode(text):
    cands, sid = ad.accept(m, i)
    rows.append((tok.decode([i]), [int(c) for c in cands if c != T.PAD], sid))
  cands, sid = ad.accept(m, tok.stop_ids[0])
  assert list(cands) == [T.STOP, T.PAD, T.PAD, T.PAD] and m.terminated
  return rows


def check(rows, golden):
  assert [r[0] for r in rows] == [g[0] for g in golden], "tokenization changed"
  for (piece, got, _), (_, want) in zip(rows, golden):
    assert got == code(want), (piece, [T.describe(i) for i in got], want)


def test_required_optional_enum_qwen_fenced_indent2():
  tok, gc = qwen()
  text = ('```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Tokyo",\n'
          '    "unit": "fahrenheit"\n  }\n}\n```')
  golden = [
      ("```", "Ps b N"), ("json", "Ps b N"), ("\n", "Ps b N"), ("{\n", "Ps b N"), (" ", "Ps b N"),
      (' "', "Ps b N"), ("name", "Ps b N"), ('":', "Ps b N"), (' "', "Ps b N"),
      ("get", "Bd b N"),            # "get_" is shared by both tools: forced
      ("_weather", "Bd c N"),       # "weather" is the dispatch decision
      ('",\n', "Ps b N"), (" ", "Ps b N"), (' "', "Ps b N"), ("arguments", "Ps b N"),
      ('":', "Ps b N"), (" {\n", "Ps b N"), ("   ", "Ps b N"), (' "', "Ps b N"),
      ("city", "Br b N"),           # required key, forced (strict property order)
      ('":', "Ps b N"), (' "', "Ps b L"),
      ("Tok", "Fr c L"), ("yo", "Fr c L"),
      ('",\n', "Ps c N"),           # closing the string and choosing to add "unit"
      ("   ", "Ps b N"), (' "', "Ps b N"), ("unit", "Bo b N"), ('":', "Ps b N"),
      (' "', "Ps b L"),             # enum choice ahead
      ("f", "Bo c N"), ("ahrenheit", "Bo b N"),   # enum value: schema-bearing, forced tail
      ('"\n', "Ps b N"), (" ", "Ps b N"), (" }\n", "Ps b N"), ("}\n", "Ps b N"),
      ("```", "Ps b L"),            # stop or another block: a real choice
  ]
  check(run(tok, gc, [WEATHER, TIME], "fenced_json", 2, text), golden)


def test_parallel_two_functions_smollm2_json_list():
  tok, gc = smollm2_grammars()
  text = ('[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
          '{"name": "get_time", "arguments": {"tz": "CET"}}]')
  call_head = [("{\"", "Ps b N"), ("name", "Ps b N"), ('":', "Ps b N"), (' "', "Ps b N"),
               ("get", "Bd b N"), ("_", "Bd b L")]
  args_head = [('",', "Ps b N"), (' "', "Ps b N"), ("arguments", "Ps b N"), ('":', "Ps b N"),
               (' {"', "Ps b N")]
  golden = ([("[", "Ps b N")] + call_head + [("weather", "Bd c N")] + args_head
            + [("city", "Br b N"), ('":', "Ps b N"), (' "', "Ps b L"), ("Paris", "Fr c L"),
               ('"}', "Ps c N"),    # '"' ends the string, '}' skips the optional unit
               ("},", "Ps c N")]    # ',' chooses a second call
            + [(" " + p if i == 0 else p, c) for i, (p, c) in enumerate(call_head)]
            + [("time", "Bd c N")] + args_head
            + [("tz", "Br b N"), ('":', "Ps b N"), (' "', "Ps b L"), ("C", "Fr c L"),
               ("ET", "Fr c L"), ('"', "Ps c N"), ("}}", "Ps b L"), ("]", "Ps c L")])
  check(run(tok, gc, [WEATHER, TIME], "json_list", None, text), golden)


def test_nested_object_qwen_tool_call_tags():
  tok, gc = qwen()
  text = ('<tool_call>\n{"name": "book_flight", "arguments": {"passenger": {"name": "Ann", '
          '"age": 30}, "seat": "aisle"}}\n</tool_call>')
  golden = [
      ("<tool_call>", "Ps b N"), ("\n", "Ps b N"), ('{"', "Ps b N"), ("name", "Ps b N"),
      ('":', "Ps b N"), (' "', "Ps b N"),
      ("book", "Bd b N"), ("_flight", "Bd b N"),   # one tool: the name is forced
      ('",', "Ps b N"), (' "', "Ps b N"), ("arguments", "Ps b N"), ('":', "Ps b N"),
      (' {"', "Ps b N"), ("pass", "Br b N"), ("enger", "Br b N"), ('":', "Ps b N"),
      (' {"', "Ps b N"),
      ("name", "Br b N"),           # nested key: required inside a required argument
      ('":', "Ps b N"), (' "', "Ps b L"), ("Ann", "Fr c L"),
      ('",', "Ps c N"), (' "', "Ps b N"),
      ("age", "Bo b N"),            # optional nested key
      ('":', "Ps b N"), (" ", "Ps b L"), ("3", "Fo c L"), ("0", "Fo c L"),
      ("},", "Ps c N"), (' "', "Ps b N"), ("seat", "Bo b N"), ('":', "Ps b N"),
      (' "', "Ps b L"), ("ais", "Bo c N"), ("le", "Bo b N"),
      ('"}}\n', "Ps b N"), ("</tool_call>", "Ps b L"),
  ]
  check(run(tok, gc, [FLIGHT], "tool_call_tags", None, text), golden)


CALLS = [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"tz": "UTC"})]


def render(fmt, indent):
  import json
  objs = [json.dumps({"name": n, "arguments": a}, indent=indent) for n, a in CALLS]
  if fmt == "fenced_json":
    return "\n".join(f"```json\n{o}\n```" for o in objs)
  if fmt == "tool_call_tags":
    return "\n".join(f"<tool_call>\n{o}\n</tool_call>" for o in objs)
  return "[" + ", ".join(objs) + "]"


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("indent", [None, 2])
def test_parallel_roles_every_format(fmt, indent):
  """Per byte: dispatch bytes spell the names; required/optional bytes the keys and values."""
  tok, gc = qwen()
  text = render(fmt, indent)
  g = tool_call_grammar(gc, [WEATHER, TIME], fmt, indent=indent)
  ad, m = FCAdapter(g, tok), g.matcher()
  for i in tok.encode(text):
    ad.accept(m, i)
  ad.accept(m, tok.stop_ids[0])
  assert m.terminated
  ad.reset()
  by = {}
  for ch in text.encode():
    (tid,) = [int(c) for c in ad.tag_bytes(bytes([ch])) if c != T.PAD]
    role = T.FCRole(T.unpack(tid)[2])
    by[role] = by.get(role, b"") + bytes([ch])
  assert by[T.FCRole.DISPATCH_KEY] == b"get_weatherget_time"
  assert by[T.FCRole.REQUIRED] == b"cityParistzUTC"
  assert by[T.FCRole.OPTIONAL] == b"unitcelsius"


def test_ambiguous_key_prefix_gives_both_roles():
  tok, gc = qwen()
  tool = {"name": "f", "parameters": {"type": "object", "properties": {
      "id": {"type": "integer"}, "idx": {"type": "integer"}}, "required": ["id"]}}
  g = tool_call_grammar(gc, [tool], "json_list")
  ad = FCAdapter(g, tok)
  ad.tag_bytes(b'[{"name": "f", "arguments": {"id": 1, "')
  got = [int(c) for c in ad.tag_bytes(b"id", forced=b"") if c != T.PAD]
  want = {T.fc(T.Cls.SCHEMA_BEARING, r, T.FCState.CRITICAL, T.Next.NO_LOOKAHEAD)
          for r in (T.FCRole.REQUIRED, T.FCRole.OPTIONAL)}
  assert set(got) == want


def test_rejected_token_raises_and_coarsen():
  tok, gc = qwen()
  g = tool_call_grammar(gc, [WEATHER], "json_list")
  ad, m = FCAdapter(g, tok), g.matcher()
  with pytest.raises(RuntimeError, match="rejected"):
    ad.accept(m, tok.encode("hello")[0])
  ids = [T.fc(T.Cls.PURE_SCAFFOLD, T.FCRole.SCAFFOLD_SEPARATOR, s, n)
         for s in (1, 2) for n in (1, 2)]
  ids.append(T.fc(T.Cls.FREE_GENERATION, T.FCRole.REQUIRED, 2, 1))
  out = coarsen(ids)
  assert len(out) <= T.N_CAND and set(out) == {
      T.fc(T.Cls.PURE_SCAFFOLD, T.FCRole.SCAFFOLD_SEPARATOR, 1),
      T.fc(T.Cls.PURE_SCAFFOLD, T.FCRole.SCAFFOLD_SEPARATOR, 2),
      T.fc(T.Cls.FREE_GENERATION, T.FCRole.REQUIRED, 2)}


def test_state_ids_and_cost():
  """Same frontier -> same id across requests; unseen -> -1; per-token cost printed (-s)."""
  tok, gc = qwen()
  text = render("fenced_json", 2)
  vocab = StateVocab(grow=True)
  a = run(tok, gc, [WEATHER, TIME], "fenced_json", 2, text, vocab=vocab)
  n = len(vocab)
  b = run(tok, gc, [WEATHER, TIME], "fenced_json", 2, text, vocab=vocab)
  assert len(vocab) == n and [r[2] for r in a] == [r[2] for r in b]
  assert all(r[2] >= 0 for r in a)
  frozen = StateVocab.from_json(vocab.to_json())
  assert frozen("no such state") == -1 and frozen(vocab.keys()[3]) == 3
  # Cost: accept (matcher) + tags + state id, per token, with the vocabulary.
  g = tool_call_grammar(gc, [WEATHER, TIME], "fenced_json", indent=2)
  ids = tok.encode(text)
  for with_vocab in (False, True):
    ad, m = FCAdapter(g, tok, vocab=frozen if with_vocab else None), g.matcher()
    t0 = time.perf_counter()
    for i in ids:
      ad.accept(m, i)
    us = (time.perf_counter() - t0) / len(ids) * 1e6
    print(f"FCAdapter.accept: {us:.1f} us/token (state ids: {with_vocab})")
    assert us < 2000  # loose: a 2-core CI box; the measured value is tens of us
