"""BFCL task oracle: data, C.1 split, tool conversion, official checker, parsing, end to end."""
from __future__ import annotations

import collections
import json

import jsonschema
import pytest

from calibrate import bfcl


@pytest.fixture(scope="module")
def cases():
  return {c.id: c for c in bfcl.load()}


# --- data and split ------------------------------------------------------------------------------

def test_load_counts_and_split_sizes(cases):
  n = collections.Counter(c.category for c in cases.values())
  assert n == {"simple_python": 400, "multiple": 200, "parallel": 200, "parallel_multiple": 200}
  got = collections.Counter((c.category, c.split) for c in cases.values())
  for cat, total in n.items():
    assert [got[(cat, s)] for s in bfcl.SPLITS] == list(bfcl.targets(total))
  assert bfcl.targets(400) == (80, 80, 240) and bfcl.targets(200) == (40, 40, 120)  # paper Table 7
  # every case has its answers and a message to answer
  assert all(c.answer and c.messages and c.messages[-1]["role"] == "user" for c in cases.values())


def test_schemas_disjoint_across_partitions(cases):
  where = collections.defaultdict(set)
  for c in cases.values():
    where[c.key].add(c.split)
  assert all(len(v) == 1 for v in where.values())
  # the rule is exercised: function sets shared within and across categories exist
  by_key = collections.Counter(c.key for c in cases.values())
  shared = [k for k, m in by_key.items() if m > 1]
  cats = {k: {c.category for c in cases.values() if c.key == k} for k in shared}
  assert len(shared) > 100 and any(len(v) > 1 for v in cats.values())


def test_split_deterministic_and_seeded(cases):
  again = bfcl.assign_splits(list(cases.values()), seed=0)
  assert again == {i: c.split for i, c in cases.items()}
  other = bfcl.assign_splits(list(cases.values()), seed=1)
  assert sum(other[i] != c.split for i, c in cases.items()) > 300
  # a category loaded alone keeps its family-wide partition
  alone = {c.id: c.split for c in bfcl.load(["parallel"])}
  assert alone == {i: c.split for i, c in cases.items() if c.category == "parallel"}
  test = bfcl.load(["multiple"], split="test")
  assert len(test) == 120 and {c.split for c in test} == {"test"}
  with pytest.raises(ValueError):
    bfcl.load(["multiple"], split="train")


def test_split_keeps_groups_whole():
  mk = lambda i, cat, key: bfcl.Case(f"{cat}_{i}", cat, [], [], [], [], key)
  cs = [mk(i, "a", f"k{i}") for i in range(47)] + [mk(i, "b", f"k{i}") for i in range(3)]
  cs += [mk(100 + i, "a", "big") for i in range(4)] + [mk(100, "b", "big")]
  for seed in range(5):
    sp = bfcl.assign_splits(cs, seed)
    for key in {c.key for c in cs}:
      assert len({sp[c.id] for c in cs if c.key == key}) == 1
    cnt = collections.Counter((c.category, sp[c.id]) for c in cs)
    assert [cnt[("a", s)] for s in bfcl.SPLITS] == list(bfcl.targets(51))
    assert sum(cnt[("b", s)] for s in bfcl.SPLITS) == 4


# --- tool conversion -----------------------------------------------------------------------------

def test_type_map_is_bfcls():
  from bfcl_eval.constants.type_mappings import GORILLA_TO_OPENAPI
  assert all(GORILLA_TO_OPENAPI[k] == v for k, v in bfcl.TYPE_MAP.items())


def test_tools_from_real_functions(cases):
  p = lambda i: cases[i].tools[0]["function"]["parameters"]
  assert p("simple_python_14")["properties"]["x_value"]["type"] == "number"            # float
  assert p("simple_python_83")["properties"]["coord1"] == {
      "type": "array", "description": "The first coordinate as (latitude, longitude).",
      "items": {"type": "number"}}                                                         # tuple
  cond = p("simple_python_89")["properties"]["conditions"]                                 # dict
  assert cond["type"] == "object" and cond["properties"]["school"]["type"] == "string"
  assert cond["required"] == []
  assert p("simple_python_109")["properties"]["data"]["type"] == "string"                 # any
  sp0 = cases["simple_python_0"].tools[0]["function"]
  assert sp0["name"] == "calculate_triangle_area" and sp0["description"].startswith("Calculate")
  assert sp0["parameters"]["required"] == ["base", "height"]
  enums = [v for c in cases.values() for t in c.tools
           for v in t["function"]["parameters"]["properties"].values() if "enum" in v]
  assert len(enums) > 20
  json_types = {"integer", "number", "string", "boolean", "array", "object"}

  def walk(s):
    assert s["type"] in json_types and "optional" not in s
    for v in s.get("properties", {}).values():
      walk(v)
    if "items" in s:
      walk(s["items"])

  for c in cases.values():
    assert {f["name"] for f in c.functions} == {t["function"]["name"] for t in c.tools}
    for t in c.tools:
      jsonschema.Draft202012Validator.check_schema(t["function"]["parameters"])
      walk(t["function"]["parameters"])


