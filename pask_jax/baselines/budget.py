"""Payload accounting and budget matching shared by every baseline.

Every method is charged with PASK's payload cost model (:func:`pask_jax.policy.cost_model`, paper
B.3): a KV entry of one (token, layer, KV head) costs ``16·2d`` bits in BF16 (H), ``4·2d + 16·2``
bits in INT4 with its two fp16 scales (L; ``+4·2`` for odd ``d``) and nothing when released (R).
Summed over layers and heads these are exactly m(H, c), m(L, c) of the layer groups, so per-head
selection (H2O, SnapKV, MiKV choose per KV head) is charged in the same currency as PASK's
per-token, per-group actions.  **Measured B** = (prefill + decode payload) / (Full-KV payload of the
same prompt and generated lengths); Full KV is 1.0.  PASK and INT4 charge the *scheduled* payload
(the ledger); the eviction methods (StreamingLLM, H2O, SnapKV) charge what is *retained at the end
of the request* (their cache only shrinks relative to Full KV by evicting).

Budget matching: H2O and MiKV take a per-request capacity that grows with the sequence
(``ceil(r·t)`` entries per head after t tokens), so the end-of-request B equals the target up to
rounding and the protected sink/recent entries; SnapKV and StreamingLLM fix their capacity before
decoding, so their B depends on the generated length, which is estimated (``gen``, measured on the
development split).  :func:`bisect` solves any monotone knob for a target mean B.
"""
from __future__ import annotations

import math
from typing import Callable

import numpy as np

from pask_jax import policy as P
from pask_jax import actions as Act


def entry_bits(head_dim: int) -> tuple[float, float]:
  """(H, L) bits of one (token, layer, KV head) entry: the cost model with one layer and head."""
  m = P.cost_model(1, 1, head_dim, 1)
  return float(m[Act.H, 0]), float(m[Act.L, 0])


def low_ratio(head_dim: int) -> float:
  """q = m(L)/m(H): the B of a cache stored entirely in INT4 (0.2656 for d=64)."""
  h, l = entry_bits(head_dim)
  return l / h


def bisect(f: Callable[[float], float], target: float, lo: float = 0.0, hi: float = 1.0,
           tol: float = 1e-4, iters: int = 60) -> float:
  """x in [lo, hi] with f(x) ≈ target for a nondecreasing f (the closest end if out of range)."""
  flo, fhi = f(lo), f(hi)
  if target <= flo:
    return lo
  if target >= fhi:
    return hi
  for _ in range(iters):
    mid = 0.5 * (lo + hi)
    fm = f(mid)
    if abs(fm - target) <= tol:
      return mid
    lo, hi = (mid, hi) if fm < target else (lo, mid)
  return 0.5 * (lo + hi)


def check_target(b: float) -> float:
  """A budget must lie in (0, 1]."""
  if not (isinstance(b, (int, float)) and math.isfinite(b) and 0.0 < b <= 1.0):
    raise ValueError(f"budget B must be in (0, 1], got {b!r}")
  return float(b)


def mean_b(pred: Callable[[int, int], float], lengths) -> float:
  """Mean over requests of a per-request B predictor ``pred(n_prompt, n_gen)``."""
  return float(np.mean([pred(int(p), int(g)) for p, g in lengths]))
