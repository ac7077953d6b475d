"""The ``pask-jax`` command line on the embedded default model."""
import json

import jsonschema
import pytest

from pask_jax import cli


@pytest.fixture(autouse=True, scope="module")
def _load_once():
  """Every ``generate`` here loads the embedded model with the same arguments (each load reads
  the GGUF and estimates its key centering, ~8 s on a 2-core CPU): the file loads it once.  The
  command's own path runs as written; the loader (pask_jax.platform.load_model) returns the model
  it loaded before for the same arguments; what it refuses is refused as before (not memoized)."""
  from pask_jax import platform
  real, loaded = platform.load_model, {}

  def load(name_or_path=None, *, dtype_name="auto", center_keys=True):
    key = (name_or_path, str(dtype_name), center_keys)
    if key not in loaded:
      loaded[key] = real(name_or_path, dtype_name=dtype_name, center_keys=center_keys)
    return loaded[key]

  mp = pytest.MonkeyPatch()
  mp.setattr(platform, "load_model", load)
  yield
  mp.undo()


def test_generate_json_schema(tmp_path, capsys):
  schema = json.load(open("examples/weather_schema.json"))
  rc = cli.main(["generate", "--prompt", "Weather in Paris as JSON", "--json-schema",
                 "examples/weather_schema.json", "--max-tokens", "48"])
  out, err = capsys.readouterr()
  assert rc == 0
  jsonschema.validate(json.loads(out.strip().splitlines()[0]), schema)
  assert "tokens/s" in err


def test_generate_tools(capsys):
  rc = cli.main(["generate", "--prompt", "What's the weather in Tokyo?", "--tools",
                 "examples/weather_tools.json", "--max-tokens", "48"])
  out, _ = capsys.readouterr()
  assert rc == 0
  line = next(l for l in out.splitlines() if l.startswith("tool calls: "))
  calls = json.loads(line[len("tool calls: "):])
  assert calls and all(c["name"] == "get_weather" for c in calls)


@pytest.mark.parametrize("argv,msg", [
    (["--json-schema", "missing.json"], "JSON schema file not found: missing.json"),
    (["--tools", "missing.json"], "tools file not found"),
    (["--model", "/nonexistent/model.gguf"], "model not found: /nonexistent/model.gguf"),
])
def test_bad_input_is_reported_plainly(argv, msg):
  with pytest.raises(SystemExit) as e:
    cli.main(["generate", "--prompt", "hi", "--max-tokens", "4"] + argv)
  assert msg in str(e.value)


def test_uncompilable_schema(tmp_path):
  bad = tmp_path / "bad.json"
  bad.write_text(json.dumps({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}))
  with pytest.raises(SystemExit, match="points nowhere"):
    cli.main(["generate", "--prompt", "hi", "--json-schema", str(bad), "--max-tokens", "4"])


def test_prompt_longer_than_context():
  with pytest.raises(SystemExit, match="exceeds the model's context of 8192"):
    cli.main(["generate", "--prompt", "word " * 9000, "--max-tokens", "4"])


def test_generate_under_pask_policy(capsys):
  rc = cli.main(["generate", "--prompt", "What's the weather in Tokyo?", "--tools",
                 "examples/weather_tools.json", "--max-tokens", "32", "--policy", "demo"])
  out, err = capsys.readouterr()
  assert rc == 0 and "tool calls: " in out
  assert "ledger: [0]" in err and "measured B" in err


def test_policy_for_another_model_is_refused(tmp_path):
  from models import ModelConfig
  from pask_jax import policy as P
  other = ModelConfig(arch="qwen2", vocab_size=10, hidden=8, intermediate=8, n_layers=24,
                      n_heads=2, n_kv_heads=2, head_dim=4)
  P.save(P.demo(other), tmp_path / "pol")
  with pytest.raises(SystemExit, match="n_layers"):
    cli.main(["generate", "--prompt", "hi", "--max-tokens", "4", "--policy", str(tmp_path / "pol")])
