"""pask_jax/grammar/schema_check.py: schemas are refused up front or enforced exactly.

The XGrammar facts the check rests on are pinned here (if an XGrammar upgrade starts enforcing
a keyword, the pin fails and the check can be relaxed), and every accepted schema of the table
is compiled and walked at random through its grammar: every complete output must validate
against the *original* schema (jsonschema).
"""
import functools
import json
import random
import re

import jsonschema
import numpy as np
import pytest

from pask_jax.grammar import GrammarError, tool_call_grammar
from pask_jax.grammar.schema_check import SchemaError, prepare
from pask_jax.testing import accepts_text, smollm2_grammars




def accepts(schema, text: str) -> bool:
  import xgrammar as xgr
  from xgrammar.testing import _is_grammar_accept_string
  g = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)
  return _is_grammar_accept_string(g, text)


# (schema, an instance XGrammar wrongly accepts as it is, or None if it refuses all values)
XGRAMMAR_GAPS = [
    ({"not": {}}, "1"),
    ({"not": {"type": "string"}}, '"a"'),
    ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "1"),
    ({"type": "object", "required": ["a"], "additionalProperties": False}, "{}"),
    ({"type": "object", "required": ["a"]}, "{}"),
    ({"type": "string", "const": 5}, "5"),
    ({"type": "string", "enum": [1, 2]}, "1"),
    ({"type": "string", "anyOf": [{"maxLength": 2}]}, "1"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1, 1]"),
    ({"type": "number", "multipleOf": 0.5}, "0.3"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "1"),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "dependentRequired": {"a": ["b"]}}, '{"a": 1}'),
    ({"type": "string", "pattern": "^[a-z]+$", "maxLength": 2}, '"abc"'),
    ({"type": "string", "format": "date", "minLength": 11}, '"2026-12-06"'),
    ({"type": "object", "properties": {"d": {"maxLength": 2}}, "required": ["d"]},
     '{"d": "abcdef"}'),
    ({"anyOf": []}, None),
    ({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}, None),
]


@pytest.mark.parametrize("schema,bad", XGRAMMAR_GAPS, ids=[json.dumps(s)[:40] for s, _ in
                                                           XGRAMMAR_GAPS])
def test_xgrammar_gaps_pinned(schema, bad):
  """What XGrammar 0.2.9 does with each schema by itself (the reason for the check)."""
  if bad is None:
    for text in ("1", '"a"', "{}", '{"a": {}}', "[]"):
      assert not accepts(schema, text)
  else:
    assert accepts(schema, bad)
    with pytest.raises(jsonschema.ValidationError):
      jsonschema.validate(json.loads(bad), schema)


REFUSED = [
    ({"not": {}}, "unsatisfiable"),
    ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "unsatisfiable"),
    ({"type": "object", "required": ["a"], "additionalProperties": False}, "unsatisfiable"),
    ({"type": "string", "const": 5}, "unsatisfiable"),
    ({"type": "string", "enum": [1, 2]}, "unsatisfiable"),
    ({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}, "unsatisfiable"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/N"}}, "required": ["a"],
      "$defs": {"N": {"not": {}}}}, "unsatisfiable"),
    ({"allOf": [{"type": "object", "properties": {"a": {}}, "additionalProperties": False},
                {"required": ["b"]}]}, "unsatisfiable"),
    ({"type": "string", "anyOf": [{"type": "integer"}, {"type": "boolean"}]}, "unsatisfiable"),
    ({"type": "array", "items": {"type": "string", "const": 1}, "minItems": 1}, "unsatisfiable"),
    ({"not": {"type": "string"}}, "'not' is not supported"),
    ({"if": {"type": "string"}, "then": {"minLength": 2}}, "'if' is not supported"),
    ({"type": "array", "uniqueItems": True}, "'uniqueItems' is not supported"),
    ({"type": "array", "contains": {"type": "integer"}}, "'contains' is not supported"),
    ({"type": "object", "properties": {"a": {}, "b": {}}, "dependentRequired": {"a": ["b"]}},
     "'dependentRequired' is not supported"),
    ({"type": "object", "propertyNames": {"maxLength": 1}}, "'propertyNames' is not supported"),
    ({"type": "number", "multipleOf": 0.5}, "multipleOf"),
    ({"type": "string", "pattern": "^[a-z]+$", "maxLength": 2}, "'maxLength' beside 'pattern'"),
    ({"properties": {"d": {"type": "string", "format": "date", "minLength": 11}}},
     "'minLength' beside 'format'"),
    ({"type": "object", "properties": {"d": {"maxLength": 2}}}, "'maxLength' without a 'type'"),
    ({"items": {"pattern": "^a$"}}, "'pattern' without a 'type'"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "can match the same value"),
    ({"properties": {"a": {"$ref": "http://example.com/s.json"}}}, "only local"),
    ({"properties": {"a": {"$ref": "#/$defs/none"}}}, "points nowhere"),
    ({"type": "nonsense"}, "invalid JSON schema"),
    (False, "unsatisfiable"),
]


