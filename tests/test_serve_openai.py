"""Issue 15 items 1-2: the OpenAI request surface, point by point against vLLM's server (the
README's serving table; one test per row or group of rows), with the official client.

Server-level tests use the shared loopback server (SmolLM2, whose template ignores tools: the
json_list format and a tools system message); rendering of a template that takes tools and
tool_calls (Qwen2.5's) is tested on the Preparer with the Qwen tokenizer, no model needed.
"""
import asyncio
import concurrent.futures as cf
import json
import math
import os

import httpx
import jsonschema
import openai
import pytest

from serve_helpers import MODEL, WEATHER, idle, pages_all_free
from serve_helpers import client as make_client
from serve_helpers import server as start_server

MSG = [{"role": "user", "content": "Hi"}]
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}},
    "required": ["tz"]}}}


@pytest.fixture(scope="module")
def base():
  return start_server()[0]


@pytest.fixture(scope="module")
def client(base):
  return make_client(base)


def _args(call, tools):
  schema = {t["function"]["name"]: t["function"]["parameters"] for t in tools}[call.function.name]
  args = json.loads(call.function.arguments)
  jsonschema.validate(args, schema)
  return args


# ---- tool_choice / parallel_tool_calls ------------------------------------------------------

def test_auto_grammar_admits_text_or_calls():
  """"auto": free text until the format's trigger, then a constrained call (XGrammar triggered
  structural tags); parallel_tool_calls=false: at most one call, nothing after it."""
  from pask_jax.testing import accepts_text, smollm2_grammars

  from pask_jax.grammar import tool_call_grammar
  tok, gc = smollm2_grammars()
  tools = [WEATHER[0], TIME]
  call = '[{"name": "get_weather", "arguments": {"city": "Oslo"}}]'
  two = '[{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "get_time", ' \
        '"arguments": {"tz": "UTC"}}]'
  g = tool_call_grammar(gc, tools, "json_list", choice="auto", check=True)
  for text in ("Hello! How are you?", "", "Sure: " + call, call, two, call + " and " + call):
    assert accepts_text(tok, g, text), text
  for text in ('[{"name": "nope", "arguments": {}}]',
               '[{"name": "get_time", "arguments": {"tz": "PST"}}]'):
    assert not accepts_text(tok, g, text), text
  one = tool_call_grammar(gc, tools, "json_list", choice="auto", max_calls=1, check=True)
  assert accepts_text(tok, one, "Sure: " + call) and accepts_text(tok, one, "text only")
  assert not accepts_text(tok, one, two) and not accepts_text(tok, one, call + " more")
  req = tool_call_grammar(gc, tools, "json_list", choice="required", max_calls=1, check=True)
  assert accepts_text(tok, req, call) and not accepts_text(tok, req, "text")
  assert not accepts_text(tok, req, two)


def test_auto_adapter_tags_free_text_as_free_generation():
  from pask_jax.testing import smollm2_grammars

  from pask_jax import tags as T
  from pask_jax.grammar import tool_call_grammar
  from pask_jax.grammar.toolcall import adapter_for
  tok, gc = smollm2_grammars()
  g = tool_call_grammar(gc, [WEATHER[0]], "json_list", choice="auto", check=True)
  ad, m = adapter_for(g, tok), g.matcher()
  text = 'Sure. [{"name": "get_weather", "arguments": {"city": "Oslo"}}] Done.'
  rows = []
  for t in tok.encode(text):
    cands, _ = ad.accept(m, t)
    rows.append((tok.decode([t]), {T.unpack(int(c))[1] for c in cands if c >= 0}))
  free, scaf = int(T.Cls.FREE_GENERATION), int(T.Cls.PURE_SCAFFOLD)
  first = next(i for i, (p, _) in enumerate(rows) if "[" in p)
  assert all(c == {free} for _, c in rows[:first])                 # "Sure." is free text
  name = next(c for p, c in rows if "weather" in p)
  assert int(T.Cls.SCHEMA_BEARING) in name                           # the call is tagged
  last = next(i for i in range(len(rows) - 1, -1, -1) if "]" in rows[i][0])
  assert all(c == {free} for _, c in rows[last + 1:]) and rows[last + 1:]   # " Done." free
  assert scaf in rows[first][1]


