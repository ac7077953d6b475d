"""The RDR controller (pask_jax.spherical.rdr): the byte budget holds (or the floors' deficit is
reported), protected items keep their tier, a larger budget never raises distortion, down-tier
comes before drop, plans match a numpy greedy oracle and a brute-force optimum on tiny cases, the
vmapped batch equals per-row calls, and one compile serves every budget and prompt length."""
import functools
import itertools
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import spherical
from pallas_kernels.sph_types import TierSpec
from pask_jax.spherical import rdr

pytestmark = pytest.mark.fast_compile

D = 64
TIERS = (TierSpec("A2", "bf16", D), TierSpec("A42", "bf16", D), TierSpec("A4", "bf16", D))
K = len(TIERS)
LAYERS = (3, 2)
COST, DENSE = rdr.costs(TIERS, LAYERS, page=16)
T, G, H, W, SINK = 24, len(LAYERS), 2, 4, 2

_traces = []


def _batch(dist, n, rho, protect):
  _traces.append(1)
  return rdr.solve_batch(dist, COST, DENSE, n, rho, protect, window=W, sink=SINK)


solve_batch = jax.jit(_batch)
solve_row = jax.jit(functools.partial(rdr.solve, window=W, sink=SINK),
                    static_argnames=("protect_dense",))


def _dist(rng, shape, *, monotone=True):
  """D_i(t) [..., K+1]: drop worst; ladder falling with cost (or in random order)."""
  scale = rng.uniform(0.05, 2.0, shape[:-1] + (1,))
  lad = rng.uniform(0.01, 1.0, shape[:-1] + (shape[-1] - 1,))
  lad = -np.sort(-lad, axis=-1) if monotone else lad
  drop = lad.max(-1, keepdims=True) + rng.uniform(0.1, 2.0, shape[:-1] + (1,))
  return (scale * np.concatenate([drop, lad], -1)).astype(np.float32)


def _bytes(route, cost, dense, n, protect_dense=False):
  """Bytes of a plan per group, in float64: sinks and window at the dense cost, the rest at C(t),
  the BF16 pool at the dense cost."""
  Tn, Gn, Hn = route.shape
  out = np.zeros(Gn)
  for g in range(Gn):
    for i in range(n):
      for h in range(Hn):
        r = int(route[i, g, h])
        fixed = i < SINK or i >= n - W
        out[g] += dense[g] if fixed or r == K + 1 else cost[g, r]
  return out


def _distortion(route, dist, free):
  lad = np.minimum(route, K).astype(int)
  return np.where(free, np.take_along_axis(dist, lad[..., None], -1)[..., 0], 0.0).sum()


def _free(n, protect):
  i = np.arange(protect.shape[0])[:, None, None]
  return (i < n) & (i >= SINK) & (i < n - W) & ~protect


def _rho(n, protect, frac, g=0):
  """The budget fraction at which group g's free items get ``frac`` of their all-b_max bytes."""
  fixed = DENSE[g] * H * min(n, SINK + W) + COST[g, K] * _prot(n, protect)[:, g].sum()
  return np.float32((fixed + frac * COST[g, K] * _free(n, protect)[:, g].sum())
                    / (n * H * DENSE[g]))


def _prot(n, protect):
  i = np.arange(protect.shape[0])[:, None, None]
  return (i >= SINK) & (i < n - W) & protect


def test_costs_from_format():
  for g, n in enumerate(LAYERS):
    assert COST[g, 0] == 0
    for k, ts in enumerate(TIERS):
      assert COST[g, k + 1] == np.float32(spherical.item_bytes(ts.layout, D, n, ts.values, 16))
    assert DENSE[g] == n * 4 * D
  with pytest.raises(ValueError, match="ascend"):
    rdr.costs(TIERS[::-1], LAYERS)
  with pytest.raises(ValueError, match="layers"):
    rdr.costs(TIERS, [0])


