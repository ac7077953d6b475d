"""Issue 27 item 4, on the project's own files (nothing installed, no network): the extras pin
the tested jax per host kind, the CPU install carries no ahead-of-time compile extras (so a bare
``import jax`` prints nothing), ``scripts/setup.sh`` takes exactly the options the README shows
and picks the CPU torch wheel explicitly, and the README's accelerator section names the pinned
versions.  (The install itself is checked on a fresh clone: bench/RESULTS.md's fresh-clone runs.)
"""
import os
import re
import subprocess
import tomllib

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYPROJECT = tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))
EXTRAS = PYPROJECT["project"]["optional-dependencies"]
SETUP = os.path.join(ROOT, "scripts", "setup.sh")
README = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
AOT_ONLY = ("libtpu", "jax-cuda13-plugin", "jax-cuda13-pjrt", "nvidia-cuda-nvcc")


def _name(req: str) -> str:
  return re.split(r"[\[=<>!;~ ]", req, maxsplit=1)[0].lower()


def _pins(reqs) -> dict[str, list[str]]:
  out: dict[str, list[str]] = {}
  for r in reqs:
    m = re.match(r"([A-Za-z0-9_.-]+)(\[[^]]*\])?==([0-9.]+)", r)
    if m:
      out.setdefault(m.group(1).lower(), []).append(m.group(3))
  return out


def test_the_cpu_install_has_no_ahead_of_time_compile_extras():
  default = [_name(r) for r in PYPROJECT["project"]["dependencies"] + EXTRAS["dev"]]
  assert not set(default) & set(AOT_ONLY)
  assert set(AOT_ONLY) <= {_name(r) for r in EXTRAS["aot"]}


def test_each_host_extra_pins_the_tested_jax():
  gpu, tpu, aot = _pins(EXTRAS["gpu"]), _pins(EXTRAS["tpu"]), _pins(EXTRAS["aot"])
  assert sorted(gpu["jax"]) == ["0.10.2", "0.11.2"]                   # by Python version
  assert any("cuda13" in r and "0.11.2" in r and ">= '3.12'" in r for r in EXTRAS["gpu"])
  assert tpu["jax"] == tpu["jaxlib"] == ["0.10.2"] and tpu["libtpu"] == ["0.0.52"]
  # the CUDA plugin must match jaxlib exactly
  assert aot["jax"] == aot["jaxlib"] == aot["jax-cuda13-plugin"] == aot["jax-cuda13-pjrt"]
  assert aot["libtpu"] == tpu["libtpu"]


def test_readme_accelerator_section_names_the_pinned_versions():
  sec = README[README.index("## On a GPU / TPU host"):README.index("## Python API")]
  assert "bash scripts/setup.sh --gpu" in sec and "bash scripts/setup.sh --tpu" in sec
  assert "jax[cuda13] 0.11.2" in sec and "jax 0.10.2 with libtpu 0.0.52" in sec
  assert 'python -c "import jax; print(jax.default_backend(), jax.devices())"' in sec
  # the commands reproducing bench/RESULTS.md's headline rows: each script exists and defines
  # every flag the README gives it
  scripts = 0
  for line in sec.splitlines():
    for part in line.split("&&"):
      m = re.search(r"\.venv/bin/python ((?:bench|scripts)/\S+\.py)(.*)", part)
      if m:
        scripts += 1
        src = open(os.path.join(ROOT, m.group(1))).read()
        for flag in re.findall(r"(--[a-z0-9-]+)", m.group(2)):
          assert f'"{flag}"' in src, (m.group(1), flag)
  assert scripts >= 6


def test_setup_script_takes_the_readme_options_and_refuses_others(tmp_path):
  # the options the README shows are the script's cases
  shown = set(re.findall(r"bash scripts/setup\.sh( --[a-z]+)?", README))
  assert {" --aot", " --gpu", " --tpu"} <= shown
  src = open(SETUP).read()
  for opt in shown - {""}:
    assert f"  {opt.strip()})" in src, opt
  for argv in (["--cuda"], ["--gpu", "--tpu"]):
    p = subprocess.run(["bash", SETUP, *argv], capture_output=True, text=True, timeout=30,
                       cwd=tmp_path, env=dict(os.environ, PYTHON="/nonexistent/python"))
    assert p.returncode == 2 and p.stderr.startswith("usage: bash scripts/setup.sh")
    assert p.stderr.count("\n") == 1 and p.stdout == ""   # before pip or a venv is touched


@pytest.mark.parametrize("needle", [
    "https://download.pytorch.org/whl/cpu",      # the PyTorch CPU wheel index, explicitly
    "PASK_TORCH_INDEX",                          # a mirror of it
    '"torch==$TORCH+cpu"',                       # the CPU build from the configured indexes
])
def test_setup_script_chooses_the_cpu_torch_wheel(needle):
  assert needle in open(SETUP).read()