def test_tool_choice_auto_returns_text_or_valid_calls(client):
  r = client.chat.completions.create(model=MODEL, max_tokens=40, tools=WEATHER,
                                     messages=[{"role": "user", "content": "Hello there!"}])
  ch = r.choices[0]
  if ch.message.tool_calls:
    assert ch.finish_reason in ("tool_calls", "length")
    for c in ch.message.tool_calls:
      _args(c, WEATHER)
  else:
    assert ch.finish_reason in ("stop", "length") and isinstance(ch.message.content, str)


def test_tool_choice_none_is_free_text(client):
  r = client.chat.completions.create(model=MODEL, max_tokens=8, tools=WEATHER,
                                     tool_choice="none", messages=MSG)
  ch = r.choices[0]
  assert ch.message.tool_calls is None and ch.message.content and ch.finish_reason in (
      "stop", "length")


def test_tool_choice_named_is_exactly_one_call(client):
  r = client.chat.completions.create(
      model=MODEL, max_tokens=40, tools=[WEATHER[0], TIME],
      tool_choice={"type": "function", "function": {"name": "get_time"}},
      messages=[{"role": "user", "content": "What time is it in Paris?"}])
  ch = r.choices[0]
  assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) == 1
  assert ch.message.tool_calls[0].function.name == "get_time"
  assert _args(ch.message.tool_calls[0], [TIME])["tz"] in ("UTC", "CET")
  assert ch.message.tool_calls[0].id.startswith("call_")


def test_required_without_parallel_calls_is_one_call(client):
  r = client.chat.completions.create(
      model=MODEL, max_tokens=60, tools=[WEATHER[0], TIME], tool_choice="required",
      parallel_tool_calls=False,
      messages=[{"role": "user", "content": "Weather in Oslo and the time in Rome?"}])
  ch = r.choices[0]
  assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) == 1


