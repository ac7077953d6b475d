"""Reading GGUF files with the ``gguf`` package: metadata as Python values, tensors as float32 or
bfloat16 arrays."""
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


# Rows of a quantized tensor dequantized at a time: the float32 scratch stays near 64 MB however
# large the tensor (a 150k-token embedding would otherwise be a whole extra f32 copy).
_CHUNK_ELEMS = 1 << 24


def tensor(t, dtype=np.float32) -> np.ndarray:
  """One tensor as ``dtype`` (float32 or bfloat16) with the numpy shape (GGUF lists dims
  fastest-first).  A BF16 tensor read as bfloat16 is a view of the memory-mapped file; a
  quantized one is dequantized in row chunks, each rounded to ``dtype`` at once."""
  import gguf
  import ml_dtypes
  dtype = np.dtype(dtype)
  if dtype not in (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16)):
    raise ValueError(f"GGUF tensors load as float32 or bfloat16, not {dtype}")
  shape = tuple(reversed([int(x) for x in t.shape]))
  kind = t.tensor_type
  T = gguf.GGMLQuantizationType
  if kind == T.BF16 and dtype == np.dtype(ml_dtypes.bfloat16):
    return np.asarray(t.data).view("<u2").view(ml_dtypes.bfloat16).reshape(shape)
  if kind in (T.F32, T.F16, T.F64):
    return np.asarray(t.data).reshape(shape).astype(np.float32, copy=False).astype(
        dtype, copy=False)
  if dtype == np.dtype(np.float32) or len(shape) < 2:
    data = gguf.quants.dequantize(t.data, kind)
    return np.asarray(data, np.float32).reshape(shape).astype(dtype, copy=False)
  raw = np.asarray(t.data)
  raw = raw.reshape(-1, raw.shape[-1])          # [rows, bytes per row]
  out = np.empty((raw.shape[0], shape[-1]), dtype)
  step = max(1, _CHUNK_ELEMS // shape[-1])
  for i in range(0, raw.shape[0], step):
    out[i:i + step] = gguf.quants.dequantize(raw[i:i + step], kind).astype(dtype)
  return out.reshape(shape)
