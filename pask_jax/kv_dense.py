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
  return DenseCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype),
                    jnp.zeros((batch,), jnp.int32))


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
  slot = jnp.arange(k.shape[1])
  vis = (slot[None, None, :] <= q_pos[:, :, None]) & (slot[None, None, :] < kv_len[:, None, None])
  if T == 1 and jax.default_backend() != "cpu":
    # Decode on an accelerator: multiply-and-reduce reads the cache once, in its own [B, S, H, D]
    # layout, converting to f32 in registers.  As einsums, XLA transposed the WHOLE stacked
    # cache to [.., H, S, D] and back around every step and materialized f32 copies of it.
    # (CPU keeps the einsum form: same numerics as always in the tests.)
    s = jnp.sum(qg[:, 0, None] * k[:, :, :, None].astype(jnp.float32), axis=-1)   # [B,S,Hkv,g]
    s = jnp.where(vis[:, 0, :, None, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=1)
    o = jnp.sum(p[..., None] * v[:, :, :, None].astype(jnp.float32), axis=1)       # [B,Hkv,g,D]
    return o.reshape(B, T, Hq, D)
  s = jnp.einsum("btkgd,bskd->bkgts", qg, k.astype(jnp.float32))
  s = jnp.where(vis[:, None, None], s, -jnp.inf)
  p = jax.nn.softmax(s, axis=-1)
  o = jnp.einsum("bkgts,bskd->btkgd", p, v.astype(jnp.float32))
  return o.reshape(B, T, Hq, D)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
  """Causal GQA attention of whole prompts over their own keys (a prefill in one chunk from
  position 0): q [B, T, Hq, D], k/v [B, T, Hkv, D] -> [B, T, Hq, D] in q's dtype.

  :func:`jax.nn.dot_product_attention`: cuDNN's fused flash attention on a GPU (the causal
  half only, no [T, T] probabilities in memory; an error there, never a silent fallback to a
  quadratic buffer), XLA's elsewhere.  Rows at and past a prompt's length (padding) see only
  keys at or before them, so every prompt row is exact.  Numerics: bf16 operands, f32
  accumulation and softmax (cuDNN rounds P to bf16 for P·V); :func:`attention` keeps f32
  operands, so the two differ at bf16 rounding."""
  impl = "cudnn" if jax.default_backend() == "gpu" else "xla"
  return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)


def attend(cache: DenseCache, layer: jax.Array, q, k, v, positions):
  """The decoder's ``attend`` for the dense cache: write this step's K/V at their positions, then
  attend.  ``cache.length`` must already count the tokens of this step (see ``decode.py``)."""
  B, T = positions.shape
  b = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
  with jax.named_scope("cache_write"):
    kc = cache.k.at[layer, b, positions].set(k.astype(cache.k.dtype), mode="drop")
    vc = cache.v.at[layer, b, positions].set(v.astype(cache.v.dtype), mode="drop")
  with jax.named_scope("attention"):
    o = attention(q, kc[layer], vc[layer], positions, cache.length)
  return o.astype(q.dtype), cache._replace(k=kc, v=vc)


def hbm_bytes(n_layers: int, capacity: int, n_kv_heads: int, head_dim: int, *,
              param_bytes: float = 0.0, batch: int = 1, itemsize: int = 2) -> float:
  """HBM bytes per generated token of one Full-KV decode step (b_HBM's numerator; docs/
  SPHERICAL_KV.md §4): ``param_bytes / batch`` plus, per sequence and layer, the WHOLE dense
  cache's K and V (:func:`attention` masks after the multiply, so XLA reads every one of the
  ``capacity`` slots, visible or not), ``capacity · Hkv · 2 · D · itemsize`` bytes."""
  if batch < 1:
    raise ValueError(f"batch must be >= 1, got {batch}")
  return param_bytes / batch + float(n_layers * capacity * n_kv_heads * 2 * head_dim * itemsize)
