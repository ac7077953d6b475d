"""Issue 27 deliverable 5: the server features vLLM users expect — ``--api-key``,
``--chat-template``, ``--tool-call-parser``, ``/v1/completions``, ``/tokenize`` and
``/detokenize``, ``serve --help`` with defaults — and two error messages.

Server-level tests use the shared loopback server (SmolLM2) and, for the options, a second app
over the same engine (``serve_helpers.options_server``: an API key, a custom template, the
hermes tool-call format), so no second model is loaded.
"""
import concurrent.futures as cf
import json

import httpx
import jsonschema
import openai
import pytest

from serve_helpers import KEY, MODEL, TEMPLATE, TIMEOUT, WEATHER
from serve_helpers import client as make_client
from serve_helpers import options_server
from serve_helpers import server as start_server

MSG = [{"role": "user", "content": "What is the weather in Oslo?"}]
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def base():
  return start_server()[0]


@pytest.fixture(scope="module")
def client(base):
  return make_client(base)


@pytest.fixture(scope="module")
def opts():
  return options_server()[0]


@pytest.fixture(scope="module")
def keyed(opts):
  return openai.OpenAI(base_url=opts + "/v1", api_key=KEY, timeout=TIMEOUT, max_retries=0)


def _error(r, status: int) -> dict:
  assert r.status_code == status, r.text
  body = r.json()
  assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
  assert "\n" not in body["error"]["message"]
  return body["error"]


# ---- --help ----------------------------------------------------------------------------------

def test_serve_help_gives_every_flag_help_and_its_default(capsys):
  from pask_jax.cli import main
  with pytest.raises(SystemExit) as e:
    main(["serve", "--help"])
  assert e.value.code == 0
  text = capsys.readouterr().out.split("options:", 1)[1]
  blocks, cur = [], None
  for line in text.splitlines():
    if line.startswith("  -"):
      cur = [line]
      blocks.append(cur)
    elif cur is not None:
      cur.append(line)
  flags = {b[0].split()[0].rstrip(",") for b in blocks}
  assert {"--api-key", "--chat-template", "--tool-call-parser", "--default-max-tokens",
          "--max-num-seqs", "--port"} <= flags
  for b in blocks:
    if b[0].split()[0] == "-h,":
      continue
    words = " ".join(" ".join(b).split())
    assert "(default:" in words, words
  assert "(default: 256)" in " ".join(text.split())   # --default-max-tokens
  # the defaults the README's serving table names where they differ from vLLM's
  said = {b[0].split()[0].rstrip(","): " ".join(" ".join(b).split()) for b in blocks}
  for flag, default in (("--host", "127.0.0.1"), ("--port", "8000"), ("--max-num-seqs", "4"),
                        ("--max-model-len", "2048"), ("--dtype", "auto")):
    assert f"(default: {default})" in said[flag], said[flag]
  for flag in ("--kv-memory", "--gpu-memory-utilization"):
    assert "(default: every slot at full context)" in said[flag], said[flag]


def test_cli_passes_the_serve_options(monkeypatch, tmp_path):
  import uvicorn

  import serve.app
  from pask_jax.cli import main
  seen = {}

  class Engine:
    sizing = type("S", (), {"describe": staticmethod(lambda: "sizes")})()

    def stop(self):
      seen["stopped"] = True

  def build(*a, **kw):
    seen.update(kw)
    return object(), Engine()

  monkeypatch.setattr(serve.app, "build", build)
  monkeypatch.setattr(uvicorn, "run", lambda *a, **kw: None)
  monkeypatch.setenv("PASK_API_KEY", "from-env")
  tpl = tmp_path / "t.jinja"
  tpl.write_text(TEMPLATE)
  assert main(["serve", "--chat-template", str(tpl), "--tool-call-parser", "hermes",
               "--enable-auto-tool-choice"]) == 0
  assert seen["api_key"] == ["from-env"] and seen["chat_template"] == str(tpl)
  assert seen["tool_call_parser"] == "hermes" and seen["stopped"]
  assert main(["serve", "--api-key", "k1", "k2"]) == 0
  assert seen["api_key"] == ["k1", "k2"] and seen["tool_call_parser"] is None
  monkeypatch.delenv("PASK_API_KEY")
  assert main(["serve"]) == 0
  assert seen["api_key"] is None
  with pytest.raises(SystemExit):
    main(["serve", "--tool-call-parser", "mistral"])


