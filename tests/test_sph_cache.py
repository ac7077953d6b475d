"""The Spherical KV tier state (pask_jax.spherical.cache): a prefill routed to tiers, written in
layer chunks, then decode evictions; every (token, group, head) lives in exactly one place, in
position order, with the right codes and values in the right page; tables never overflow their
pools; free lists hand out each page once; resident bytes match §2.3's item cost."""
import functools
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels import int4
from pallas_kernels.testing import sph_synth
from pallas_kernels import spherical
from pallas_kernels.sph_types import TierSpec
from pallas_kernels.testing import synth
from pask_jax import actions as Act
from pask_jax.spherical import cache as C

pytestmark = pytest.mark.fast_compile

L, B, H, D, W, G, SINK, PAGE = 4, 2, 2, 64, 8, 2, 2, 8
TIERS = (TierSpec("A4", "bf16", D), TierSpec("A42", "int4", D), TierSpec("A2", "int4", D))
K = len(TIERS)

prefill_rows = jax.jit(C.prefill_rows, static_argnums=2)
write_prefill = jax.jit(C.write_prefill, static_argnums=4)
evict_step = jax.jit(C.evict_step)


def _route_np(route, pos):
  """The normalization rule, in numpy: sinks and any head on the BF16 pool -> all heads there."""
  dense = (route == K + 1).any(-1, keepdims=True) | (pos < SINK)[..., None, None]
  return np.where(dense, K + 1, route)


def _run(seed, *, capacity=64, pool_pages=None, steps=10, t=40, lengths=(40, 27),
         p_route=(0.15, 0.3, 0.25, 0.2, 0.1), inactive_step=3):
  rng = np.random.default_rng(seed)
  n_all = t + steps
  kall = (rng.standard_normal((L, B, n_all, H, D)) * rng.uniform(0.5, 2, (L, 1, 1, H, 1))
          + rng.standard_normal((L, 1, 1, H, D))).astype(np.float32)
  vall = rng.standard_normal((L, B, n_all, H, D)).astype(np.float32)
  mu = rng.standard_normal((L, H, D)).astype(np.float32)
  route = rng.choice(K + 2, size=(B, n_all, G, H), p=p_route).astype(np.int8)
  prot = rng.random((B, n_all, G, H)) < 0.2
  st = C.init(L, B, H, D, tiers=TIERS, capacity=capacity, window=W, n_groups=G, page=PAGE,
              sink=SINK, mu=mu, pool_pages=pool_pages)
  lengths = np.asarray(lengths, np.int32)
  st, rows = prefill_rows(st, jnp.asarray(route[:, :t]), t, jnp.asarray(lengths),
                          jnp.asarray(prot[:, :t]))
  for start in (0, 2):   # two chunks of two layers
    st = write_prefill(st, rows, jnp.asarray(kall[start:start + 2, :, :t]),
                       jnp.asarray(vall[start:start + 2, :, :t]), start)
  count = lengths.copy()
  win_pos = np.full((B, W), -1)
  for b in range(B):
    for p in range(max(0, count[b] - W), count[b]):
      win_pos[b, p % W] = p
  for s in range(steps):
    active = np.ones(B, bool)
    if s == inactive_step:
      active[1] = False
    slot = np.where(active, count % W, W)
    old = np.where(active, win_pos[np.arange(B), np.minimum(slot, W - 1)], -1)
    take = np.maximum(old, 0)
    k_old = kall[:, np.arange(B), take]
    v_old = vall[:, np.arange(B), take]
    new = np.minimum(count, n_all - 1)
    st = evict_step(st, jnp.asarray(slot), jnp.asarray(old), jnp.asarray(k_old),
                    jnp.asarray(v_old), jnp.asarray(route[np.arange(B), new]),
                    jnp.asarray(prot[np.arange(B), new]))
    for b in np.flatnonzero(active):
      win_pos[b, slot[b]] = count[b]
      count[b] += 1
  return st, dict(kall=kall, vall=vall, mu=mu, route=route, prot=prot, count=count,
                  win_pos=win_pos)


@pytest.fixture(scope="module")
def run():
  return _run(0)


