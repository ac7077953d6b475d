"""StreamingLLM (Xiao et al., ICLR 2024, "Efficient Streaming Language Models with Attention
Sinks"): keep the first ``sink`` tokens (attention sinks) and a window of the most recent tokens;
evict everything else.

Expressed exactly as a PASK policy: every tag → R in every layer group, the cache's static
``sink`` and ``window`` sizes as the policy's, so it runs through
:class:`~pask_jax.decode.PaskRunner` on the real mixed-precision cache and kernels (sinks live in
the BF16 pool, the window in the ring; a token leaving the window is released).  Budget: the window
is the knob; B is what is retained at the end of the request, ``min(n, sink + W) / n`` (the PASK
ledger would charge the window tokens by their pending action R, so its scheduled B is not used
for this method).  The window is static per compiled runner, so one W serves a whole run:
:func:`window_for` solves it for a target mean B from the prompt lengths and an estimate of the
generated length.
"""
from __future__ import annotations

import numpy as np

from pask_jax import actions as Act
from pask_jax.baselines import _tables
from pask_jax.baselines.budget import bisect

DEFAULT_SINK = 4


def policy(model, *, sink: int = DEFAULT_SINK, window: int, tokenizer_hash: str | None = None):
  """All-R policy with the given sinks and recent window."""
  return _tables.uniform(model, Act.R, sink=sink, window=window, name="streaming",
                         tokenizer_hash=tokenizer_hash)


def keep_mask(n: int, sink: int, window: int) -> np.ndarray:
  """The rule: bool[n], position p kept iff p < sink or p >= n - window."""
  p = np.arange(n)
  return (p < sink) | (p >= n - window)


def measured(n_prompt: int, n_gen: int, sink: int, window: int) -> dict:
  """Retained-at-end B, split into prompt and generated positions."""
  n = n_prompt + n_gen
  keep = keep_mask(n, sink, window)
  kp, kg = int(keep[:n_prompt].sum()), int(keep[n_prompt:].sum())
  return {"prefill_B": kp / n_prompt, "decode_B": kg / n_gen if n_gen else float("nan"),
          "total_B": (kp + kg) / n}


def window_for(target: float, lengths, sink: int = DEFAULT_SINK) -> int:
  """Smallest window W >= 1 whose mean retained B over ``lengths`` [(n_prompt, n_gen)] reaches
  ``target`` (one shared W: the cache shape is static)."""
  f = lambda w: float(np.mean([min(p + g, sink + int(round(w))) / (p + g) for p, g in lengths]))
  hi = max(p + g for p, g in lengths)
  return max(1, int(round(bisect(f, target, 1.0, float(hi), tol=1e-6))))
