"""Online structural control: Algorithm 2 of the paper (§3.5, B.1, B.6, B.7), pure and jittable.

``actions, balance = control(policy, tag_ids[4], state_id, balance)`` for ONE sequence; ``vmap``
it over the batch (``control_batch`` does).  Everything is traced: tag ids, state id, balance
and the policy's budgets, so one compilation serves a whole generation.

Balance convention (DESIGN.md, B.6).  ``balance`` passed in is R_t, the balance *including* the
allowance of the current token: R_1 = b = B_D·C_full (:func:`initial_balance`), and the returned
value is R_{t+1} = R_t − M(a_t) + b, so it can be passed straight back at the next token.
Equivalently R_t = t·b − Σ_{i<t} M(a_i) with t counting accepted non-stop tokens.  Debt (negative
R) carries forward; the balance is a float32 number of bits.

Steps for one token (Alg. 2):

1. Lookup + candidate resolution (Eq. 12, B.1).  ``tag_ids`` holds up to 4 candidate ids, ``PAD``
   (-1) ignored.  One valid candidate: its stored (a⁰, a⁻, ρ).  Several: ã⁰ = ã⁻ = the max over
   all candidates' actions *and* floors, so the budget cannot undo conservative resolution, and no
   promotion (no unique calibrated score).  No valid candidate, or an id outside the table: H for
   action and floor.
2. a = max(a⁰, a⁻) (Eq. 11);  B_t = [R_t − Γ(s_t)]₊ with Γ from the parser-state id (ids outside
   the reserve table, e.g. -1, take the pooled reserve).
3. Demote: while M(a) > B_t, apply the one adjacent demotion (H→L or L→R, never below the floor)
   with the *lowest* stored priority — the ρ of the upgrade it undoes (ρ(L→H) for H→L, ρ(R→L) for
   L→R); NaN (no score) ranks last; ties go to the lower layer group.  Stops when M(a) <= B_t or
   only floors remain (floors beat the budget).
4. Promote, only if Crit(z) (state critical or next lookahead_critical) and the candidate is
   unique: repeatedly take the eligible adjacent upgrade with the *highest* ρ (NaN: ineligible;
   ties: upper group first) and apply it if M(a) + Δ <= B_t; stop at the first upgrade that does
   not fit ("promotes in descending priority only while total cost fits").
5. R_{t+1} = R_t − M(a) + b.

Stop tokens (B.7) charge nothing: if ``is_stop`` or any candidate equals ``tags.STOP`` (-2), the
actions are all R (the token's KV is never stored) and the balance is returned unchanged (no
charge and no allowance).  Each group moves at most two adjacent steps per direction, so both
loops run a fixed 2·G iterations: the per-token work is O(G) and independent of history length.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pask_jax import tags as T
from pask_jax.policy import FrozenPolicy


def initial_balance(policy: FrozenPolicy) -> jax.Array:
  """R_1 = b = B_D · C_full (float32 bits)."""
  return jnp.asarray(policy.allowance, jnp.float32)


def total_cost(policy: FrozenPolicy, actions: jax.Array) -> jax.Array:
  """M(a) = Σ_c m(a_c, c) for ``actions[..., G]`` -> float32 bits ``[...]``."""
  G = policy.n_groups
  a = actions.astype(jnp.int32)
  return jnp.sum(policy.cost[a, jnp.arange(G)], axis=-1)


def resolve(policy: FrozenPolicy, tag_ids: jax.Array):
  """Eq. 12 + parent fallback for one token's candidates ``int32[N_CAND]`` (vmap for more).

  Returns (a0 int32[G], floor int32[G], prio f32[G, 2], crit bool, unique bool): resolved base
  actions, floors, scores (NaN unless exactly one candidate), whether the tag is critical, and
  whether exactly one valid candidate was given.
  """
  ids = jnp.asarray(tag_ids, jnp.int32)
  valid = ids >= 0                                   # [C]; PAD and STOP are negative
  known = valid & (ids < policy.action.shape[0])     # outside the table: no entry -> H
  safe = jnp.where(known, ids, 0)
  H = jnp.int32(T.H)
  a0 = jnp.where(known[:, None], policy.action[safe].astype(jnp.int32), H)   # [C, G]
  fl = jnp.where(known[:, None], policy.floor[safe].astype(jnp.int32), H)
  pr = jnp.where(known[:, None, None], policy.prio[safe], jnp.nan)          # [C, G, 2]
  n_valid = jnp.sum(valid)
  unique = n_valid == 1
  first = jnp.argmax(valid)                          # the valid one when unique
  # Several candidates: action = floor = max over every candidate's action and floor.
  amax = jnp.max(jnp.where(valid[:, None], jnp.maximum(a0, fl), -1), axis=0)
  amax = jnp.where(n_valid > 0, amax, H)             # all pads: H
  res_a0 = jnp.where(unique, a0[first], amax)
  res_fl = jnp.where(unique, fl[first], amax)
  res_pr = jnp.where(unique, pr[first], jnp.nan)
  crit = jnp.any(known & policy.crit[safe])
  return res_a0, res_fl, res_pr, crit, unique


def _demote(a, floor, prio, cost, budget):
  """Alg. 2 Demote over one token's groups.  a, floor: int32[G]; prio f32[G, 2]; cost f32[3, G]."""
  G = a.shape[0]
  gi = jnp.arange(G)

  def body(_, a):
    m = jnp.sum(cost[a, gi])
    elig = a > floor
    # Priority of the demotion = ρ of the upgrade it undoes: H→L undoes L→H (index 1), L→R undoes
    # R→L (index 0): index a-1.
    p = prio[gi, jnp.clip(a - 1, 0, 1)]
    # NaN (no score) ranks after every score but before ineligible groups (+inf).
    key = jnp.where(elig, jnp.where(jnp.isnan(p), jnp.finfo(jnp.float32).max, p), jnp.inf)
    best = jnp.argmin(key)  # the first minimum: ties go to the lower group
    do = (m > budget) & jnp.any(elig)
    return a.at[best].add(jnp.where(do, -1, 0))

  return jax.lax.fori_loop(0, 2 * G, body, a)