def test_reference_answers_fit_schema_and_checker(cases):
  """The ground truth is expressible in the converted schema (so the grammar can produce it)
  and the official checker accepts it, for every non-live case but two data quirks."""
  unfit = []
  for c in cases.values():
    tools = {t["function"]["name"]: t["function"]["parameters"] for t in c.tools}
    ref = bfcl.reference_calls(c)
    assert bfcl.check(c, ref) == (True, ""), c.id
    assert bfcl.per_call(c, ref) == 1.0
    if not all(jsonschema.Draft202012Validator(tools[fn]).is_valid(a)
               for call in ref for fn, a in call.items()):
      unfit.append(c.id)
  # a variable name given for an array, and a fruit name for an integer, in BFCL's ground truth
  assert unfit == ["parallel_multiple_21", "parallel_multiple_94"]


def test_schema_validity_of_answers(cases):
  """``valid`` (pask_jax.grammar.call_problem): the reference answer written in each format
  is valid; a wrong type, an unknown tool, a block that does not parse or is not closed, and
  an answer with no call are not; W3's score checks against the padded tools it offered."""
  from pask_jax.grammar import call_problem
  from pask_jax.grammar.toolcall import render_calls
  c = cases["simple_python_0"]
  calls = [{"name": fn, "arguments": a} for call in bfcl.reference_calls(c)
           for fn, a in call.items()]
  for fmt, indent in (("fenced_json", 2), ("tool_call_tags", None), ("json_list", None)):
    text = render_calls(calls, fmt, indent)
    assert call_problem(c.tools, text) is None
    assert bfcl.score(c, text, fmt=fmt)["valid"] is True
  block = render_calls(calls, "fenced_json", 2)
  arg = next(iter(calls[0]["arguments"]))
  bad = [dict(calls[0], arguments={**calls[0]["arguments"], arg: [1, 2]})]
  assert "arguments#/" in call_problem(c.tools, render_calls(bad, "fenced_json", 2))
  other = [dict(calls[0], name="nope")]
  assert "unknown tool 'nope'" in call_problem(c.tools, render_calls(other, "json_list", None))
  assert call_problem(c.tools, block + "\n```json\n{\"name\": \n```") == \
      "call block 1 does not parse as JSON"
  assert call_problem(c.tools, block + "\n```json\n{\"name\": ") == "a call block is not closed"
  assert call_problem(c.tools, "I would call it.") == "no call block parses as JSON"
  assert bfcl.score(c, block, complete=False)["valid"] is False
  # another case's tool: invalid against this case's tools, valid against a list holding it
  d = next(x for x in cases.values() if x.category == "simple_python" and x.tools != c.tools)
  theirs = render_calls([{"name": fn, "arguments": a} for call in bfcl.reference_calls(d)
                         for fn, a in call.items()], "fenced_json", 2)
  assert bfcl.score(c, theirs, fmt="fenced_json")["valid"] is False
  assert bfcl.score(c, theirs, fmt="fenced_json", tools=c.tools + d.tools)["valid"] is True


# --- the official checker ------------------------------------------------------------------------

def test_checker_hand_written(cases):
  sp = cases["simple_python_0"]
  assert bfcl.check(sp, [{"calculate_triangle_area": {"base": 10, "height": 5}}])[0]
  assert bfcl.check(sp,
                    [{"calculate_triangle_area": {"base": 10, "height": 5, "unit": "units"}}])[0]
  ok, err = bfcl.check(sp, [{"calculate_triangle_area": {"base": 5, "height": 10}}])
  assert not ok and "value_error" in err
  assert not bfcl.check(sp, [{"calculate_triangle_area": {"base": 10}}])[0]
  assert not bfcl.check(sp, [{"calculate_triangle_area": {"base": 10, "height": 5}}] * 2)[0]

  mu = cases["multiple_0"]  # dotted name kept (stand-in config: underscore_to_dot=False)
  good = {"triangle_properties.get": {"side1": 5, "side2": 4, "side3": 3}}
  assert bfcl.check(mu, [good])[0]
  assert not bfcl.check(mu, [{"triangle_properties_get": good["triangle_properties.get"]}])[0]
  other = next(f["name"] for f in mu.functions if f["name"] != "triangle_properties.get")
  assert not bfcl.check(mu, [{other: good["triangle_properties.get"]}])[0]

  pa = cases["parallel_0"]
  a = {"spotify.play": {"artist": "Taylor Swift", "duration": 20}}
  b = {"spotify.play": {"artist": "Maroon 5", "duration": 15}}
  assert bfcl.check(pa, [a, b])[0] and bfcl.check(pa, [b, a])[0]  # order-free
  assert not bfcl.check(pa, [a])[0]
  assert not bfcl.check(pa, [a, {"spotify.play": {"artist": "Maroon 5", "duration": 20}}])[0]
  assert bfcl.check(pa, None) == (False, "no tool call in BFCL form")
  assert not bfcl.check(pa, [])[0]


