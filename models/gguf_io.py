"""Reading GGUF files with the ``gguf`` package: metadata as Python values, tensors as float32."""
from __future__ import annotations

import os
from typing import Any

import numpy as np


def open_gguf(path: str | os.PathLike):
  import gguf  # imported lazily: only GGUF users pay for it
  path = os.fspath(path)
  if not os.path.exists(path):
    raise FileNotFoundError(f"GGUF file not found: {path}")
  try:
    return gguf.GGUFReader(path)
  except Exception as e:  # a truncated or foreign file: say which
    raise ValueError(f"{path} is not a readable GGUF file: {e}") from e


def metadata(reader) -> dict[str, Any]:
  """All key/value fields decoded: strings as str, arrays as lists, scalars as Python numbers."""
  import gguf
  out: dict[str, Any] = {}
  for key, field in reader.fields.items():
    if not field.types:
      continue
    kind = field.types[0]
    if kind == gguf.GGUFValueType.ARRAY:
      sub = field.types[-1]
      if sub == gguf.GGUFValueType.STRING:
        out[key] = [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
      else:
        out[key] = [field.parts[i].tolist()[0] for i in field.data]
    elif kind == gguf.GGUFValueType.STRING:
      out[key] = bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")
    else:
      out[key] = field.parts[field.data[0]].tolist()[0]
  return out


def tensor(t) -> np.ndarray:
  """Dequantize one tensor to float32 with the numpy shape (GGUF lists dims fastest-first)."""
  import gguf
  data = gguf.quants.dequantize(t.data, t.tensor_type)
  return np.asarray(data, np.float32).reshape(tuple(reversed([int(x) for x in t.shape])))
