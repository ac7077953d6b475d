"""Spherical KV hybrids with PASK (docs/SPHERICAL_KV.md §3 "Coexistence"): the one bridge from
PASK's policy and tags into RDR, so that :mod:`.rdr` imports nothing of PASK.

*RDR+tags*: a (token, layer group) whose PASK floor is H joins RDR's protected set P on every KV
head.  The floor is PASK's own resolution of the token's tag candidates
(:func:`pask_jax.controller.resolve`: parent chain precomputed in the policy table, several
candidates -> the max of their actions and floors, no valid or an unknown candidate -> H), so a
token is protected here exactly when PASK's controller could never store it below H.

*PASK+ADA*: PASK's controller and policy decide R/L/H per (token, group) as they do for PASK;
H goes to the BF16 pool, L to one Spherical tier instead of the INT4 pool, R is dropped
(:func:`routes`).  The controller budgets with the policy's cost model, whose m(L) becomes the
tier's bytes (:func:`with_tier_cost`, PASK's payload convention: no metadata).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pask_jax import actions as Act
from pask_jax import controller


def floor_h(policy, cands) -> jax.Array:
  """Tag candidates ``int32 [..., N_CAND]`` -> bool ``[..., G]``: PASK's resolved floor is H.
  Rows whose candidates are all ``PAD`` (padding) resolve to H like PASK's; callers mask them."""
  cands = jnp.asarray(cands, jnp.int32)
  flat = cands.reshape(-1, cands.shape[-1])
  fl = jax.vmap(lambda c: controller.resolve(policy, c)[1])(flat)            # [N, G]
  return (fl == Act.H).reshape(cands.shape[:-1] + (fl.shape[-1],))


def with_tier_cost(policy, tier, layers, n_kv_heads: int):
  """``policy`` whose m(L) (bits per (token, group), all KV heads) is the cost of tier ``tier``
  (a :class:`TierSpec`) over ``layers[g]`` layers per group instead of INT4's; m(R), m(H) and
  C_full unchanged (the controller then spends its budget on the tier's bytes)."""
  layers = np.asarray(layers, np.float32)
  if layers.shape != (policy.n_groups,):
    raise ValueError(f"the policy has {policy.n_groups} layer groups, got layer counts "
                     f"{layers.tolist()}")
  bits = 8.0 * n_kv_heads * tier.bytes * layers
  return policy.replace(cost=policy.cost.at[Act.L].set(jnp.asarray(bits, policy.cost.dtype)))


def routes(actions, n_kv_heads: int, tier: int = 1) -> jax.Array:
  """PASK actions ``int [..., G]`` (R/L/H) -> Spherical routes ``int8 [..., G, Hkv]``: H the
  BF16 pool (``tier + 1`` for a one-tier ladder), L tier ``tier``, R drop (0)."""
  a = jnp.asarray(actions)
  r = jnp.where(a == Act.H, tier + 1, jnp.where(a == Act.L, tier, 0)).astype(jnp.int8)
  return jnp.broadcast_to(r[..., None], r.shape + (n_kv_heads,))


__all__ = ["floor_h", "routes", "with_tier_cost"]
