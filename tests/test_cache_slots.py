"""Engine-owned paging in pask_jax.cache: init_paged, insert_slot, release_slot."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from pask_jax import cache as C
from pask_jax.testing import cache as tcache

pytestmark = pytest.mark.fast_compile

L, Hkv, D, W, PAGE, CAP, G = 3, 2, 8, 4, 4, 16, 3
P_HI, P_LO = 10, 9
# jitted: eager scatters over the whole cache cost seconds per call on CPU
append = jax.jit(tcache.append)
materialize = jax.jit(C.materialize_prefill)


def _prompt(seed, n, T=12):
  r = np.random.default_rng(seed)
  k = jnp.asarray(r.normal(size=(L, 1, T, Hkv, D)), jnp.float32)
  v = jnp.asarray(r.normal(size=(L, 1, T, Hkv, D)), jnp.float32)
  plan = jnp.asarray(r.integers(0, 3, size=(1, T, G)), jnp.int8)
  return k, v, plan, jnp.asarray([n], jnp.int32)


def _row(ids, n_pages, pool):
  return jnp.asarray(list(ids) + [pool] * (n_pages - len(ids)), jnp.int32)


def _paged():
  return C.init_paged(L, 3, Hkv, D, capacity=CAP, window=W, hi_pool_pages=P_HI,
                      lo_pool_pages=P_LO, sink=1, n_groups=G, page=PAGE)


def _attend(cache, b, q):
  """Reference attention of sequence b for every layer -> [L, Hkv*2, D]."""
  outs = []
  for layer in range(L):
    win, hi, lo, maps = tcache.layer_inputs(cache, layer)
    pick = lambda t: jax.tree.map(lambda x: x[b:b + 1] if x.ndim and x.shape[0] == cache.batch
                                  else x, t)
    out = pallas_kernels.decode_attention(q, pick(win), hi, lo, pick(maps), backend="reference")
    outs.append(np.asarray(out[0], np.float32))
  return np.stack(outs)


def test_init_paged_shapes_and_unassigned_tables():
  c = _paged()
  assert c.layers.hi_k.shape == (L, P_HI, PAGE, Hkv, D)
  assert c.layers.lo_k.shape == (L, P_LO, PAGE, Hkv, D // 2)
  assert c.hi_pages.shape == (G, 3, CAP // PAGE)
  assert (np.asarray(c.hi_pages) == P_HI).all() and (np.asarray(c.lo_pages) == P_LO).all()
  assert c.hi_pos.shape == (G, 3, CAP)


def test_insert_slot_matches_dense_prefill_and_touches_only_its_pages():
  k, v, plan, n = _prompt(0, 11)
  hi_ids, lo_ids = [7, 2], [4, 8]
  c = _paged()
  ins = jax.jit(C.insert_slot)
  c = ins(c, jnp.int32(1), k, v, plan, n, _row(hi_ids, 4, P_HI), _row(lo_ids, 4, P_LO))
  ref = materialize(C.init(L, 1, Hkv, D, capacity=CAP, window=W, sink=1, n_groups=G,
                                     page=PAGE), k, v, plan, n)
  for g in range(G):
    assert tcache.stored_positions(c, g, 1) == tcache.stored_positions(ref, g, 0)
    assert tcache.stored_positions(c, g, 0) == {"hi": [], "lo": [], "win": []}
  assert int(c.count[1]) == 11 and int(c.count[0]) == 0 and int(c.count[2]) == 0
  # Pages outside the slot's rows stay zero: nothing leaked into another slot's future pages.
  hk = np.asarray(c.layers.hi_k, np.float32)
  lk = np.asarray(c.layers.lo_k)
  assert not hk[:, [p for p in range(P_HI) if p not in hi_ids]].any()
  assert not lk[:, [p for p in range(P_LO) if p not in lo_ids]].any()
  assert hk[:, hi_ids[0]].any()
  q = jnp.asarray(np.random.default_rng(1).normal(size=(1, 2 * Hkv, D)), jnp.float32)
  np.testing.assert_allclose(_attend(c, 1, q), _attend(ref, 0, q), rtol=1e-5, atol=1e-5)


def test_two_slots_then_decode_steps_and_release():
  c = _paged()
  ins = jax.jit(C.insert_slot)
  k0, v0, p0, n0 = _prompt(2, 9)
  k1, v1, p1, n1 = _prompt(3, 12)
  c = ins(c, jnp.int32(0), k0, v0, p0, n0, _row([0, 1, 2], 4, P_HI), _row([0, 1], 4, P_LO))
  c = ins(c, jnp.int32(2), k1, v1, p1, n1, _row([5, 3, 9], 4, P_HI), _row([2, 6], 4, P_LO))
  refs = [materialize(C.init(L, 1, Hkv, D, capacity=CAP, window=W, sink=1,
                                       n_groups=G, page=PAGE), k, v, p, n)
          for k, v, p, n in ((k0, v0, p0, n0), (k1, v1, p1, n1))]
  r = np.random.default_rng(4)
  active = jnp.asarray([True, False, True])
  for _ in range(3):
    kk = jnp.asarray(r.normal(size=(L, 3, Hkv, D)), jnp.float32)
    vv = jnp.asarray(r.normal(size=(L, 3, Hkv, D)), jnp.float32)
    act = jnp.asarray(r.integers(0, 3, size=(3, G)), jnp.int8)
    c = append(c, kk, vv, act, active)
    refs = [append(refs[0], kk[:, 0:1], vv[:, 0:1], act[0:1]),
            append(refs[1], kk[:, 2:3], vv[:, 2:3], act[2:3])]
  q = jnp.asarray(r.normal(size=(1, 2 * Hkv, D)), jnp.float32)
  for b, ref in ((0, refs[0]), (2, refs[1])):
    for g in range(G):
      assert tcache.stored_positions(c, g, b) == tcache.stored_positions(ref, g, 0)
    np.testing.assert_allclose(_attend(c, b, q), _attend(ref, 0, q), rtol=1e-5, atol=1e-5)
  assert int(c.count[1]) == 0 and not bool(c.overflow.any())
  c = jax.jit(C.release_slot)(c, jnp.int32(2))
  assert int(c.count[2]) == 0 and int(c.hi_len[:, 2].sum()) == 0
  assert (np.asarray(c.hi_pages[:, 2]) == P_HI).all()
  assert (np.asarray(c.lo_pages[:, 2]) == P_LO).all()
  for g in range(G):   # slot 0 unaffected by releasing slot 2
    assert tcache.stored_positions(c, g, 0) == tcache.stored_positions(refs[0], g, 0)


def test_per_group_pages_assigned_on_demand_match_dense_layout():
  """Each layer group with its own page rows (the same ids reused across groups: groups own
  disjoint layers), prompt pages only for what the plan stores, and every later page handed in
  by ``assign_pages`` exactly when its first entry is materialized: the same stored positions
  and attention as the dense layout, no overflow."""
  k, v, plan, n = _prompt(5, 12)
  plan_np = np.asarray(plan)[0].copy()
  plan_np[:1] = 2   # the sink (position 0) is stored H whatever its plan says
  done = plan_np[:12 - W]
  c = _paged()
  free = {X: [list(range(P))[::-1] for _ in range(G)] for X, P in (("hi", P_HI), ("lo", P_LO))}
  held = {X: np.zeros(G, int) for X in free}
  length = {X: (done == code).sum(0) for X, code in (("hi", 2), ("lo", 1))}
  rows = {}
  for X, P in (("hi", P_HI), ("lo", P_LO)):
    tbl = np.full((G, CAP // PAGE), P, np.int32)
    for g in range(G):
      held[X][g] = -(-length[X][g] // PAGE)
      for j in range(held[X][g]):
        tbl[g, j] = free[X][g].pop()
    rows[X] = jnp.asarray(tbl)
  c = jax.jit(C.insert_slot)(c, jnp.int32(1), k, v, plan, n, rows["hi"], rows["lo"])
  ref = materialize(C.init(L, 1, Hkv, D, capacity=CAP, window=W, sink=1, n_groups=G,
                           page=PAGE), k, v, plan, n)
  acts = list(plan_np[:12])
  r = np.random.default_rng(6)
  active = jnp.asarray([False, True, False])
  assign = jax.jit(C.assign_pages)
  assigned = 0
  for t in range(12, CAP - 1):
    new = {X: np.full((G, 3), -1, np.int32) for X in free}
    if t >= W:   # the token leaving the window at this step
      for X, code in (("hi", 2), ("lo", 1)):
        for g in range(G):
          if acts[t - W][g] == code:
            if length[X][g] % PAGE == 0:
              new[X][g, 1] = free[X][g].pop()
              assigned += 1
            length[X][g] += 1
    c = assign(c, jnp.asarray(new["hi"]), jnp.asarray(new["lo"]))
    kk = jnp.asarray(r.normal(size=(L, 3, Hkv, D)), jnp.float32)
    vv = jnp.asarray(r.normal(size=(L, 3, Hkv, D)), jnp.float32)
    act = np.asarray(r.integers(0, 3, size=(3, G)), np.int8)
    acts.append(act[1])
    c = append(c, kk, vv, jnp.asarray(act), active)
    ref = append(ref, kk[:, 1:2], vv[:, 1:2], jnp.asarray(act[1:2]))
  assert assigned > 0 and not bool(c.overflow.any())
  for g in range(G):
    assert tcache.stored_positions(c, g, 1) == tcache.stored_positions(ref, g, 0)
  assert (np.asarray(c.hi_len[:, 1]) == length["hi"]).all()
  assert (np.asarray(c.lo_len[:, 1]) == length["lo"]).all()
  q = jnp.asarray(r.normal(size=(1, 2 * Hkv, D)), jnp.float32)
  np.testing.assert_allclose(_attend(c, 1, q), _attend(ref, 0, q), rtol=1e-5, atol=1e-5)


def test_int4_format_slots_store_what_the_bytes_format_stores():
  """init_paged / insert_slot / decode steps / release_slot on an int4-format INT4 pool: the same
  state and the same dequantized INT4 rows as the bytes format, only the slots' own pages
  written, the same attention."""
  k0, v0, p0, n0 = _prompt(7, 12)
  k1, v1, p1, n1 = _prompt(8, 10)
  r = np.random.default_rng(9)
  steps = [(jnp.asarray(r.normal(size=(L, 3, Hkv, D)), jnp.float32),
            jnp.asarray(r.normal(size=(L, 3, Hkv, D)), jnp.float32),
            jnp.asarray(r.integers(1, 3, size=(3, G)), jnp.int8)) for _ in range(3)]
  out = []
  for fmt in ("bytes", "int4"):
    c = C.init_paged(L, 3, Hkv, D, capacity=CAP, window=W, hi_pool_pages=P_HI,
                     lo_pool_pages=P_LO, sink=1, n_groups=G, page=PAGE, lo_format=fmt)
    assert c.lo_format == fmt
    ins = jax.jit(C.insert_slot)
    c = ins(c, jnp.int32(0), k0, v0, p0, n0, _row([0, 1, 2], 4, P_HI), _row([3, 1], 4, P_LO))
    c = ins(c, jnp.int32(2), k1, v1, p1, n1, _row([5, 3, 9], 4, P_HI), _row([2, 6, 8], 4, P_LO))
    for kk, vv, act in steps:
      c = append(c, kk, vv, act, jnp.asarray([True, False, True]))
    out.append(c)
  a, b = out
  strip = lambda c: c.replace(layers=c.layers.replace(lo_k=0, lo_v=0, lo_s=0))  # per row below
  for x, y in zip(jax.tree.leaves(strip(a)), jax.tree.leaves(strip(b))):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  (ka, va), (kb, vb) = tcache.lo_dequantized(a), tcache.lo_dequantized(b)
  np.testing.assert_array_equal(ka, kb)
  np.testing.assert_array_equal(va, vb)
  assert int(b.lo_len.sum()) > 0 and np.abs(kb).sum() > 0
  assert not kb[:, [0, 4, 5, 7]].any()            # pages no slot was given stay empty
  q = jnp.asarray(r.normal(size=(1, 2 * Hkv, D)), jnp.float32)
  for s in (0, 2):
    np.testing.assert_array_equal(_attend(a, s, q), _attend(b, s, q))
  b = jax.jit(C.release_slot)(b, jnp.int32(2))
  assert (np.asarray(b.lo_pages[:, 2]) == P_LO).all() and int(b.lo_len[:, 2].sum()) == 0
