"""Prompt span labels (Table 6) with the real Qwen2.5 and SmolLM2 vocabularies.

Goldens written by hand from pask_jax/grammar/prompt_spans.py's docstring.  Code per token:
p protected_content, s schema_scaffold, f function_name, k parameter_key, t type_constraint,
e enum_constraint, d schema_description; several letters = candidates in text order.
"""
import functools
import json
import os

import numpy as np
import pytest

from pask_jax.testing import smollm2_tokenizer, stored_tokenizer

from pask_jax import tags as T
from pask_jax.grammar import tools_system_prompt
from pask_jax.grammar.prompt_spans import char_labels, label_prompt, spans

P = T.PromptLabel
DATA = os.path.join(os.path.dirname(__file__), "data", "qwen_tokenizer.json.gz")
_L = {"p": P.PROTECTED_CONTENT, "s": P.SCHEMA_SCAFFOLD, "f": P.FUNCTION_NAME,
      "k": P.PARAMETER_KEY, "t": P.TYPE_CONSTRAINT, "e": P.ENUM_CONSTRAINT,
      "d": P.SCHEMA_DESCRIPTION}
TOOLS = [{"type": "function", "function": {
    "name": "get_time", "description": "Now", "parameters": {
        "type": "object", "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}},
        "required": ["tz"]}}}]


@functools.lru_cache(maxsize=None)
def qwen():
  return stored_tokenizer(DATA)




def rows(tok, text):
  ids, tags = label_prompt(tok, text)
  assert ids == tok.encode(text) and tags.shape == (len(ids), T.N_CAND)
  return [(tok.decode([i], skip_special=False), [int(c) for c in r if c != T.PAD])
          for i, r in zip(ids, tags)]


def check(got, golden):
  assert [g[0] for g in got] == [g[0] for g in golden], "tokenization changed"
  for (piece, ids), (_, want) in zip(got, golden):
    assert ids == [T.prompt(_L[c]) for c in want], (piece, [T.describe(i) for i in ids], want)


def test_qwen_tools_block_golden():
  tok = qwen()
  text = tok.apply_chat_template([{"role": "user", "content": 'time? {"tz": 1}'}], tools=TOOLS)
  got = rows(tok, text)
  start = next(i for i, (p, _) in enumerate(got) if p == ">\n")  # the end of "<tools>\n"
  golden = [
      (">\n", "p"), ('{"', "s"), ("type", "s"), ('":', "s"), (' "', "s"), ("function", "s"),
      ('",', "s"), (' "', "s"), ("function", "s"), ('":', "s"), (' {"', "s"), ("name", "s"),
      ('":', "s"), (' "', "s"), ("get", "f"), ("_time", "f"), ('",', "s"), (' "', "s"),
      ("description", "s"), ('":', "s"), (' "', "s"), ("Now", "d"), ('",', "s"), (' "', "s"),
      ("parameters", "s"), ('":', "s"), (' {"', "s"), ("type", "s"), ('":', "s"), (' "', "s"),
      ("object", "t"), ('",', "s"), (' "', "s"), ("properties", "s"), ('":', "s"),
      (' {"', "s"), ("tz", "k"), ('":', "s"), (' {"', "s"), ("type", "s"), ('":', "s"),
      (' "', "s"), ("string", "t"), ('",', "s"), (' "', "s"), ("enum", "s"), ('":', "s"),
      (' ["', "s"), ("UTC", "e"), ('",', "s"), (' "', "s"), ("C", "e"), ("ET", "e"),
      ('"]', "s"), ("}},", "s"), (' "', "s"), ("required", "s"), ('":', "s"), (' ["', "s"),
      ("tz", "k"), ('"]', "s"), ("}}", "s"),
      ("}\n", "sp"),                 # crosses the end of the span
      ("</", "p"),
  ]
  check(got[start:start + len(golden)], golden)
  # Everything outside the tools line (instructions, the user's own JSON) is protected.
  lab = char_labels(text)
  a, b = text.index('{"type"'), text.index("}}}\n") + 3
  assert (lab[:a] == P.PROTECTED_CONTENT).all() and (lab[b:] == P.PROTECTED_CONTENT).all()


def test_smollm2_ddl_golden():
  tok = smollm2_tokenizer()
  text = ("Schema:\nCREATE TABLE team (\n  id INTEGER PRIMARY KEY,\n  name VARCHAR(20) NOT NULL\n"
          ");\nQ: how many?")
  golden = [
      ("Schema", "p"), (":", "p"), ("\n", "p"), ("CREATE", "s"), (" TABLE", "s"),
      (" team", "sf"),               # crosses scaffold space and the table name
      (" (", "s"), ("\n ", "s"), (" id", "sk"), (" INT", "st"), ("EGER", "t"), (" PRI", "se"),
      ("MARY", "e"), (" KEY", "se"), (",", "s"), ("\n ", "s"), (" name", "sk"), (" V", "st"),
      ("ARCH", "t"), ("AR", "t"), ("(", "s"), ("2", "t"), ("0", "t"), (")", "s"),
      (" NOT", "se"), (" NULL", "se"), ("\n", "s"), (");", "s"), ("\n", "p"), ("Q", "p"),
      (":", "p"), (" how", "p"), (" many", "p"), ("?", "p"),
  ]
  check(rows(tok, text), golden)


