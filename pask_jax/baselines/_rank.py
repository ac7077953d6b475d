"""Shared selection helper."""
from __future__ import annotations

import jax.numpy as jnp


def rank_desc(x, mask):
  """Rank of each element along the last axis among ``mask``ed ones, highest first (0 = best);
  ties go to the earlier position; masked-out elements rank after every masked-in one."""
  key = jnp.where(mask, x.astype(jnp.float32), -jnp.inf)
  order = jnp.argsort(-key, axis=-1, stable=True)
  return jnp.argsort(order, axis=-1, stable=True)