# ---- --api-key ---------------------------------------------------------------------------------

def test_api_key_is_required_except_on_health_and_metrics(opts, keyed):
  for path in ("/v1/models", "/tokenize"):
    method = httpx.get if path == "/v1/models" else httpx.post
    kw = {} if method is httpx.get else {"json": {"prompt": "hi"}}
    missing = _error(method(opts + path, timeout=30, **kw), 401)
    assert missing["code"] == "invalid_api_key" and "didn't provide" in missing["message"]
    for bad in (f"Bearer {KEY}x", f"Basic {KEY}", KEY, "Bearer", f"Bearer {KEY} x"):
      wrong = _error(method(opts + path, headers={"Authorization": bad}, timeout=30, **kw), 401)
      assert wrong["code"] == "invalid_api_key" and "Incorrect API key" in wrong["message"]
    assert method(opts + path, headers=AUTH, timeout=30, **kw).status_code == 200
  r = httpx.post(opts + "/v1/chat/completions", timeout=30,
                 json={"model": MODEL, "messages": MSG, "max_tokens": 2})
  assert _error(r, 401)["code"] == "invalid_api_key"
  assert r.headers["www-authenticate"] == "Bearer"
  assert httpx.get(opts + "/health", timeout=30).status_code == 200
  assert "pask_running" in httpx.get(opts + "/metrics", timeout=30).text
  with pytest.raises(openai.AuthenticationError):
    openai.OpenAI(base_url=opts + "/v1", api_key="wrong", max_retries=0).models.list()
  assert [m.id for m in keyed.models.list().data] == [MODEL]
  r = keyed.chat.completions.create(model=MODEL, messages=MSG, max_tokens=2)
  assert r.usage.completion_tokens >= 1


def test_auth_middleware_compares_digests_of_every_key():
  from serve.guard import Auth
  a = Auth(None, ["k1", "ключ"])
  assert a.allowed([(b"authorization", b"Bearer k1")])
  assert a.allowed([(b"authorization", "bearer ключ".encode())])
  assert not a.allowed([(b"authorization", b"Bearer k2")])
  assert not a.allowed([(b"authorization", b"Bearer k1 k1")])
  assert not a.allowed([])
  with pytest.raises(ValueError):
    Auth(None, [""])


# ---- --chat-template ---------------------------------------------------------------------------

def test_chat_template_is_a_file_or_inline(tmp_path):
  from serve.app import load_chat_template, with_chat_template
  from serve_helpers import server
  f = tmp_path / "t.jinja"
  f.write_text(TEMPLATE)
  assert load_chat_template(str(f)) == TEMPLATE == load_chat_template(TEMPLATE)
  assert load_chat_template("{{ messages[0]['content'] }}\\n") == \
      "{{ messages[0]['content'] }}\n"   # one-line form: escapes decoded, as vLLM
  for bad in (str(tmp_path / "missing.jinja"), str(tmp_path)):
    with pytest.raises(ValueError, match="neither a readable file"):
      load_chat_template(bad)
  (tmp_path / "empty.jinja").write_text(" \n")
  with pytest.raises(ValueError, match="empty"):
    load_chat_template(str(tmp_path / "empty.jinja"))
  tok = server()[2].state.prep.tok
  custom = with_chat_template(tok, TEMPLATE)
  assert custom.apply_chat_template(MSG) == f"<|im_start|>user: {MSG[0]['content']}<|im_end|>\n" \
                                            "<|im_start|>assistant: "
  assert tok.chat_template != TEMPLATE   # the model's tokenizer is not changed
  for broken, why in (("{% for m in messages %}", "does not parse"),
                      ("{{ messages[0].nope.deeper }}", "render")):
    with pytest.raises(ValueError, match=why) as e:
      with_chat_template(tok, broken)
    assert "\n" not in str(e.value)


def test_chat_template_is_what_the_model_sees(opts, keyed):
  r = httpx.post(opts + "/tokenize", headers=AUTH, timeout=30,
                 json={"messages": MSG, "return_token_strs": True})
  assert r.status_code == 200, r.text
  out = r.json()
  want = f"<|im_start|>user: {MSG[0]['content']}<|im_end|>\n<|im_start|>assistant: "
  got = httpx.post(opts + "/detokenize", headers=AUTH, timeout=30,
                   json={"tokens": out["tokens"]}).json()["prompt"]
  assert got == want
  c = keyed.chat.completions.create(model=MODEL, messages=MSG, max_tokens=2)
  assert c.usage.prompt_tokens == out["count"]


