"""The Python API (pask_jax): the README's example block run as written, lazy import, errors."""
import contextlib
import io
import json
import os
import re
import subprocess
import sys

import jsonschema
import pytest

from serve_helpers import TEMPLATE, serve_kwargs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme_example(marker: str = "api-example") -> str:
  text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
  m = re.search(rf"<!-- {marker}:[^>]*-->\s*```python\n(.*?)```", text, re.S)
  assert m, f"README.md lost its {marker} block"
  return m.group(1)


def test_readme_example_runs(monkeypatch):
  """The block exactly as the README shows it, on the default SmolLM2 model."""
  monkeypatch.chdir(ROOT)
  ns: dict = {}
  buf = io.StringIO()
  with contextlib.redirect_stdout(buf):
    exec(compile(readme_example(), "README.md:api-example", "exec"), ns)
  out, led, doc, answers = ns["out"], ns["led"], ns["doc"], ns["answers"]
  assert out.tool_calls and out.tool_calls[0]["name"] == "get_weather"
  assert 0 < led["measured_B"] < 1 and sum(led["actions"].values()) > 0   # demo releases some
  jsonschema.validate(doc, json.load(open(os.path.join(ROOT, "examples/weather_schema.json"))))
  assert len(answers) == 2
  for a in answers:   # the engine decodes under its policy: ledgers, and calls that parse
    assert a.tool_calls and a.tool_calls[0]["name"] == "get_weather"
    assert 0 < ns["pj"].read_ledger(a)["measured_B"] <= 1
  assert "get_weather" in buf.getvalue()
  # the batch example, after the first block (it uses its model)
  with contextlib.redirect_stdout(buf):
    exec(compile(readme_example("api-batch-example"), "README.md:api-batch-example", "exec"), ns)
  outs = ns["outs"]
  assert len(outs) == 3 and all(isinstance(o, ns["pj"].Generation) for o in outs)
  for o in outs:
    assert o.finish in ("stop", "length") and "\n\n" not in o.text and o.tokens
  # one code path: the CLI's generate gives the API's answer (same model object: its cached
  # runner, no second compile).  The CLI loads through pask_jax.platform.load_model (patching
  # api.load_model, as this did before, left the CLI reading the GGUF and compiling again).
  from pask_jax import cli, platform
  monkeypatch.setattr(platform, "load_model",
                      lambda name_or_path=None, **kw: ns["model"] if name_or_path is None
                      else pytest.fail(f"the CLI loaded {name_or_path!r}"))
  cap = io.StringIO()
  with contextlib.redirect_stdout(cap):
    assert cli.main(["generate", "--prompt", "What's the weather in Tokyo?", "--tools",
                     "examples/weather_tools.json", "--policy", "demo", "--max-tokens", "32"]) == 0
  assert cap.getvalue().splitlines()[0] == out.text


def test_import_is_cheap_and_lazy():
  code = ("import sys, pask_jax; assert 'jax' not in sys.modules and 'xgrammar' not in sys.modules;"
          "f = pask_jax.generate; assert callable(f) and 'pask_jax.api' in sys.modules;"
          "print(sorted(pask_jax.__all__))")
  r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                     timeout=120)
  assert r.returncode == 0, r.stderr[-2000:]
  for name in ("load_model", "load_policy", "generate", "read_ledger", "start_engine", "submit"):
    assert name in r.stdout


def test_bad_input_is_named():
  import pask_jax as pj
  from pask_jax.testing import smollm2
  m = smollm2()
  with pytest.raises(ValueError, match="invalid JSON schema"):
    pj.prepare(m, "hi", json_schema={"type": "objekt"})
  with pytest.raises(ValueError, match="tools or a JSON schema"):
    pj.prepare(m, "hi", tools=[], json_schema={"type": "object"})
  with pytest.raises(ValueError, match="unknown tool format"):
    pj.prepare(m, "hi", tools=json.load(open(os.path.join(ROOT, "examples/weather_tools.json"))),
               tool_format="xml")
  with pytest.raises(ValueError, match="exceeds the model's context of 8192"):
    pj.prepare(m, "word " * 9000, max_tokens=4)
  with pytest.raises(ValueError, match="prompt must be"):
    pj.prepare(m, [])
  with pytest.raises(FileNotFoundError, match="policy '/nonexistent'"):
    pj.load_policy("/nonexistent", m)
  with pytest.raises(ValueError, match="max_tokens must be positive"):
    pj.generate(m, "hi", max_tokens=0)
  with pytest.raises(ValueError, match="temperature must be >= 0"):
    pj.generate(m, "hi", temperature=-1.0)
  with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
    pj.generate(m, "hi", top_p=0.0)
  # transformers' generate arguments we do not implement are refused by name, never ignored.
  for kw in ("top_k", "num_beams", "repetition_penalty", "do_sample", "stop_strings"):
    with pytest.raises(TypeError, match=kw):
      pj.generate(m, "hi", **{kw: 1})
  with pytest.raises(ValueError, match="not generated under a PASK policy"):
    pj.read_ledger(pj.Generation("x", [1], "stop", 3))
  p = pj.prepare(m, [{"role": "user", "content": "hi"}], system="Be brief.")
  assert p.text.startswith("<|im_start|>system\nBe brief.") and p.ids == m.tokenizer.encode(p.text)