def test_budget_protection_and_order():
  rng = np.random.default_rng(1)
  B = 4
  seen = set()
  for frac in (-0.2, 0.3, 0.8, 0.93, 0.97, 1.1):
    dist = _dist(rng, (B, T, G, H, K + 1))
    n = rng.integers(W + SINK + 2, T + 1, B).astype(np.int32)
    protect = rng.random((B, T, G, H)) < 0.15
    rhos = np.asarray([_rho(n[b], protect[b], frac) for b in range(B)], np.float32)
    plan = jax.device_get(solve_batch(dist, n, rhos, protect))
    for b in range(B):
      rho = rhos[b]
      route, nb = plan.route[b], int(n[b])
      i = np.arange(T)
      prot = protect[b] & (i >= SINK)[:, None, None] & (i < nb - W)[:, None, None]
      free = _free(nb, protect[b])
      # Sinks in the BF16 pool, window and protected items at b_max, padding dropped.
      assert (route[:SINK] == K + 1).all()
      assert (route[nb - W:nb] == K).all()
      assert (route[prot] == K).all()
      assert (route[nb:] == 0).all()
      np.testing.assert_array_equal(plan.prot[b], prot)
      assert (route[free] <= K).all()
      got = _bytes(route, COST, DENSE, nb)
      np.testing.assert_allclose(plan.bytes[b], got, rtol=1e-6)
      budget = rho * nb * H * DENSE
      np.testing.assert_allclose(plan.budget[b], budget, rtol=1e-6)
      fixed = _bytes(np.where(free, 0, route), COST, DENSE, nb)
      for g in range(G):
        if fixed[g] <= plan.budget[b][g]:
          assert got[g] <= plan.budget[b][g] and plan.deficit[b][g] == 0
        else:   # the floors alone exceed the budget: every free item dropped, deficit reported
          assert (route[:, g][free[:, g]] == 0).all()
          np.testing.assert_allclose(plan.deficit[b][g], fixed[g] - plan.budget[b][g],
                                     atol=1e-6 * fixed[g])
        # Down-tier before drop: a drop means every free item of the group is at t1 or dropped.
        rg = route[:, g][free[:, g]]
        if (rg == 0).any():
          assert (rg <= 1).all()
        seen.add("deficit" if plan.deficit[b][g] > 0 else "drop" if (rg == 0).any() else
                 "down" if (rg < K).any() else "top")
        assert plan.lam[b][g] >= 0   # distortion per byte at the cut
  assert seen == {"deficit", "drop", "down", "top"}


def test_protect_dense_routes_whole_token():
  rng = np.random.default_rng(2)
  dist = _dist(rng, (T, G, H, K + 1))
  protect = rng.random((T, G, H)) < 0.2
  plan = jax.device_get(solve_row(dist, COST, DENSE, 20, 0.5, protect, protect_dense=True))
  i = np.arange(T)
  mid = (i >= SINK) & (i < 20 - W)
  any_h = protect.any(-1, keepdims=True) & mid[:, None, None]
  assert (plan.route[np.broadcast_to(any_h, protect.shape)] == K + 1).all()
  assert (plan.route[:SINK] == K + 1).all() and (plan.route[16:20] == K + 1).all()
  assert (plan.route[20:] == 0).all()
  np.testing.assert_allclose(plan.bytes, _bytes(plan.route, COST, DENSE, 20), rtol=1e-6)


def test_larger_budget_never_raises_distortion():
  rng = np.random.default_rng(3)
  for monotone in (True, False):
    dist = _dist(rng, (T, G, H, K + 1), monotone=monotone)
    protect = rng.random((T, G, H)) < 0.1
    n = int(rng.integers(12, T + 1))
    rhos = np.asarray([_rho(n, protect, f) for f in np.linspace(0.0, 1.02, 41)], np.float32)
    B = len(rhos)
    plan = jax.device_get(solve_batch(np.broadcast_to(dist, (B,) + dist.shape),
                                      np.full(B, n, np.int32), rhos,
                                      np.broadcast_to(protect, (B,) + protect.shape)))
    free = _free(n, protect)
    tot = [_distortion(plan.route[b], dist, free) for b in range(B)]
    assert np.all(np.diff(tot) <= 1e-6 * max(tot)), tot
    assert np.all(np.diff(plan.bytes, axis=0) >= -1e-3)
    assert tot[0] > tot[-1]   # the sweep spans drops to full precision


# ---- numpy oracle -----------------------------------------------------------------------------

def _hull_np(c, d):
  """Lower convex hull vertices (indices, ascending cost) of points (c, d), collinear kept."""
  out = []
  for j in range(len(c)):
    while len(out) >= 2:
      o, a = out[-2], out[-1]
      cross = (c[a] - c[o]) * (d[j] - d[o]) - (d[a] - d[o]) * (c[j] - c[o])
      if cross < 0:
        out.pop()
      else:
        break
    out.append(j)
  return out


