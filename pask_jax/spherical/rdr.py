"""The RDR controller (docs/SPHERICAL_KV.md §2.4): for one sequence's items (token i, layer
group g, KV head h), choose each item's route — drop or a tier of the ladder — under a byte budget,
down-tiering before dropping.  Pure and jittable; :func:`solve_batch` vmaps it over the batch with
traced budgets ``rho [B]`` and prompt lengths ``n [B]`` (padded token axis, so one compile serves
every budget and length).  Imports nothing of PASK's controller.

Routes follow :mod:`.cache`: 0 = drop, k ∈ 1..K = tier k (the ladder, ascending item cost), K + 1 =
the BF16 pool.  Inputs, per sequence (T padded tokens, G groups, H KV heads, K tiers)::

  dist  [T, G, H, K+1] f32  D_i(t); column 0 = drop, κ_drop applied (:func:`distortion`)
  cost  [G, K+1]       f32  item cost C(t) of group g, drop = 0, metadata counted (:func:`costs`)
  dense [G]            f32  dense BF16 K+V bytes of one (token, group, head): layers_g · 4D
  n                    i32  prompt tokens; tokens i ≥ n are padding (route 0, no bytes)
  rho                  f32  budget as a fraction of dense

**Budget** (per group, §2.4): ``B_g = rho · n · H · dense_g``.  Fixed bytes come off first: sinks
(i < ``sink``, BF16 pool) and the window (the last ``window`` prompt tokens, held in BF16) at the
dense cost, protected items at C(K) (``protect_dense``: at the dense cost, in the BF16 pool).  The
free items share ``A_g = B_g − fixed``.  Guarantee: the free items' bytes are ≤ max(A_g, 0), so
``bytes_g ≤ B_g`` unless the fixed bytes alone exceed it; then every free item is dropped and the
shortfall is reported as ``deficit_g`` (floors beat the budget, never hidden).  Sums are f32: exact
while they are multiples of 1/8 byte below 2^21 bytes (the item costs of :func:`costs` with
``page`` a power of two ≤ 32 are), beyond that up to f32 rounding (relative ~1e-6: a few bytes per
megabyte of budget).

**Solver** (per group; sort + cumsum, no loops over items):
phase A — every free item starts at its *start tier*, the cheapest ladder tier of least distortion
(b_max whenever distortion falls strictly up the ladder, the normal case [ours: a measured ladder
need not be monotone, and a tier that costs more and distorts more is never worth keeping]).  Its
down-steps follow the lower convex hull of {(C(t), D_i(t)) : 1 ≤ t ≤ start} (collinear points kept
as vertices), each with ratio ΔD/ΔC (distortion added per byte saved; a running max down the chain
guards against rounding so an item's steps stay in order).  All steps of the group are sorted by
ratio ascending, ties by (h, i, step from the top) [ours: §2.4's (g, h, i) within one group]; the
shortest prefix whose savings cover the excess ``Σ C(start) − A_g`` is taken.
Phase B — only if every free item is at t1 and still over: drop in ascending
``ν_i = (D_i(t0) − D_i(t1)) / C(t1)`` order, ties by (h, i), the shortest prefix covering the rest.
``lam_g`` is the ratio at the cut (the last phase-A step's ratio or the last drop's ν; 0 if nothing
had to go).  A larger budget never raises the total distortion provided D_i(t0) ≥ D_i(t1) (a drop
never helps; §2.4's model gives that unless κ_drop is far below 1: a drop counts ‖·‖² = 2 and
(r − r̃)² = r² against a tier's ≈ 2·E[1 − cos] ≤ 0.22).

Protected items (sinks, the window, the optional ``protect`` mask — the top-mass and radius
outliers of :func:`protect_mask`, PASK floor tags for "RDR+tags") are never dropped or demoted:
sinks route to the BF16 pool, the others to tier K (``protect_dense``: the BF16 pool; there a
(token, group) with any protected head is protected on every head, since that pool stores all
heads).  Window tokens get their route now like any protected item [ours: the decode rule may still
re-route them when they leave the window].

**Decode gate** (:func:`gate`, §2.4's rule ``gated``, ablation A5): when a generated token leaves
the window, each of its items takes ``argmin_t D_i(t) + λ_g C(t)`` (drop included; ties to the
cheaper route), ``D_i`` from the attention the token received while in the window; the
(token, group) then fits the balance by capping every head's tier at the highest cap whose cost
fits (down-tier before drop; cap 0 drops all).

Not here (the caller's business): whether a tier's pool has room (the cache drops an item that does
not fit and sets ``overflow``), the balance's income, and the ``rdr="box"`` variant.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import spherical
from pallas_kernels.sph_types import TierSpec


class Plan(NamedTuple):
  """What :func:`solve` decided for one sequence (a leading [B] axis from :func:`solve_batch`)."""
  route: jax.Array    # [T, G, H] int8: 0 drop, k tier k, K + 1 BF16 pool
  prot: jax.Array     # [T, G, H] bool: protected by the ``protect`` mask (flag bit for the cache)
  lam: jax.Array      # [G] f32: distortion per byte at the cut
  bytes: jax.Array    # [G] f32: bytes of the plan (fixed + free items)
  budget: jax.Array   # [G] f32: B_g
  deficit: jax.Array  # [G] f32: max(0, bytes − budget), > 0 only when the floors exceed B_g


def costs(tiers, layers, page: int = 16) -> tuple[np.ndarray, np.ndarray]:
  """Item costs of the ladder ``tiers`` (:class:`TierSpec`, ascending cost) for groups of
  ``layers[g]`` layers -> (cost [G, K+1] f32 with drop = 0, dense [G] f32), from the format
  module's byte sizes with metadata (position, flag bit, page-table entry share) counted."""
  tiers = tuple(tiers)
  if not tiers or not all(isinstance(t, TierSpec) for t in tiers):
    raise ValueError(f"tiers must be a non-empty sequence of TierSpec, got {tiers!r}")
  if len({t.d for t in tiers}) > 1:
    raise ValueError(f"every tier must share the head dim, got {[t.d for t in tiers]}")
  layers = [int(x) for x in layers]
  if not layers or min(layers) < 1:
    raise ValueError(f"layers must be a non-empty list of counts >= 1, got {layers}")
  cost = np.asarray([[0.0] + [spherical.item_bytes(t.layout, t.d, n, t.values, page)
                              for t in tiers] for n in layers], np.float32)
  if np.any(np.diff(cost[:, 1:], axis=1) <= 0):
    raise ValueError(f"the ladder's item costs must ascend, got {cost[0, 1:].tolist()}")
  dense = np.asarray([n * spherical.dense_bytes(tiers[0].d) for n in layers], np.float32)
  return cost, dense


