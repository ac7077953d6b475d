"""Full KV: every token's K/V kept in the model's precision (the reference, B = 1.0).

Runs on :class:`pask_jax.decode.Runner` (the dense cache) unchanged.
"""
from __future__ import annotations

from pask_jax.decode import Runner


def runner(model, *, batch: int, capacity: int, mesh=None) -> Runner:
  return Runner(model, batch=batch, capacity=capacity, mesh=mesh)


def measured(n_prompt: int, n_gen: int) -> dict:
  return {"prefill_B": 1.0, "decode_B": 1.0 if n_gen else float("nan"), "total_B": 1.0}