def _oracle(dist, cost, dense, n, rho, protect):
  """§2.4's two-phase greedy with explicit loops, float64."""
  Tn, Gn, Hn, _ = dist.shape
  dist = dist.astype(np.float64)
  free = _free(n, protect)
  route = np.zeros((Tn, Gn, Hn), int)
  lams = np.zeros(Gn)
  for g in range(Gn):
    c = cost[g].astype(np.float64)
    fixed = sum(dense[g] * Hn for i in range(n) if i < SINK or i >= n - W)
    fixed += sum(c[K] for i in range(n) for h in range(Hn) if protect[i, g, h] and not
                 (i < SINK or i >= n - W))
    avail = np.float32(np.float32(rho) * np.float32(n * Hn) * dense[g]) - fixed
    steps, cur, excess = [], {}, -avail
    for h in range(Hn):
      for i in range(Tn):
        if not free[i, g, h]:
          continue
        d = dist[i, g, h, 1:]
        start = int(np.argmin(d))
        verts = _hull_np(c[1:start + 2], d[:start + 1])
        cur[(h, i)] = start
        excess += c[1 + start]
        run = -np.inf
        for s, (lo, hi) in enumerate(zip(verts[-2::-1], verts[::-1])):
          r = (d[lo] - d[hi]) / (c[1 + hi] - c[1 + lo])
          run = max(run, r)
          steps.append((run, h, i, s, c[1 + hi] - c[1 + lo], lo))
    steps.sort(key=lambda x: x[:4])
    saved = 0.0
    for r, h, i, s, sv, lo in steps:
      if saved >= excess:
        break
      cur[(h, i)] = lo
      saved += sv
      lams[g] = r
    rest = excess - saved
    items = sorted(cur, key=lambda hi: ((dist[hi[1], g, hi[0], 0] - dist[hi[1], g, hi[0], 1])
                                        / c[1], hi))
    saved = 0.0
    for h, i in items:
      if saved >= rest:
        break
      cur[(h, i)] = -1
      saved += c[1]
      lams[g] = (dist[i, g, h, 0] - dist[i, g, h, 1]) / c[1]
    for (h, i), t in cur.items():
      route[i, g, h] = t + 1
  return route, lams


@pytest.mark.parametrize("seed", range(6))
def test_matches_numpy_oracle(seed):
  rng = np.random.default_rng(100 + seed)
  Tn = 16
  dist = _dist(rng, (Tn, G, H, K + 1), monotone=seed % 2 == 0)
  protect = rng.random((Tn, G, H)) < 0.1
  n = int(rng.integers(10, Tn + 1))
  for frac in (0.5, 0.9, 0.95, 0.98, 1.0):
    rho = _rho(n, protect, frac + rng.uniform(-0.01, 0.01), g=seed % G)
    plan = jax.device_get(solve_row(dist, COST, DENSE, n, rho, protect))
    want, lam = _oracle(dist, COST, DENSE, n, rho, protect)
    free = _free(n, protect)
    np.testing.assert_array_equal(np.where(free, plan.route, 0), want)
    np.testing.assert_allclose(plan.lam, lam, rtol=1e-5)


@pytest.mark.parametrize("seed", range(4))
def test_phase_a_is_optimal_for_its_bytes(seed):
  """Without drops the greedy cut minimizes D + λC, so on any subset of items no ladder
  assignment with at most the plan's bytes there has less distortion (brute force, 3^6)."""
  rng = np.random.default_rng(200 + seed)
  Tn = n = 12
  dist = _dist(rng, (Tn, G, H, K + 1), monotone=seed < 2)
  protect = np.zeros((Tn, G, H), bool)
  free = _free(n, protect)
  idx = [tuple(x) for x in np.argwhere(free[:, 0])][::2]     # 6 of group 0's 12 free items
  c = COST[0].astype(np.float64)
  checked = 0
  for frac in np.linspace(0.88, 1.0, 13):
    rho = _rho(n, protect, frac)
    plan = jax.device_get(solve_row(dist, COST, DENSE, n, rho, protect))
    r0 = plan.route[:, 0]
    if (r0[free[:, 0]] == 0).any() or (r0[free[:, 0]] == K).all():
      continue   # phase B, or nothing to cut
    cap = sum(c[r0[i, h]] for i, h in idx)
    best = min(sum(float(dist[i, 0, h, t]) for (i, h), t in zip(idx, ts))
               for ts in itertools.product(range(1, K + 1), repeat=len(idx))
               if sum(c[t] for t in ts) <= cap)
    got = sum(float(dist[i, 0, h, r0[i, h]]) for i, h in idx)
    assert got <= best + 1e-6 * abs(best)
    checked += 1
  assert checked >= 3