def test_every_token_group_head_lives_in_exactly_one_place(run):
  st, r = run
  count, group_of = r["count"], st.group_of
  assert not np.asarray(st.overflow).any()
  for b in range(B):
    n = count[b]
    pos = np.arange(n)
    route = _route_np(r["route"][b, :n], pos)                      # [n, G, H]
    in_win = pos >= n - W
    for g in range(G):
      for h in range(H):
        places = in_win.astype(int) + (~in_win & (route[:, g, h] == K + 1))
        for t in range(K):
          ln = int(st.length[t][g, b, h])
          stored = np.asarray(st.pos[t][g, b, h])
          want = pos[~in_win & (route[:, g, h] == t + 1)]
          np.testing.assert_array_equal(stored[:ln], want)        # appended in position order
          assert (stored[ln:] == -1).all()
          places = places + np.isin(pos, stored[:ln])
        dropped = ~in_win & (route[:, g, h] == 0)
        np.testing.assert_array_equal(places, (~dropped).astype(int))
    # The window's pending routes; the base cache's actions are H exactly on the BF16 route.
    slots = r["win_pos"][b]
    want = _route_np(r["route"][b, slots], slots)
    np.testing.assert_array_equal(np.asarray(st.route[b]), want)
    np.testing.assert_array_equal(np.asarray(st.prot[b]), r["prot"][b, slots])
    acts = np.asarray(C.base_actions(st, st.route[b]))
    np.testing.assert_array_equal(acts, np.where((want == K + 1).any(-1), Act.H, Act.R))
  assert len(set(group_of)) == G


@functools.partial(jax.jit, static_argnums=3)
def _encode(k, mu, rot, sp):
  return spherical.encode(spherical.to_code_space(k, mu, rot), sp)


