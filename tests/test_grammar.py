"""Constrained decoding: validity is guaranteed by the grammar, even for a random model."""
import json

import jsonschema
import numpy as np
import pytest

from pask_jax.testing import grammar_compiler, smollm2
from models import ModelConfig, random_model
from pask_jax.decode import Runner, Sampling, generate
from pask_jax.grammar import (FORMATS, GrammarError, parse_calls,
                              tool_call_grammar)


@pytest.fixture(scope="module")
def setup():
  tok = smollm2().tokenizer
  cfg = ModelConfig(arch="llama", vocab_size=tok.vocab_size, hidden=32, intermediate=48,
                    n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, tie_embeddings=True)
  runner = Runner(random_model(cfg, seed=7), batch=4, capacity=512)
  return tok, runner, grammar_compiler(tok, cfg.vocab_size)


def random_schema(rng, depth=0):
  """Bounded random schemas (so a random model finishes within the token budget)."""
  kinds = (["string", "integer", "boolean", "enum", "number"]
           + (["object", "array"] if depth < 2 else []))
  k = kinds[rng.integers(len(kinds))]
  if k == "string":
    return {"type": "string", "maxLength": int(rng.integers(1, 6))}
  if k == "integer":
    return {"type": "integer", "minimum": -50, "maximum": int(rng.integers(0, 999))}
  if k == "number":
    return {"type": "number", "minimum": -1, "maximum": 10}
  if k == "boolean":
    return {"type": "boolean"}
  if k == "enum":
    return {"enum": [f"v{i}" for i in range(int(rng.integers(1, 4)))]}
  if k == "array":
    return {"type": "array", "items": random_schema(rng, depth + 1), "maxItems": 2}
  n = int(rng.integers(1, 4))
  props = {f"k{i}": random_schema(rng, depth + 1) for i in range(n)}
  req = [p for p in props if rng.random() < 0.6]
  return {"type": "object", "properties": props, "required": req, "additionalProperties": False}


def test_random_schemas_always_validate(setup):
  tok, runner, gc = setup
  rng = np.random.default_rng(0)
  prompt = tok.encode("Answer in JSON:")
  done = 0
  for trial in range(6):
    schemas = [{"type": "object", "properties": {"a": random_schema(rng), "b": random_schema(rng)},
                "required": ["a"], "additionalProperties": False} for _ in range(runner.batch)]
    grammars = [gc.json_schema(s) for s in schemas]
    res = generate(runner, tok, [prompt] * runner.batch, grammars=grammars,
                   sampling=Sampling(max_tokens=300, temperature=1.0, seed=trial))
    for s, r in zip(schemas, res):
      assert r.finish == "stop", f"did not finish: {r.text!r}"
      jsonschema.validate(json.loads(r.text), s)
      done += 1
  assert done == 24


def _accepts(tok, g, text):
  m = g.matcher()
  return all(m.accept(t) for t in tok.encode(text)) and m.accept(tok.stop_ids[0])


@pytest.mark.parametrize("text,ok", [
    ('"ab"', True), ('"abcde"', True), ('"abcdef"', False), ('""', False),
    ('"a\x1fb"', False), ('"a\tb"', False),                  # raw control characters: never
    ('"éèçàü"', True), ('"éèçàüß"', False),                    # code points, not bytes
    ('"a\\"b"', False), ('"a\\nb"', False), ('"\\u00e9x"', False)])  # no escapes
def test_length_bounded_strings_are_json_strings(setup, text, ok):
  """XGrammar 0.2.9 bounds a string's length with a character class that admits raw control
  characters; ours (matcher.schema_ebnf) admits any code point but those, a quote and a
  backslash (no escapes: they would cost the mask fill 1000x), in a schema and in tool-call
  arguments alike."""
  tok, _, gc = setup
  schema = {"type": "string", "minLength": 1, "maxLength": 5}
  assert _accepts(tok, gc.json_schema(schema), text) is ok
  tools = [{"type": "function", "function": {"name": "f", "parameters": {
      "type": "object", "properties": {"s": schema}, "required": ["s"]}}}]
  call = '[{"name": "f", "arguments": {"s": ' + text + '}}]'
  assert _accepts(tok, tool_call_grammar(gc, tools, "json_list"), call) is ok


