"""One Flax NNX decoder for the Qwen2/2.5, Qwen3 and Llama-3/SmolLM2 families.

Layer weights are stacked on a leading layer axis and the forward pass is a ``lax.scan`` over
layers, so compile time does not grow with depth.  The KV cache is *not* part of the module: the
caller passes a cache pytree and an ``attend`` function, which is how the same decoder runs with
the dense Full-KV cache and with the PASK mixed-precision cache::

    attend(cache, layer, q[B,T,Hq,D], k[B,T,Hkv,D], v[B,T,Hkv,D], positions[B,T])
        -> (out[B,T,Hq,D], cache)

``q`` and ``k`` arrive with RoPE applied; ``layer`` is a traced int32 scalar.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.config import ModelConfig

Attend = Callable[..., tuple[jax.Array, Any]]


class Buffer(nnx.Variable):
  """A non-trainable array that travels with the parameters (RoPE inverse frequencies)."""


def rope_inv_freq(cfg: ModelConfig, freq_factors: np.ndarray | None = None) -> np.ndarray:
  """Inverse frequencies ``[D/2]`` for rotate-half RoPE, with llama3 scaling if configured.

  ``freq_factors`` is GGUF's ``rope_freqs.weight`` (llama3 scaling precomputed as divisors).
  """
  d = cfg.head_dim
  inv = 1.0 / (cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
  if freq_factors is not None:
    inv = inv / np.asarray(freq_factors, np.float64)
  elif cfg.rope_scaling is not None:  # HF's llama3 rule
    s = dict(cfg.rope_scaling)
    factor, lo, hi = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    lo_wl, hi_wl = old / lo, old / hi
    smooth = (old / wavelen - lo) / (hi - lo)
    scaled = np.where(wavelen > lo_wl, inv / factor, inv)
    mid = (wavelen <= lo_wl) & (wavelen >= hi_wl)
    inv = np.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
  return inv.astype(np.float32)


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
  xf = x.astype(jnp.float32)
  xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  return (xf * w.astype(jnp.float32)).astype(x.dtype)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
  """Rotate-half RoPE. x: [B, T, H, D]; positions: [B, T]."""
  ang = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
  cos, sin = jnp.cos(ang)[:, :, None, :], jnp.sin(ang)[:, :, None, :]
  xf = x.astype(jnp.float32)
  x1, x2 = jnp.split(xf, 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class Decoder(nnx.Module):
  """Decoder-only transformer; weights are ``x @ W`` ([in, out]) and stacked over layers."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
    self.cfg = cfg
    L, d, f, D = cfg.n_layers, cfg.hidden, cfg.intermediate, cfg.head_dim
    hq, hkv = cfg.n_heads * D, cfg.n_kv_heads * D
    init = lambda *shape, fan_in: nnx.Param(
        (jax.random.normal(rngs.params(), shape, jnp.float32) / math.sqrt(fan_in)).astype(dtype))
    ones = lambda *shape: nnx.Param(jnp.ones(shape, dtype))
    self.embed = init(cfg.vocab_size, d, fan_in=d)
    self.attn_norm, self.mlp_norm = ones(L, d), ones(L, d)
    self.wq, self.wk, self.wv = init(L, d, hq, fan_in=d), init(L, d, hkv, fan_in=d), init(
        L, d, hkv, fan_in=d)
    self.wo = init(L, hq, d, fan_in=hq)
    if cfg.qkv_bias:
      self.bq, self.bk, self.bv = init(L, hq, fan_in=16), init(L, hkv, fan_in=16), init(
          L, hkv, fan_in=16)
    if cfg.qk_norm:
      self.q_norm, self.k_norm = ones(L, D), ones(L, D)
    self.w_gate, self.w_up = init(L, d, f, fan_in=d), init(L, d, f, fan_in=d)
    self.w_down = init(L, f, d, fan_in=f)
    self.norm = ones(d)
    if not cfg.tie_embeddings:
      self.lm_head = init(d, cfg.vocab_size, fan_in=d)
    self.inv_freq = Buffer(jnp.asarray(rope_inv_freq(cfg)))

  def layer_params(self) -> dict[str, jax.Array]:
    names = ["attn_norm", "mlp_norm", "wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"]
    names += ["bq", "bk", "bv"] if self.cfg.qkv_bias else []
    names += ["q_norm", "k_norm"] if self.cfg.qk_norm else []
    return {n: getattr(self, n)[...] for n in names}

  def __call__(self, tokens: jax.Array, positions: jax.Array, cache: Any, attend: Attend,
               *, last_only: jax.Array | None = None) -> tuple[jax.Array, Any]:
    """tokens, positions: [B, T] -> (logits [B, T, V] float32, cache).

    ``last_only``: optional [B] int32 index; then only the logits at that step are computed
    ([B, 1, V]), which is what prefill needs (the lm_head over a long prompt is expensive).
    """
    cfg = self.cfg
    B, T = tokens.shape
    x = jnp.take(self.embed[...], tokens, axis=0)
    inv_freq = self.inv_freq[...]

    def layer(carry, xs):
      x, cache = carry
      p, idx = xs
      h = rms_norm(x, p["attn_norm"], cfg.rms_eps)
      q, k, v = h @ p["wq"], h @ p["wk"], h @ p["wv"]
      if cfg.qkv_bias:
        q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
      q = q.reshape(B, T, cfg.n_heads, cfg.head_dim)
      k = k.reshape(B, T, cfg.n_kv_heads, cfg.head_dim)
      v = v.reshape(B, T, cfg.n_kv_heads, cfg.head_dim)
      if cfg.qk_norm:
        q, k = rms_norm(q, p["q_norm"], cfg.rms_eps), rms_norm(k, p["k_norm"], cfg.rms_eps)
      q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
      o, cache = attend(cache, idx, q, k, v, positions)
      x = x + o.reshape(B, T, -1).astype(x.dtype) @ p["wo"]
      h = rms_norm(x, p["mlp_norm"], cfg.rms_eps)
      x = x + (jax.nn.silu(h @ p["w_gate"]) * (h @ p["w_up"])) @ p["w_down"]
      return (x, cache), None

    idx = jnp.arange(cfg.n_layers, dtype=jnp.int32)
    (x, cache), _ = jax.lax.scan(layer, (x, cache), (self.layer_params(), idx))
    if last_only is not None:
      x = jnp.take_along_axis(x, last_only[:, None, None].astype(jnp.int32), axis=1)
    x = rms_norm(x, self.norm[...], cfg.rms_eps)
    head = self.embed[...].T if cfg.tie_embeddings else self.lm_head[...]
    logits = jnp.einsum("btd,dv->btv", x, head, preferred_element_type=jnp.float32)
    return logits, cache