def test_batch_equals_rows_and_compiles_once():
  rng = np.random.default_rng(4)
  before = len(_traces)
  B = 3
  for _ in range(3):
    dist = _dist(rng, (B, T, G, H, K + 1))
    n = rng.integers(1, T + 1, B).astype(np.int32)
    rho = rng.uniform(0.0, 1.0, B).astype(np.float32)
    protect = rng.random((B, T, G, H)) < 0.1
    plan = jax.device_get(solve_batch(dist, n, rho, protect))
    for b in range(B):
      one = jax.device_get(solve_row(dist[b], COST, DENSE, n[b], rho[b], protect[b]))
      for name, x, y in zip(one._fields, one, plan):
        np.testing.assert_array_equal(x, y[b], err_msg=name)
  assert len(_traces) - before == 1   # budgets and lengths are traced: one trace in all


@pytest.mark.parametrize("seed", range(3))
def test_shared_tiers_route_all_heads_alike(seed):
  """``shared``: every head of a (token, group) takes the route the oracle gives the summed
  problem (one item per (token, group): distortions summed, H times the cost, protected if any
  head is); bytes and budget in the per-head problem's units, so the budget holds."""
  rng = np.random.default_rng(300 + seed)
  Tn = 16
  dist = _dist(rng, (Tn, G, H, K + 1), monotone=seed % 2 == 0)
  protect = rng.random((Tn, G, H)) < 0.08
  n = int(rng.integers(10, Tn + 1))
  d1, p1 = dist.sum(2, keepdims=True), protect.any(2, keepdims=True)
  pb = np.broadcast_to(p1, protect.shape)
  shared = jax.jit(functools.partial(rdr.solve, window=W, sink=SINK, shared=True))
  for frac in (0.4, 0.8, 0.95, 1.0):
    rho = _rho(n, pb, frac + rng.uniform(-0.01, 0.01), g=seed % G)
    plan = jax.device_get(shared(dist, COST, DENSE, n, rho, protect))
    assert plan.route.shape == (Tn, G, H)
    assert np.all(plan.route == plan.route[..., :1]) and np.all(plan.prot == plan.prot[..., :1])
    want, lam = _oracle(d1, COST * H, DENSE * H, n, rho, p1)
    np.testing.assert_array_equal(np.where(_free(n, p1), plan.route[..., :1], 0), want)
    np.testing.assert_allclose(plan.lam, lam, rtol=1e-5)
    np.testing.assert_allclose(plan.bytes, _bytes(plan.route, COST, DENSE, n), rtol=1e-6)
    np.testing.assert_allclose(plan.budget, rho * n * H * DENSE, rtol=1e-6)
    assert np.all(plan.bytes <= plan.budget * (1 + 1e-6)) or np.any(plan.deficit > 0)
    np.testing.assert_array_equal(plan.prot, pb & _free(n, np.zeros_like(pb)))
  with pytest.raises(ValueError, match="protect"):
    rdr.solve(dist, COST, DENSE, 10, 0.5, np.zeros((Tn, G), bool), window=W, shared=True)


def test_shared_gate_routes_all_heads_alike():
  rng = np.random.default_rng(8)
  B = 4
  dist = _dist(rng, (B, G, H, K + 1))
  lam = rng.uniform(0, 1e-3, (B, G)).astype(np.float32)
  bal = (rng.uniform(0.3, 1.2, (B, G)) * H * COST[:, K]).astype(np.float32)
  elig = np.asarray([True, True, False, True])
  route, want, left = jax.device_get(rdr.gate(dist, COST, lam, bal, elig, shared=True))
  r1, w1, l1 = jax.device_get(rdr.gate(dist.sum(2, keepdims=True), COST * H, lam, bal, elig))
  np.testing.assert_array_equal(route, np.broadcast_to(r1, route.shape))
  np.testing.assert_array_equal(want, np.broadcast_to(w1, want.shape))
  np.testing.assert_array_equal(left, l1)
  for b in range(B):   # brute force: the summed problem's argmin, then the highest cap that fits
    for g in range(G):
      score = dist[b, g].sum(0) + lam[b, g] * H * COST[g]
      w = int(np.argmin(score))
      fits = [c for c in range(K + 1) if H * COST[g, min(w, c)] <= bal[b, g]]
      r = min(w, max(fits)) if elig[b] else 0
      assert want[b, g].tolist() == [w] * H and route[b, g].tolist() == [r] * H
  paid = np.take_along_axis(np.broadcast_to(COST[None, :, None], route.shape[:3] + (K + 1,)),
                            route[..., None].astype(int), -1)[..., 0].sum(-1)
  np.testing.assert_allclose(bal - left, np.where(elig[:, None], paid, 0.0), rtol=1e-6)
  assert np.all(left >= 0)


