"""The INT4 storage format the kernels read: symmetric per-row INT4, half-split nibbles (paper B.5).

A row is one (token, KV head) vector of length D (even).  Its scale is ``s = fp16(max|x| / 7)``,
clamped into fp16's finite range and bounded below by the smallest positive fp16 (so tiny rows
never divide by zero); where the fp16 rounding of a subnormal scale would push max|x|/s above
7.5 it is bumped to the next fp16, so that |x - dequant(quant(x))| <= s/2 holds for every element
of every row whose max|x| <= 7.5·65504.  Codes are ``clip(round(x / s), -7, 7)`` with round half
to even, and an all-zero row gets zero codes and scale 1.  Byte ``i`` of a packed row holds element
``i`` in its low nibble and element ``i + D/2`` in its high nibble, both as 4-bit two's complement,
so unpacking is two shifts and a concatenate.  Shifts are done on int32 because int8 shifts do not
compile on TPU.

Bit-exact on every backend, under jit and eagerly.  XLA rewrites ``x / 7`` into ``x * (1/7)``
under jit and TPUs divide approximately, so a division-based quantizer stores different bits for
the same K/V on different backends.  Here nothing divides:

* the scale is ``fp16(max|x| · f32(1/7))``, one IEEE multiply, defined that way (it differs from
  the correctly rounded ``max|x| / 7`` by at most one f32 ulp before the fp16 rounding, and the
  7.5 check below keeps the error bound either way);
* the code is the exact round-half-even of ``x / s``: a first guess from a reciprocal (any
  reciprocal within a few ulps: it only has to land within one of the answer), clipped to
  [-8, 8], then corrected against the midpoints ``(c ± 1/2) · s``, which are exact f32 products
  (at most 5 + 11 significant bits), so the comparison, and the code, do not depend on how the
  backend divides.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

QMAX = 7
# Smallest positive (subnormal) and largest finite fp16.
FP16_TINY = float(np.finfo(np.float16).smallest_subnormal)
FP16_MAX = float(np.finfo(np.float16).max)
_INV_QMAX = np.float32(1.0) / np.float32(QMAX)


def scale_of(x: jax.Array) -> jax.Array:
  """Per-row fp16 scale of ``x[..., D]`` -> ``[...]`` float16 (1 for all-zero rows)."""
  amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1)
  s = jnp.minimum(amax * _INV_QMAX, FP16_MAX).astype(jnp.float16)   # never inf
  s = jnp.maximum(s, jnp.float16(FP16_TINY))
  # Round-to-nearest keeps max|x|/s <= 7.5 (so clipping at ±7 stays within s/2) for normal fp16
  # scales, but a subnormal scale (max|x| < ~4e-4) can round down by up to half of 2**-24, e.g.
  # max|x| = 7·1.45·2**-24 -> s = 2**-24 and an error of 3.15 s.  Take the next fp16 up then
  # (7.5·s is an exact f32 product; at fp16's max there is no next one).
  bump = (amax > 7.5 * s.astype(jnp.float32)) & (s < jnp.float16(FP16_MAX))
  s = jnp.where(bump, jnp.nextafter(s, jnp.float16(jnp.inf)), s)
  return jnp.where(amax == 0, jnp.float16(1.0), s)


def round_div(x: jax.Array, s: jax.Array, offset: float = 0.0, lo: float = -8.0,
              hi: float = 8.0) -> jax.Array:
  """Round-half-even of ``x / s - offset`` (f32, s > 0 an fp16 value), clipped to [lo, hi],
  without dividing: the reciprocal's guess is corrected against the exact midpoints
  ``(c + offset ± 1/2) · s`` (``offset`` a multiple of 1/2 and |c| <= 255: at most 9 + 11
  significant bits, an exact f32 product), so every backend stores the same codes."""
  c = jnp.clip(jnp.round(x * (1.0 / s) - offset), lo, hi)
  up, dn = (c + (offset + 0.5)) * s, (c + (offset - 0.5)) * s
  even = lambda a: jnp.where(jnp.fmod(a, 2.0) == 0, a, a + 1.0)  # the even one of (a, a + 1)
  c = jnp.where(x > up, c + 1.0, jnp.where(x == up, even(c), c))
  c = jnp.where(x < dn, c - 1.0, jnp.where(x == dn, even(c - 1.0), c))
  return c


def quantize(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``x[..., D]`` (D even) -> (codes ``int8[..., D]`` in [-7, 7], scale ``float16[...]``)."""
  if x.shape[-1] % 2:
    raise ValueError(f"INT4 packing needs an even last dimension, got {x.shape[-1]}")
  s = scale_of(x)
  c = round_div(x.astype(jnp.float32), s[..., None].astype(jnp.float32))
  return jnp.clip(c, -QMAX, QMAX).astype(jnp.int8), s


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


