"""One prompt-rendering path: the ids (and prompt-span labels) that the API, the server and the
BFCL / synthetic calibration tasks feed the model, for a fixed set of inputs on the SmolLM2 and
Qwen2.5 tokenizers, equal the ids recorded from the four separate paths that existed before
they were unified (``tests/data/prompt_ids.json.gz``; ``python tests/test_prompt.py --record``
rewrites it)."""
import gzip
import hashlib
import json
import os
import sys
import types

import numpy as np
import pytest

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
GOLDEN = os.path.join(DATA, "prompt_ids.json.gz")

WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}},
           {"type": "function", "function": {
    "name": "get_time", "description": "Local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Weather in Oslo?"}]
FORMATS = ("fenced_json", "tool_call_tags", "json_list")


def _tags(tags):
  if tags is None:
    return None
  return hashlib.sha256(np.ascontiguousarray(tags, np.int32).tobytes()).hexdigest()[:16]


def _tokenizers():
  from pask_jax.testing import smollm2_tokenizer, stored_tokenizer
  return {"smollm2": (smollm2_tokenizer(), "llama"),
          "qwen": (stored_tokenizer(os.path.join(DATA, "qwen_tokenizer.json.gz")), "qwen2")}


class _Engine:
  def __init__(self):
    from pask_jax import policy as P
    self.policy, self.context = P.all_high(), 8192

  def fits_ever(self, n, m):
    return None


def _api(tok, arch, out):
  from pask_jax import api
  model = types.SimpleNamespace(tokenizer=tok, cfg=types.SimpleNamespace(
      arch=arch, vocab_size=tok.vocab_size, max_position=1 << 20))
  calls = {"plain": dict(prompt="What is 2+2?"),
           "system": dict(prompt="What is 2+2?", system="Answer in one word."),
           "chat": dict(prompt=CHAT),
           "no_template": dict(prompt="raw text", chat_template=False),
           "schema": dict(prompt="Give n.", json_schema=SCHEMA),
           "tools": dict(prompt=CHAT, tools=WEATHER),
           "tools_system": dict(prompt="Oslo?", system="Be brief.", tools=WEATHER)}
  for f in FORMATS:
    calls[f"tools_{f}"] = dict(prompt="Weather in Oslo?", tools=WEATHER, tool_format=f)
  for name, kw in calls.items():
    for labels in (False, True):
      p = api.prepare(model, labels=labels, **kw)
      out[f"api/{name}/{labels}"] = {"ids": list(p.ids), "tags": _tags(p.tags), "fmt": p.fmt}