@pytest.mark.parametrize("schema,why", REFUSED, ids=[json.dumps(s)[:40] for s, _ in REFUSED])
def test_refused_with_a_reason(schema, why):
  with pytest.raises(SchemaError, match=why) as e:
    prepare(schema, "response_format.json_schema.schema")
  msg = str(e.value)
  assert msg.startswith("response_format.json_schema.schema: ") and "\n" not in msg


ACCEPTED = [
    {"type": "object", "properties": {"a": {"type": "string", "maxLength": 3}}, "required": ["a"],
     "additionalProperties": False},
    {"allOf": [{"type": "object", "properties": {"a": {"type": "integer", "minimum": 0,
                                                        "maximum": 5}}, "required": ["a"]},
               {"properties": {"b": {"enum": ["x", "y"]}}, "required": ["b"]}]},
    {"allOf": [{"type": "integer", "minimum": 2}, {"maximum": 4}, {"multipleOf": 2}]},
    {"type": "string", "anyOf": [{"maxLength": 2}, {"enum": ["long one", "x"]}]},
    {"type": "object", "required": ["k"], "additionalProperties": {"type": "boolean"}},
    {"type": "string", "enum": ["a", 1, "bb"], "minLength": 2},
    {"oneOf": [{"type": "object", "properties": {"kind": {"const": "a"}, "n": {"type": "integer",
                                                                              "maximum": 9}},
                "required": ["kind", "n"]},
               {"type": "object", "properties": {"kind": {"const": "b"}}, "required": ["kind"]}]},
    {"$defs": {"Leaf": {"type": "string", "maxLength": 2}},
     "type": "object", "properties": {"l": {"$ref": "#/$defs/Leaf"},
                                      "m": {"$ref": "#/properties/l"}},
     "required": ["l", "m"]},
    {"type": "object", "properties": {"a": {"$ref": "#/$defs/A", "maximum": 3}},
     "required": ["a"], "$defs": {"A": {"type": "integer", "minimum": 0}}},
    {"type": "object", "properties": {"gone": False, "n": {"type": "integer", "maximum": 9}},
     "required": ["n"]},
    {"type": "object", "properties": {"maybe": {"not": {}}, "n": {"type": "boolean"}},
     "required": ["n"]},
    {"type": "object", "properties": {"next": {"$ref": "#"}, "v": {"type": "integer",
                                                                  "maximum": 9}},
     "required": ["v"]},
    {"type": "integer", "not": False},
    {"type": "array", "items": {"type": "integer", "maximum": 9}, "maxItems": 1,
     "uniqueItems": True},
    {"type": "string", "format": "not-a-format", "maxLength": 3},
    {"type": "string", "pattern": "^[a-c]{1,3}$", "minLength": 0},
    {"type": "string", "enum": ["a", "bb"], "pattern": "^a+$", "maxLength": 1},
    {"type": "string", "const": "2026-01-01", "format": "date", "maxLength": 10},
    {"type": ["string", "integer"], "maxLength": 2},
]


def test_xgrammar_formats_pinned():
  """XGRAMMAR_FORMATS is exactly the formats beside which XGrammar drops a length bound."""
  import xgrammar as xgr
  from pask_jax.grammar.schema_check import XGRAMMAR_FORMATS
  for f in sorted(XGRAMMAR_FORMATS) + ["not-a-format", "color"]:
    g = str(xgr.Grammar.from_json_schema(json.dumps({"type": "string", "format": f,
                                                     "maxLength": 7})))
    assert ("{0, 7}" not in g) == (f in XGRAMMAR_FORMATS), f