# ---- --tool-call-parser ------------------------------------------------------------------------

def test_unknown_tool_call_parser_is_refused():
  from serve.app import create_app
  _, engine, first = start_server()
  with pytest.raises(ValueError, match="unknown tool-call parser 'mistral'"):
    create_app(engine, first.state.prep.tok, first.state.prep.cfg, grammars=first.state.grammars,
               tool_call_parser="mistral")


def test_hermes_format_constrains_and_parses_the_calls(opts, keyed):
  from pask_jax.grammar.toolcall import split_calls, tools_system_prompt
  from serve.protocol import ChatCompletionRequest
  prep = options_server()[1].state.prep
  plan = prep.plan(ChatCompletionRequest(model=MODEL, messages=MSG, tools=WEATHER))
  assert plan.job["fmt"] == plan.fmt == "tool_call_tags"
  # The template ignores tools: they are described (with the hermes shape) in a system message.
  described = tools_system_prompt(WEATHER, "tool_call_tags", "auto")
  assert "<tool_call>" in described and described in prep.render(plan)
  # the two requests at once: the engine decodes them side by side (one step, not two, per
  # token; each request's answer is checked alone below)
  choices = ("required", {"type": "function", "function": {"name": "get_weather"}})
  with cf.ThreadPoolExecutor(2) as ex:
    rs = list(ex.map(lambda choice: keyed.chat.completions.create(
        model=MODEL, messages=MSG, tools=WEATHER, max_tokens=60, tool_choice=choice,
        logprobs=True), choices))
  for r in rs:
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None, ch
    (call,) = ch.message.tool_calls
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER[0]["function"]["parameters"])
    raw = "".join(t.token for t in ch.logprobs.content)   # the text the model wrote
    assert raw.startswith('<tool_call>\n{"name": "get_weather", "arguments": {')
    assert raw.endswith("}\n</tool_call>")
    assert split_calls(raw, "tool_call_tags")[1] == [{"name": "get_weather", "arguments": args}]


# ---- /v1/completions ---------------------------------------------------------------------------

PROMPT = "The capital of France is"


def test_completions_text_tokens_stream_and_echo(base, client):
  r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6)
  assert r.object == "text_completion" and r.id.startswith("cmpl-")
  ch = r.choices[0]
  assert ch.finish_reason in ("stop", "length") and isinstance(ch.text, str)
  assert r.usage.completion_tokens <= 6
  ids = httpx.post(base + "/tokenize", json={"prompt": PROMPT}, timeout=30).json()["tokens"]
  assert r.usage.prompt_tokens == len(ids)   # plain text: no chat template
  for prompt in (ids, [ids], [PROMPT]):
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6)
    assert again.choices[0].text == ch.text
  chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, stream=True,
                                          stream_options={"include_usage": True}))
  assert "".join(c.choices[0].text for c in chunks if c.choices) == ch.text
  assert chunks[-2].choices[0].finish_reason == ch.finish_reason
  assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == \
      r.usage.completion_tokens
  e = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, echo=True)
  assert e.choices[0].text == PROMPT + ch.text
  es = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, echo=True,
                                 stream=True)
  assert "".join(c.choices[0].text for c in es) == PROMPT + ch.text


def test_completions_sampling_stop_and_logprobs(client):
  kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=1.0, top_p=0.9)
  a = client.completions.create(seed=3, **kw).choices[0].text
  assert client.completions.create(seed=3, **kw).choices[0].text == a
  greedy = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12).choices[0]
  stop = greedy.text.strip()[:3]
  cut = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, stop=[stop])
  assert cut.choices[0].finish_reason == "stop" and stop not in cut.choices[0].text
  assert greedy.text.startswith(cut.choices[0].text)
  lp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, logprobs=2)
  c, info = lp.choices[0], lp.choices[0].logprobs
  assert "".join(info.tokens) == c.text
  assert len(info.tokens) == len(info.token_logprobs) == len(info.top_logprobs) == \
      len(info.text_offset) >= 1
  if c.finish_reason == "length":
    assert len(info.tokens) == lp.usage.completion_tokens == 5
  assert all(x <= 0 for x in info.token_logprobs) and info.text_offset[0] == 0
  assert all(1 <= len(t) <= 2 and max(t.values()) >= l - 1e-4
             for t, l in zip(info.top_logprobs, info.token_logprobs))
  assert info.text_offset == sorted(info.text_offset)