def quantize_numpy(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """The same quantizer in float64 numpy (an independent oracle for the bit-exactness tests).

  float64 division is exact enough here: a quotient of a 24-bit and an 11-bit significand that is
  not a half-integer lies at least ~2**-37 (relative) away from one, far above float64's 2**-53.
  """
  x = np.asarray(x, np.float32)
  amax = np.max(np.abs(x), axis=-1)
  s = np.minimum(amax * _INV_QMAX, np.float32(FP16_MAX)).astype(np.float16)
  s = np.maximum(s, np.float16(FP16_TINY))
  bump = (amax > np.float32(7.5) * s.astype(np.float32)) & (s < np.float16(FP16_MAX))
  with np.errstate(over="ignore"):   # nextafter(max) is computed, then not selected
    s = np.where(bump, np.nextafter(s, np.float16(np.inf)), s)
  s = np.where(amax == 0, np.float16(1.0), s).astype(np.float16)
  q = np.round(x.astype(np.float64) / s[..., None].astype(np.float64))   # half to even
  return np.clip(q, -QMAX, QMAX).astype(np.int8), s


# ---- the two storage formats of an INT4 pool ---------------------------------------------------
# (pask_jax.cache.init(lo_format=...); pallas_kernels.types.LowPool)
#
# "bytes": codes packed as above, token-major pages ``k, v [.., P, page, Hkv, D/2]`` uint8.
# "int4":  codes as jax int4, head-major pages ``k [.., P, Hkv, page, D]`` (token rows) and
#          ``v [.., P, Hkv, D, page]`` (dim-major: one token is one element in each of D rows),
#          what the Mosaic GPU kernel reads fastest (pallas_kernels.gpu.mgpu_int4, paged mode).
#          Its fp16 scales are head-major too, ``s [.., P, Hkv, 2, page]`` (K plane, V plane): a
#          (page, head)'s K or V scales are one contiguous run the kernel reads by TMA as they are.
# "bytes" scales are per row, ``s [.., P, page, Hkv, 2]`` (K scale, V scale).
# The codes, the scales and the bytes per row are the same in both: D/2 bytes per K row and per
# V row (jax stores int4 two to a byte) plus the two fp16 scales (4 bytes).

FORMATS = ("bytes", "int4")


def check_format(fmt: str) -> str:
  if fmt not in FORMATS:
    raise ValueError(f"lo_format must be 'bytes' or 'int4', got {fmt!r}")
  return fmt


def format_of(codes: jax.Array) -> str:
  """The storage format of an INT4 pool from its code array's dtype."""
  return "int4" if jnp.dtype(codes.dtype) == jnp.dtype(jnp.int4) else "bytes"


def pool_codes(k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array]:
  """A pool's K/V codes in either format (leading axes ``[.., P]`` kept) -> token-major signed
  codes ``int32 [.., P, page, Hkv, D]`` each."""
  if format_of(k) == "bytes":
    return unpack(k), unpack(v)
  return (jnp.swapaxes(k, -3, -2).astype(jnp.int32),
          jnp.moveaxis(v, -1, -3).astype(jnp.int32))


def scale_shape(n_pages: int, page: int, hkv: int, fmt: str) -> tuple[int, ...]:
  """Shape of an INT4 pool's scales (one layer) in format ``fmt``."""
  return (n_pages, page, hkv, 2) if check_format(fmt) == "bytes" else (n_pages, hkv, 2, page)


def pool_scales(s: jax.Array, fmt: str) -> jax.Array:
  """A pool's scales in format ``fmt`` (leading axes ``[.., P]`` kept) -> per row
  ``[.., P, page, Hkv, 2]`` (K scale, V scale)."""
  return s if check_format(fmt) == "bytes" else jnp.moveaxis(s, -1, -3)


def scale_array(s: jax.Array, fmt: str) -> jax.Array:
  """Inverse of :func:`pool_scales`: per-row scales ``[.., P, page, Hkv, 2]`` -> format ``fmt``."""
  return s if check_format(fmt) == "bytes" else jnp.moveaxis(s, -3, -1)


def pool_arrays(kc: jax.Array, vc: jax.Array, fmt: str) -> tuple[jax.Array, jax.Array]:
  """Inverse of :func:`pool_codes`: token-major codes ``[.., P, page, Hkv, D]`` in [-8, 7] ->
  the pool's K/V arrays in format ``fmt``."""
  if check_format(fmt) == "bytes":
    return pack(kc), pack(vc)
  return (jnp.swapaxes(kc, -3, -2).astype(jnp.int4),
          jnp.moveaxis(vc, -3, -1).astype(jnp.int4))
