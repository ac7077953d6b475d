"""H2O (Zhang et al., NeurIPS 2023, "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of
Large Language Models"): per layer and KV head, keep the tokens with the largest *accumulated*
attention (heavy hitters) together with protected sink and recent tokens, and evict the rest.

Here: scores are the attention probabilities each key received, summed over all prompt queries
(prefill) and then every decode query, and over the query heads sharing the KV head (GQA).  The
capacity grows with the sequence: after t tokens at most ``ceil(r·t)`` entries per (layer, head)
are kept (r = the budget knob), so the end-of-request B ≈ r; the first ``sink`` and last
``recent`` positions are never evicted (paper C.3 / Table 8 tunes sink ∈ {2,4,8}, recent ∈
{16,32,64,128}).  After prefill the heavy hitters are chosen at once; during decoding the one
lowest-scoring unprotected entry is evicted whenever the count exceeds the capacity (H2O's
one-in/one-out rule).  Runs on :class:`~pask_jax.baselines.masked.MaskedRunner`.
"""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from pask_jax.baselines._rank import rank_desc


def protected(slot, n, sink, recent):
  """bool[..., S]: sink or recent positions among the first n (n, sink, recent: [...])."""
  n, sink, recent = n[..., None], sink[..., None], recent[..., None]
  return (slot < n) & ((slot < sink) | (slot >= n - recent))


def select(score, n, sink, recent, cap):
  """Keep mask bool[..., S]: protected ∪ the top ``cap - |protected|`` others by ``score``.

  score [..., S]; n, sink, recent, cap int [...] (broadcast over S).
  """
  slot = jnp.arange(score.shape[-1])
  valid = slot < n[..., None]
  prot = protected(slot, n, sink, recent)
  cand = valid & ~prot
  heavy = jnp.maximum(cap - jnp.sum(prot, axis=-1), 0)
  return prot | (cand & (rank_desc(score, cand) < heavy[..., None]))


def capacity(ratio, t):
  """Entries kept per (layer, head) after t tokens: ceil(r·t) (float32 math, as in jit)."""
  return jnp.ceil(jnp.asarray(ratio, jnp.float32) * jnp.asarray(t, jnp.float32) - 1e-4).astype(
      jnp.int32)


def kept_at_end(ratio: float, n: int, sink: int, recent: int) -> int:
  """Entries per head at the end of an n-token request (host-side prediction)."""
  return min(n, max(math.ceil(ratio * n - 1e-4), min(n, sink + recent)))


def predict_b(ratio: float, lengths, sink: int, recent: int) -> float:
  """Mean retained B over [(n_prompt, n_gen)]."""
  return float(np.mean([kept_at_end(ratio, p + g, sink, recent) / (p + g) for p, g in lengths]))
