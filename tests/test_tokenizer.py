"""Chat templates rendered as transformers renders them, checked against transformers' own
``apply_chat_template`` on every template the tests have: SmolLM2's (from its GGUF, read by
transformers' GGUF loader too), Qwen2.5's (the GGUF metadata exported to tests/data), and a
Llama-3-style and a Mistral-style template (written here, saved as HF tokenizer directories)."""
import copy
import gzip
import json
import os

import pytest

from models import gguf_io, registry
from models.tokenizer import ChatTemplateError, Tokenizer

import transformers  # noqa: E402 — the dev extra installs it

DATA = os.path.join(os.path.dirname(__file__), "data", "qwen_tokenizer.json.gz")

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather <b>now</b> & später ☃ for a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "City name, e.g. Zürich"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}}]
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Tokyo", "unit": "celsius"}}}
CONVERSATIONS = {
    "one user turn": [{"role": "user", "content": "Hello"}],
    "system + turns": [{"role": "system", "content": "You are terse."},
                       {"role": "user", "content": "Hi"},
                       {"role": "assistant", "content": "Hello! How can I help?"},
                       {"role": "user", "content": "  Weather in Paris? Größe ☃  "}],
    "tool round trip": [{"role": "user", "content": "What's the weather in Tokyo?"},
                        {"role": "assistant", "content": None, "tool_calls": [CALL]},
                        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}],
    "string arguments": [{"role": "user", "content": "Tokyo?"},
                         {"role": "assistant", "content": "",
                          "tool_calls": [dict(CALL, function=dict(
                              CALL["function"], arguments='{"city": "Tokyo"}'))]}],
    "roles out of order": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
    "two calls": [{"role": "user", "content": "Tokyo and Paris?"},
                  {"role": "assistant", "tool_calls": [CALL, CALL]}],
}

