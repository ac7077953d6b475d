"""Reading GGUF files with the ``gguf`` package: metadata as Python values, tensors as float32 or
bfloat16 arrays."""
from __future__ import annotations

import mmap
import os
import struct
from typing import Any, NamedTuple

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


class GGUF(NamedTuple):
  """A GGUF file's metadata (as :func:`metadata` decodes it) and tensors (``gguf.ReaderTensor``,
  their ``data`` views of the memory-mapped file), as :func:`read` gives them."""
  meta: dict[str, Any]
  tensors: list


# GGUF value types (gguf.GGUFValueType) -> struct format (little-endian); 8 string, 9 array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}
_STRING, _ARRAY = 8, 9
_READ_VERSIONS = (2, 3)     # gguf.gguf_reader.READER_SUPPORTED_VERSIONS


class _Unusual(Exception):
  """A valid file :func:`read` leaves to ``gguf.GGUFReader`` (big-endian, nested arrays)."""


def read(path: str | os.PathLike) -> GGUF:
  """The metadata and tensors of a GGUF file: what :func:`metadata` of :func:`open_gguf` and its
  ``tensors`` give, read without ``gguf.GGUFReader``'s numpy view per value (its parse of a 49k
  vocabulary's ~98k strings costs ~2 s of CPU; this one ~0.1 s).  A missing file is a
  FileNotFoundError, an unreadable one a ValueError naming it; the rare layouts this parser does
  not take (a big-endian file, arrays of arrays) are read by ``gguf.GGUFReader``."""
  path = os.fspath(path)
  if not os.path.exists(path):
    raise FileNotFoundError(f"GGUF file not found: {path}")
  try:
    return _read(path)
  except _Unusual:
    reader = open_gguf(path)
    return GGUF(metadata(reader), list(reader.tensors))
  except (ValueError, KeyError, IndexError, struct.error, UnicodeDecodeError, OverflowError,
          OSError) as e:
    if isinstance(e, FileNotFoundError):
      raise
    raise ValueError(f"{path} is not a readable GGUF file: {e}") from e