def _walk(tok, grammar, rng, steps=160):
  """A random walk through the grammar on single-byte tokens (biased to finish): the text, or
  None when it did not finish."""
  m = grammar.matcher()
  single = _single_bytes(tok)
  stop = tok.stop_ids[0]
  bits = np.zeros((1, -(-tok.vocab_size // 32)), np.int32)
  out = bytearray()
  for _ in range(steps):
    m.fill(bits)
    allowed = lambda t: (bits[0, t // 32] >> (t % 32)) & 1
    if allowed(stop) and rng.random() < 0.5:
      assert m.accept(stop)
      return out.decode()
    opts = [(b, t) for b, t in single.items() if allowed(t)]
    if not opts:
      return None
    close = [o for o in opts if o[0] in b'"}],' or o[0] in b"0123456789"]
    b, t = rng.choice(close if close and rng.random() < 0.6 else opts)
    assert m.accept(t)
    out.append(b)
  return None


@functools.lru_cache(maxsize=None)
def _single_bytes(tok):
  tb = tok.token_bytes()
  return {bytes(b)[0]: i for i, b in enumerate(tb) if len(b) == 1 and 32 <= b[0] < 127}


@pytest.mark.parametrize("schema", ACCEPTED, ids=[json.dumps(s)[:40] for s in ACCEPTED])
def test_accepted_schemas_hold_exactly(schema):
  tok, gc = smollm2_grammars()
  g = gc.json_schema(schema)
  rng = random.Random(0)
  done = 0
  for _ in range(30):
    text = _walk(tok, g, rng)
    if text is not None:
      jsonschema.validate(json.loads(text), schema)
      done += 1
  assert done >= 5


def test_prepare_is_identity_on_plain_schemas():
  s = {"type": "object", "properties": {"city": {"type": "string", "description": "x"},
                                        "unit": {"enum": ["c", "f"]}},
       "required": ["city"], "additionalProperties": True}
  assert prepare(s) == s


def test_tool_refs_resolve_against_the_parameters():
  """Issue 16 item 3: $ref inside a tool's parameters means the parameters, not the wrapper."""
  tok, gc = smollm2_grammars()
  defs = {"type": "object", "$defs": {"City": {"enum": ["Paris", "Rome"]}},
          "properties": {"city": {"$ref": "#/$defs/City"}}, "required": ["city"]}
  g = tool_call_grammar(gc, [{"name": "f", "parameters": defs}], "json_list", check=True)
  ok = '[{"name": "f", "arguments": {"city": "Paris"}}]'
  assert accepts_text(tok, g, ok)
  assert not accepts_text(tok, g, '[{"name": "f", "arguments": {"city": "Oslo"}}]')
  old = {"type": "object", "definitions": {"N": {"type": "integer", "maximum": 5}},
         "properties": {"n": {"$ref": "#/definitions/N"}}, "required": ["n"]}
  g = tool_call_grammar(gc, [{"name": "f", "parameters": old}], "json_list", check=True)
  assert accepts_text(tok, g, '[{"name": "f", "arguments": {"n": 5}}]')
  assert not accepts_text(tok, g, '[{"name": "f", "arguments": {"n": 6}}]')
  # '#' is the parameters object itself (recursion), not the call object.
  rec = {"type": "object", "properties": {"sub": {"$ref": "#"}, "v": {"type": "integer"}},
         "required": ["v"]}
  g = tool_call_grammar(gc, [{"name": "f", "parameters": rec}], "json_list", check=True)
  assert accepts_text(tok, g, '[{"name": "f", "arguments": {"sub": {"v": 2}, "v": 1}}]')
  assert not accepts_text(tok, g, '[{"name": "f", "arguments": {"sub": {"name": "f"}, "v": 1}}]')
  # A pointer into the call object does not exist in the parameters.
  with pytest.raises(GrammarError, match=r"tools\[0\].parameters: .*points nowhere"):
    tool_call_grammar(gc, [{"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"$ref": "#/properties/name"}}}}], "json_list",
        check=True)
  # Two tools with the same def name do not collide.
  a = {"type": "object", "$defs": {"T": {"type": "integer"}},
       "properties": {"t": {"$ref": "#/$defs/T"}},
       "required": ["t"]}
  b = {"type": "object", "$defs": {"T": {"type": "boolean"}},
       "properties": {"t": {"$ref": "#/$defs/T"}},
       "required": ["t"]}
  g = tool_call_grammar(gc, [{"name": "a", "parameters": a}, {"name": "b", "parameters": b}],
                        "json_list", check=True)
  assert accepts_text(tok, g, '[{"name": "a", "arguments": {"t": 1}}, '
                              '{"name": "b", "arguments": {"t": true}}]')
  assert not accepts_text(tok, g, '[{"name": "a", "arguments": {"t": true}}]')


def test_xgrammar_messages_are_one_clean_line():
  _, gc = smollm2_grammars()
  with pytest.raises(GrammarError) as e:
    gc.json_schema({"type": "integer", "minimum": 5, "maximum": 3})
  msg = str(e.value)
  assert "minimum greater than maximum" in msg and "\n" not in msg
  assert not re.search(r"\[\d\d:\d\d:\d\d\]|\.(cc|h):\d+", msg), msg


def test_large_enum_check():
  # (Its cost is linear in the enum: 20,000 values were compiled as the issue's blocking case.)
  s = {"type": "string", "enum": [f"v{i}" for i in range(20000)]}
  assert prepare(s)["enum"] == s["enum"]
