"""Uniform INT4 beyond the recent window, KIVI-like (Liu et al., ICML 2024, "KIVI: A Tuning-Free
Asymmetric 2bit Quantization for KV Cache"): recent tokens stay in full precision (KIVI's residual
group), every older token is quantized, nothing is evicted.

Expressed exactly as a PASK policy: every tag → L in every layer group; sinks stay H (the cache's
rule); a token leaving the recent ``window`` goes to the INT4 pool with PASK's quantizer (4-bit
symmetric per (token, head) row, fp16 scales; KIVI's per-channel asymmetric 2-bit keys are not
reproduced).  It runs through :class:`~pask_jax.decode.PaskRunner` on the same cache and kernels,
and its B is the ledger's scheduled payload (window tokens charged by their pending action L,
as for PASK).  Fixed-profile: B ≈ m(L)/m(H) (0.27 for d = 64) plus the sinks, whatever the target.
"""
from __future__ import annotations

from pask_jax import policy as P
from pask_jax import actions as Act
from pask_jax.baselines import _tables


def policy(model, *, sink: int = P.DEFAULT_SINK, window: int = P.DEFAULT_WINDOW,
           tokenizer_hash: str | None = None):
  """All-L policy with the given sinks and recent window."""
  return _tables.uniform(model, Act.L, sink=sink, window=window, name="int4",
                         tokenizer_hash=tokenizer_hash)
