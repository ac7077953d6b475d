"""Shared test fixtures: tiny configs, teacher-forced log-probs, the parity comparison."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from models import ModelConfig, load
from pask_jax import kv_dense

TINY = {
    "llama": ModelConfig(arch="llama", vocab_size=97, hidden=64, intermediate=96, n_layers=3,
                         n_heads=4, n_kv_heads=2, head_dim=16, rope_theta=10000.0,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 32},
                         rms_eps=1e-5, tie_embeddings=True),
    "qwen2": ModelConfig(arch="qwen2", vocab_size=101, hidden=56, intermediate=80, n_layers=2,
                         n_heads=7, n_kv_heads=1, head_dim=8, rope_theta=1e6, tie_embeddings=False),
    "qwen3": ModelConfig(arch="qwen3", vocab_size=89, hidden=48, intermediate=64, n_layers=2,
                         n_heads=4, n_kv_heads=2, head_dim=16, rope_theta=1e6, tie_embeddings=True),
}


@functools.lru_cache(maxsize=None)
def smollm2():
  return load()


def full_logprobs(model, ids) -> np.ndarray:
  """Teacher-forced log-softmax over a whole sequence [T, V] (one forward, dense cache)."""
  cfg = model.cfg
  T = len(ids)
  cache = kv_dense.init(cfg.n_layers, 1, T, cfg.n_kv_heads, cfg.head_dim, jnp.float32)
  cache = cache._replace(length=jnp.array([T], jnp.int32))
  logits, _ = model(jnp.asarray([ids], jnp.int32), jnp.arange(T)[None], cache, kv_dense.attend)
  return np.asarray(jax.nn.log_softmax(logits[0], axis=-1))


def relerr(out, ref) -> float:
  out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
  return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