BAD_COMPLETIONS = [
    ({"prompt": ""}, "prompt", "must not be empty"),
    ({"prompt": []}, "prompt", "must not be empty"),
    ({"prompt": ["a", "b"]}, "prompt", "one request per prompt"),
    ({"prompt": [1, "a"]}, "prompt", "list of integers"),
    ({"prompt": [1, 10 ** 9]}, "prompt", "outside this model's vocabulary"),
    ({"prompt": [-1]}, "prompt", "outside this model's vocabulary"),
    ({"prompt": 5}, "prompt", "string or a list of token ids"),
    ({"prompt": "hi", "n": 2}, "n", "n > 1"),
    ({"prompt": "hi", "best_of": 3}, "best_of", "best_of > 1"),
    ({"prompt": "hi", "suffix": "x"}, "suffix", "suffix"),
    ({"prompt": "hi", "echo": True, "logprobs": 1}, None, "'echo' with 'logprobs'"),
    ({"prompt": "hi", "logprobs": 21}, "logprobs", "20"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    ({"prompt": "hi", "top_k": 3}, "top_k", "Unrecognized request argument supplied: top_k"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options", "stream"),
    ({"prompt": "hi", "max_tokens": 300}, "prompt", "max_tokens"),
    ({"prompt": "word " * 600, "max_tokens": 4}, "prompt", "max_tokens"),
]


@pytest.mark.parametrize("extra,param,text", BAD_COMPLETIONS, ids=[str(i) for i in
                                                                   range(len(BAD_COMPLETIONS))])
def test_completions_bad_input_is_a_one_line_400(base, extra, param, text):
  err = _error(httpx.post(base + "/v1/completions", json={"model": MODEL, **extra}, timeout=30),
               400)
  assert err["param"] == param and text in err["message"], err
  if text == "max_tokens":
    assert err["code"] == "context_length_exceeded" and "256 tokens" in err["message"]


def test_completions_unknown_model_is_a_404(base):
  err = _error(httpx.post(base + "/v1/completions", json={"model": "nope", "prompt": "hi"},
                          timeout=30), 404)
  assert err["code"] == "model_not_found"


# ---- /tokenize, /detokenize --------------------------------------------------------------------

def test_tokenize_and_detokenize(base, client):
  tok = start_server()[2].state.prep.tok
  r = httpx.post(base + "/tokenize", timeout=30,
                 json={"model": MODEL, "prompt": PROMPT, "return_token_strs": True}).json()
  assert r["tokens"] == tok.encode(PROMPT) and r["count"] == len(r["tokens"])
  assert r["max_model_len"] == 256
  assert r["token_strs"] == [tok.tok.id_to_token(i) for i in r["tokens"]]
  raw = httpx.post(base + "/tokenize", json={"prompt": PROMPT, "add_special_tokens": False},
                   timeout=30).json()
  assert raw["token_strs"] is None and raw["tokens"] == tok.tok.encode(
      PROMPT, add_special_tokens=False).ids
  d = httpx.post(base + "/detokenize", json={"model": MODEL, "tokens": raw["tokens"]},
                 timeout=30).json()
  assert d == {"prompt": PROMPT}
  chat = httpx.post(base + "/tokenize", json={"messages": MSG, "tools": WEATHER},
                    timeout=30).json()
  c = client.chat.completions.create(model=MODEL, messages=MSG, tools=WEATHER, max_tokens=2,
                                     tool_choice="none")
  with_tools = client.chat.completions.create(model=MODEL, messages=MSG, tools=WEATHER,
                                              max_tokens=2)
  assert chat["count"] == with_tools.usage.prompt_tokens   # tools in a system message
  assert c.usage.prompt_tokens < chat["count"]   # "none": this template drops them
  cont = httpx.post(base + "/tokenize", timeout=30, json={
      "messages": MSG + [{"role": "assistant", "content": "It is"}],
      "add_generation_prompt": False, "continue_final_message": True}).json()
  text = httpx.post(base + "/detokenize", json={"tokens": cont["tokens"]}, timeout=30).json()
  assert text["prompt"].endswith("It is")


BAD_TOKENIZE = [
    ("/tokenize", {}, 400, "prompt", "exactly one of"),
    ("/tokenize", {"prompt": "a", "messages": MSG}, 400, "prompt", "exactly one of"),
    ("/tokenize", {"messages": []}, 400, "messages", "must not be empty"),
    ("/tokenize", {"prompt": "a", "tools": WEATHER}, 400, "prompt", "need 'messages'"),
    ("/tokenize", {"messages": MSG, "continue_final_message": True}, 400,
     "continue_final_message", "add_generation_prompt"),
    ("/tokenize", {"prompt": "a", "model": "nope"}, 404, "model", "does not exist"),
    ("/tokenize", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages[0].content", "has type 'image_url'"),
    ("/detokenize", {"tokens": [1, 10 ** 9]}, 400, "tokens", "outside this model's vocabulary"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens", "valid list"),
    ("/detokenize", {"tokens": [1], "extra": 1}, 400, "extra", "Unrecognized"),
]


@pytest.mark.parametrize("path,body,status,param,text", BAD_TOKENIZE,
                         ids=[str(i) for i in range(len(BAD_TOKENIZE))])
def test_tokenize_bad_input(base, path, body, status, param, text):
  err = _error(httpx.post(base + path, json=body, timeout=30), status)
  assert err["param"] == param and text in err["message"], err


# ---- messages ----------------------------------------------------------------------------------

def test_image_part_error_names_the_type(base):
  err = _error(httpx.post(base + "/v1/chat/completions", timeout=30, json={
      "model": MODEL, "messages": [{"role": "user", "content": [
          {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}), 400)
  assert "content[0] has type 'image_url'" in err["message"] and "{" not in err["message"]


def test_context_length_error_names_max_tokens(base):
  for content, max_tokens in (("hi", 250), ("word " * 400, 8)):
    err = _error(httpx.post(base + "/v1/chat/completions", timeout=30, json={
        "model": MODEL, "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": content}]}), 400)
    assert err["code"] == "context_length_exceeded" and err["param"] == "messages"
    assert f"{max_tokens} in the completion: max_tokens" in err["message"], err
    assert "maximum context length is 256 tokens" in err["message"]


def test_hermes_is_qwen25s_native_format():
  """A Qwen2.5 checkpoint (family default: fenced JSON) served with ``hermes``: its template's
  ``<tool_call>`` blocks, compact JSON, the ``<tool_call>`` token itself admitted."""
  import gzip
  import os

  from tokenizers import Tokenizer as HFTokenizer

  from models.tokenizer import Tokenizer
  from pask_jax import policy as P
  from pask_jax.grammar import GrammarCompiler, tool_call_grammar
  from serve.app import TOOL_CALL_PARSERS, Preparer
  from serve.protocol import ChatCompletionRequest
  with gzip.open(os.path.join(os.path.dirname(__file__), "data", "qwen_tokenizer.json.gz")) as f:
    rec = json.loads(f.read())   # written by scripts/export_tokenizer.py
  tok = Tokenizer(HFTokenizer.from_str(json.dumps(rec["tokenizer"])),
                  chat_template=rec["chat_template"], stop_ids=rec["stop_ids"],
                  bos_id=rec["bos_id"], add_bos=rec["add_bos"], vocab_size=rec["vocab_size"],
                  special_tokens=rec.get("special_tokens"))

  def accepts(g, text):
    m = g.matcher()
    return all(m.accept(t) for t in tok.encode(text)) and m.accept(tok.stop_ids[0])

  assert "<tool_call>" in tok.chat_template   # Qwen2.5's own instruction
  engine = type("E", (), {"policy": P.all_high(), "context": 4096})()
  cfg = type("Cfg", (), {"arch": "qwen2", "vocab_size": tok.vocab_size})()
  body = ChatCompletionRequest(model="m", messages=MSG, tools=WEATHER)
  assert Preparer(engine, tok, cfg, None).plan(body).job["fmt"] == "fenced_json"
  p = Preparer(engine, tok, cfg, None, tool_format=TOOL_CALL_PARSERS["hermes"]).plan(body)
  assert (p.fmt, p.indent, p.job["fmt"], p.job["indent"]) == ("tool_call_tags", None) * 2
  g = tool_call_grammar(GrammarCompiler(tok, tok.vocab_size), WEATHER, p.fmt, indent=p.indent)
  call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
  assert tok.encode(call)[0] == tok.tok.token_to_id("<tool_call>")   # one added token
  assert accepts(g, call)
  assert not accepts(g, '```json\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n```')