def distortion(eps_theta, eps_r, reuse, stability, seg, *, omega=(1.0, 1.0, 2.0),
               alpha_theta: float = 1.0, alpha_r: float = 1.0, kappa_drop: float = 1.0):
  """§2.4's ``D_i(t) = ω_seg(i)·(α_θ û_{g,h} ε^θ_i(t) + α_r (1 − ŝ_{g,h}) ε^r_i(t))``, column 0
  (drop) times ``kappa_drop``.  eps_theta, eps_r ``[T, G, H, K+1]`` (attention-weighted, column 0
  the drop errors); reuse û, stability ŝ ``[G, H]``; seg int ``[T]`` (0 prefix, 1 retrieved,
  2 recent) indexing ``omega``."""
  om = jnp.asarray(omega, jnp.float32)[jnp.asarray(seg, jnp.int32)]
  d = (alpha_theta * reuse[..., None] * eps_theta
       + alpha_r * (1.0 - stability[..., None]) * eps_r) * om[:, None, None, None]
  return d.at[..., 0].multiply(kappa_drop)


def protect_mask(att, radius, n, *, sink: int = 0, window: int = 0, top: float = 0.02,
                 outlier: float = 4.0):
  """§2.4's rule-based protection for one sequence -> bool [T, G, H], False on padding: per
  (g, h) the top ``floor(top · m)`` of the m candidate items by attention mass ``att [T, G, H]``
  (ties to the earlier token), and radius outliers ``radius > outlier · median`` (the lower median
  over the valid items of ``radius [T, G, H]``, e.g. the mean over the group's layers).  Candidates
  are the valid tokens outside the first ``sink`` and the last ``window`` [ours: those are
  protected anyway, and sinks would take the top slots]."""
  T = att.shape[0]
  n = jnp.asarray(n, jnp.int32)
  i = jnp.arange(T)
  valid = (i < n)[:, None, None]
  cand = (i >= sink) & (i < n - window)
  a = jnp.where(cand[:, None, None], att, -jnp.inf)
  order = jnp.argsort(-a, axis=0, stable=True)
  rank = jnp.argsort(order, axis=0)
  m = jnp.sum(cand).astype(jnp.float32)
  hot = cand[:, None, None] & (rank < jnp.floor(top * m).astype(jnp.int32))
  r = jnp.sort(jnp.where(valid, radius, jnp.inf), axis=0)
  med = jnp.take(r, jnp.maximum((n - 1) // 2, 0), axis=0)
  return valid & (hot | (radius > outlier * med))


def _hull(dl, cl):
  """Lower convex hull of the ladder points up to the start tier, per item.  dl [..., K], cl [K]
  -> (start [...], vertex [..., K] bool, prev [..., K] int: the next vertex below tier j)."""
  K = dl.shape[-1]
  start = jnp.argmin(dl, axis=-1)                   # first minimum = the cheapest
  idx = jnp.arange(K)
  allowed = idx <= start[..., None]
  vertex = [allowed[..., j] for j in range(K)]
  for j in range(1, K - 1):
    for a in range(j):
      for b in range(j + 1, K):
        line = dl[..., a] + (dl[..., b] - dl[..., a]) * ((cl[j] - cl[a]) / (cl[b] - cl[a]))
        vertex[j] = vertex[j] & ~(allowed[..., b] & (dl[..., j] > line))
  prev, below = [], jnp.zeros(start.shape, jnp.int32)
  for j in range(K):
    prev.append(below)
    below = jnp.where(vertex[j], j, below)
  return start, jnp.stack(vertex, -1), jnp.stack(prev, -1)


def _allocate(d, c, free, avail):
  """One group: d [T, H, K+1], c [K+1], free [T, H], avail scalar -> (ladder route [T, H] int32 in
  0..K, lam)."""
  T, H, K1 = d.shape
  K = K1 - 1
  dl, cl = d[..., 1:], c[1:]
  start, vertex, prev = _hull(dl, cl)
  # Down-steps, one slot per upper vertex j = K-1 .. 1 (top first: the tie order within an item).
  js = list(range(K - 1, 0, -1))
  ratios, saves, oks, lows = [], [], [], []
  run = jnp.full((T, H), -jnp.inf, jnp.float32)
  for j in js:
    p = prev[..., j]
    ok = free & vertex[..., j] & (j <= start)
    dc = cl[j] - cl[p]
    r = (jnp.take_along_axis(dl, p[..., None], -1)[..., 0] - dl[..., j]) / dc
    run = jnp.where(ok, jnp.maximum(run, r), run)
    ratios.append(jnp.where(ok, run, jnp.inf))
    saves.append(jnp.where(ok, dc, 0.0))
    oks.append(ok)
    lows.append(p)
  flat = lambda xs: jnp.transpose(jnp.stack(xs, -1), (1, 0, 2)).reshape(-1)   # (h, i, step)
  c_start = jnp.where(free, cl[start], 0.0)
  excess = jnp.sum(c_start) - avail
  lowest = start
  lam = jnp.float32(0.0)
  total_a = jnp.float32(0.0)
  if js:
    ratio, save, ok = flat(ratios), flat(saves), flat(oks)
    order = jnp.argsort(ratio, stable=True)
    s_save = save[order]
    before = jnp.cumsum(s_save) - s_save
    take_s = ok[order] & (before < excess)
    n_take = jnp.sum(take_s)
    lam = jnp.where(n_take > 0, ratio[order][jnp.maximum(n_take - 1, 0)], 0.0)
    take = jnp.zeros_like(take_s).at[order].set(take_s)
    take = jnp.transpose(take.reshape(H, T, len(js)), (1, 0, 2))
    for s in range(len(js)):
      lowest = jnp.where(take[..., s], jnp.minimum(lowest, lows[s]), lowest)
    total_a = jnp.sum(save)
  rest = excess - total_a
  nu = (d[..., 0] - d[..., 1]) / c[1]
  nu_f = jnp.where(free, nu, jnp.inf).T.reshape(-1)                         # (h, i)
  order = jnp.argsort(nu_f, stable=True)
  s_save = jnp.where(free.T.reshape(-1), c[1], 0.0)[order]
  before = jnp.cumsum(s_save) - s_save
  drop_s = free.T.reshape(-1)[order] & (before < rest) & (rest > 0)
  n_drop = jnp.sum(drop_s)
  drop = jnp.zeros_like(drop_s).at[order].set(drop_s).reshape(H, T).T
  lam = jnp.where(n_drop > 0, nu_f[order][jnp.maximum(n_drop - 1, 0)], lam)
  route = jnp.where(drop, 0, lowest + 1)
  return route, lam


def _share(dist, cost, dense, protect):
  """The shared-tier problem: one item per (token, group) standing for its H heads — their
  distortions summed, costs and dense bytes times H, protected if any head is."""
  H = dist.shape[-2]
  prot = None if protect is None else jnp.any(jnp.asarray(protect, bool), axis=-1,
                                               keepdims=True)
  return (jnp.sum(dist, axis=-2, keepdims=True), jnp.asarray(cost, jnp.float32) * H,
          jnp.asarray(dense, jnp.float32) * H, prot)


def solve(dist, cost, dense, n, rho, protect=None, *, window: int, sink: int = 0,
          protect_dense: bool = False, shared: bool = False) -> Plan:
  """The RDR prefill plan of one sequence (module docstring); ``window`` and ``sink`` are
  static token counts, ``n`` and ``rho`` may be traced, ``protect`` is an optional bool
  ``[T, G, H]`` of extra protected items.  ``shared`` (static; the per-head vs shared tiers
  ablation of §4): every KV head of a (token, group) takes one route, chosen for the sum of the
  heads' distortions at H times the item cost (protected if any head is); the budget, the bytes
  and λ are those of the per-head problem's units."""
  dist = jnp.asarray(dist, jnp.float32)
  if dist.ndim != 4 or dist.shape[-1] < 2:
    raise ValueError(f"dist must be [T, G, H, K+1] with K >= 1, got {dist.shape}")
  if shared:   # checked here, where the costs are still the per-head ones
    T, G, H, K1 = dist.shape
    if jnp.shape(cost) != (G, K1) or jnp.shape(dense) != (G,):
      raise ValueError(f"cost must be [G, K+1] = {(G, K1)} and dense [G] = {(G,)}, "
                       f"got {jnp.shape(cost)} and {jnp.shape(dense)}")
    if protect is not None and jnp.shape(protect) != (T, G, H):
      raise ValueError(f"protect must be [T, G, H] = {(T, G, H)}, got {jnp.shape(protect)}")
    d1, c1, dense1, p1 = _share(dist, cost, dense, protect)
    plan = solve(d1, c1, dense1, n, rho, p1, window=window, sink=sink,
                 protect_dense=protect_dense)
    wide = lambda x: jnp.broadcast_to(x, (T, G, H))
    return plan._replace(route=wide(plan.route), prot=wide(plan.prot))
  T, G, H, K1 = dist.shape
  K = K1 - 1
  cost = jnp.asarray(cost, jnp.float32)
  dense = jnp.asarray(dense, jnp.float32)
  if cost.shape != (G, K1) or dense.shape != (G,):
    raise ValueError(f"cost must be [G, K+1] = {(G, K1)} and dense [G] = {(G,)}, "
                     f"got {cost.shape} and {dense.shape}")
  if window < 0 or sink < 0:
    raise ValueError(f"window and sink must be >= 0, got {window}, {sink}")
  try:
    ladder = np.asarray(cost)[:, 1:]
  except jax.errors.TracerArrayConversionError:
    ladder = None   # traced costs: the caller vouches for the order
  if ladder is not None and np.any(np.diff(ladder, axis=1) <= 0):
    raise ValueError(f"the ladder's item costs must ascend per group, got {ladder.tolist()}")
  n = jnp.asarray(n, jnp.int32)
  i = jnp.arange(T)
  valid = i < n
  is_sink = valid & (i < sink)
  in_win = valid & (i >= n - window) & ~is_sink
  fixed_tok = (is_sink | in_win)[:, None, None]
  if protect is None:
    prot = jnp.zeros((T, G, H), bool)
  else:
    protect = jnp.asarray(protect, bool)
    if protect.shape != (T, G, H):
      raise ValueError(f"protect must be [T, G, H] = {(T, G, H)}, got {protect.shape}")
    prot = protect & valid[:, None, None] & ~fixed_tok
    if protect_dense:
      prot = jnp.broadcast_to(jnp.any(prot, axis=-1, keepdims=True), prot.shape)
  free = valid[:, None, None] & ~fixed_tok & ~prot
  nf = n.astype(jnp.float32)
  budget = jnp.asarray(rho, jnp.float32) * nf * H * dense
  n_fixed = jnp.sum(is_sink | in_win).astype(jnp.float32)
  prot_cost = dense if protect_dense else cost[:, K]
  fixed = n_fixed * H * dense + jnp.sum(prot, axis=(0, 2)).astype(jnp.float32) * prot_cost
  avail = budget - fixed
  lad, lam = jax.vmap(_allocate, in_axes=(1, 0, 1, 0))(dist, cost, free, avail)   # [G, T, H]
  lad = jnp.transpose(lad, (1, 0, 2))
  spent = jnp.sum(jnp.where(free, cost[jnp.arange(G)[None, :, None], lad], 0.0), axis=(0, 2))
  k_prot = K + 1 if protect_dense else K
  route = jnp.where(free, lad, 0)
  route = jnp.where(prot | (in_win[:, None, None] & ~is_sink[:, None, None]), k_prot, route)
  if protect_dense:
    route = jnp.where(in_win[:, None, None], K + 1, route)
  route = jnp.where(is_sink[:, None, None], K + 1, route)
  total = fixed + spent
  return Plan(route.astype(jnp.int8), prot, lam, total, budget, jnp.maximum(total - budget, 0.0))


def solve_batch(dist, cost, dense, n, rho, protect=None, *, window: int, sink: int = 0,
                protect_dense: bool = False, shared: bool = False) -> Plan:
  """:func:`solve` vmapped over the batch: dist ``[B, T, G, H, K+1]``, n and rho ``[B]``,
  protect ``[B, T, G, H]`` or None; cost and dense shared.  Jit it with ``window``, ``sink``,
  ``protect_dense`` and ``shared`` static; budgets and lengths stay traced."""
  f = functools.partial(solve, window=window, sink=sink, protect_dense=protect_dense,
                        shared=shared)
  if protect is None:
    return jax.vmap(lambda d, m, r: f(d, cost, dense, m, r))(dist, n, rho)
  return jax.vmap(lambda d, m, r, p: f(d, cost, dense, m, r, p))(dist, n, rho, protect)


def gate(dist, cost, lam, balance, eligible, *, shared: bool = False):
  """The gated decode rule for one leaving token per sequence (module docstring).

  dist ``[B, G, H, K+1]`` (D_i(t), column 0 drop, κ_drop applied), cost ``[G, K+1]`` (per item,
  drop 0), lam ``[B, G]`` (λ_g of the prefill plan), balance ``[B, G]`` (bytes the token may
  spend, its provisional reservation refunded), eligible bool ``[B]`` or ``[B, G]`` (the
  (token, group)s gated).  Returns (route ``[B, G, H]`` int32 in 0..K, the rule's unconstrained
  choice ``[B, G, H]``, balance after paying); what is not eligible gets route 0 and pays
  nothing.  ``shared`` (static): one route for all KV heads of a (token, group), chosen for
  the sum of their distortions at H times the item cost (as :func:`solve`'s).
  Jittable, every input may be traced."""
  dist = jnp.asarray(dist, jnp.float32)
  cost = jnp.asarray(cost, jnp.float32)
  B, G, H, K1 = dist.shape
  if shared:
    route, want, bal = gate(jnp.sum(dist, axis=2, keepdims=True), cost * H, lam, balance,
                            eligible)
    wide = lambda x: jnp.broadcast_to(x, (B, G, H))
    return wide(route), wide(want), bal
  score = dist + jnp.asarray(lam, jnp.float32)[:, :, None, None] * cost[None, :, None, :]
  want = jnp.argmin(score, axis=-1).astype(jnp.int32)                     # [B, G, H]
  caps = jnp.arange(K1)                                                    # cap c: min(want, c)
  capped = jnp.minimum(want[..., None], caps)                              # [B, G, H, K+1]
  c_item = jnp.take_along_axis(jnp.broadcast_to(cost[None, :, None, :], capped.shape), capped,
                               -1)
  spend = jnp.sum(c_item, axis=2)                                          # [B, G, K+1] per cap
  fits = spend <= jnp.asarray(balance, jnp.float32)[..., None]
  cap = jnp.max(jnp.where(fits, caps, 0), axis=-1)                         # [B, G]; 0 always fits
  elig = jnp.broadcast_to(jnp.asarray(eligible, bool).reshape((B, -1)), (B, G))
  route = jnp.where(elig[..., None], jnp.minimum(want, cap[..., None]), 0)
  paid = jnp.where(elig, jnp.take_along_axis(spend, cap[..., None], -1)[..., 0], 0.0)
  return route, want, jnp.asarray(balance, jnp.float32) - paid


def fixed(cost, dense, n, rho, n_tokens: int, n_kv_heads: int, *, tier: int,
          sink: int = 0) -> Plan:
  """The plan without RDR (ablations A2 angle-only and quant-only, §4): every valid token at
  ladder tier ``tier`` (1..K) on every head, sinks in the BF16 pool, nothing dropped, nothing
  protected, for a batch: ``n`` and ``rho`` ``[B]`` (traced), ``n_tokens`` (T) and the head count
  static.  ``bytes`` charges each token where it will live (window tokens at the tier they go
  to); ``deficit`` is what the fixed rate spends beyond ``rho``'s budget (reported, never
  hidden); ``lam`` is 0."""
  cost = jnp.asarray(cost, jnp.float32)
  dense = jnp.asarray(dense, jnp.float32)
  G, K1 = cost.shape
  if not 1 <= tier < K1:
    raise ValueError(f"tier must be a ladder tier in 1..{K1 - 1}, got {tier}")
  if sink < 0:
    raise ValueError(f"sink must be >= 0, got {sink}")
  n = jnp.asarray(n, jnp.int32)
  B, H, Tn = n.shape[0], int(n_kv_heads), int(n_tokens)
  i = jnp.arange(Tn)[None, :]
  valid = i < n[:, None]
  is_sink = valid & (i < sink)
  route = jnp.where(is_sink, K1, jnp.where(valid, tier, 0)).astype(jnp.int8)     # [B, T]
  route = jnp.broadcast_to(route[:, :, None, None], (B, Tn, G, H))
  n_sink = jnp.sum(is_sink, axis=1).astype(jnp.float32)[:, None]                # [B, 1]
  n_rest = n.astype(jnp.float32)[:, None] - n_sink
  total = H * (n_sink * dense + n_rest * cost[:, tier])                          # [B, G]
  budget = jnp.asarray(rho, jnp.float32)[:, None] * n.astype(jnp.float32)[:, None] * H * dense
  zeros = jnp.zeros((B, G), jnp.float32)
  return Plan(route, jnp.zeros(route.shape, bool), zeros, total, budget,
              jnp.maximum(total - budget, 0.0))


__all__ = ["Plan", "costs", "distortion", "fixed", "gate", "protect_mask", "solve",
           "solve_batch"]