def test_length_bounded_string_characters_are_one_class():
  """Each length-bounded character is one character class: with an alternative (an escape)
  XGrammar fills the mask inside the string ~1000x slower (bench/grammar_fill.py)."""
  from pask_jax.grammar.matcher import schema_ebnf
  ebnf = schema_ebnf(json.dumps({"type": "object", "properties": {
      "a": {"type": "string", "maxLength": 8}, "b": {"type": "string", "minLength": 2}}}))
  rules = [line for line in ebnf.splitlines() if line.split(" ::= ")[0].endswith("_characters")]
  assert len(rules) == 2
  for line in rules:
    body = line.split(" ::= ", 1)[1]
    assert body.startswith("(([^") and body.endswith("]))") and "|" not in body, line
    assert "\\0-\\x1f" in body, line      # no raw control characters


def test_a_property_or_value_named_root_stays_root(setup):
  """The tool-call grammar renames its schema's rule ``root``, never the text ``"root"``."""
  tok, _, gc = setup
  tools = [{"type": "function", "function": {"name": "root", "parameters": {
      "type": "object", "properties": {"root": {"enum": ["root", "a root"]}},
      "required": ["root"]}}}]
  g = tool_call_grammar(gc, tools, "json_list")
  assert _accepts(tok, g, '[{"name": "root", "arguments": {"root": "a root"}}]')
  assert not _accepts(tok, g, '[{"name": "root", "arguments": {"call": "a root"}}]')
  assert not _accepts(tok, g, '[{"name": "call", "arguments": {"root": "root"}}]')


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
     "parameters": {"type": "object", "properties": {
         "city": {"type": "string", "maxLength": 8},
         "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
         "required": ["city"]}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                         "b": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["a", "b"]}}},
]


@pytest.mark.parametrize("fmt", FORMATS)
def test_tool_calls_parse_and_name_declared_tools(setup, fmt):
  tok, runner, gc = setup
  g = tool_call_grammar(gc, TOOLS, fmt)
  res = generate(runner, tok, [tok.encode("Call a tool.")] * runner.batch,
                 grammars=[g] * runner.batch,
                 sampling=Sampling(max_tokens=400, temperature=1.0, seed=11))
  schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
  for r in res:
    assert r.finish == "stop", r.text
    calls = parse_calls(r.text, fmt)
    assert calls
    for c in calls:
      assert c["name"] in schemas
      jsonschema.validate(c["arguments"], schemas[c["name"]])


def test_several_calls_in_one_answer(setup):
  """The grammar admits several blocks; the parser returns all of them."""
  tok, _, gc = setup
  g = tool_call_grammar(gc, TOOLS, "fenced_json")
  text = ('```json\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n```\n'
          '```json\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n```')
  m = g.matcher()
  for t in tok.encode(text):
    assert m.accept(t), tok.decode([t])
  assert m.accept(tok.stop_ids[0]) and m.terminated
  assert [c["name"] for c in parse_calls(text)] == ["add", "get_weather"]


def test_rollback_restores_state(setup):
  tok, _, gc = setup
  g = gc.json_schema({"type": "object", "properties": {"x": {"type": "integer"}},
                      "required": ["x"]})
  m = g.matcher()
  ids = tok.encode('{"x": 12')
  before = np.zeros((1, -(-gc.vocab_size // 32)), np.int32)
  after = before.copy()
  for t in ids[:2]:
    assert m.accept(t)
  m.fill(before)
  for t in ids[2:]:
    assert m.accept(t)
  m.rollback(len(ids) - 2)
  m.fill(after)
  assert (before == after).all()


def test_bad_schemas_give_clear_errors(setup):
  _, _, gc = setup
  with pytest.raises(GrammarError, match="not valid JSON"):
    gc.json_schema("{not json")
  with pytest.raises(GrammarError, match="points nowhere"):
    gc.json_schema({"type": "object", "properties": {"a": {"$ref": "#/definitions/missing"}}})
  with pytest.raises(GrammarError, match="cannot compile"):
    gc.ebnf("root ::= undefined_rule")
  with pytest.raises(GrammarError, match="unknown tool-call format"):
    tool_call_grammar(gc, TOOLS, "xml")
  with pytest.raises(GrammarError, match="name"):
    tool_call_grammar(gc, [{"function": {"description": "nameless"}}], "json_list")