@pytest.fixture(scope="module")
def smol():
  from pask_jax.testing import smollm2
  return smollm2()


def test_sampling_params_mirror_the_server_and_bad_values_are_one_line(smol):
  import pask_jax as pj
  sp = pj.SamplingParams(max_tokens=8, temperature=0.5, top_p=0.9, seed=3, stop="END",
                         logprobs=5)
  assert sp.stop == ("END",) and pj.SamplingParams(stop=["a", "b"]).stop == ("a", "b")
  for kw, msg in ((dict(max_tokens=0), "max_tokens must be positive"),
                  (dict(max_tokens=2.5), "max_tokens must be positive"),
                  (dict(temperature=float("nan")), "temperature must be >= 0"),
                  (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
                  (dict(seed="1"), "seed must be an int"),
                  (dict(stop=[""]), "stop must be a non-empty string"),
                  (dict(stop=["x"] * 17), "at most 16"),
                  (dict(logprobs=21), r"logprobs must be None or an int in \[0, 20\]"),
                  (dict(n=0), "n must be a positive int"),
                  (dict(n=2), "n=2: one answer per prompt")):
    with pytest.raises(ValueError, match=msg) as e:
      pj.SamplingParams(**kw)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=msg):   # the same through generate's keywords
      pj.generate(smol, "hi", **kw)
  with pytest.raises(ValueError, match="give sampling= or temperature, not both"):
    pj.generate(smol, "hi", sampling=sp, temperature=0.0)
  with pytest.raises(TypeError, match="SamplingParams"):
    pj.generate(smol, "hi", sampling={"max_tokens": 4})
  with pytest.raises(ValueError, match="logprobs: pask_jax.generate does not compute"):
    pj.generate(smol, "hi", logprobs=2)
  tools = json.load(open(os.path.join(ROOT, "examples/weather_tools.json")))
  with pytest.raises(ValueError, match="stop cannot be used with tools or json_schema"):
    pj.generate(smol, "hi", tools=tools, stop=["x"])
  with pytest.raises(ValueError, match="prompt must be"):
    pj.generate(smol, ["hi", {"role": "user"}])


def test_batch_equals_one_at_a_time(smol):
  import pask_jax as pj
  qs = ["Name a color.", "What is two plus two? Answer briefly.",
        [{"role": "user", "content": "Say hello in French."}]]
  outs = pj.generate(smol, qs, max_tokens=12)
  assert isinstance(outs, list) and len(outs) == 3
  for q, o in zip(qs, outs):
    one = pj.generate(smol, q, max_tokens=12)
    assert (o.text, o.tokens, o.finish, o.prompt_tokens) == \
        (one.text, one.tokens, one.finish, one.prompt_tokens)
  # under PASK with tools: per-row trackers, calls and ledgers as one at a time
  tools = json.load(open(os.path.join(ROOT, "examples/weather_tools.json")))
  qs = ["What's the weather in Tokyo?", "Weather in Oslo, in celsius?"]
  outs = pj.generate(smol, qs, tools=tools, policy="demo", max_tokens=32)
  for q, o in zip(qs, outs):
    one = pj.generate(smol, q, tools=tools, policy="demo", max_tokens=32)
    assert o.text == one.text and o.tool_calls == one.tool_calls
    assert pj.read_ledger(o)["measured_B"] == pj.read_ledger(one)["measured_B"]