def _read(path: str) -> GGUF:
  import gguf
  data = np.memmap(path, mode="r")
  buf = memoryview(data)
  n = len(buf)
  unpack = struct.unpack_from

  def need(off: int, size: int) -> None:
    if off + size > n:
      raise ValueError(f"truncated at byte {off} (the file has {n})")

  def string(off: int, errors: str = "strict") -> tuple[str, int]:
    need(off, 8)
    (k,) = unpack("<Q", buf, off)
    need(off + 8, k)
    return str(buf[off + 8:off + 8 + k], "utf-8", errors), off + 8 + k

  need(0, 24)
  if bytes(buf[:4]) != b"GGUF":
    raise ValueError("GGUF magic invalid")
  (version,) = unpack("<I", buf, 4)
  if version & 0xFFFF == 0:
    raise _Unusual("big-endian")
  if version not in _READ_VERSIONS:
    raise ValueError(f"Sorry, file appears to be version {version} which we cannot handle")
  n_tensors, n_kv = unpack("<QQ", buf, 8)
  meta: dict[str, Any] = {"GGUF.version": version, "GGUF.tensor_count": n_tensors,
                          "GGUF.kv_count": n_kv}
  types: dict[str, int] = {}
  off = 24
  for _ in range(n_kv):
    key, off = string(off)
    need(off, 4)
    (kind,) = unpack("<I", buf, off)
    off += 4
    if key in meta:
      raise KeyError(f"Duplicate {key}")
    types[key] = kind
    if kind == _STRING:
      meta[key], off = string(off, "replace")
    elif kind == _ARRAY:
      need(off, 12)
      sub, count = unpack("<IQ", buf, off)
      off += 12
      if sub == _STRING:
        out = []
        for _ in range(count):
          s, off = string(off, "replace")
          out.append(s)
        meta[key] = out
      elif sub in _SCALARS:
        dt = np.dtype(_SCALARS[sub]).newbyteorder("<")
        need(off, dt.itemsize * count)
        meta[key] = np.frombuffer(buf, dt, count, off).tolist()
        off += dt.itemsize * count
      elif sub == _ARRAY:
        raise _Unusual("an array of arrays")
      else:
        raise ValueError(f"unknown GGUF value type {sub} in array {key}")
    elif kind in _SCALARS:
      fmt = "<" + _SCALARS[kind]
      need(off, struct.calcsize(fmt))
      (meta[key],) = unpack(fmt, buf, off)
      off += struct.calcsize(fmt)
    else:
      raise ValueError(f"unknown GGUF value type {kind} of {key}")
  infos = []
  for _ in range(n_tensors):
    name, off = string(off)
    need(off, 4)
    (n_dims,) = unpack("<I", buf, off)
    need(off + 4, 8 * n_dims + 12)
    dims = np.frombuffer(buf, "<u8", n_dims, off + 4).copy()
    kind, offset = unpack("<IQ", buf, off + 4 + 8 * n_dims)
    off += 4 + 8 * n_dims + 12
    infos.append((name, dims, kind, offset))
  align = 32
  if "general.alignment" in meta:
    if types["general.alignment"] != 4:       # UINT32
      raise ValueError("Bad type for general.alignment field")
    align = meta["general.alignment"]
    if align == 0 or align & (align - 1):
      raise ValueError("Invalid alignment: must be a non-zero power of two")
  start = off + (-off) % align
  T = gguf.GGMLQuantizationType
  plain = {T.F16: np.float16, T.F32: np.float32, T.F64: np.float64, T.I8: np.int8,
           T.I16: np.int16, T.I32: np.int32, T.I64: np.int64}
  tensors, seen = [], set()
  for name, dims, kind, offset in infos:
    if name in seen:
      raise ValueError(f"Found duplicated tensor with name {name}")
    seen.add(name)
    kind = T(kind)
    n_elems = int(np.prod(dims))
    np_dims = tuple(reversed(dims.tolist()))
    block, type_size = gguf.GGML_QUANT_SIZES[kind]
    n_bytes = n_elems * type_size // block
    at = start + offset
    if kind in plain:
      dtype, count = np.dtype(plain[kind]), n_elems
    else:
      dtype, count = np.dtype(np.uint8), n_bytes
      np_dims = gguf.quants.quant_shape_to_byte_shape(np_dims, kind)
    need(at, dtype.itemsize * count)
    arr = data[at:at + dtype.itemsize * count].view(dtype)[:count].reshape(np_dims)
    tensors.append(gguf.ReaderTensor(name=name, tensor_type=kind, shape=dims,
                                     n_elements=n_elems, n_bytes=n_bytes, data_offset=at,
                                     data=arr, field=None))
  return GGUF(meta, tensors)


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


# Host arrays of at least this many bytes are anonymous memory maps of their own (page-aligned)
# instead of numpy allocations: numpy asks Linux for transparent huge pages on every allocation of
# 4 MB or more (madvise), and where THP defragmentation is "madvise" (a common default) the first
# touch of each 2 MB page may stall in direct compaction.  Filling SmolLM2's float32 weights took
# 3.7-4.2 s of CPU that way against 1.3 s in plain pages (2-core VM, 2026-12-05); decoding with
# either ran at the same speed.
MAP_BYTES = 1 << 22


def empty(shape, dtype) -> np.ndarray:
  """An uninitialized C-contiguous array whose data starts on a 64-byte boundary: on the CPU
  backend ``jax.device_put`` then uses the buffer in place instead of copying it.  From
  :data:`MAP_BYTES` on, a writable view of an anonymous memory map (zeros until written; freed
  with the last array or JAX buffer that uses it)."""
  dtype = np.dtype(dtype)
  count = int(np.prod(shape, dtype=np.int64))
  n = count * dtype.itemsize
  if n >= MAP_BYTES:
    return np.frombuffer(mmap.mmap(-1, n), dtype, count).reshape(shape)
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
