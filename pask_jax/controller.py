"""Online structural control: Algorithm 2 of the paper (§3.5, B.1, B.6, B.7), pure and jittable.

``actions, balance = control(policy, tag_ids[4], state_id, balance)`` for ONE sequence; ``vmap``
it over the batch (``control_batch`` does).  Everything is traced: tag ids, state id, balance
and the policy's budgets, so one compilation serves a whole generation.

Balance convention (docs/DESIGN.md, B.6).  ``balance`` passed in is R_t, the balance *including* the
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
from pask_jax import actions as Act
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
  H = jnp.int32(Act.H)
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


def _unroll(G: int) -> bool | int:
  """Unroll Alg. 2's 2·G-step loops when G is small (every model here: 3 groups): a rolled loop
  is a ``while`` thunk on the GPU, launched step by step from the host outside the step's CUDA
  graphs (issue 24); unrolled, its few ops fuse into the step's straight-line kernels."""
  return True if 2 * G <= 16 else 4


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

  return jax.lax.fori_loop(0, 2 * G, body, a, unroll=_unroll(G))


def _promote(a, prio, cost, budget):
  """Alg. 2 Promote: descending priority while M(a) + Δ <= budget (stop at the first misfit)."""
  G = a.shape[0]
  gi = jnp.arange(G)

  def body(_, carry):
    a, stopped = carry
    p = prio[gi, jnp.clip(a, 0, 1)]           # R→L is index 0, L→H index 1
    elig = (a < Act.H) & ~jnp.isnan(p)
    key = jnp.where(elig, p, -jnp.inf)
    # Ties go to the upper group: argmax over the reversed axis.
    best = G - 1 - jnp.argmax(key[::-1])
    delta = cost[jnp.clip(a[best] + 1, 0, 2), best] - cost[a[best], best]
    fits = jnp.sum(cost[a, gi]) + delta <= budget
    can = jnp.any(elig) & ~stopped
    do = can & fits
    return a.at[best].add(jnp.where(do, 1, 0)), stopped | (can & ~fits) | ~jnp.any(elig)

  a, _ = jax.lax.fori_loop(0, 2 * G, body, (a, jnp.bool_(False)), unroll=_unroll(G))
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
  a = jnp.where(stop, Act.R, a)
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


# ---- prefill companion (§3.6, B.4) ------------------------------------------------------------

def _prefill_one(policy: FrozenPolicy, cands: jax.Array, n: jax.Array):
  """One prompt: cands int32[T, N_CAND], n = prompt length -> (int8[T, G], floor excess bits)."""
  Tn = cands.shape[0]
  G = policy.n_groups
  _, floor, prio, _, _ = jax.vmap(lambda c: resolve(policy, c))(cands)   # [T, G], [T, G, 2]
  t = jnp.arange(Tn)
  real = t < n
  floor = jnp.where((t < policy.sink)[:, None], Act.H, floor)              # sinks: H, no upgrades
  cost = policy.cost                                                     # [3, G]
  gi = jnp.arange(G)[None, :]
  base = jnp.where(real[:, None], cost[floor, gi], 0.0)                  # [T, G]
  target = policy.b_p * n.astype(jnp.float32) * policy.c_full            # T_P
  # Upgrade steps: step 0 = floor -> floor+1, step 1 = floor+1 -> floor+2 (if below H).  The
  # second step of a chain can only follow the first, so its key is min(own, first): sorting the
  # steps then reproduces "repeatedly take the best eligible upgrade".
  p0 = prio[jnp.arange(Tn)[:, None], gi, jnp.clip(floor, 0, 1)]          # [T, G]
  p1 = prio[jnp.arange(Tn)[:, None], gi, jnp.clip(floor + 1, 0, 1)]
  ok0 = real[:, None] & (floor < Act.H) & ~jnp.isnan(p0)
  ok1 = ok0 & (floor + 1 < Act.H) & ~jnp.isnan(p1)
  k0 = jnp.where(ok0, p0, -jnp.inf)
  k1 = jnp.where(ok1, jnp.minimum(p0, p1), -jnp.inf)
  d0 = cost[jnp.clip(floor + 1, 0, 2), gi] - cost[floor, gi]
  d1 = cost[jnp.clip(floor + 2, 0, 2), gi] - cost[jnp.clip(floor + 1, 0, 2), gi]
  key = jnp.stack([k0, k1], axis=-1).reshape(-1)                         # [T*G*2] (t, g, step)
  delta = jnp.stack([d0, d1], axis=-1).reshape(-1)
  ok = jnp.stack([ok0, ok1], axis=-1).reshape(-1)
  # Descending key; ties: token position, then layer group, then step (lexsort: last key first).
  idx = jnp.arange(key.shape[0])
  order = jnp.lexsort((idx, -key))
  used = jnp.sum(base) + jnp.cumsum(jnp.where(ok[order], delta[order], 0.0))
  # Promote while it fits: the longest prefix of eligible steps whose cumulative cost <= T_P.
  fits = jnp.cumprod((used <= target) & ok[order]).astype(bool)
  take = jnp.zeros_like(ok).at[order].set(fits)
  up = take.reshape(Tn, G, 2).sum(-1)
  act = jnp.where(real[:, None], floor + up, Act.R).astype(jnp.int8)
  excess = jnp.maximum(jnp.sum(base) - target, 0.0)
  return act, excess


def plan_prefill(policy: FrozenPolicy, cands: jax.Array, lengths: jax.Array | None = None):
  """Prefill retention plan (§3.6, B.4) from prompt-label candidates ``int32[B, T, N_CAND]``.

  Per prompt of n tokens: T_P = B_P · n · C_full.  Every token starts at its floor (labels are
  resolved like decode tags: parent chain, Eq. 12 for cross-label tokens, no entry → H); sink
  positions are H.  Then adjacent upgrades are applied in descending stored priority (ties:
  token position, then layer group) while the total stays <= T_P, stopping at the first one that
  does not fit; upgrades without a score (NaN, or several candidates) are not taken.  Floors beat
  the budget: their excess over T_P is returned, not enforced.  Base actions are not used here:
  the prefill companion allocates from floors and priorities alone.  Window tokens are planned
  like the rest (their plan is the pending action applied when they leave the window).

  Returns (plan int8[B, T, G] — R on padding rows —, floor excess float32[B] bits).
  """
  B, Tn, _ = cands.shape
  n = jnp.full((B,), Tn, jnp.int32) if lengths is None else jnp.asarray(lengths, jnp.int32)
  return jax.vmap(lambda c, m: _prefill_one(policy, c, m))(jnp.asarray(cands, jnp.int32), n)
