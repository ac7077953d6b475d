"""Token selection inside jit: grammar bitmask, greedy, temperature and nucleus (top-p) sampling.

Temperature and top-p are per-sequence *traced* arrays, so changing them never recompiles;
temperature <= 0 means greedy.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def unpack_bitmask(bits: jax.Array, vocab_size: int) -> jax.Array:
  """int32[B, ceil(V/32)] -> bool[B, V] (bit t % 32 of word t // 32)."""
  u = jax.lax.bitcast_convert_type(bits, jnp.uint32)
  shifts = jnp.arange(32, dtype=jnp.uint32)
  allowed = (jax.lax.shift_right_logical(u[:, :, None], shifts[None, None, :]) & 1).astype(bool)
  return allowed.reshape(bits.shape[0], -1)[:, :vocab_size]


def apply_bitmask(logits: jax.Array, bits: jax.Array) -> jax.Array:
  return jnp.where(unpack_bitmask(bits, logits.shape[-1]), logits, -jnp.inf)


def sample(logits: jax.Array, key: jax.Array, temperature: jax.Array,
           top_p: jax.Array) -> jax.Array:
  """logits [B, V] (already masked) -> tokens [B] int32.

  The sort that nucleus sampling needs runs only when some sequence samples (``lax.cond``), so
  greedy decoding pays for an argmax alone.
  """
  greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  return jax.lax.cond(jnp.any(temperature > 0),
                      lambda: nucleus(logits, key, temperature, top_p, greedy), lambda: greedy)


def nucleus(logits, key, temperature, top_p, greedy):
  """Temperature and top-p sampling of ``logits [B, V]`` (masked) with ``key``; rows whose
  temperature is <= 0 take ``greedy``."""
  t = jnp.maximum(temperature, 1e-6)[:, None]
  scaled = logits / t
  order = jnp.argsort(-scaled, axis=-1)
  sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
  probs = jax.nn.softmax(sorted_logits, axis=-1)
  # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
  keep = (jnp.cumsum(probs, axis=-1) - probs) < top_p[:, None]
  sorted_logits = jnp.where(keep, sorted_logits, -jnp.inf)
  pick = jax.random.categorical(key, sorted_logits, axis=-1)
  sampled = jnp.take_along_axis(order, pick[:, None], axis=-1)[:, 0].astype(jnp.int32)
  return jnp.where(temperature <= 0, greedy, sampled)
