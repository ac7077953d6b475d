"""Symmetric per-row KV quantizers of 2, 3, 4 and 8 bits, their packing and their exact byte cost.

A row is one (token, KV head) K or V vector of length D with one fp16 scale, as in the cache's INT4
format (:mod:`pallas_kernels.int4`, paper B.5).  Grids:

* **4 bits** — the cache's own INT4 (:func:`pallas_kernels.int4.quantize`, bit for bit; odd D,
  which the cache does not store, by the same rule below): mid-tread codes in [-7, 7],
  ``s = fp16(max|x| / 7)``.
* **3 and 8 bits** — the same mid-tread rule with QMAX 3 and 127.
* **2 bits** — mid-rise: values ``(c + 1/2)·s`` for codes c in [-2, 1] (±s/2, ±3s/2),
  ``s = fp16(max|x| / 1.5)``.  A mid-tread 2-bit grid would spend its fourth code on nothing
  ({-s, 0, s}); mid-rise uses all four levels at the same one-scale cost.

Every grid keeps ``|x - dequant(quant(x))| <= s/2`` (the scale is rounded to fp16 and bumped to
the next fp16 where the rounding would push max|x|/s past the top level's half-step, as in
:func:`pallas_kernels.int4.scale_of`; codes are the exactly rounded ``x/s - OFFSET``, half to even,
computed without dividing by :func:`pallas_kernels.int4.round_div`, so a tie stores the same code
on every backend, under jit or not), so a row's error is at most ``max|x| / (2·QMAX)``
(``max|x| / 3`` for 2 bits): INT2 > INT3 > INT4 > INT8.

Packing (codes stored as unsigned ``c - CMIN``): 8 bits one per byte; 4 bits the cache's
half-split nibbles; 2 bits four per byte (byte i holds elements i, i + D/4, i + D/2, i + 3D/4 in
bit pairs 0-1, 2-3, 4-5, 6-7); 3 bits **eight values in three bytes** (a 24-bit little-endian word
per group of eight consecutive elements).  A row with D not a multiple of the group is padded with
zero codes, and the padding is charged: :func:`row_bits` = ``b·g·ceil(D/g) + 16`` for the packing
group g (8 for 3 bits, 4 for 2, 2 for 4, 1 for 8; codes + the fp16 scale), BF16 = ``16·D`` with no
scale.  For 4 bits this is exactly the payload cost model's
m(L) per row (:func:`pask_jax.policy.cost_model`: ``4·D + 16``, ``+4`` for odd D).
"""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from pallas_kernels import int4

WIDTHS = (2, 3, 4, 8)
BF16 = 16
QMAX = {2: 1.5, 3: 3.0, 4: 7.0, 8: 127.0}   # top level in units of s
CMIN = {2: -2, 3: -3, 4: -7, 8: -127}        # lowest code
CMAX = {2: 1, 3: 3, 4: 7, 8: 127}
OFFSET = {2: 0.5, 3: 0.0, 4: 0.0, 8: 0.0}    # value = (code + OFFSET) * s
GROUP = {2: 4, 3: 8, 4: 2, 8: 1}             # elements per packing unit (D padded to a multiple)


def check_bits(bits: int) -> int:
  if bits not in WIDTHS:
    raise ValueError(f"quantizer bit width must be one of {WIDTHS}, got {bits!r}")
  return int(bits)


def row_bits(bits: int, d: int) -> int:
  """Stored bits of one (token, KV head) K or V row of length ``d`` at ``bits`` (16: BF16)."""
  if bits == BF16:
    return 16 * d
  g = GROUP[check_bits(bits)]
  return bits * g * math.ceil(d / g) + 16


def entry_bits(bits: int, d: int) -> int:
  """Bits of one (token, layer, KV head) entry: its K and its V row."""
  return 2 * row_bits(bits, d)


def scale_of(x, bits: int):
  """Per-row fp16 scale of ``x[..., D]`` for ``bits`` -> ``[...]`` float16 (1 for zero rows)."""
  top = QMAX[check_bits(bits)]
  amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1)
  s = jnp.minimum(amax * np.float32(1.0 / top), int4.FP16_MAX).astype(jnp.float16)
  s = jnp.maximum(s, jnp.float16(int4.FP16_TINY))
  # fp16 rounding may leave max|x| above the top level's half-step: take the next fp16 up.
  bump = (amax > np.float32(top + 0.5) * s.astype(jnp.float32)) & (s < jnp.float16(int4.FP16_MAX))
  s = jnp.where(bump, jnp.nextafter(s, jnp.float16(jnp.inf)), s)
  return jnp.where(amax == 0, jnp.float16(1.0), s)