def _promote(a, prio, cost, budget):
  """Alg. 2 Promote: descending priority while M(a) + Δ <= budget (stop at the first misfit)."""
  G = a.shape[0]
  gi = jnp.arange(G)

  def body(_, carry):
    a, stopped = carry
    p = prio[gi, jnp.clip(a, 0, 1)]           # R→L is index 0, L→H index 1
    elig = (a < T.H) & ~jnp.isnan(p)
    key = jnp.where(elig, p, -jnp.inf)
    # Ties go to the upper group: argmax over the reversed axis.
    best = G - 1 - jnp.argmax(key[::-1])
    delta = cost[jnp.clip(a[best] + 1, 0, 2), best] - cost[a[best], best]
    fits = jnp.sum(cost[a, gi]) + delta <= budget
    can = jnp.any(elig) & ~stopped
    do = can & fits
    return a.at[best].add(jnp.where(do, 1, 0)), stopped | (can & ~fits) | ~jnp.any(elig)

  a, _ = jax.lax.fori_loop(0, 2 * G, body, (a, jnp.bool_(False)))
  return a


def control(policy: FrozenPolicy, tag_ids: jax.Array, state_id: jax.Array, balance: jax.Array,
            is_stop: jax.Array | bool = False) -> tuple[jax.Array, jax.Array]:
  """Alg. 2 for one token: ``(int8[G] actions, float32 R_{t+1})``.  See the module docstring.

  tag_ids: int32[N_CAND] candidates (PAD = -1); state_id: int32 scalar parser-state id (-1 =
  unseen); balance: float32 R_t including the current allowance; is_stop: bool scalar.
  """
  ids = jnp.asarray(tag_ids, jnp.int32)
  assert ids.shape == (T.N_CAND,), f"tag_ids must be [{T.N_CAND}], got {ids.shape}"
  balance = jnp.asarray(balance, jnp.float32)
  stop = jnp.asarray(is_stop, bool) | jnp.any(ids == T.STOP)
  a0, floor, prio, crit, unique = resolve(policy, ids)
  a = jnp.maximum(a0, floor)                                        # Eq. 11
  budget = jnp.maximum(balance - policy.gamma(state_id), 0.0)       # B_t
  a = _demote(a, floor, prio, policy.cost, budget)
  promoted = _promote(a, prio, policy.cost, budget)
  a = jnp.where(crit & unique, promoted, a)
  a = jnp.where(stop, T.R, a)
  spent = total_cost(policy, a)
  new_balance = jnp.where(stop, balance, balance - spent + policy.allowance)
  return a.astype(jnp.int8), new_balance


def control_batch(policy: FrozenPolicy, tag_ids: jax.Array, state_ids: jax.Array,
                  balance: jax.Array, is_stop: jax.Array | None = None):
  """``control`` vmapped over the batch: tag_ids [B, 4], state_ids [B], balance [B], is_stop [B]
  -> (int8[B, G], float32[B])."""
  if is_stop is None:
    is_stop = jnp.zeros(jnp.shape(state_ids), bool)
  return jax.vmap(control, in_axes=(None, 0, 0, 0, 0))(policy, tag_ids, state_ids, balance,
                                                        is_stop)
