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


# Rows dequantized at a time: the float32 scratch of ``gguf.quants.dequantize`` stays near 64 MB
# however large the tensor (a 150k-token embedding would otherwise be whole extra f32 copies).
_CHUNK_ELEMS = 1 << 24
_ALIGN = 64


def empty(shape, dtype) -> np.ndarray:
  """An uninitialized C-contiguous array whose data starts on a 64-byte boundary: on the CPU
  backend ``jax.device_put`` then uses the buffer in place instead of copying it."""
  dtype = np.dtype(dtype)
  n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
  raw = np.empty(n + _ALIGN, np.uint8)
  off = (-raw.ctypes.data) % _ALIGN
  return raw[off:off + n].view(dtype).reshape(shape)


def tensor(t, dtype=np.float32, out: np.ndarray | None = None) -> np.ndarray:
  """One tensor as ``dtype`` (float32 or bfloat16) with the numpy shape (GGUF lists dims
  fastest-first).  A BF16 tensor read as bfloat16 (``out`` not given) is a view of the
  memory-mapped file; any other is written into ``out`` (given: an array of that shape and dtype,
  a view included, e.g. a transposed layer slice of a stacked array; else a new 64-byte aligned
  one), a quantized one dequantized in row chunks, each rounded to ``dtype`` at once."""
  import gguf
  import ml_dtypes
  dtype = np.dtype(dtype)
  if dtype not in (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16)):
    raise ValueError(f"GGUF tensors load as float32 or bfloat16, not {dtype}")
  shape = tuple(reversed([int(x) for x in t.shape]))
  if out is not None and (out.shape != shape or out.dtype != dtype):
    raise ValueError(f"tensor {t.name}: out is {out.dtype}{list(out.shape)}, the tensor "
                     f"{dtype}{list(shape)}")
  kind = t.tensor_type
  T = gguf.GGMLQuantizationType
  if kind == T.BF16 and dtype == np.dtype(ml_dtypes.bfloat16):
    view = np.asarray(t.data).view("<u2").view(ml_dtypes.bfloat16).reshape(shape)
    if out is None:
      return view
    out[...] = view
    return out
  out = empty(shape, dtype) if out is None else out
  if kind in (T.F32, T.F16, T.F64):
    # F16 widens exactly; F64 rounds through float32 (the float32 load's values, rounded once).
    out[...] = np.asarray(t.data).reshape(shape).astype(np.float32, copy=False)
    return out
  if len(shape) < 2:
    out[...] = gguf.quants.dequantize(t.data, kind).reshape(shape)
    return out
  raw = np.asarray(t.data)
  raw = raw.reshape(-1, raw.shape[-1])          # [rows, bytes per row]
  # Rows of the destination: a matrix as it is (a strided view too), a contiguous N-d array
  # flattened to rows; a strided N-d view through a contiguous scratch copy.
  rows = out if out.ndim == 2 else out.reshape(-1, shape[-1]) if out.flags.c_contiguous else None
  if rows is None:
    out[...] = tensor(t, dtype)
    return out
  step = max(1, _CHUNK_ELEMS // shape[-1])
  for i in range(0, raw.shape[0], step):
    rows[i:i + step] = gguf.quants.dequantize(raw[i:i + step], kind)
  return out
