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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme_example() -> str:
  text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
  m = re.search(r"<!-- api-example:[^>]*-->\s*```python\n(.*?)```", text, re.S)
  assert m, "README.md lost its API example block"
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
  # one code path: the CLI's generate gives the API's answer (same model object: its cached
  # runner, no second compile)
  from pask_jax import api, cli
  monkeypatch.setattr(api, "load_model", lambda name, dtype="auto": ns["model"])
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