def test_tool_choice_errors(base):
  def bad(extra, param):
    r = httpx.post(base + "/v1/chat/completions", timeout=30,
                   json={"model": MODEL, "messages": MSG, **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text

  bad({"tool_choice": "required"}, "tool_choice")               # no tools
  bad({"tools": WEATHER, "tool_choice": {"type": "function", "function": {"name": "x"}}},
      "tool_choice")
  bad({"tools": [WEATHER[0], WEATHER[0]]}, "tools")             # duplicate names
  bad({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools[0].type")
  bad({"tools": WEATHER, "response_format": {"type": "json_object"}}, "response_format")
  bad({"tools": WEATHER, "tool_choice": "required", "stop": ["x"]}, "stop")


# ---- multi-turn tool conversations ----------------------------------------------------------

def _turns(args='{"city": "Paris"}', call_id="call_1", answer_id="call_1"):
  return [{"role": "user", "content": "Weather in Paris?"},
          {"role": "assistant", "content": None, "tool_calls": [
              {"id": call_id, "type": "function",
               "function": {"name": "get_weather", "arguments": args}}]},
          {"role": "tool", "tool_call_id": answer_id, "content": '{"temp_c": 21}'}]


class _FakeEngine:
  def __init__(self):
    from pask_jax import policy as P
    self.policy, self.context = P.all_high(), 4096

  def fits_ever(self, n, m):
    return None


def _prep(tok, arch):
  from serve.app import Preparer
  from serve.protocol import ChatCompletionRequest
  cfg = type("Cfg", (), {"arch": arch, "vocab_size": tok.vocab_size})()
  prep = Preparer(_FakeEngine(), tok, cfg, None)

  def render(**body):
    b = ChatCompletionRequest.model_validate({"model": "m", **body})
    p = prep.plan(b)
    return prep.prompt(p, b)[0]

  return render


def test_multi_turn_rendered_as_the_qwen_template_expects():
  """Arguments reach a tools template as an object (no double encoding), the tool result as
  the template's tool turn."""
  from pask_jax.testing import stored_tokenizer
  tok = stored_tokenizer(os.path.join(os.path.dirname(__file__), "data", "qwen_tokenizer.json.gz"))
  text = _prep(tok, "qwen2")(messages=_turns(), tools=WEATHER)
  assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
  assert '\\"city\\"' not in text and '"{' not in text
  assert '<tool_response>\n{"temp_c": 21}\n</tool_response>' in text
  assert text.rstrip().endswith("<|im_start|>assistant")


def test_multi_turn_rendered_for_a_template_without_tools():
  from pask_jax.testing import smollm2_grammars
  tok, _ = smollm2_grammars()
  text = _prep(tok, "llama")(messages=_turns(), tools=WEATHER)
  # The template cannot render tool_calls: the call is written as the model writes calls.
  assert '<|im_start|>assistant\n[{"name": "get_weather", "arguments": {"city": "Paris"}}]' in text
  assert '<|im_start|>tool\n{"temp_c": 21}<|im_end|>' in text
  assert "To call functions" in text   # the auto-mode tools system message


def test_multi_turn_through_the_server(client, base):
  r = client.chat.completions.create(model=MODEL, max_tokens=24, tools=WEATHER,
                                     messages=_turns())
  assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
  for extra, param in ((dict(messages=_turns(answer_id="call_9")), "messages[2].tool_call_id"),
                       (dict(messages=_turns(args="{oops")),
                        "messages[1].tool_calls[0].function.arguments"),
                       (dict(messages=_turns(args="[1]")),
                        "messages[1].tool_calls[0].function.arguments")):
    r = httpx.post(base + "/v1/chat/completions", timeout=30,
                   json={"model": MODEL, "tools": WEATHER, **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


# ---- stop -----------------------------------------------------------------------------------

def test_stop_strings_across_token_boundaries(client, server_engine):
  kw = dict(model=MODEL, max_tokens=16, temperature=0,
            messages=[{"role": "user", "content": "Name three colors."}])
  full = client.chat.completions.create(**kw).choices[0].message.content
  tok = server_engine.tok
  ids = tok.encode(full)
  pieces = [tok.decode([i]) for i in ids]
  # A stop string that spans the boundary between the 3rd and 4th token of the answer.
  k = next(i for i in range(2, len(pieces) - 1) if len(pieces[i]) >= 1 and len(pieces[i + 1]) >= 1
           and full.find(pieces[i][-1] + pieces[i + 1][0]) > 0)
  cut = full.find(pieces[k][-1] + pieces[k + 1][0])
  stop = full[cut:cut + 2]
  r = client.chat.completions.create(stop=[stop, "zzzz-never"], **kw)
  assert r.choices[0].finish_reason == "stop"
  assert r.choices[0].message.content == full[:full.find(stop)]
  parts, finish = [], None
  for c in client.chat.completions.create(stop=stop, stream=True, **kw):
    if c.choices:
      parts.append(c.choices[0].delta.content or "")
      finish = c.choices[0].finish_reason or finish
  assert "".join(parts) == full[:full.find(stop)] and finish == "stop"


@pytest.fixture(scope="module")
def server_engine():
  return start_server()[1]


# ---- logprobs -------------------------------------------------------------------------------

def test_logprobs_and_top_logprobs(client, server_engine):
  r = client.chat.completions.create(model=MODEL, max_tokens=6, temperature=0, logprobs=True,
                                     top_logprobs=5, messages=[{"role": "user",
                                                                "content": "Say hello."}])
  ch = r.choices[0]
  content = ch.logprobs.content
  assert len(content) == r.usage.completion_tokens
  assert "".join(e.token for e in content) == ch.message.content
  for e in content:
    assert len(e.top_logprobs) == 5 and e.logprob <= 0
    tops = [t.logprob for t in e.top_logprobs]
    assert tops == sorted(tops, reverse=True) and sum(math.exp(t) for t in tops) <= 1 + 1e-4
    assert e.top_logprobs[0].token == e.token and abs(e.top_logprobs[0].logprob - e.logprob) < 1e-5
    assert bytes(e.bytes).decode("utf-8", "replace") == e.token
  # The first token comes from the full-precision prefill: its log-prob is the model's.
  from pask_jax.testing import full_logprobs
  from pask_jax.grammar.prompt_spans import label_prompt
  tok = server_engine.tok
  ids, _ = label_prompt(tok, tok.apply_chat_template([{"role": "user", "content": "Say hello."}]))
  ref = full_logprobs(server_engine.model, ids)[-1]
  first = tok.encode(content[0].token)[0] if len(tok.encode(content[0].token)) == 1 else None
  if first is not None:
    assert abs(float(ref[first]) - content[0].logprob) < 0.05
  # Without top_logprobs: the chosen token only; under a grammar: the masked distribution.
  r = client.chat.completions.create(model=MODEL, max_tokens=8, logprobs=True, messages=MSG)
  assert all(e.top_logprobs == [] for e in r.choices[0].logprobs.content)
  r = client.chat.completions.create(model=MODEL, max_tokens=8, logprobs=True, top_logprobs=20,
                                     messages=MSG, response_format={"type": "json_object"})
  c = r.choices[0].logprobs.content
  # The distribution is the grammar-masked one: every alternative of the first token opens
  # the object, and their probabilities (all the mass the mask leaves, at most 20) sum to <= 1.
  assert c and all(t.token.startswith("{") for t in c[0].top_logprobs)
  assert sum(math.exp(t.logprob) for t in c[0].top_logprobs) <= 1 + 1e-4
  assert server_engine.runner.traces["fwd" if server_engine.overlap else "step"] == 1


def test_logprobs_errors(base):
  for extra, param in (({"top_logprobs": 3}, "top_logprobs"),
                       ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
                       ({"logprobs": "yes"}, "logprobs")):
    r = httpx.post(base + "/v1/chat/completions", timeout=30,
                   json={"model": MODEL, "messages": MSG, **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


# ---- every other field ----------------------------------------------------------------------

REFUSED = [
    ("presence_penalty", 0.5), ("frequency_penalty", -1.0), ("logit_bias", {"50256": -100}),
    ("n", 2), ("store", True), ("audio", {"voice": "alloy", "format": "wav"}),
    ("modalities", ["text", "audio"]), ("prediction", {"type": "content", "content": "x"}),
    ("reasoning_effort", "low"), ("verbosity", "low"), ("web_search_options", {}),
    ("functions", [{"name": "f"}]), ("function_call", "auto"), ("service_tier", "flex"),
    ("top_k", 5), ("min_p", 0.1), ("repetition_penalty", 1.1), ("echo", True),
]


@pytest.mark.parametrize("field,value", REFUSED, ids=[f for f, _ in REFUSED])
def test_unsupported_fields_are_a_400_naming_them(client, field, value):
  with pytest.raises(openai.BadRequestError) as e:
    client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=2,
                                   extra_body={field: value})
  err = e.value.body
  assert err["param"] == field and field in err["message"], err


ACCEPTED = [("user", "u1"), ("safety_identifier", "s1"), ("metadata", {"k": "v"}),
            ("prompt_cache_key", "k"), ("prompt_cache_retention", "24h"),
            ("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("logit_bias", {}),
            ("n", 1), ("store", False), ("modalities", ["text"]), ("service_tier", "auto"),
            ("seed", 7), ("top_p", 0.9), ("max_completion_tokens", 2)]


def test_neutral_fields_are_accepted(client):
  # four requests at a time (the server's slots): each is answered on its own, and their decode
  # steps are shared instead of one after the other
  with cf.ThreadPoolExecutor(4) as ex:
    rs = list(ex.map(lambda fv: client.chat.completions.create(
        model=MODEL, messages=MSG, max_tokens=2, extra_body={fv[0]: fv[1]}), ACCEPTED))
  for (field, _), r in zip(ACCEPTED, rs):
    assert r.choices[0].finish_reason in ("stop", "length"), field


def test_message_level_fields(base):
  def post(msgs):
    return httpx.post(base + "/v1/chat/completions", timeout=30,
                      json={"model": MODEL, "max_tokens": 2, "messages": msgs})
  r = post([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
  assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content"
  assert "only text content parts" in r.json()["error"]["message"]
  r = post([{"role": "user", "content": "hi", "colour": "red"}])
  assert r.status_code == 400 and "colour" in r.json()["error"]["message"]
  r = post([{"role": "function", "content": "x", "name": "f"}])
  assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0]"
  r = post([{"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi"}], "name": "ann"}])
  assert r.status_code == 200, r.text


# ---- model names, usage in streams ---------------------------------------------------------

def test_served_model_names(client, base):
  with pytest.raises(openai.NotFoundError) as e:
    client.chat.completions.create(model="gpt-4o", messages=MSG, max_tokens=2)
  assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
  r = client.chat.completions.create(model="smollm2", messages=MSG, max_tokens=2)
  assert r.model == MODEL   # an alias answers with the first served name
  assert client.models.retrieve(MODEL).id == MODEL


def test_stream_usage_only_when_asked(client):
  kw = dict(model=MODEL, messages=MSG, max_tokens=3, stream=True)
  assert all(c.usage is None for c in client.chat.completions.create(**kw))
  chunks = list(client.chat.completions.create(stream_options={"include_usage": True}, **kw))
  assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1
  assert all(c.usage is None for c in chunks[:-1])
  assert chunks[-2].choices[0].finish_reason in ("stop", "length")


def test_stream_with_tools_splits_text_and_calls():
  """The streamed answer of an auto request: text deltas first (the tail that could begin the
  call trigger held back), the calls as one tool_calls delta once complete."""
  from pask_jax.testing import smollm2_grammars

  from serve.app import Responder, sse_chunks
  from serve.metrics import Metrics
  tok, _ = smollm2_grammars()
  text = 'Let me check. [{"name": "get_weather", "arguments": {"city": "Oslo"}}]'
  deltas = ["Let me", " check.", " [", '{"name"', ': "get_weather", "arguments": ',
            '{"city": "Oslo"}}]']

  class Req:
    def cancel(self):
      pass

  async def run():
    q = asyncio.Queue()
    for d in deltas:
      q.put_nowait(("delta", d))
    led = {k: 0.0 for k in ("prefill_bits", "decode_bits", "full_kv_bits", "measured_B",
                            "prefill_B", "decode_B")}
    led.update(prefill_counts={}, decode_counts={})
    q.put_nowait(("done", {"text": text, "finish": "stop", "tokens": [1] * 20,
                           "prompt_tokens": 5, "ledger": led, "overflow": False}))
    meta = {"id": "c", "created": 0, "model": MODEL, "t_arrive": 0.0, "logprobs": None}
    m = Metrics(type("E", (), {"snapshot": lambda s: {}, "alive": True})())
    return [x async for x in sse_chunks(Req(), q, Responder(tok, "json_list", True), meta, False,
                                        m)]

  chunks = [json.loads(c[6:]) for c in asyncio.run(run()) if c.startswith("data: {")]
  content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
  calls = [tc for c in chunks for tc in c["choices"][0]["delta"].get("tool_calls") or ()]
  assert content == "Let me check. " and len(calls) == 1
  assert calls[0]["function"]["name"] == "get_weather" and calls[0]["index"] == 0
  assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


# ---- /metrics ------------------------------------------------------------------------------

def test_metrics_parse_in_both_formats(base, client):
  from prometheus_client.openmetrics.parser import text_string_to_metric_families as om
  from prometheus_client.parser import text_string_to_metric_families as prom
  client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=3)
  text = httpx.get(base + "/metrics", timeout=10).text
  fams = {f.name: f for f in prom(text)}
  r = httpx.get(base + "/metrics", timeout=10,
                headers={"accept": "application/openmetrics-text; version=1.0.0"})
  assert r.headers["content-type"].startswith("application/openmetrics-text")
  ofams = {f.name: f for f in om(r.text)}
  for name in ("pask_time_to_first_token_seconds", "pask_time_per_output_token_seconds",
               "pask_e2e_request_latency_seconds", "pask_request_queue_time_seconds"):
    assert fams[name].type == "histogram" and ofams[name].type == "histogram"
    count = next(s.value for s in fams[name].samples if s.name == name + "_count")
    assert count >= 1, name
  m = idle(base)
  assert pages_all_free(m)
  assert 0 < m["pask_measured_b"] < 1   # the demo policy compresses
  assert ofams["pask_pages_free"].type == "gauge" and ofams["pask_requests"].type == "counter"
  assert m['pask_http_requests_total{code="200"}'] >= 1


def test_seeded_sampling_is_reproducible(client):
  kw = dict(model=MODEL, max_tokens=6, temperature=1.0, top_p=0.9, seed=1234,
            messages=[{"role": "user", "content": "Tell me a word."}])
  a = client.chat.completions.create(**kw).choices[0].message.content
  b = client.chat.completions.create(**kw).choices[0].message.content
  assert a == b
