"""MiKV (Yang et al., 2024, "No Token Left Behind: Reliable KV Cache Compression via
Importance-Aware Mixed Precision Quantization"): importance-ranked KV entries stay in high
precision, the rest are kept at low precision instead of being evicted.

Here, as in the PASK paper's reproduction (C.3: "H2O-style cumulative-attention importance"): the
H2O rule of :mod:`pask_jax.baselines.h2o` picks the high tier (sinks, recent window and the heavy
hitters, ``ceil(h·t)`` entries per (layer, KV head) after t tokens); every other entry is demoted
to INT4 with PASK's exact quantizer (:mod:`pallas_kernels.int4`: 4-bit symmetric, per (token, head)
row, fp16 scales — so MiKV's group-size knob is fixed at the row, d, and its low-bit width at 4).
Demotion is irreversible (the BF16 values are gone, as in PASK's cache).  Nothing is evicted, so
B = h + (1 - h)·q with q = m(L)/m(H): the high ratio h is set from the target B by
:func:`high_ratio` (any target below q is unreachable).  Runs on
:class:`~pask_jax.baselines.masked.MaskedRunner`, where the INT4 tier is simulated by replacing the
stored K/V rows with quantize→dequantize values.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from pask_jax.baselines import h2o


def select(score, n, sink, recent, high_cap):
  """(keep, low) bool[..., S]: everything valid kept; outside the H2O high set -> low."""
  slot = jnp.arange(score.shape[-1])
  valid = slot < n[..., None]
  high = h2o.select(score, n, sink, recent, high_cap)
  return valid, valid & ~high


def high_ratio(target: float, q: float) -> float:
  """h with h + (1 - h)·q = target."""
  if target < q:
    raise ValueError(f"MiKV cannot reach B={target}: an all-INT4 cache already costs {q:.4f}")
  return (target - q) / (1.0 - q)


def predict_b(ratio: float, lengths, sink: int, recent: int, q: float) -> float:
  out = []
  for p, g in lengths:
    n = p + g
    hc = h2o.kept_at_end(ratio, n, sink, recent)
    out.append((hc + (n - hc) * q) / n)
  return float(np.mean(out))