def test_compact_ladder_keeps_bf16_values_for_protected_items():
  """The compact ladder (A42/int4 < A4/int4 < A4/bf16): A4's two tiers distort keys alike, so
  a free item starts at the cheaper one (the BF16-value tier is never worth its bytes to RDR's
  key distortion) and only protected items reach the top tier."""
  tiers = (TierSpec("A42", "int4", D), TierSpec("A4", "int4", D), TierSpec("A4", "bf16", D))
  cost, dense = rdr.costs(tiers, LAYERS, page=16)
  assert [t.name for t in tiers] == ["A42/int4", "A4/int4", "A4"]
  rng = np.random.default_rng(9)
  dist = _dist(rng, (T, G, H, 4))
  dist[..., 3] = dist[..., 2]                      # same key code: same distortion
  protect = rng.random((T, G, H)) < 0.1
  n = T
  plan = jax.device_get(rdr.solve(dist, cost, dense, n, 1.0, protect, window=W, sink=SINK))
  free = _free(n, protect)
  assert np.all(plan.route[free] == 2) and np.all(plan.route[_prot(n, protect)] == 3)


def test_distortion_formula():
  rng = np.random.default_rng(5)
  et = rng.uniform(0.1, 1, (T, G, H, K + 1)).astype(np.float32)
  er = rng.uniform(0.1, 1, (T, G, H, K + 1)).astype(np.float32)
  u, s = rng.uniform(0.5, 2, (G, H)), rng.uniform(0, 1, (G, H))
  seg = rng.integers(0, 3, T)
  got = np.asarray(rdr.distortion(et, er, jnp.asarray(u), jnp.asarray(s), seg, alpha_theta=0.7,
                                  alpha_r=1.3, kappa_drop=0.5))
  om = np.array([1.0, 1.0, 2.0])[seg][:, None, None, None]
  want = om * (0.7 * u[..., None] * et + 1.3 * (1 - s[..., None]) * er)
  want[..., 0] *= 0.5
  np.testing.assert_allclose(got, want, rtol=1e-5)


def test_protect_mask():
  rng = np.random.default_rng(6)
  Tn, n, sink, win = 200, 160, 2, 8
  att = rng.random((Tn, G, H)).astype(np.float32)
  att[:sink] += 5.0        # sinks draw the most mass but are not candidates
  rad = rng.uniform(1, 2, (Tn, G, H)).astype(np.float32)
  rad[7, 0, 1] = 50.0
  rad[190, 1, 0] = 50.0    # padding: never protected
  got = np.asarray(rdr.protect_mask(att, rad, n, sink=sink, window=win))
  assert not got[n:].any()
  assert got[7, 0, 1]
  for g in range(G):
    for h in range(H):
      cand = att[sink:n - win, g, h]
      top = set(sink + np.argsort(-cand, kind="stable")[:3])   # floor(0.02 * 150) = 3
      med = np.sort(rad[:n, g, h])[(n - 1) // 2]
      want = {i for i in range(n) if i in top or rad[i, g, h] > 4 * med}
      assert set(np.flatnonzero(got[:, g, h])) == want


def test_bad_input_is_refused():
  dist = _dist(np.random.default_rng(7), (T, G, H, K + 1))
  with pytest.raises(ValueError, match="dist"):
    rdr.solve(dist[0], COST, DENSE, 10, 0.5, window=W)
  with pytest.raises(ValueError, match="cost"):
    rdr.solve(dist, COST[:, :2], DENSE, 10, 0.5, window=W)
  with pytest.raises(ValueError, match="ascend"):
    rdr.solve(dist, COST[:, ::-1], DENSE, 10, 0.5, window=W)
  with pytest.raises(ValueError, match="protect"):
    rdr.solve(dist, COST, DENSE, 10, 0.5, np.zeros((T, G), bool), window=W)