def quantize(x, bits: int):
  """``x[..., D]`` -> (codes ``int8[..., D]`` in [CMIN, CMAX], scale ``float16[...]``)."""
  if check_bits(bits) == 4 and x.shape[-1] % 2 == 0:
    return int4.quantize(x)
  s = scale_of(x, bits)
  c = int4.round_div(x.astype(jnp.float32), s[..., None].astype(jnp.float32), OFFSET[bits],
                     CMIN[bits] - 1.0, CMAX[bits] + 1.0)
  return jnp.clip(c, CMIN[bits], CMAX[bits]).astype(jnp.int8), s


def dequantize(codes, scale, bits: int, dtype=jnp.float32):
  """``(codes + OFFSET) * scale`` in ``dtype``."""
  c = codes.astype(jnp.float32) + OFFSET[check_bits(bits)]
  return (c * scale[..., None].astype(jnp.float32)).astype(dtype)


def qdq(x, bits: int):
  """quantize -> dequantize (float32); ``bits`` 16 returns ``x`` as float32."""
  if bits == BF16:
    return x.astype(jnp.float32)
  return dequantize(*quantize(x, bits), bits)


def quantize_numpy(x: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
  """The same quantizer in float64 numpy (an independent reference for tests).  The codes are the
  exactly rounded ``x / s - OFFSET`` (half to even), which float64 computes: a quotient that is
  not on a midpoint lies at least ~2**-37 (relative) away from one (:func:`int4.quantize_numpy`)."""
  if check_bits(bits) == 4:
    return int4.quantize_numpy(x)
  top = QMAX[bits]
  x = np.asarray(x, np.float32)
  amax = np.max(np.abs(x), axis=-1)
  s = np.minimum(amax * np.float32(1.0 / top), np.float32(int4.FP16_MAX)).astype(np.float16)
  s = np.maximum(s, np.float16(int4.FP16_TINY))
  bump = (amax > np.float32(top + 0.5) * s.astype(np.float32)) & (s < np.float16(int4.FP16_MAX))
  with np.errstate(over="ignore"):
    s = np.where(bump, np.nextafter(s, np.float16(np.inf)), s)
  s = np.where(amax == 0, np.float16(1.0), s).astype(np.float16)
  q = np.round(x.astype(np.float64) / s[..., None].astype(np.float64) - OFFSET[bits])
  return np.clip(q, CMIN[bits], CMAX[bits]).astype(np.int8), s


# --- packing -------------------------------------------------------------------------------------

def _pad(u, group: int):
  d = u.shape[-1]
  extra = -d % group
  if extra:
    u = jnp.pad(u, [(0, 0)] * (u.ndim - 1) + [(0, extra)])
  return u


def pack(codes, bits: int):
  """``int8[..., D]`` codes -> ``uint8[..., ceil(bits·D/8)]`` (see the module doc)."""
  check_bits(bits)
  if bits == 4:
    if codes.shape[-1] % 2:
      codes = jnp.pad(codes, [(0, 0)] * (codes.ndim - 1) + [(0, 1)])
    return int4.pack(codes)
  u = codes.astype(jnp.int32) - CMIN[bits]                  # unsigned, < 2**bits
  if bits == 8:
    return u.astype(jnp.uint8)
  u = _pad(u, GROUP[bits])
  if bits == 2:
    q = u.shape[-1] // 4
    parts = [u[..., i * q:(i + 1) * q] << (2 * i) for i in range(4)]
    return (parts[0] | parts[1] | parts[2] | parts[3]).astype(jnp.uint8)
  g = u.reshape(u.shape[:-1] + (u.shape[-1] // 8, 8))       # 3 bits: 8 values -> 24-bit word
  word = sum(g[..., i] << (3 * i) for i in range(8))
  b = jnp.stack([(word >> (8 * i)) & 0xFF for i in range(3)], axis=-1)
  return b.reshape(u.shape[:-1] + (-1,)).astype(jnp.uint8)


def unpack(packed, bits: int, d: int):
  """Inverse of :func:`pack`: ``uint8[..., ceil(bits·D/8)]`` -> ``int32[..., d]`` codes."""
  check_bits(bits)
  p = packed.astype(jnp.int32)
  if bits == 4:
    return int4.unpack(packed)[..., :d]
  if bits == 8:
    u = p
  elif bits == 2:
    u = jnp.concatenate([(p >> (2 * i)) & 3 for i in range(4)], axis=-1)
  else:
    b = p.reshape(p.shape[:-1] + (p.shape[-1] // 3, 3))
    word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)
    u = jnp.stack([(word >> (3 * i)) & 7 for i in range(8)], axis=-1)
    u = u.reshape(p.shape[:-1] + (-1,))
  return u[..., :d] + CMIN[bits]


def packed_nbytes(bits: int, d: int, rows: int) -> int:
  """Bytes of ``rows`` packed rows (codes + fp16 scales): ``rows · row_bits / 8``."""
  return rows * row_bits(bits, d) // 8