def test_per_call_fraction(cases):
  pa = cases["parallel_0"]
  a = {"spotify.play": {"artist": "Taylor Swift", "duration": 20}}
  b = {"spotify.play": {"artist": "Maroon 5", "duration": 15}}
  bad = {"spotify.play": {"artist": "Adele", "duration": 15}}
  assert bfcl.per_call(pa, [b, a]) == 1.0
  assert bfcl.per_call(pa, [a]) == 0.5
  assert bfcl.per_call(pa, [a, a]) == 0.5      # one produced call matches one expected call
  assert bfcl.per_call(pa, [bad, a, bad]) == 0.5
  assert bfcl.per_call(pa, [bad]) == 0.0 and bfcl.per_call(pa, None) == 0.0
  pm = cases["parallel_multiple_0"]
  s = {"math_toolkit.sum_of_multiples": {"lower_limit": 1, "upper_limit": 1000,
                                         "multiples": [3, 5]}}
  assert bfcl.per_call(pm, [s]) == 0.5 and not bfcl.check(pm, [s])[0]
  # maximum matching, not greedy: call 0 fits both expected, call 1 only the first
  assert bfcl.max_matching([[True, True], [True, False]]) == 2
  assert bfcl.max_matching([[True, False], [True, False]]) == 1


# --- parsing and scoring of model text -----------------------------------------------------------

def test_decode_formats_to_bfcl_form(cases):
  one = {"name": "spotify.play", "arguments": {"artist": "Taylor Swift", "duration": 20}}
  two = {"name": "spotify.play", "arguments": {"artist": "Maroon 5", "duration": 15}}
  want = [{"spotify.play": one["arguments"]}, {"spotify.play": two["arguments"]}]
  fenced = "\n".join(f"```json\n{json.dumps(c, indent=2)}\n```" for c in (one, two))
  tags = "\n".join(f"<tool_call>\n{json.dumps(c)}\n</tool_call>" for c in (one, two))
  lst = json.dumps([one, two])
  for text, fmt in ((fenced, "fenced_json"), (tags, "tool_call_tags"), (lst, "json_list")):
    assert bfcl.decode(text, fmt) == want
    r = bfcl.score(cases["parallel_0"], text, fmt=fmt)
    assert r["passed"] and r["per_call"] == 1.0 and r["calls"] == want
  with pytest.raises(ValueError):
    bfcl.decode("I cannot help with that.")
  r = bfcl.score(cases["parallel_0"], "[{\"name\": \"spotify.play\", \"argu")
  assert (r["passed"], r["per_call"], r["calls"]) == (False, 0.0, None)
  assert r["error"].startswith("unparseable")
  r = bfcl.score(cases["parallel_0"], lst, complete=False)  # cut at max_tokens: a failure
  assert (r["passed"], r["per_call"], r["error"]) == (False, 0.0, "incomplete output")


# --- prompts -------------------------------------------------------------------------------------

class _Tpl:
  """A tokenizer stand-in recording what the chat template receives."""

  def __init__(self, template):
    self.chat_template, self.seen = template, None

  def apply_chat_template(self, messages, tools=None):
    self.seen = (messages, tools)
    return "rendered"


def test_render_with_and_without_template_tools(cases):
  c = cases["multiple_0"]
  tk = _Tpl("{% if tools %}{{ tools }}{% endif %}")
  bfcl.render(c, tk, "fenced_json")
  assert tk.seen == (c.messages, c.tools)
  tk = _Tpl("{{ messages }}")
  bfcl.render(c, tk, "json_list")
  msgs, tools = tk.seen
  assert tools is None and msgs[0]["role"] == "system" and msgs[1:] == c.messages
  assert all(json.dumps(t["function"]) in msgs[0]["content"] for t in c.tools)
  assert "JSON list" in msgs[0]["content"]
  own = bfcl.Case("x", "live_simple", [{"role": "system", "content": "Be brief."}] + c.messages,
                  c.functions, c.tools, c.answer, c.key)
  bfcl.render(own, tk, "json_list")
  msgs, _ = tk.seen
  assert len(msgs) == len(own.messages) and msgs[0]["content"].endswith("\n\nBe brief.")
  assert own.messages[0]["content"] == "Be brief."  # the case is not mutated


