"""RocketKV (Behnam et al., ICML 2025, "RocketKV: Accelerating Long-Context LLM Inference via
Two-Stage KV Cache Compression"), as the PASK paper reproduces it in one batched stack (its
Appendix, Table 8): two stages over the dense masked cache of
:class:`~pask_jax.baselines.masked.MaskedRunner`.

* **Prefill — permanent eviction.** SnapKV's observation-window scorer (the last ``obs`` prompt
  queries vote, summed over the query heads of a KV head) with **max pooling** of an odd kernel
  (31, 63 or 127), keeping ``ceil(r · n)`` prompt entries per (layer, KV head) — the observation
  window included (:func:`prompt_cap`).  Generated tokens' K/V are all kept, in BF16.
* **Decode — sparse reads.** Each step reads only ``ceil(read_frac · cap)`` of the stored entries
  per (request, layer, KV head) (``read_frac`` 0.5, the paper's), chosen by a coarse-to-fine
  sketch (:func:`read_mask`): the stored entries in chunks of :data:`CHUNK` consecutive ones, each
  chunk summarized by the elementwise max and min of its keys (sequence reduction), scored on the
  ``top_r`` key channels where the group's queries are largest (head-dimension reduction) by the
  upper bound Σ_d max(q_d·kmax_d, q_d·kmin_d) summed over the group's query heads (one selection
  per KV head); the current token is always read.  What is not read stays stored.

Budget: the stored entries set B (``(cap + g) / (n + g)`` per request); the read set changes no
byte that is kept, so it does not enter B.  The prompt ratio ``r`` is solved from the target B by
bisection over the requests' lengths (:func:`predict_b`), as H2O's capacity ratio is, instead of
being tuned: a tuned ratio would set B itself.

Choices where the paper is silent (its reproduction's kernels are not public): chunks of 4 stored
entries (the official code's page size), ``top_r`` half the head dimension, the current token
always read.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from pask_jax.baselines._rank import rank_desc

CHUNK = 4          # stored entries per sketch chunk
READ_FRAC = 0.5    # entries read per step, as a fraction of the prompt capacity
TOP_R = 0.5        # key channels scored, as a fraction of the head dimension
KERNELS = (31, 63, 127)


def prompt_cap(ratio: float, n_prompt: int, obs: int) -> int:
  """Prompt entries kept per (layer, KV head) of a request: ``ceil(ratio · n)`` within
  [min(obs, n), n] (the observation window always stays)."""
  c = int(math.ceil(ratio * n_prompt - 1e-9))
  return int(min(n_prompt, max(min(obs, n_prompt), c)))


def read_budget(cap: int, read_frac: float = READ_FRAC) -> int:
  """Entries a decode step reads per (layer, KV head) for a request of prompt capacity ``cap``."""
  return max(1, int(math.ceil(read_frac * cap)))


def predict_b(ratio: float, lengths, obs: int) -> float:
  """Mean B over ``lengths`` [(n_prompt, n_gen)]: kept prompt entries plus every generated one."""
  return float(np.mean([(prompt_cap(ratio, p, obs) + g) / (p + g) for p, g in lengths]))


def read_mask(q, k, stored, current, budget, top_r):
  """The entries one decode step reads.

  q [B, Hkv, G, D] (the step's queries by KV head), k [B, S, Hkv, D], stored bool [B, Hkv, S],
  current int [B] (the new token's slot: always read), budget int [B] (entries read per KV head),
  top_r int [B] (key channels scored) -> bool [B, Hkv, S], a subset of ``stored`` with
  min(budget, stored) entries (plus the current token where the budget left it out)."""
  B, S, Hkv, D = k.shape
  nc = -(-S // CHUNK)
  kt = jnp.swapaxes(k, 1, 2).astype(jnp.float32)                   # [B, Hkv, S, D]
  # sequence reduction: chunks of CHUNK consecutive stored entries (slot order)
  chunk = jnp.where(stored, (jnp.cumsum(stored, -1) - 1) // CHUNK, nc)   # nc: unstored
  bi = jnp.arange(B)[:, None, None]
  hi = jnp.arange(Hkv)[None, :, None]
  kmax = jnp.full((B, Hkv, nc + 1, D), -jnp.inf).at[bi, hi, chunk].max(kt)
  kmin = jnp.full((B, Hkv, nc + 1, D), jnp.inf).at[bi, hi, chunk].min(kt)
  # chunks that hold no entry (never looked up) scored 0 rather than from infinities
  kmax, kmin = (jnp.where(jnp.isfinite(x), x, 0.0) for x in (kmax, kmin))
  # head-dimension reduction: the channels where the group's queries are largest
  qf = q.astype(jnp.float32)
  mag = jnp.sum(jnp.abs(qf), axis=2)                                # [B, Hkv, D]
  chan = rank_desc(mag, jnp.ones_like(mag, bool)) < top_r[:, None, None]
  qc = jnp.where(chan[:, :, None], qf, 0.0)                         # [B, Hkv, G, D]
  # Σ_g Σ_d max(q·kmax, q·kmin) = Σ_d (Σ_g q⁺)·kmax + (Σ_g q⁻)·kmin (kmax >= kmin in every
  # chunk that holds an entry): no [G, chunks, D] product is formed
  pos, neg = jnp.sum(jnp.maximum(qc, 0.0), 2), jnp.sum(jnp.minimum(qc, 0.0), 2)
  hp = jax.lax.Precision.HIGHEST                                    # not TF32 on a GPU
  score = (jnp.einsum("bhd,bhcd->bhc", pos, kmax, precision=hp) +
           jnp.einsum("bhd,bhcd->bhc", neg, kmin, precision=hp))    # [B, Hkv, nc+1]
  tok = jnp.take_along_axis(score, jnp.minimum(chunk, nc), axis=-1)  # [B, Hkv, S]
  read = stored & (rank_desc(tok, stored) < budget[:, None, None])
  here = jnp.arange(S)[None, None, :] == current[:, None, None]
  return read | (here & stored)


def read_mask_reference(q, k, stored, current, budget, top_r, *, margin: bool = False):
  """:func:`read_mask` one (request, KV head) at a time in numpy (float64), for tests.  With
  ``margin``: also, per entry, how far its chunk's score lies from the last one read (relative
  to the scores' scale; +inf where that does not decide), so that a test can leave out entries
  a float32 rounding could move across the cut."""
  q, k, stored = np.asarray(q, np.float64), np.asarray(k, np.float64), np.asarray(stored)
  B, S, Hkv, D = k.shape
  out = np.zeros((B, Hkv, S), bool)
  gap = np.full((B, Hkv, S), np.inf)
  for b in range(B):
    for h in range(Hkv):
      slots = np.flatnonzero(stored[b, h])
      mag = np.abs(q[b, h]).sum(0)
      chan = np.argsort(-mag, kind="stable")[:int(top_r[b])]
      scores = []
      for c0 in range(0, len(slots), CHUNK):
        ks = k[b, slots[c0:c0 + CHUNK], h][:, chan]
        qq = q[b, h][:, chan]
        ub = np.maximum(qq * ks.max(0), qq * ks.min(0)).sum()
        scores += [ub] * len(slots[c0:c0 + CHUNK])
      scores = np.asarray(scores, np.float64)
      order = np.argsort(-scores, kind="stable")
      n_read = min(int(budget[b]), len(slots))
      out[b, h, slots[order[:n_read]]] = True
      if 0 < n_read < len(slots):
        cut = scores[order[n_read - 1]]
        gap[b, h, slots] = np.abs(scores - cut) / max(np.abs(scores).max(), 1e-30)
      if stored[b, h, current[b]]:
        out[b, h, current[b]] = True
  return (out, gap) if margin else out