def test_stored_rows_hold_the_tokens_codes_values_and_flags(run):
  st, r = run
  lv = spherical.level_of_position(D)
  for t, ts in enumerate(TIERS):
    pool = jax.tree.map(np.asarray, st.pools[t])
    for lyr in range(L):
      g = st.group_of[lyr]
      ln = np.asarray(st.length[t][g])                              # [B, H]
      bs, hs, js = (np.concatenate(x) for x in zip(*[
          (np.full(ln[b, h], b), np.full(ln[b, h], h), np.arange(ln[b, h]))
          for b in range(B) for h in range(H)]))
      assert len(js) > 10
      pid = np.asarray(st.pages[t][g])[bs, hs, js // PAGE]
      p = np.asarray(st.pos[t][g])[bs, hs, js]
      row = (lyr, pid, js % PAGE)
      kb = jnp.asarray(r["kall"][lyr, bs, p, hs]).astype(jnp.bfloat16)
      vb = jnp.asarray(r["vall"][lyr, bs, p, hs]).astype(jnp.bfloat16)
      codes, rad = _encode(kb, jnp.asarray(r["mu"][lyr, hs]), spherical.rotation(D, lyr), ts.key)
      got = sph_synth.unpack_numpy(pool.ang[row], ts.key)
      step = np.abs(got - np.asarray(codes))
      step = np.where(lv == 1, np.minimum(step, 2**ts.b1 - step), step)
      assert step.max() <= 1 and (step > 0).mean() < 0.01          # one code of slack, rarely
      side = jnp.asarray(pool.side[row])
      np.testing.assert_allclose(np.asarray(spherical.side_radius(side)), np.asarray(rad),
                                 rtol=1e-3)
      if ts.values == "bf16":
        np.testing.assert_array_equal(pool.v[row].astype(np.float32), np.asarray(vb, np.float32))
      else:
        vq, vs = int4.quantize_packed(vb)
        np.testing.assert_array_equal(pool.v[row], np.asarray(vq))
        np.testing.assert_array_equal(np.asarray(spherical.side_value_scale(side)),
                                      np.asarray(vs, np.float32))
      fl = np.asarray(st.flags[t][g])[bs, hs, js // PAGE]
      np.testing.assert_array_equal((fl >> (js % PAGE)) & 1, r["prot"][bs, p, g, hs])


def test_state_feeds_the_reference_kernel(run):
  st, _ = run
  s = synth.Shape(b=B, hq=2 * H, hkv=H, d=D, page=16, w=4, lo_cap=16, hi_cap=16)
  args = synth.make(s, [3, 0], [0, 5], [2, 4], seed=9)
  q, win, hi, lo, maps = args
  rep = lambda t: type(t)(*(jnp.stack([x] * L) for x in t))     # the base, stacked on layers
  stacked = (q, pk.Window(jnp.stack([win.k] * L), jnp.stack([win.v] * L), win.length), rep(hi),
             rep(lo), maps)
  for lyr in (0, 3):
    sph = C.sph_inputs(st, st.group_of[lyr])
    out = pk.decode_attention(*stacked, sph=sph, layer=lyr, backend="reference")
    want, _ = sph_synth.naive(*args, sph_synth.layer_of(sph, lyr))
    assert synth.rel_err(out, want) < 6e-3


def test_capacity_overflow_drops_and_flags():
  st, r = _run(1, capacity=PAGE, steps=4, p_route=(0.0, 0.8, 0.1, 0.1, 0.0))
  assert np.asarray(st.overflow).all()
  for t in range(K):
    ln = np.asarray(st.length[t])
    assert (ln <= PAGE).all()
    for g in range(G):
      for b in range(B):
        for h in range(H):
          n = r["count"][b]
          pos = np.arange(n)
          route = _route_np(r["route"][b, :n], pos)[:, g, h]
          want = pos[(pos < n - W) & (route == t + 1)][:PAGE]      # the first ones fit
          np.testing.assert_array_equal(np.asarray(st.pos[t][g, b, h])[:ln[g, b, h]], want)


@pytest.mark.parametrize("pool_pages", (64, 5))
def test_free_lists_hand_out_each_page_once(pool_pages):
  st, r = _run(2, pool_pages=pool_pages, steps=6)
  for t in range(K):
    n_pool = st.pools[t].ang.shape[1]
    for g in range(G):
      ln = np.asarray(st.length[t][g])
      tbl = np.asarray(st.pages[t][g])
      used = np.concatenate([tbl[b, h, : -(-ln[b, h] // PAGE)] for b in range(B)
                             for h in range(H)])
      assert ((used >= 0) & (used < n_pool)).all()
      assert len(set(used.tolist())) == len(used)                  # no page shared
      assigned = tbl[(tbl >= 0) & (tbl < n_pool)]
      assert int(st.free_n[t][g]) == n_pool - len(assigned)
      assert len(assigned) == len(used)                            # none taken for nothing
  # 5 pages per (tier, group) cannot hold 40 prompt tokens in 4 tables: some items are lost.
  assert np.asarray(st.overflow).any() == (pool_pages == 5)


def test_assign_pages_ahead_then_append():
  st = C.init(L, B, H, D, tiers=TIERS[:1], capacity=32, window=W, n_groups=G, page=PAGE,
              pool_pages=6)
  want = jnp.asarray(np.array([[[9, 0], [1, 8]], [[0, 0], [17, 0]]], np.int32))
  st = jax.jit(C.assign_pages)(st, (want,))
  tbl = np.asarray(st.pages[0])
  # Group 0: 2 + 0 + 1 + 1 pages = 4 of 6; group 1: 3 pages.  Popped in (b, h, page) order.
  np.testing.assert_array_equal(tbl[0, 0, 0, :2], [0, 1])
  np.testing.assert_array_equal(tbl[0, 1, 0, :1], [2])
  np.testing.assert_array_equal(tbl[0, 1, 1, :1], [3])
  np.testing.assert_array_equal(tbl[1, 1, 0, :3], [0, 1, 2])
  np.testing.assert_array_equal(np.asarray(st.free_n[0]), [2, 3])
  assert (tbl[0, 0, 1] == 6).all()                                # untouched: unassigned


def test_resident_bytes_match_the_item_cost():
  # Every non-window token of a 2·PAGE + W prompt goes to one tier: two full pages per table.
  for t, ts in enumerate(TIERS):
    st = C.init(L, B, H, D, tiers=TIERS, capacity=64, window=W, n_groups=G, page=PAGE)
    n = 2 * PAGE + W
    route = jnp.full((B, n, G, H), t + 1, jnp.int8)
    st, _ = prefill_rows(st, route, n)
    n_layers = [st.group_of.count(g) for g in range(G)]
    want = sum(2 * PAGE * H * spherical.item_bytes(ts.layout, D, nl, ts.values, PAGE)
               for nl in n_layers)
    np.testing.assert_allclose(np.asarray(C.resident_bytes(st)), want, rtol=1e-6)
  # A partial page is charged in full (slack), its table entry once.
  st = C.init(L, B, H, D, tiers=TIERS[1:2], capacity=64, window=W, n_groups=G, page=PAGE)
  st, _ = prefill_rows(st, jnp.full((B, 3 + W, G, H), 1, jnp.int8), 3 + W)
  per_head = sum(PAGE * nl * TIERS[1].bytes + 3 * (4 + 1 / 8) + 4
                 for nl in (st.group_of.count(0), st.group_of.count(1)))
  np.testing.assert_allclose(np.asarray(C.resident_bytes(st)), H * per_head, rtol=1e-6)
  assert TIERS[1].bytes == 3 * D // 8 + 4 + D // 2                # §2.3: compact t1


def test_bad_input_is_refused():
  with pytest.raises(ValueError, match="head dim"):
    C.init(L, B, H, 128, tiers=TIERS, capacity=16, window=W)
  with pytest.raises(ValueError, match="at least one tier"):
    C.init(L, B, H, D, tiers=(), capacity=16, window=W)
  st = C.init(L, B, H, D, tiers=TIERS, capacity=16, window=W, n_groups=G)
  with pytest.raises(ValueError, match="route must be"):
    C.prefill_rows(st, jnp.zeros((B, 5, G + 1, H), jnp.int8), 5)
  jax.tree.flatten(st)  # a pytree: static fields are not leaves
  assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(st))
  with pytest.raises(ValueError, match=f"^{H} KV heads do not split over 3 devices$"):
    C.init(L, B, H, D, tiers=TIERS, capacity=16, window=W, shards=3)
  with pytest.raises(ValueError, match="pool_pages .shared free lists. cannot split over 2"):
    C.init(L, B, H, D, tiers=TIERS, capacity=16, window=W, pool_pages=8, shards=2)


@pytest.mark.parametrize("shards", [1, 2])
def test_pages_numbered_per_device_block(shards):
  """``init(shards=N)`` (tensor parallelism): the KV heads of device i name only pages of block i
  of every tier pool, so the pool splits on its page axis; N = 1 keeps ``(b·Hkv + h)·n``."""
  st = C.init(L, B, H, D, tiers=TIERS[:2], capacity=20, window=W, n_groups=G, shards=shards)
  for t in range(2):
    pages, n_pool = np.asarray(st.pages[t]), st.pools[t].ang.shape[1]    # [G, B, H, n]
    assert sorted(pages[0].ravel()) == list(range(n_pool)) and (pages == pages[:1]).all()
    block = pages // (n_pool // shards)
    assert (block == np.arange(H)[:, None] // (H // shards)).all(), block
    if shards == 1:
      assert (pages[0] == np.arange(n_pool).reshape(B, H, -1)).all()



def test_write_prefill_takes_a_traced_start_and_refuses_a_chunk_past_the_layers():
  """The commit writes one layer at a time in a loop (a traced start): the pools are what a
  static start writes; a static chunk that runs past the last layer is refused by name."""
  rng = np.random.default_rng()
  t = 24
  k = rng.standard_normal((L, B, t, H, D)).astype(np.float32)
  v = rng.standard_normal((L, B, t, H, D)).astype(np.float32)
  route = rng.choice(K + 2, size=(B, t, G, H)).astype(np.int8)
  st = C.init(L, B, H, D, tiers=TIERS, capacity=40, window=W, n_groups=G, page=PAGE, sink=SINK,
              mu=rng.standard_normal((L, H, D)).astype(np.float32))
  st, rows = prefill_rows(st, jnp.asarray(route), t, jnp.asarray([t, 17], np.int32),
                          jnp.asarray(rng.random((B, t, G, H)) < 0.2))
  want = write_prefill(st, rows, jnp.asarray(k[1:3]), jnp.asarray(v[1:3]), 1)
  got = jax.jit(C.write_prefill)(st, rows, jnp.asarray(k[1:3]), jnp.asarray(v[1:3]),
                                 jnp.int32(1))
  for a, b in zip(jax.tree.leaves(want.pools), jax.tree.leaves(got.pools)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert any(np.any(np.asarray(a) != np.asarray(b))   # layers 1-2 were written
             for a, b in zip(jax.tree.leaves(want.pools), jax.tree.leaves(st.pools)))
  with pytest.raises(ValueError, match="not within the model's 4 layers"):
    C.write_prefill(st, rows, jnp.asarray(k[:2]), jnp.asarray(v[:2]), 3)
