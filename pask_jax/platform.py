"""What the command line, the Python API and the offline tools do before a model runs: pick the
JAX platform and load a model (imports nothing heavy until called)."""
from __future__ import annotations

import os
import sys
from typing import Any


def pick() -> None:
  """Run on the CPU when this host has no accelerator, unless the user chose a platform.

  The ahead-of-time compile extras install the CUDA plugin and libtpu even on CPU-only hosts,
  where JAX would otherwise try (and loudly fail) to initialize them.
  """
  if "JAX_PLATFORMS" in os.environ:
    return
  has_gpu = os.path.exists("/dev/nvidia0") or os.path.exists("/dev/nvidiactl")
  has_tpu = os.path.exists("/dev/accel0") or os.path.exists("/dev/vfio/0")
  if not (has_gpu or has_tpu):
    os.environ["JAX_PLATFORMS"] = "cpu"


def dtype(name: Any):
  """``"auto"`` (float32 on a CPU host, bfloat16 on an accelerator), ``"float32"``,
  ``"bfloat16"`` or a dtype -> the dtype."""
  import jax
  import jax.numpy as jnp
  if name == "auto":
    return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
  if isinstance(name, str):
    try:
      return {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[name]
    except KeyError:
      raise ValueError(f"dtype must be auto, float32 or bfloat16, got {name!r}") from None
  return name


def load_model(name_or_path: str | None = None, *, dtype_name: Any = "auto",
               center_keys: bool = True):
  """:func:`pask_jax.api.load_model` (which documents it); picks the platform first when JAX is
  not imported yet (a CPU-only host with the AOT extras: don't wake the plugins)."""
  if "jax" not in sys.modules:
    pick()
  from models import load
  return load(name_or_path, dtype=dtype(dtype_name), need_tokenizer=True,
              center_keys=center_keys)


def load_model_or_exit(name_or_path: str | None, dtype_name: Any = "auto",
                       center_keys: bool = True):
  """:func:`load_model` for a command line: what is wrong becomes a one-line exit."""
  try:
    return load_model(name_or_path, dtype_name=dtype_name, center_keys=center_keys)
  except (FileNotFoundError, ValueError) as e:
    raise SystemExit(f"error: {e}")
