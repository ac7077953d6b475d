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
charge and no allowance).  Each group moves at most two adjacent steps per direction, so each
loop has at most 2·G steps and is computed in closed form (below): the per-token work is O(G²)
and independent of history length.
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
  whether exactly one valid candidate was given.  The candidate axis is unrolled (it has
  ``N_CAND`` = 4 entries): elementwise selects instead of reductions over it keep the batched
  decode step's controller in a few fused kernels (issue 24).
  """
  ids = jnp.asarray(tag_ids, jnp.int32)
  n_tags = policy.action.shape[0]
  H = jnp.int32(Act.H)
  rows = []
  for c in range(ids.shape[0]):
    i = ids[c]
    valid = i >= 0                                   # PAD and STOP are negative
    known = valid & (i < n_tags)                     # outside the table: no entry -> H
    safe = jnp.where(known, i, 0)
    rows.append((valid, known,
                 jnp.where(known, policy.action[safe].astype(jnp.int32), H),      # [G]
                 jnp.where(known, policy.floor[safe].astype(jnp.int32), H),
                 jnp.where(known, policy.prio[safe], jnp.nan),                   # [G, 2]
                 known & policy.crit[safe]))
  n_valid = sum(r[0].astype(jnp.int32) for r in rows)
  unique = n_valid == 1
  # The valid candidate when unique: the first valid one (later ones are PAD).
  a0, fl, pr = rows[-1][2:5]
  for valid, _, ra, rf, rp, _ in reversed(rows[:-1]):
    a0, fl, pr = (jnp.where(valid, x, y) for x, y in ((ra, a0), (rf, fl), (rp, pr)))
  # Several candidates: action = floor = max over every candidate's action and floor.
  amax = jnp.full_like(a0, -1)
  for valid, _, ra, rf, _, _ in rows:
    amax = jnp.maximum(amax, jnp.where(valid, jnp.maximum(ra, rf), -1))
  amax = jnp.where(n_valid > 0, amax, H)             # all pads: H
  crit = _any([r[5] for r in rows])
  return (jnp.where(unique, a0, amax), jnp.where(unique, fl, amax),
          jnp.where(unique, pr, jnp.nan), crit, unique)


# Alg. 2's demote and promote loops in closed form.  Each group moves at most two adjacent steps
# per direction, and each loop applies the steps of every group in one order: by key (demote:
# ascending, promote: descending), a group's second step after its first (its key is the worse
# of the two: the max ascending, the min descending), ties to the lower group (demote) or the
# upper group (promote); demote takes steps while the cost before the step exceeds the budget,
# promote while the cost after it fits.  Costs are sums of integer bit counts, so the
# cumulative sums below are exact and the greedy loops' choices are reproduced exactly (tests:
# a NumPy Alg. 2, loops written as the paper reads).  One token's state is a list of G scalars,
# every quantity elementwise on the batch: O(G²) ops without a sequential chain, which XLA fuses
# into a few kernels (as a batched ``.at[best]`` loop it was ~50 kernels of the GPU decode
# step's graph, each a launch (issue 24); as an unrolled chain of selects, XLA's CPU fusion
# re-evaluated the chain per use, exponentially).


def _group_cost(cost, g: int, a):
  """m(a, g) for action ``a`` of group ``g`` (cost f32[3, G]) by selects, not a gather."""
  return jnp.where(a == 0, cost[0, g], jnp.where(a == 1, cost[1, g], cost[2, g]))


def _cost_sum(cost, a):
  m = _group_cost(cost, 0, a[0])
  for g in range(1, len(a)):
    m = m + _group_cost(cost, g, a[g])
  return m


def _any(xs):
  out = xs[0]
  for x in xs[1:]:
    out = out | x
  return out


def _taken(keys, elig, amount, ahead, fits):
  """Steps taken by a greedy walk in the order ``ahead(j, i)`` (j goes before i): step i is
  taken iff eligible and ``fits(cum_i, amount_i)``, cum_i the eligible amounts up to and with i
  in that order (monotone: the taken steps are a prefix)."""
  n = len(keys)
  out = []
  for i in range(n):
    cum = amount[i]
    for j in range(n):
      if j != i:
        cum = cum + jnp.where(elig[j] & ahead(j, i), amount[j], 0.0)
    out.append(elig[i] & fits(cum, amount[i]))
  return out


def _demote(a, floor, prio, cost, budget):
  """Alg. 2 Demote: a, floor lists of G int32; prio G pairs (ρ(R→L), ρ(L→H)); cost f32[3, G].
  A demotion's priority is the ρ of the upgrade it undoes (H→L: ρ(L→H), L→R: ρ(R→L)); NaN (no
  score) ranks after every score."""
  G = len(a)
  fmax = jnp.finfo(jnp.float32).max
  ranked = lambda p: jnp.where(jnp.isnan(p), fmax, p)
  keys, elig, saving = [], [], []
  for g in range(G):
    k0 = ranked(jnp.where(a[g] >= 2, prio[g][1], prio[g][0]))
    e0 = a[g] > floor[g]
    keys += [k0, jnp.maximum(k0, ranked(prio[g][0]))]     # second step: L→R, after H→L
    elig += [e0, e0 & (a[g] - 2 >= floor[g])]
    saving += [_group_cost(cost, g, a[g]) - _group_cost(cost, g, jnp.maximum(a[g] - 1, 0)),
               jnp.broadcast_to(cost[1, g] - cost[0, g], a[g].shape)]
  # Ascending key; ties: lower group, then first step (index order 2g + step).
  ahead = lambda j, i: (keys[j] < keys[i]) | ((keys[j] == keys[i]) & (j < i))
  m = _cost_sum(cost, a)
  take = _taken(keys, elig, saving, ahead, lambda cum, own: m - cum + own > budget)
  return [a[g] - take[2 * g].astype(jnp.int32) - take[2 * g + 1].astype(jnp.int32)
          for g in range(G)]


def _promote(a, prio, cost, budget):
  """Alg. 2 Promote: descending priority while M(a) + Δ <= budget (stop at the first misfit);
  upgrades without a score are not taken."""
  G = len(a)
  keys, elig, delta = [], [], []
  for g in range(G):
    p0 = jnp.where(a[g] >= 1, prio[g][1], prio[g][0])      # R→L or L→H
    e0 = (a[g] < Act.H) & ~jnp.isnan(p0)
    keys += [p0, jnp.minimum(p0, prio[g][1])]             # second step: L→H, after R→L
    elig += [e0, e0 & (a[g] == Act.R) & ~jnp.isnan(prio[g][1])]
    delta += [_group_cost(cost, g, jnp.minimum(a[g] + 1, 2)) - _group_cost(cost, g, a[g]),
              jnp.broadcast_to(cost[2, g] - cost[1, g], a[g].shape)]
  # Descending key; ties: upper group, then first step.
  order = lambda i: (i // 2, -(i % 2))
  ahead = lambda j, i: (keys[j] > keys[i]) | ((keys[j] == keys[i]) & (order(j) > order(i)))
  m = _cost_sum(cost, a)
  take = _taken(keys, elig, delta, ahead, lambda cum, own: m + cum <= budget)
  return [a[g] + take[2 * g].astype(jnp.int32) + take[2 * g + 1].astype(jnp.int32)
          for g in range(G)]


def control(policy: FrozenPolicy, tag_ids: jax.Array, state_id: jax.Array, balance: jax.Array,
            is_stop: jax.Array | bool = False) -> tuple[jax.Array, jax.Array]:
  """Alg. 2 for one token: ``(int8[G] actions, float32 R_{t+1})``.  See the module docstring.

  tag_ids: int32[N_CAND] candidates (PAD = -1); state_id: int32 scalar parser-state id (-1 =
  unseen); balance: float32 R_t including the current allowance; is_stop: bool scalar.
  """
  ids = jnp.asarray(tag_ids, jnp.int32)
  assert ids.shape == (T.N_CAND,), f"tag_ids must be [{T.N_CAND}], got {ids.shape}"
  balance = jnp.asarray(balance, jnp.float32)
  stop = jnp.asarray(is_stop, bool) | _any([ids[c] == T.STOP for c in range(T.N_CAND)])
  a0, floor, prio, crit, unique = resolve(policy, ids)
  G = policy.n_groups
  cost = policy.cost
  floor = [floor[g] for g in range(G)]
  prio = [(prio[g, 0], prio[g, 1]) for g in range(G)]
  a = [jnp.maximum(a0[g], floor[g]) for g in range(G)]               # Eq. 11
  budget = jnp.maximum(balance - policy.gamma(state_id), 0.0)       # B_t
  a = _demote(a, floor, prio, cost, budget)
  promoted = _promote(a, prio, cost, budget)
  a = [jnp.where(stop, Act.R, jnp.where(crit & unique, p, x)) for p, x in zip(promoted, a)]
  new_balance = jnp.where(stop, balance, balance - _cost_sum(cost, a) + policy.allowance)
  return jnp.stack(a).astype(jnp.int8), new_balance


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