LLAMA3 = r"""{{- bos_token }}
{%- if custom_tools is defined %}{%- set tools = custom_tools %}{%- endif %}
{%- if not tools_in_user_message is defined %}{%- set tools_in_user_message = true %}{%- endif %}
{%- if not date_string is defined %}{%- set date_string = "26 Jul 2024" %}{%- endif %}
{%- if not tools is defined %}{%- set tools = none %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if tools is not none %}{{- "Environment: ipython\n" }}{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- if tools_in_user_message and not tools is none %}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
    {%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""  # noqa: E501 (the model's template, verbatim)

# Mistral-style, written WITHOUT whitespace control so that trim_blocks / lstrip_blocks matter.
MISTRAL = """{{ bos_token }}
{% for message in messages %}
    {% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {% endif %}
    {% if message['role'] == 'user' %}
        {% if loop.last and tools is not none %}
[AVAILABLE_TOOLS] {{ tools | tojson }}[/AVAILABLE_TOOLS]
        {% endif %}
        {{ '[INST] ' + message['content'] + ' [/INST]' }}
    {% elif message['role'] == 'assistant' %}
        {% if message.tool_calls is defined %}
[TOOL_CALLS] {{ message.tool_calls | map(attribute='function') | list | tojson }}{{ eos_token }}
        {% else %}
        {{ ' ' + message['content'] + eos_token }}
        {% endif %}
    {% endif %}
{% endfor %}
"""
SPECIAL = {"llama3": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
                      "pad_token": "<|finetune_right_pad_id|>"},
           "mistral": {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}}


def render(tok, msgs, **kw):
  """('ok', text) or ('raised', first line) — so refusals are compared too."""
  try:
    return "ok", tok.apply_chat_template(msgs, **kw)
  except Exception as e:  # noqa: BLE001
    return "raised", type(e).__name__


def hf_render(hf, msgs, **kw):
  try:
    return "ok", hf.apply_chat_template(copy.deepcopy(msgs), tokenize=False, **kw)
  except Exception as e:  # noqa: BLE001
    return "raised", type(e).__name__


def assert_same_as_transformers(ours, hf, *, with_tools=True):
  seen = set()
  for name, msgs in CONVERSATIONS.items():
    for tools in ([None, TOOLS] if with_tools else [None]):
      for agp in (True, False):
        a = render(ours, msgs, tools=tools, add_generation_prompt=agp)
        b = hf_render(hf, msgs, tools=tools, add_generation_prompt=agp)
        seen.add(a[0])
        if b[0] == "raised":   # a template refusal: ours refuses with a named ValueError
          assert a[0] == "raised", (name, tools is not None, agp, a)
          with pytest.raises(ChatTemplateError):
            ours.apply_chat_template(msgs, tools=tools, add_generation_prompt=agp)
          continue
        assert a == b, (name, tools is not None, agp)
        if agp:   # and the prompt's token ids: transformers adds no special tokens to a chat
          want = hf.apply_chat_template(copy.deepcopy(msgs), tools=tools, tokenize=True,
                                        add_generation_prompt=True)
          want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
          assert ours.encode(a[1]) == list(want), name
  return seen


@pytest.fixture(scope="module")
def smollm2_pair():
  path = registry.smollm2_path()
  ours = Tokenizer.from_gguf_metadata(gguf_io.read(path).meta)
  hf = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path),
                                                  gguf_file=os.path.basename(path))
  return ours, hf


def test_smollm2_gguf_template_and_special_tokens(smollm2_pair):
  ours, hf = smollm2_pair
  assert ours.special_tokens == hf.special_tokens_map   # read from the GGUF metadata alike
  assert ours.chat_template == hf.chat_template
  assert assert_same_as_transformers(ours, hf) == {"ok", "raised"}   # content=None: both refuse


def _hf_from(ours: Tokenizer, template, special):
  return transformers.PreTrainedTokenizerFast(tokenizer_object=copy.deepcopy(ours.tok),
                                              chat_template=template, **special)


def test_qwen25_gguf_template():
  from tokenizers import Tokenizer as HFTokenizer
  with gzip.open(DATA, "rb") as f:
    rec = json.loads(f.read())
  assert rec["source"].endswith(".gguf") and "<tools>" in rec["chat_template"]
  special = rec.get("special_tokens") or {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
  ours = Tokenizer(HFTokenizer.from_str(json.dumps(rec["tokenizer"])),
                   chat_template=rec["chat_template"], stop_ids=rec["stop_ids"],
                   bos_id=rec["bos_id"], add_bos=rec["add_bos"], special_tokens=special)
  assert ours.takes_tools()
  hf = _hf_from(ours, rec["chat_template"], ours.special_tokens)
  assert assert_same_as_transformers(ours, hf) == {"ok"}


@pytest.fixture(scope="module")
def base_tok():
  path = registry.smollm2_path()
  return Tokenizer.from_gguf_metadata(gguf_io.read(path).meta)


def _hf_dir(tmp_path, base_tok, template, special):
  """An HF tokenizer directory written by transformers: tokenizer.json + tokenizer_config.json
  (+ chat_template.jinja); the special tokens are added to the vocabulary first."""
  from tokenizers import AddedToken
  raw = copy.deepcopy(base_tok.tok)
  raw.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special.values()])
  hf = transformers.PreTrainedTokenizerFast(tokenizer_object=raw, chat_template=template, **special)
  hf.save_pretrained(tmp_path)
  return tmp_path


@pytest.mark.parametrize("kind", ["llama3", "mistral"])
def test_handwritten_templates_from_hf_dirs(kind, tmp_path, base_tok):
  d = _hf_dir(tmp_path, base_tok, {"llama3": LLAMA3, "mistral": MISTRAL}[kind], SPECIAL[kind])
  ours = Tokenizer.from_hf_dir(d)
  hf = transformers.AutoTokenizer.from_pretrained(d)
  assert ours.special_tokens == hf.special_tokens_map == SPECIAL[kind]
  assert ours.tok.token_to_id(SPECIAL[kind]["eos_token"]) in ours.stop_ids
  assert assert_same_as_transformers(ours, hf) == {"ok", "raised"}
  text = ours.apply_chat_template(CONVERSATIONS["one user turn"])
  assert text.startswith(SPECIAL[kind]["bos_token"])         # the special token is in context
  with pytest.raises(ChatTemplateError, match="alternate" if kind == "mistral" else "single"):
    ours.apply_chat_template(CONVERSATIONS["roles out of order" if kind == "mistral" else
                                           "two calls"])
  # A model that adds BOS itself (GGUF add_bos_token) still gets ONE BOS before a chat that
  # writes {{ bos_token }}: the ids transformers produces for the same chat.
  bos = ours.tok.token_to_id(SPECIAL[kind]["bos_token"])
  adds = Tokenizer(ours.tok, chat_template=ours.chat_template, stop_ids=ours.stop_ids,
                   bos_id=bos, add_bos=True, special_tokens=ours.special_tokens)
  ids = adds.encode(text)
  assert ids[0] == bos and ids[1] != bos
  assert ids == list(hf.apply_chat_template(CONVERSATIONS["one user turn"], tokenize=True,
                                            add_generation_prompt=True)["input_ids"])
  assert adds.encode("plain")[0] == bos


def test_tojson_and_kwargs_like_transformers(base_tok):
  tpl = ("{{ messages[0].content | tojson }}|{{ tools | tojson(indent=2, sort_keys=true) }}|"
         "{{ bos_token }}|{{ date_string | default('none') }}|{% generation %}x{% endgeneration %}"
         "|{{ namespace(a=1).a }}|{{ dict(b=2).b }}")
  ours = Tokenizer(base_tok.tok, chat_template=tpl, stop_ids=[],
                   special_tokens={"bos_token": "<B>"})
  hf = _hf_from(ours, tpl, {"bos_token": "<B>"})
  msgs = [{"role": "user", "content": "<b>&'\"</b> ☃"}]
  for kw in ({}, {"date_string": "1 Jan", "bos_token": "<override>"}):
    a = ours.apply_chat_template(msgs, tools=TOOLS, add_generation_prompt=False, **kw)
    assert a == hf.apply_chat_template(msgs, tools=TOOLS, tokenize=False, **kw)
  assert '"<b>&\'\\"</b> ☃"' in a and "<override>" in a   # no HTML escaping, kwargs win


def test_continue_final_message_and_named_templates(tmp_path, base_tok):
  tpls = {"default": "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>"
                     "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}",
          "tool_use": "TOOLS {{ (tools or []) | length }} "
                      "{% for m in messages %}{{ m.content }}{% endfor %}"}
  d = _hf_dir(tmp_path, base_tok, tpls, {"eos_token": "</s>"})
  ours, hf = Tokenizer.from_hf_dir(d), transformers.AutoTokenizer.from_pretrained(d)
  assert set(ours.chat_templates) == {"default",
                                      "tool_use"} and ours.chat_template == tpls["default"]
  msgs = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "The answer is"}]
  for kw in ({"tools": TOOLS, "add_generation_prompt": False},
             {"continue_final_message": True, "add_generation_prompt": False},
             {"chat_template": "tool_use", "add_generation_prompt": False}):
    assert ours.apply_chat_template(msgs, **kw) == hf.apply_chat_template(msgs, tokenize=False,
                                                                          **kw)
  assert ours.apply_chat_template(msgs, continue_final_message=True).endswith("The answer is")


def test_template_errors_are_one_line_value_errors(base_tok):
  bad = Tokenizer(base_tok.tok, chat_template="{% for m in messages %}{{ m.content", stop_ids=[])
  with pytest.raises(ChatTemplateError, match="does not parse"):
    bad.apply_chat_template([{"role": "user", "content": "x"}])
  none = Tokenizer(base_tok.tok, chat_template=None, stop_ids=[])
  with pytest.raises(ChatTemplateError, match="no chat template"):
    none.apply_chat_template([{"role": "user", "content": "x"}])
  with pytest.raises(ValueError, match="empty conversation"):
    base_tok.apply_chat_template([])
  with pytest.raises(ValueError, match="tools must be JSON-schema dicts"):
    base_tok.apply_chat_template([{"role": "user", "content": "x"}], tools=[print])