def test_ddl_constraints_and_quoted_identifiers():
  text = ('CREATE TABLE "order items" (oid INT, `qty` INT DEFAULT 1, '
          'FOREIGN KEY (oid) REFERENCES orders(id));')
  got = {(text[a:b], lab) for a, b, lab in spans(text)}
  for want in [("order items", P.FUNCTION_NAME), ("oid", P.PARAMETER_KEY), ("qty", P.PARAMETER_KEY),
               ("DEFAULT", P.ENUM_CONSTRAINT), ("1", P.ENUM_CONSTRAINT),
               ("FOREIGN", P.ENUM_CONSTRAINT), ("REFERENCES", P.ENUM_CONSTRAINT),
               ("orders", P.FUNCTION_NAME), ("id", P.PARAMETER_KEY), ("INT", P.TYPE_CONSTRAINT)]:
    assert want in got, want


def test_invalid_spans_keep_the_default():
  bad = ['{"name": "f", "parameters": [1]}',                 # not a tool schema
         '{"name": "f", "parameters": {"type": "object"}',    # invalid JSON
         "CREATE TABLE t (a INTEGER,, b)",                    # SQLite rejects it
         "CREATE TABLE t (a INTEGER",
         '{"a": {"b": 1}}']
  for text in bad:
    assert (char_labels(text) == P.PROTECTED_CONTENT).all(), text
  # A tool list nested in other JSON is still found; a bare tool list too.
  tool = {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}
  for text in (json.dumps({"tools": [tool]}), json.dumps([tool, tool])):
    got = {(text[a:b], lab) for a, b, lab in spans(text)}
    assert ("f", P.FUNCTION_NAME) in got and ("x", P.PARAMETER_KEY) in got
    assert ("integer", P.TYPE_CONSTRAINT) in got


def test_system_message_tools_smollm2():
  """SmolLM2's template ignores tools: the tool list goes in the system message as JSON lines."""
  tok = smollm2_tokenizer()
  sys_msg = tools_system_prompt(TOOLS, "json_list")
  text = tok.apply_chat_template([{"role": "system", "content": sys_msg},
                                  {"role": "user", "content": "What time is it in Paris?"}])
  ids, tags = label_prompt(tok, text)
  assert len(ids) == len(tok.encode(text))
  labs = {T.unpack(int(c))[1] for c in tags.ravel() if c != T.PAD}
  assert labs == {int(v) for v in P}
  named = [tok.decode([i]) for i, r in zip(ids, tags) if T.prompt(P.FUNCTION_NAME) in r]
  assert "".join(named).strip() == "get_time"
  assert np.all(tags[:, 0] >= 0)


# ---- hostile prompts (issue 16): no recursion, linear time, same labels --------------------

def _reference_json_spans(text, lab):
  """The former algorithm (``raw_decode`` at every bracket): quadratic, recursive; the
  reference the linear scanner must agree with on small texts."""
  from pask_jax.grammar import prompt_spans as S
  i, n = 0, len(text)
  while i < n:
    j = min((k for k in (text.find("{", i), text.find("[", i)) if k >= 0), default=-1)
    if j < 0:
      return
    try:
      val, end = json.JSONDecoder().raw_decode(text, j)
    except ValueError:
      i = j + 1
      continue
    if S.is_tools(val):
      lab[j:end] = P.SCHEMA_SCAFFOLD
      S.JsonLabeler(text, lab).value(j, (None, False, False))
      i = end
    else:
      i = j + 1


def test_linear_scanner_agrees_with_raw_decode():
  from pask_jax.grammar import prompt_spans as S
  rng = np.random.default_rng(0)
  tool = json.dumps(TOOLS[0]["function"])
  parts = ["{", "[", "]", "}", '"', ",", ":", " ", "x", "1", "true", '{"a": 1}', "[1, 2]",
           tool, "[" + tool + "]", '{"tools": [' + tool + "]}", '"[{', "\\", "\n"]
  for _ in range(300):
    text = "".join(rng.choice(parts, size=int(rng.integers(1, 25))))
    a = np.full(len(text), int(P.PROTECTED_CONTENT), np.int8)
    b = a.copy()
    _reference_json_spans(text, a)
    S.json_spans(text, b)
    assert (a == b).all(), text


@pytest.mark.parametrize("text", ["[" * 5000, "{" * 5000, "[" * 3000 + "]" * 3000,
                                  '{"a": ' * 2000 + "1" + "}" * 2000, "{x" * 200_000,
                                  '[" ' * 50_000, "CREATE TABLE t (" * 20_000])
def test_bracket_floods_are_labelled(text):
  # No RecursionError (raw_decode at every bracket recursed ~1,000 deep) and nothing mislabelled.
  # Labelling is linear now (a 400 KB flood: 18.7 s -> a fraction of a second, bench/RESULTS.md);
  # tests do not assert wall-clock times.
  lab = char_labels(text)
  assert (lab == P.PROTECTED_CONTENT).all()


def test_tools_found_after_a_flood():
  tool = json.dumps([TOOLS[0]["function"]])
  text = "[" * 3000 + " " + "{x" * 5000 + " " + tool
  got = {(text[a:b], lab) for a, b, lab in spans(text)}
  assert ("get_time", P.FUNCTION_NAME) in got and ("tz", P.PARAMETER_KEY) in got
