"""SnapKV (Li et al., NeurIPS 2024, "SnapKV: LLM Knows What You are Looking for Before
Generation"): per layer and KV head, the last ``obs`` prompt queries (the observation window) vote
for prefix tokens with their attention; the votes are pooled along the sequence (``avg`` or
``max``, odd ``kernel``) so that neighbours of important tokens come along; the top-scoring prefix
tokens plus the observation window are kept, the rest of the prompt is evicted once, after
prefill.  **Generation keeps everything**: every generated token's K/V is appended and never
evicted (the original method compresses the prompt only).

Votes are summed over the query heads sharing a KV head (GQA).  Budget: the prompt capacity of a
request is ``round(B·(n_p + ĝ) − ĝ)`` entries per head (clipped to [min(obs, n_p), n_p]), with ĝ
the expected generated length, so the end-of-request B ≈ target when n_gen ≈ ĝ.  Knobs (paper
Table 8): obs ∈ {16,32,64,128}, pooling ∈ {avg, max}, kernel ∈ {3,5,7}.  Runs on
:class:`~pask_jax.baselines.masked.MaskedRunner`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pask_jax.baselines._rank import rank_desc

MAX_KERNEL = 127      # max pooling (RocketKV's kernels 31-127); avg pooling up to AVG_KERNEL
AVG_KERNEL = 15
_LEVELS = MAX_KERNEL.bit_length()   # sparse-table levels: windows of 1, 2, 4, ..., 64 entries


def _max_pool(x, lo, hi):
  """max of ``x[..., lo:hi + 1]`` per position (``lo``, ``hi`` int [..., S], lo <= hi, inside
  [0, S)): a sparse table — level j holds the max of 2^j entries from each position — and two
  overlapping lookups per window, so any traced window length costs the same."""
  S = x.shape[-1]
  levels = [x]
  for j in range(1, _LEVELS):
    prev, w = levels[-1], 1 << (j - 1)
    shifted = jnp.concatenate([prev[..., w:], jnp.full(prev.shape[:-1] + (w,), -jnp.inf,
                                                       prev.dtype)], -1)[..., :S]
    levels.append(jnp.maximum(prev, shifted))
    if (1 << j) >= S:
      break
  table = jnp.stack(levels, 0)                                   # [J, ..., S]
  n = hi - lo + 1
  # the largest level whose span fits the window: floor(log2(n)), made exact at powers of two
  j = jnp.floor(jnp.log2(n.astype(jnp.float32))).astype(jnp.int32)
  j = jnp.where(jnp.left_shift(1, j + 1) <= n, j + 1, j)
  j = jnp.where(jnp.left_shift(1, j) > n, j - 1, j)
  j = jnp.clip(j, 0, len(levels) - 1)
  # gathers along S and then along the level axis only, so that the leading axes (a KV head
  # axis sharded under tensor parallelism among them) are never merged
  at = lambda start: jnp.take_along_axis(
      jnp.take_along_axis(table, jnp.broadcast_to(start[None], table.shape), -1), j[None], 0)[0]
  return jnp.maximum(at(lo), at(hi - jnp.left_shift(1, j) + 1))


def window_votes(q, k, n, obs: int):
  """The observation window's votes without the prompt's [T, T] probabilities: the last ``obs``
  prompt queries of each sequence gathered, their attention over the prompt's keys (causal, f32,
  scale D^-1/2) summed over the window and the query heads of each KV head.  q [B, T, Hq, D], k
  [B, T, Hkv, D] (post-RoPE, one layer), n [B] prompt lengths -> vote [B, Hkv, T] f32 (0 at
  and past n).  The same sums as :class:`~pask_jax.baselines.masked.MaskedRunner`'s SnapKV
  prefill statistics, at O(obs · T) per layer instead of O(T · capacity)."""
  B, T, Hq, D = q.shape
  Hkv = k.shape[2]
  pos = n[:, None] - obs + jnp.arange(obs)[None, :]                      # [B, obs]
  valid = pos >= 0
  at = jnp.clip(pos, 0, T - 1)
  qw = jnp.take_along_axis(q, at[:, :, None, None], axis=1)             # [B, obs, Hq, D]
  qw = qw.reshape(B, obs, Hkv, Hq // Hkv, D).astype(jnp.float32) * D ** -0.5
  s = jnp.einsum("bokgd,btkd->bkgot", qw, k.astype(jnp.float32))        # [B, Hkv, G, obs, T]
  slot = jnp.arange(T)
  vis = (slot[None, None, :] <= pos[:, :, None]) & (slot[None, None, :] < n[:, None, None])
  s = jnp.where(vis[:, None, None], s, -jnp.inf)
  p = jax.nn.softmax(s, axis=-1)
  p = jnp.where((valid[:, None, None, :, None]) & vis[:, None, None], p, 0.0)
  return jnp.sum(p, axis=(2, 3))


def pool(vote, prefix, kernel, is_max):
  """1-D pooling of ``vote[..., S]`` over the ``prefix`` positions (same padding, like
  ``max_pool1d`` with -inf padding / ``avg_pool1d`` with zero padding counted in the mean).
  ``kernel`` int [...] (odd; <= MAX_KERNEL for max, <= AVG_KERNEL for avg) and ``is_max`` bool
  [...] may differ per row."""
  S = vote.shape[-1]
  x = jnp.where(prefix, vote.astype(jnp.float32), 0.0)
  half = kernel[..., None] // 2
  slot = jnp.arange(S)
  lo = jnp.clip(slot - half, 0, S - 1)
  hi = jnp.clip(slot + half, 0, S - 1)
  mx = _max_pool(jnp.where(prefix, x, -jnp.inf), jnp.broadcast_to(lo, x.shape),
                 jnp.broadcast_to(hi, x.shape))
  sm = jnp.zeros(x.shape, jnp.float32)
  for o in range(-(AVG_KERNEL // 2), AVG_KERNEL // 2 + 1):
    src = slot + o
    inside = (src >= 0) & (src < S)
    sh = jnp.take(x, jnp.clip(src, 0, S - 1), axis=-1)
    pre = jnp.take(prefix, jnp.clip(src, 0, S - 1), axis=-1) & inside
    sm = sm + jnp.where((jnp.abs(o) <= half) & pre, sh, 0.0)
  return jnp.where(is_max[..., None], mx, sm / kernel[..., None].astype(jnp.float32))


def select(vote, n, obs, kernel, is_max, cap):
  """Keep mask bool[..., S]: the observation window ∪ the top ``cap - |window|`` pooled prefix
  tokens.  vote [..., S] (attention from the window's queries); n, obs, kernel, cap int [...]."""
  slot = jnp.arange(vote.shape[-1])
  n_ = n[..., None]
  valid = slot < n_
  window = valid & (slot >= n_ - obs[..., None])
  prefix = valid & ~window
  pooled = pool(vote, prefix, kernel, is_max)
  k = jnp.maximum(cap - jnp.sum(window, axis=-1), 0)
  return window | (prefix & (rank_desc(pooled, prefix) < k[..., None]))


def prompt_cap(target: float, n_prompt: int, obs: int, gen: float) -> int:
  """Prompt entries kept per head for one request (see module doc)."""
  c = int(round(target * (n_prompt + gen) - gen))
  return int(min(n_prompt, max(min(obs, n_prompt), c)))


def predict_b(target: float, lengths, obs: int, gen: float) -> float:
  return float(np.mean([(prompt_cap(target, p, obs, gen) + g) / (p + g) for p, g in lengths]))
