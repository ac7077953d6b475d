"""The dense Full-KV cache: the baseline every PASK result is measured against.

``k, v: [L, B, S, Hkv, D]``; sequence ``b`` holds its tokens at slots ``0 .. length[b]-1`` (slot =
absolute position).  Prompts of different lengths share one prefill call: padding rows sit at
slots >= length and are never visible.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class DenseCache(NamedTuple):
  k: jax.Array       # [L, B, S, Hkv, D]
  v: jax.Array       # [L, B, S, Hkv, D]
  length: jax.Array  # [B] int32: visible tokens once the current step is written


def init(n_layers: int, batch: int, capacity: int, n_kv_heads: int, head_dim: int,
         dtype=jnp.bfloat16) -> DenseCache:
  shape = (n_layers, batch, capacity, n_kv_heads, head_dim)
  return DenseCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((batch,), jnp.int32))


def attention(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, kv_len: jax.Array,
              scale: float | None = None) -> jax.Array:
  """Causal GQA attention over a dense cache, FP32 math.

  q: [B, T, Hq, D], k/v: [B, S, Hkv, D], q_pos: [B, T] absolute positions, kv_len: [B].
  Key slot s is visible to a query at position p iff s <= p and s < kv_len.
  """
  B, T, Hq, D = q.shape
  Hkv = k.shape[2]
  scale = D ** -0.5 if scale is None else scale
  qg = q.reshape(B, T, Hkv, Hq // Hkv, D).astype(jnp.float32) * scale
  s = jnp.einsum("btkgd,bskd->bkgts", qg, k.astype(jnp.float32))
  slot = jnp.arange(k.shape[1])
  vis = (slot[None, None, :] <= q_pos[:, :, None]) & (slot[None, None, :] < kv_len[:, None, None])
  s = jnp.where(vis[:, None, None], s, -jnp.inf)
  p = jax.nn.softmax(s, axis=-1)
  o = jnp.einsum("bkgts,bskd->btkgd", p, v.astype(jnp.float32))
  return o.reshape(B, T, Hq, D)


def attend(cache: DenseCache, layer: jax.Array, q, k, v, positions):
  """The decoder's ``attend`` for the dense cache: write this step's K/V at their positions, then
  attend.  ``cache.length`` must already count the tokens of this step (see ``decode.py``)."""
  B, T = positions.shape
  b = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
  kc = cache.k.at[layer, b, positions].set(k.astype(cache.k.dtype), mode="drop")
  vc = cache.v.at[layer, b, positions].set(v.astype(cache.v.dtype), mode="drop")
  o = attention(q, kc[layer], vc[layer], positions, cache.length)
  return o.astype(q.dtype), cache._replace(k=kc, v=vc)
