"""Symmetric per-row INT4 with the half-split nibble layout (paper B.5, DESIGN.md "INT4").

A row is one (token, KV head) vector of length D (even).  Its scale is
``s = fp16(max|x| / 7)`` bounded below by the smallest positive fp16 (so tiny rows never divide by
zero) and, where the fp16 rounding of a subnormal scale would push max|x|/s above 7.5, bumped to the
next fp16 so that |x - dequant(quant(x))| <= s/2 holds for every element; codes are
``clip(round(x / s), -7, 7)``, and an all-zero row gets zero codes and scale 1.
Byte ``i`` of a packed row holds element ``i`` in its low nibble and element ``i + D/2`` in its high
nibble, both as 4-bit two's complement, so unpacking is two shifts and a concatenate.  Shifts are
done on int32 because int8 shifts do not compile on TPU.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

QMAX = 7
# Smallest positive (subnormal) fp16: 2**-24.
FP16_TINY = float(np.finfo(np.float16).smallest_subnormal)


def scale_of(x: jax.Array) -> jax.Array:
  """Per-row fp16 scale of ``x[..., D]`` -> ``[...]`` float16 (1 for all-zero rows)."""
  amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1)
  s = (amax / QMAX).astype(jnp.float16)
  s = jnp.maximum(s, jnp.float16(FP16_TINY))
  # Round-to-nearest keeps max|x|/s <= 7.5 (so clipping at ±7 stays within s/2) for normal fp16
  # scales, but a subnormal scale (max|x| < ~4e-4) can round down by up to half of 2**-24, e.g.
  # max|x| = 7·1.45·2**-24 -> s = 2**-24 and an error of 3.15 s.  Take the next fp16 up then.
  s = jnp.where(amax > 7.5 * s.astype(jnp.float32), jnp.nextafter(s, jnp.float16(jnp.inf)), s)
  return jnp.where(amax == 0, jnp.float16(1.0), s)


def quantize(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``x[..., D]`` (D even) -> (codes ``int8[..., D]`` in [-7, 7], scale ``float16[...]``)."""
  if x.shape[-1] % 2:
    raise ValueError(f"INT4 packing needs an even last dimension, got {x.shape[-1]}")
  s = scale_of(x)
  q = jnp.round(x.astype(jnp.float32) / s[..., None].astype(jnp.float32))
  return jnp.clip(q, -QMAX, QMAX).astype(jnp.int8), s


def pack(codes: jax.Array) -> jax.Array:
  """``int8[..., D]`` codes in [-8, 7] -> ``uint8[..., D/2]`` half-split nibbles."""
  half = codes.shape[-1] // 2
  c = codes.astype(jnp.int32)
  lo, hi = c[..., :half] & 0xF, c[..., half:] & 0xF
  return (lo | (hi << 4)).astype(jnp.uint8)


def unpack(packed: jax.Array) -> jax.Array:
  """``uint8[..., D/2]`` -> ``int32[..., D]`` signed codes (sign-extended nibbles)."""
  p = packed.astype(jnp.int32)
  # Move each nibble to the top of the int32 and shift back arithmetically: sign extension.
  lo = (p << 28) >> 28
  hi = (p << 24) >> 28
  return jnp.concatenate([lo, hi], axis=-1)


def quantize_packed(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``x[..., D]`` -> (``uint8[..., D/2]``, ``float16[...]``)."""
  codes, s = quantize(x)
  return pack(codes), s


def dequantize(packed: jax.Array, scale: jax.Array, dtype=jnp.float32) -> jax.Array:
  """Inverse of :func:`quantize_packed`: ``codes * scale`` in ``dtype``."""
  return (unpack(packed).astype(jnp.float32) * scale[..., None].astype(jnp.float32)).astype(dtype)