def test_stop_strings_end_and_are_cut(smol):
  import pask_jax as pj
  q = "Count from 1 to 20, separated by commas."
  full = pj.generate(smol, q, max_tokens=32)
  stop = full.text[len(full.text) // 2:len(full.text) // 2 + 2]
  assert stop.strip(), full.text
  cut = pj.generate(smol, q, sampling=pj.SamplingParams(max_tokens=32, stop=["@@never", stop]))
  assert cut.finish == "stop" and cut.text == full.text[:full.text.find(stop)]
  assert len(cut.tokens) < len(full.tokens) and cut.tokens == full.tokens[:len(cut.tokens)]


class Decoded(Exception):
  """Raised in place of decoding: what generate handed the generation loop is checked."""


class Engine:
  """What submit reads of an engine (the model, its tool format, policy and context) and a
  submit that keeps the request: no engine runs."""

  def __init__(self, model, context: int):
    self.loaded, self.tool_format, self.policy, self.context = model, None, None, context
    self.got = []

  def submit(self, req):
    self.got.append(req)


def test_chat_template_is_a_file_or_a_template_as_serve_takes_it(smol, tmp_path, monkeypatch):
  """``chat_template=`` of prepare / generate / submit takes what ``serve --chat-template``
  takes (a file path, else the template itself, one-line form included), resolved and refused
  by the same functions (:mod:`pask_jax.prompt`), the errors naming the keyword."""
  import pask_jax as pj
  import serve.app
  from pask_jax import decode, prompt
  assert (serve.app.load_chat_template, serve.app.with_chat_template) == (
      prompt.load_chat_template, prompt.with_chat_template)       # one resolution for both
  f = tmp_path / "t.jinja"
  f.write_text(TEMPLATE)
  want = ("<|im_start|>system: Be brief.<|im_end|>\n<|im_start|>user: hi<|im_end|>\n"
          "<|im_start|>assistant: ")
  for given in (str(f), TEMPLATE, TEMPLATE.replace("\n", "\\n")):
    p = pj.prepare(smol, "hi", system="Be brief.", chat_template=given)
    assert p.text == want and p.ids == smol.tokenizer.encode(want), given
  assert smol.tokenizer.chat_template != TEMPLATE          # the model's tokenizer is unchanged
  assert pj.prepare(smol, "hi", chat_template=False).text == "hi"
  for bad, msg in ((str(tmp_path / "no.jinja"), r"chat_template '.*no\.jinja' is neither a "
                                                r"readable file \(No such file"),
                   (str(tmp_path), r"chat_template '.*' is neither a readable file"),
                   ("{% for m in messages %}", "chat_template cannot render a one-message "
                                               "conversation: .*"),
                   ("", "chat_template must be a file path or a template"),
                   (None, "chat_template must be True, False, or a template")):
    with pytest.raises(ValueError, match=msg) as e:
      pj.prepare(smol, "hi", chat_template=bad)
    assert "\n" not in str(e.value)
  seen = []

  def run(runner, tokenizer, prompts, **kw):
    seen.append(list(prompts[0]))
    raise Decoded

  monkeypatch.setattr(decode, "generate", run)
  with pytest.raises(Decoded):
    pj.generate(smol, "hi", system="Be brief.", chat_template=str(f))
  engine = Engine(smol, context=2048)
  pj.submit(engine, "hi", system="Be brief.", chat_template=TEMPLATE)
  assert seen == [engine.got[0].ids] == [smol.tokenizer.encode(want)]


def test_max_tokens_default_is_serves(smol, monkeypatch):
  """``max_tokens=None``, the default of SamplingParams, generate, submit and ``pask-jax
  generate``, is what ``serve`` gives a chat completion that sets none: --default-max-tokens
  (one constant, pask_jax.options.DEFAULT_MAX_TOKENS) capped by the room the prompt leaves in
  the context (the model's for generate, the engine's for submit)."""
  import pask_jax as pj
  from pask_jax import cli, decode, options, platform
  default = options.DEFAULT_MAX_TOKENS
  assert pj.SamplingParams().max_tokens is None
  assert serve_kwargs(monkeypatch, [])["default_max_tokens"] == default == 256
  seen = []

  def run(runner, tokenizer, prompts, *, sampling, **kw):
    seen.append((len(prompts[0]), sampling.max_tokens))
    raise Decoded

  monkeypatch.setattr(decode, "generate", run)
  monkeypatch.setattr(platform, "load_model", lambda *a, **kw: smol)
  for call in (lambda: pj.generate(smol, "hi"), lambda: pj.generate(smol, "word " * 8100),
               lambda: cli.main(["generate", "--prompt", "hi"])):
    with pytest.raises(Decoded):
      call()
  (_, short), (n, capped), (_, by_cli) = seen
  assert short == by_cli == default and n + capped == smol.cfg.max_position and capped < default
  engine = Engine(smol, context=2048)
  for q in ("hi", "word " * 2000):
    pj.submit(engine, q)
  short, long = engine.got
  assert short.max_tokens == default and len(long.ids) + long.max_tokens == 2048
  pj.submit(engine, "hi", max_tokens=3)
  assert engine.got[-1].max_tokens == 3


def test_start_engine_takes_the_serve_sizing_options(smol):
  import pask_jax as pj
  for kw, msg in ((dict(slots=0), "slots must be a positive int"),
                  (dict(kv_memory=1.0, gpu_memory_utilization=0.5), "not both"),
                  (dict(kv_memory=-1.0), "kv_memory must be a positive number"),
                  (dict(gpu_memory_utilization=1.5), r"in \(0, 1\]"),
                  (dict(kv_mix=(0.8, 0.5)), "kv_mix must be two fractions"),
                  (dict(preemption="swap"), "preemption must be 'replay' or 'recompute'"),
                  (dict(prefill_chunk=100), "prefill_chunk must be one of"),
                  (dict(prefill_share=0.0), "prefill_share must be in"),
                  (dict(hi_pages=0), "hi_pages must be None or a positive int"),
                  (dict(lo_format="nibbles"), "lo_format must be 'auto', 'bytes' or 'int4'"),
                  (dict(lo_page=0), "lo_page must be None or a positive int"),
                  (dict(tool_format="mistral"), "unknown tool format 'mistral'"),
                  (dict(tensor_parallel_size=0), "tensor_parallel_size must be a positive")):
    with pytest.raises(ValueError, match=msg):
      pj.start_engine(smol, "demo", warmup=False, **kw)
  for bad in (0, -5, 2.5, "128"):
    with pytest.raises(ValueError, match="warmup must be True, False or a positive int"):
      pj.start_engine(smol, "demo", warmup=bad)
  big = pj.start_engine(smol, "demo", slots=2, context=256, warmup=False)
  big.stop()
  e = pj.start_engine(smol, "demo", slots=2, context=256, kv_memory=0.004, kv_mix=(0.5, 0.5),
                      preemption="recompute", prefill_chunk=128, prefill_share=0.5,
                      lo_format="int4", tool_format="hermes", warmup=False)
  try:
    assert e.preemption == "recompute" and e.hi_total + e.lo_total < big.hi_total + big.lo_total
    assert e.tool_format == "hermes" and big.tool_format is None
    f = pj.submit(e, "Name a color.", sampling=pj.SamplingParams(max_tokens=6, logprobs=2))
    g = f.result(timeout=600)
    assert len(g.logprobs) == len(g.tokens) and all(len(alts) <= 2 for _, alts in g.logprobs)
    assert pj.submit(e, "Name a color.", max_tokens=6).result(timeout=600).logprobs is None
  finally:
    e.stop()


# ---- the API and pask-jax serve cannot drift -----------------------------------------------------

# start_engine keyword -> what serve passes build (the flag's argparse default)
ENGINE_OPTIONS = {"policy": "policy", "slots": "slots", "context": "context", "page": "page",
                  "hi_pages": "hi_pages", "lo_pages": "lo_pages", "kv_memory": "kv_memory_gb",
                  "gpu_memory_utilization": "gpu_memory_utilization", "kv_mix": "kv_mix",
                  "preemption": "preemption", "prefill_chunk": "prefill_chunk",
                  "prefill_share": "prefill_share", "lo_format": "lo_format",
                  "lo_page": "lo_page", "tool_format": "tool_call_parser",
                  "tensor_parallel_size": "tensor_parallel_size"}


def test_start_engine_defaults_are_serves(monkeypatch):
  """Every engine option of start_engine defaults to what ``pask-jax serve`` uses when its flag
  is not given (and serve.app.build's own defaults agree); a new option of either side fails
  here until the other has it."""
  import inspect

  import pask_jax as pj
  from serve.app import build
  api = {k: p.default for k, p in inspect.signature(pj.start_engine).parameters.items()
         if p.default is not inspect.Parameter.empty}
  assert set(api) == set(ENGINE_OPTIONS) | {"warmup"}, set(api) ^ set(ENGINE_OPTIONS)
  assert api["warmup"] is True   # the server always warms up every bucket
  served = serve_kwargs(monkeypatch, [])
  built = {k: p.default for k, p in inspect.signature(build).parameters.items()}
  for ours, theirs in ENGINE_OPTIONS.items():
    assert api[ours] == served[theirs], (ours, api[ours], served[theirs])
    assert built[theirs] == api[ours], (theirs, built[theirs], api[ours])
  assert (api["slots"], api["context"], api["lo_format"]) == (4, 2048, "auto")
  # the values the engine itself takes: one list of chunks, preemptions, shares
  from serve.engine import PREEMPTION, PREFILL_CHUNKS
  from serve.schedule import PREFILL_SHARE
  from pask_jax import options
  assert set(options.PREEMPTION) == set(PREEMPTION)
  assert options.PREFILL_CHUNKS == PREFILL_CHUNKS and api["prefill_share"] == PREFILL_SHARE


def test_serve_refuses_what_start_engine_refuses(monkeypatch, capsys):
  import serve.app
  from pask_jax.cli import main

  def build(*a, **kw):
    raise AssertionError("a bad flag reached build")

  monkeypatch.setattr(serve.app, "build", build)
  for argv, msg in ((["--kv-mix", "0.8", "0.5"], "--kv-mix must be two fractions"),
                    (["--kv-mix", "0", "0"], "--kv-mix must be two fractions"),
                    (["--gpu-memory-utilization", "1.5"], r"expected a fraction in \(0, 1\]"),
                    (["--prefill-share", "1"], r"expected a fraction in \(0, 1\)"),
                    (["--lo-format", "nibbles"], "invalid choice"),
                    (["--lo-page", "0"], "--lo-page")):
    with pytest.raises(SystemExit) as e:
      main(["serve", *argv])
    assert e.value.code == 2
    assert re.search(msg, capsys.readouterr().err), argv
  import pask_jax as pj
  for kw, msg in ((dict(kv_mix=(0.0, 0.0)), "kv_mix must be two fractions"),
                  (dict(prefill_share=1.0), r"prefill_share must be in \(0, 1\)")):
    with pytest.raises(ValueError, match=msg):
      pj.start_engine(None, **kw)   # refused before the model is looked at


def test_tool_format_names_are_the_same_everywhere(monkeypatch, capsys):
  """vLLM's ``hermes`` (= ``tool_call_tags``) and the other names are accepted alike by serve
  --tool-call-parser, generate --tool-format, the API's tool_format and the server's app."""
  from pask_jax import api, options
  from pask_jax.cli import main
  from pask_jax.prompt import style
  from serve.prepare import TOOL_CALL_PARSERS
  names = ["hermes", "tool_call_tags", "fenced_json", "json_list"]
  assert list(options.TOOL_FORMATS) == names and TOOL_CALL_PARSERS == options.TOOL_FORMATS
  for name in names:
    assert serve_kwargs(monkeypatch, ["--tool-call-parser", name])["tool_call_parser"] == name
    for arch in ("qwen2", "qwen3", "llama"):
      assert style(arch, name)[0] == options.TOOL_FORMATS[name]
  assert style("qwen2", "hermes") == ("tool_call_tags", None)
  assert style("qwen3", "hermes") == style("qwen3", None)   # its own format: the same indent
  for cmd in (["serve", "--tool-call-parser"], ["generate", "--prompt", "x", "--tool-format"]):
    with pytest.raises(SystemExit):
      main([*cmd, "mistral"])
    err = capsys.readouterr().err
    choices = err.split("choose from", 1)[1]
    assert "invalid choice: 'mistral'" in err and all(n in choices for n in names), err
  # submit: a request that names no format takes the engine's (as the server's parser)
  seen = []

  def prepare(model, prompt, **kw):
    seen.append(kw["tool_format"])
    raise LookupError("stop here")

  monkeypatch.setattr(api, "prepare", prepare)
  engine = type("E", (), {"loaded": object(), "tool_format": "hermes"})()
  for given, want in ((None, "hermes"), ("json_list", "json_list")):
    with pytest.raises(LookupError):
      api.submit(engine, "hi", tool_format=given)
    assert seen[-1] == want


def test_hermes_tool_calls_through_the_api(smol):
  import pask_jax as pj
  tools = json.load(open(os.path.join(ROOT, "examples/weather_tools.json")))
  p = pj.prepare(smol, "Weather in Oslo?", tools=tools, tool_format="hermes")
  assert p.fmt == "tool_call_tags" and "<tool_call>" in p.text