def test_live_categories_load():
  live = bfcl.load(["live_parallel"])
  assert len(live) == 16 and {c.split for c in live} == set(bfcl.SPLITS)
  with pytest.raises(ValueError):
    bfcl.load(["simple_java"])


# --- end to end ----------------------------------------------------------------------------------

def test_run_cases_smollm2_full_kv():
  """Two simple cases through SmolLM2 with Full KV under the tool-call grammar.  The model is too
  weak to be right reliably: this checks the pipeline, not accuracy."""
  from pask_jax.testing import smollm2
  from pask_jax.decode import Runner
  m = smollm2()
  cs = bfcl.load(["simple_python"], split="calibration")[:2]
  cap = bfcl.capacity_needed(cs, m.tokenizer, arch=m.cfg.arch, max_tokens=48)
  runner = Runner(m.model, batch=2, capacity=cap)
  seen = []
  recs = bfcl.run_cases(runner, m.tokenizer, cs, max_tokens=48,
                        progress=lambda d, n: seen.append((d, n)))
  assert [r.id for r in recs] == [c.id for c in cs] and seen == [(2, 2)]
  assert any(r.finish == "stop" for r in recs)
  for c, r in zip(cs, recs):
    assert r.text.startswith('[{"name": "') and r.tokens > 0 and r.prompt_len > 0  # json_list
    assert isinstance(r.passed, bool) and 0.0 <= r.per_call <= 1.0
    if r.finish == "stop":  # complete constrained output always parses into declared tools
      assert r.calls and all(next(iter(x)) in {f["name"] for f in c.functions} for x in r.calls)
      assert r.passed == bfcl.check(c, r.calls)[0]
    else:
      assert r.calls is None and not r.passed and r.error == "incomplete output"
    json.dumps(r.asdict())  # records serialize (per-case JSONL)
  s = bfcl.summary(recs)
  assert s["overall"]["n"] == 2 and 0.0 <= s["simple_python"]["accuracy"] <= 1.0


# --- grammar <-> checker round trip --------------------------------------------------------------

def _ordered(v, schema):
  """``v`` with object keys in the schema's property order (strict grammars fix that order)."""
  if isinstance(v, dict) and "properties" in schema:
    props = schema["properties"]
    return {k: _ordered(v[k], props[k]) for k in props if k in v}
  if isinstance(v, list) and "items" in schema:
    return [_ordered(x, schema["items"]) for x in v]
  return v


def _answer_text(case, fmt, indent):
  """The reference answer written as the model would in ``fmt``."""
  params = {t["function"]["name"]: t["function"]["parameters"] for t in case.tools}
  calls = [{"name": fn, "arguments": _ordered(a, params[fn])}
           for c in bfcl.reference_calls(case) for fn, a in c.items()]
  if fmt == "json_list":
    return json.dumps(calls)
  return "\n".join(f"```json\n{json.dumps(c, indent=indent)}\n```" for c in calls)


@pytest.mark.parametrize("which", ["smollm2", "qwen"])
def test_grammar_accepts_reference_and_checker_passes(cases, which):
  """Per family format (SmolLM2: json_list; Qwen2: fenced JSON at indent 2), the case grammar
  accepts the correct answer token by token, stops, and the scored text passes."""
  import os
  from pask_jax.testing import grammar_compiler
  if which == "qwen":
    from pask_jax.testing import stored_tokenizer
    tok = stored_tokenizer(
        os.path.join(os.path.dirname(__file__), "data", "qwen_tokenizer.json.gz"))
    arch = "qwen2"
  else:
    from pask_jax.testing import smollm2
    tok, arch = smollm2().tokenizer, "llama"
  fmt, indent = bfcl.style_for(arch)
  assert (fmt, indent) == {"qwen": ("fenced_json", 2), "smollm2": ("json_list", None)}[which]
  grammars = bfcl.Grammars(grammar_compiler(tok), fmt, indent)
  ids = ["simple_python_0", "simple_python_83", "simple_python_89", "multiple_0", "parallel_0",
         "parallel_multiple_0"]
  for i in ids:
    c = cases[i]
    text = _answer_text(c, fmt, indent)
    m = grammars(c).matcher()
    for t in tok.tok.encode(text, add_special_tokens=False).ids:
      assert m.accept(t), (i, text)
    assert m.accept(tok.stop_ids[0]) and m.terminated, i
    r = bfcl.score(c, text, fmt=fmt)
    assert r["passed"] and r["per_call"] == 1.0, (i, r)
  # the prompt goes through the template's own tools section when it has one
  prompt = bfcl.render(cases["parallel_0"], tok, fmt)
  if which == "qwen":
    assert "<tools>" in prompt and json.dumps(cases["parallel_0"].tools[0],
                                              ensure_ascii=False) in prompt
  else:
    assert "<tools>" not in prompt and "You can call these functions" in prompt
  assert cases["parallel_0"].messages[0]["content"] in prompt
