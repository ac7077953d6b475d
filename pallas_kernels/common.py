"""Pieces shared by the reference and both kernels: the Eq. 15 merge, padding, fp16 decoding.

Convention for partial results (every backend): a partial is ``(o, m, l)`` where ``o`` is the
*unnormalized* FP32 value sum ``u_j``, ``m`` the score maximum ``v_j`` in **log2 units** (scores are
multiplied by ``scale * log2(e)`` so kernels can use ``exp2``), and ``l`` the exponential sum
``l_j``.  A partial with ``l == 0`` is empty (no visible key) and is ignored by the merge whatever
its ``m``/``o`` hold.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

LOG2E = math.log2(math.e)
# Finite "minus infinity" for running maxima: exp2(NEG - x) underflows to 0 without the
# inf - inf = NaN a true -inf start would give on a block with no visible key.
NEG = -1e30


def default_scale(d: int, scale: float | None) -> float:
  return 1.0 / math.sqrt(d) if scale is None else float(scale)


def cdiv(a: int, b: int) -> int:
  return -(-a // b)


def next_pow2(x: int) -> int:
  return 1 << max(0, (x - 1).bit_length())


def merge(o: jax.Array, m: jax.Array, l: jax.Array, axis: int) -> tuple[jax.Array, jax.Array]:
  """Shared-normalization merge of partials (paper Eq. 15) along ``axis``.

  o: [..., S, ..., D] f32 unnormalized; m, l: same without D.  Returns (out f32 [..., D] with
  ``axis`` removed, l_total).  Empty partials (l == 0) contribute nothing; if every partial is
  empty the output is 0, never NaN.
  """
  live = l > 0
  mm = jnp.where(live, m, -jnp.inf)
  v = jnp.max(mm, axis=axis, keepdims=True)
  v = jnp.where(jnp.isfinite(v), v, 0.0)
  w = jnp.where(live, jnp.exp2(mm - v), 0.0)                  # e^{v_j - v}, 0 when empty
  num = jnp.sum(jnp.where(live[..., None], o, 0.0) * w[..., None], axis=axis)
  den = jnp.sum(w * jnp.where(live, l, 0.0), axis=axis)
  out = num / jnp.where(den > 0, den, 1.0)[..., None]
  return out, den


def round_bf16(x: jax.Array) -> jax.Array:
  """f32 -> f32 rounded to the nearest bf16 (ties to even), by integer ops on the bits.

  ``x.astype(bf16).astype(f32)`` says the same, but XLA's GPU pipeline (excess precision allowed,
  its default) folds such round trips away, so on a GPU it returns ``x`` unrounded; bit ops it
  cannot fold.  Finite inputs (NaN payloads are not preserved)."""
  bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
  odd = jax.lax.shift_right_logical(bits, jnp.uint32(16)) & jnp.uint32(1)
  bits = (bits + jnp.uint32(0x7FFF) + odd) & jnp.uint32(0xFFFF0000)
  return jax.lax.bitcast_convert_type(bits, jnp.float32)


def split_bf16(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """f32 -> (hi, lo) bf16 with hi + lo == x to ~2^-17, safe in XLA graphs (:func:`round_bf16`:
  with ``astype`` round trips XLA on a GPU makes lo zero, and two-pass products lose their low
  half).  Inside Triton kernels ``gpu.decode.split_bf16`` (plain converts) is exact."""
  hi = round_bf16(x)
  return hi.astype(jnp.bfloat16), (x - hi).astype(jnp.bfloat16)


def f16_bits_to_f32(h: jax.Array) -> jax.Array:
  """int32 holding fp16 bits in its low 16 bits -> f32, with integer ops only.

  Used in the TPU kernel, where fp16 vector loads do not compile: scales travel as raw bits.
  Handles normals, subnormals and zero (inf/NaN never occur in INT4 scales).
  """
  h = h & 0xFFFF
  sign = jax.lax.shift_right_logical(h, 15)
  e = jax.lax.shift_right_logical(h, 10) & 0x1F
  man = h & 0x3FF
  # Normal: rebias exponent 15 -> 127, widen mantissa 10 -> 23 bits.
  bits = ((e + (127 - 15)) << 23) | (man << 13) | (sign << 31)
  normal = jax.lax.bitcast_convert_type(bits, jnp.float32)
  sub = man.astype(jnp.float32) * (2.0 ** -24)
  sub = jnp.where(sign == 1, -sub, sub)
  return jnp.where(e == 0, sub, normal)


def scale_bits(scale: jax.Array) -> jax.Array:
  """fp16 ``[..., 2]`` (K, V) -> int32 ``[...]``: K bits low, V bits high (one small fused pass,
  4 B a row)."""
  u = jax.lax.bitcast_convert_type(scale, jnp.uint16)            # [..., 2]
  u = u.astype(jnp.uint32)
  return jax.lax.bitcast_convert_type(u[..., 0] | (u[..., 1] << 16), jnp.int32)


def combine_partials(o, m, l, axis):
  """Unnormalized partials (log2 units) along ``axis`` -> one unnormalized partial (o, m, l),
  ``axis`` removed; empty partials (l = 0) contribute nothing, all empty gives (0, NEG, 0)."""
  live = l > 0
  mm = jnp.where(live, m, -jnp.inf)
  v = jnp.max(mm, axis=axis, keepdims=True)
  v = jnp.where(jnp.isfinite(v), v, NEG)
  w = jnp.where(live, jnp.exp2(mm - v), 0.0)
  o = jnp.sum(jnp.where(live[..., None], o, 0.0) * w[..., None], axis=axis)
  return o, jnp.squeeze(v, axis), jnp.sum(jnp.where(live, l, 0.0) * w, axis=axis)