def _server(tok, arch, out):
  from serve.app import Preparer
  from serve.protocol import ChatCompletionRequest, CompletionRequest
  cfg = types.SimpleNamespace(arch=arch, vocab_size=tok.vocab_size)
  turns = [{"role": "user", "content": "Weather in Paris?"},
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'},
           {"role": "user", "content": "And Oslo?"}]
  bodies = {"plain": dict(messages=CHAT),
            "schema": dict(messages=CHAT, response_format={
                "type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}),
            "tools": dict(messages=CHAT, tools=WEATHER),
            "tools_none": dict(messages=CHAT, tools=WEATHER, tool_choice="none"),
            "tools_required": dict(messages=CHAT, tools=WEATHER, tool_choice="required"),
            "tools_named": dict(messages=CHAT, tools=WEATHER, tool_choice={
                "type": "function", "function": {"name": "get_time"}}),
            "turns": dict(messages=turns, tools=WEATHER)}
  for fmt in (None,) + FORMATS:
    prep = Preparer(_Engine(), tok, cfg, None, tool_format=fmt)
    for name, body in bodies.items():
      b = ChatCompletionRequest.model_validate({"model": "m", **body})
      p = prep.plan(b)
      text, ids, offsets, _ = prep.prompt(p, b)
      out[f"server/{fmt}/{name}"] = {"ids": list(ids), "tags": _tags(prep.labels(text, offsets)),
                                     "fmt": p.fmt}
    p = prep.plan(ChatCompletionRequest.model_validate(
        {"model": "m", "messages": CHAT[:2], "tools": WEATHER}))
    text = prep.render(p, add_generation_prompt=False)
    out[f"server/{fmt}/tokenize"] = {"ids": prep.tokenize(text), "tags": None, "fmt": p.fmt}
  prep = Preparer(_Engine(), tok, cfg, None)
  for name, prompt in (("text", "Once upon a time"), ("ids", [1, 2, 3, 40, 50])):
    text, ids, offsets, _ = prep.completion(CompletionRequest.model_validate(
        {"model": "m", "prompt": prompt, "max_tokens": 4}))
    out[f"server/completion/{name}"] = {"ids": list(ids), "tags": _tags(prep.labels(text, offsets)),
                                        "fmt": None}


def _bfcl(tok, arch, out):
  from calibrate import bfcl
  from calibrate.tasks import SyntheticTask
  from pask_jax.testing import grammar_compiler
  fns = [t["function"] for t in WEATHER]
  cases = [bfcl.Case("a", "simple_python", [{"role": "user", "content": "Weather in Oslo?"}],
                     fns, WEATHER, [], "k"),
           bfcl.Case("b", "multiple", [{"role": "system", "content": "Be brief."},
                                       {"role": "user", "content": "Time in Rome?"}],
                     fns, WEATHER, [], "k")]
  for labels in (False, True):
    for c, p in zip(cases, bfcl.prepare(cases, tok, arch=arch, prompt_labels=labels)):
      out[f"bfcl/{c.id}/{labels}"] = {"ids": list(p.ids), "tags": _tags(p.tags),
                                      "fmt": None}
  task = SyntheticTask(tok, grammar_compiler(tok), 3, seed=1)
  for i, r in enumerate(task.requests):
    out[f"synthetic/{i}"] = {"ids": list(r.ids), "tags": _tags(r.tags), "fmt": None}


def _prompt_tags(p):
  return p.tags


def render_all() -> dict:
  out = {}
  for tname, (tok, arch) in _tokenizers().items():
    got: dict = {}
    _api(tok, arch, got)
    _server(tok, arch, got)
    _bfcl(tok, arch, got)
    out.update({f"{tname}/{k}": v for k, v in got.items()})
  return out


def test_every_path_renders_the_recorded_ids():
  with gzip.open(GOLDEN, "rt") as f:
    want = json.load(f)
  got = render_all()
  assert sorted(got) == sorted(want)
  bad = [k for k in want if got[k] != want[k]]
  assert not bad, f"{len(bad)} inputs render differently, e.g. {bad[:5]}"


def test_style_defaults_and_choices():
  from pask_jax.prompt import style
  assert style("qwen2") == ("fenced_json", 2) and style("llama") == ("json_list", None)
  assert style("qwen2", "fenced_json") == ("fenced_json", 2)   # the family's own: its indent
  assert style("qwen2", "tool_call_tags") == ("tool_call_tags", None)
  assert style("mystery") == ("json_list", None)
  with pytest.raises(ValueError, match="unknown tool format 'yaml'"):
    style("llama", "yaml")


def test_render_takes_a_template_and_leaves_the_messages_alone():
  from pask_jax.prompt import render
  from pask_jax.testing import smollm2_tokenizer
  tok = smollm2_tokenizer()
  msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
  tpl = "{% for m in messages %}[{{ m.role }}:{{ m.content }}]{% endfor %}"
  assert render(tok, msgs, template=tpl) == "[system:Be brief.][user:Hi]"
  got = render(tok, msgs, tools=WEATHER[:1], template=tpl, merge=True)
  assert got.startswith("[system:You can call these functions:") and "Be brief.][user:Hi]" in got
  assert got.count("[system:") == 1
  tools_tpl = "{{ tools | length }}{% for m in messages %}[{{ m.role }}]{% endfor %}"
  assert render(tok, msgs, tools=WEATHER, template=tools_tpl) == "2[system][user]"
  assert msgs[0] == {"role": "system", "content": "Be brief."} and len(msgs) == 2


def test_engine_request_is_built_from_a_prompt():
  from pask_jax.prompt import Prompt
  from serve.engine import Request
  tags = np.zeros((3, 4), np.int32)
  p = Prompt("abc", [5, 6, 7], tags, fmt="json_list")
  r = Request.of(p, 9, temperature=0.5, stop=("x",))
  assert (r.ids, r.max_tokens, r.temperature, r.stop) == ([5, 6, 7], 9, 0.5, ("x",))
  assert r.tags is tags and r.tracker is not None and r.ids is not p.ids


if __name__ == "__main__" and sys.argv[1:] == ["--record"]:
  with gzip.open(GOLDEN, "wt") as f:
    json.dump(render_all(), f)
