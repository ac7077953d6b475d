"""Uniform FrozenPolicy tables: one action for every tag id (a baseline as a PASK policy)."""
from __future__ import annotations

import jax.numpy as jnp

from pask_jax import policy as P


def uniform(model, action: int, *, sink: int, window: int, name: str,
            tokenizer_hash: str | None = None) -> P.FrozenPolicy:
  """Every tag id's action and floor = ``action`` in every group; no scores, no reserve.

  The tables are filled directly (not through entries) so that no id falls back to H.  The
  record (a static field of the policy pytree) does not depend on ``action`` or ``name``, so
  uniform policies with the same sink and window share one compiled PASK step.
  """
  del name  # the method is in the (traced) tables, not in the static record
  pol = P.build({}, model, b_d=1.0, b_p=1.0, pooled=0.0, sink=sink, window=window,
                tokenizer_hash=tokenizer_hash, adapter="any",
                extra={"name": "uniform baseline (every tag id -> one action)"})
  a = jnp.full_like(pol.action, action)
  return pol.replace(action=a, floor=a)
