"""b_HBM, the HBM bytes of one decode step (docs/SPHERICAL_KV.md §4 "b_HBM as built"): exact
byte counts of small hand-checkable caches (a full page, a ragged page, an empty tier, the
window, both access granularities, both tier read paths), an independent per-row count on
random caches, monotonicity, paged dense BF16 (all-high) against its formula, the reconstruct
path against the angle path on identical storage, and the runners' per-sequence fields.

Only the maps (lengths, table shapes, counts) enter the byte counts, so the caches here are
made with the maps' own update functions (random lengths and plans) and no K/V is encoded."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.sph_types import TierSpec
from pask_jax import actions as Act
from pask_jax import cache as pcache
from pask_jax import kv_dense
from pask_jax import policy as P
from pask_jax.decode import PaskRunner, Runner, hbm_rows, param_bytes
from pask_jax.spherical import cache as scache
from pask_jax.testing import tiny_llama

pytestmark = pytest.mark.fast_compile

D = 64
ROW = 4 * D          # dense BF16 K + V bytes per (token, KV head)
A42 = 24 + 4 + 2 * D   # A42 codes (3D/8) + side word + BF16 values: §2.3's 156 B at D = 64
_prefill_rows = jax.jit(pcache.prefill_rows, static_argnums=2)   # eager: 2 s of small compiles


def _hand_caches():
  """Two layers in one group, 2 sequences, 2 KV heads, window 4, pages of 16, tables of 3
  pages; one tier (A42, BF16 values) whose heads hold 16 (one full page), 21 (a ragged second
  page) | 0 (an empty tier head), 5 entries; the base cache holds 30 and 3 tokens."""
  L, B, H = 2, 2, 2
  cache = pcache.init(L, B, H, D, capacity=40, window=4, n_groups=1, page=16)
  cache = cache.replace(count=jnp.array([30, 3], jnp.int32),
                        hi_len=jnp.array([[10, 0]], jnp.int32),
                        lo_len=jnp.array([[17, 0]], jnp.int32))
  sph = scache.init(L, B, H, D, tiers=(TierSpec("A42", "bf16", D),), capacity=48, window=4,
                    n_groups=1, page=16)
  sph = sph.replace(length=(jnp.array([[[16, 21], [0, 5]]], jnp.int32),))
  return cache, sph


def test_exact_bytes_of_a_hand_checkable_cache():
  cache, sph = _hand_caches()
  win, int4 = 2 * ROW, 2 * (D + 4)   # per slot (2 KV heads): BF16 K+V; INT4 codes + 2 scales
  # row granularity (the GPU kernels): visible rows and the table entries they name
  base = [2 * (4 * win + (10 * win + 4) + (17 * int4 + 2 * 4)),   # window 4 of 30, 1 + 2 pages
          2 * (3 * win)]                                          # 3 window slots, empty pools
  np.testing.assert_array_equal(pcache.hbm_bytes(cache), base)
  tiers = [2 * ((16 * A42 + 4) + (21 * A42 + 2 * 4)), 2 * (0 + (5 * A42 + 4))]
  np.testing.assert_array_equal(scache.tier_hbm_bytes(sph), tiers)
  # the weights' share and the base cache join in the whole figure
  np.testing.assert_array_equal(scache.hbm_bytes(sph, cache, param_bytes=1000, batch=2),
                                np.add(base, tiers) + 500)
  # page granularity (the TPU kernels): whole pages up to the last visible one (one page for an
  # empty partition), the whole tables (3 entries), the whole window ring
  base_p = [2 * (4 * win + (16 * win + 12) + (2 * 16 * int4 + 12)),
            2 * (4 * win + (16 * win + 12) + (16 * int4 + 12))]
  np.testing.assert_array_equal(pcache.hbm_bytes(cache, granularity="page"), base_p)
  tiers_p = [2 * ((16 * A42 + 12) + (32 * A42 + 12)), 2 * ((16 * A42 + 12) + (16 * A42 + 12))]
  np.testing.assert_array_equal(scache.tier_hbm_bytes(sph, granularity="page"), tiers_p)
  # reconstruct (A1): the whole table rebuilt (3 pages read, written as dense K+V), then the
  # visible rebuilt rows read by a BF16 partition (at "page": whole pages + its 1-slot window)
  rebuild = 3 * 16 * (A42 + ROW) + 3 * 4
  rec = [2 * (2 * rebuild + (16 * ROW + 4) + (21 * ROW + 8)), 2 * (2 * rebuild + 5 * ROW + 4)]
  np.testing.assert_array_equal(scache.tier_hbm_bytes(sph, read="reconstruct"), rec)
  rec_p = [2 * (2 * rebuild + (16 * ROW + 12 + ROW) + (32 * ROW + 12 + ROW)),
           2 * (2 * rebuild + 2 * (16 * ROW + 12 + ROW))]
  np.testing.assert_array_equal(
      scache.tier_hbm_bytes(sph, granularity="page", read="reconstruct"), rec_p)


def _per_row(cache, sph, granularity):
  """The same count, by walking every layer, KV head and entry (independent of the module)."""
  lay = cache.layers
  L, B, W, H, Dh = lay.win_k.shape
  count, hi_len, lo_len = (np.asarray(x) for x in (cache.count, cache.hi_len, cache.lo_len))
  tier_len = [np.asarray(x) for x in sph.length]
  out = np.zeros(B)
  for b in range(B):
    for layer in range(L):
      g = cache.group_of[layer]
      out[b] += (min(count[b], W) if granularity == "row" else W) * H * 4 * Dh
      for n, tbl, pg, row in ((hi_len[g, b], cache.hi_pages.shape[-1], cache.page, H * 4 * Dh),
                              (lo_len[g, b], cache.lo_pages.shape[-1], cache.lo_page,
                               H * (Dh + 4))):
        pages = {j // pg for j in range(n)}
        if granularity == "row":
          out[b] += n * row + 4 * len(pages)
        else:
          out[b] += max(1, len(pages)) * pg * row + 4 * tbl
      for ts, length, tbl in zip(sph.spec, tier_len, sph.pages):
        for h in range(H):
          n = length[sph.group_of[layer], b, h]
          pages = {j // sph.page for j in range(n)}
          if granularity == "row":
            out[b] += n * ts.bytes + 4 * len(pages)
          else:
            out[b] += max(1, len(pages)) * sph.page * ts.bytes + 4 * tbl.shape[-1]
  return out


def _random_caches(rng, L=5, B=3, H=2, G=3, W=8, page=16):
  """A base cache after a random prefill plan (R/L/H per token and group, random prompt
  lengths) and a ladder of three tiers (BF16 and INT4 values) with random lengths per (group,
  sequence, KV head), at least one entry each."""
  Tn = 70
  cache = pcache.init(L, B, H, D, capacity=96, window=W, n_groups=G, page=page, sink=2)
  lengths = rng.integers(W + 1, Tn + 1, B)
  plan = rng.integers(0, 3, (B, Tn, G))
  cache, _ = _prefill_rows(cache, jnp.asarray(plan, jnp.int8), Tn, jnp.asarray(lengths))
  tiers = (TierSpec("A2", "bf16", D), TierSpec("A42", "int4", D), TierSpec("A4", "bf16", D))
  sph = scache.init(L, B, H, D, tiers=tiers, capacity=(40, 64, 80), window=W, n_groups=G,
                    page=page)
  sph = sph.replace(length=tuple(
      jnp.asarray(rng.integers(1, p.shape[-1] * page + 1, (G, B, H)), jnp.int32)
      for p in sph.pages))
  return cache, sph


@pytest.mark.parametrize("granularity", pcache.GRANULARITIES)
def test_random_caches_match_a_per_row_count(granularity):
  rng = np.random.default_rng(26)
  cache, sph = _random_caches(rng)
  assert int(np.sum(np.asarray(cache.lo_len))) > 0 and int(np.sum(np.asarray(cache.hi_len))) > 0
  got = scache.hbm_bytes(sph, cache, granularity=granularity)
  np.testing.assert_array_equal(got, _per_row(cache, sph, granularity))


def test_more_rows_in_a_tier_read_more_bytes():
  rng = np.random.default_rng(7)
  cache, sph = _random_caches(rng)
  for t in range(sph.n_tiers):
    g, b, h = (int(rng.integers(0, n)) for n in sph.length[t].shape)
    cap = sph.pages[t].shape[-1] * sph.page
    n0 = min(int(sph.length[t][g, b, h]), cap - sph.page)
    lens = lambda n: tuple(x.at[g, b, h].set(n) if i == t else x
                           for i, x in enumerate(sph.length))
    one, more, page_more = (sph.replace(length=lens(n)) for n in (n0, n0 + 1, n0 + sph.page))
    for read in ("angles", "reconstruct"):
      a, c = (scache.tier_hbm_bytes(s, read=read) for s in (one, more))
      assert c[b] > a[b] and np.array_equal(np.delete(c, b), np.delete(a, b)), (t, read)
      a, c, e = (scache.tier_hbm_bytes(s, granularity="page", read=read)
                 for s in (one, more, page_more))
      assert c[b] >= a[b] and e[b] > a[b], (t, read)   # whole pages: one more page, more bytes


@pytest.mark.parametrize("granularity", pcache.GRANULARITIES)
def test_all_high_equals_the_dense_formula(granularity):
  """PASK's all-high cache (every token past the window in the BF16 pool; no INT4 pool) reads
  exactly what paged dense BF16's formula says, and its b_HBM is 1."""
  rng = np.random.default_rng(3)
  L, B, H, W, Tn = 4, 3, 2, 8, 90
  cache = pcache.init(L, B, H, D, capacity=128, window=W, n_groups=2, page=16, sink=4)
  lengths = rng.integers(1, Tn + 1, B)
  lengths[0] = 3   # all in the window
  cache, _ = _prefill_rows(cache, jnp.full((B, Tn, 2), Act.H, jnp.int8), Tn,
                                 jnp.asarray(lengths))
  cache = cache.replace(lo_pages=cache.lo_pages[..., :0])   # no INT4 table: nothing of it read
  np.testing.assert_array_equal(np.asarray(cache.hi_len), [np.maximum(lengths - W, 0)] * 2)
  got = pcache.hbm_bytes(cache, param_bytes=777, batch=3, granularity=granularity)
  want = pcache.dense_hbm_bytes(lengths, n_layers=L, n_kv_heads=H, head_dim=D, window=W,
                                page=16, table_pages=cache.hi_pages.shape[-1], param_bytes=777,
                                batch=3, granularity=granularity)
  np.testing.assert_array_equal(got, want)
  # the formula itself: row = every token's K+V in every layer + the pool's table entries
  if granularity == "row":
    np.testing.assert_array_equal(
        want, 259 + L * (lengths * H * ROW + np.ceil(np.maximum(lengths - W, 0) / 16) * 4))
  rows = hbm_rows(got - 259, want - 259, 777, 3, granularity)
  assert all(r["b_HBM"] == 1.0 for r in rows)


@pytest.mark.parametrize("granularity", pcache.GRANULARITIES)
def test_reconstruct_reads_more_than_angles_on_identical_storage(granularity):
  rng = np.random.default_rng(11)
  cache, sph = _random_caches(rng)
  a = scache.hbm_bytes(sph, cache, granularity=granularity)
  r = scache.hbm_bytes(sph, cache, granularity=granularity, read="reconstruct")
  # beyond the angle path's reads: at least the rebuild's writes, dense K+V for every row of
  # every table (the rebuild's own reads cover the angle path's, the BF16 partition adds more)
  L, H = len(sph.group_of), sph.route.shape[-1]
  writes = sum(L * H * p.shape[-1] * sph.page * ROW for p in sph.pages)
  assert np.all(r - a > writes)


def test_runners_report_their_step_bytes():
  """PaskRunner and the Full-KV runner (their ``hbm``) on hand-made states: the weights split
  over the batch, the cache's reads, and b_HBM against paged dense; no step is compiled."""
  model = tiny_llama(256)
  c = model.cfg
  pol = P.all_high(c, n_groups=3, sink=2, window=4)
  runner = PaskRunner(model, pol, batch=2, capacity=64)
  w = param_bytes(runner.params)
  assert w == sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(runner.params))
  assert w > 0 and runner.param_bytes == w
  cache = pcache.init_for(c, 2, pol, capacity=64)
  lengths = np.array([37, 9])
  cache, _ = _prefill_rows(cache, jnp.full((2, 40, 3), Act.H, jnp.int8), 40,
                                 jnp.asarray(lengths))
  rows = runner.hbm((cache, None, None))
  kv = pcache.hbm_bytes(cache)
  for r, k in zip(rows, kv):
    assert r["hbm_bytes_per_token"] == w / 2 + k and r["hbm_kv_bytes"] == k
    assert r["b_HBM"] == 1.0 and r["hbm_granularity"] == "row"
  full = Runner(model, batch=2, capacity=64)
  dc = kv_dense.init(c.n_layers, 2, 64, c.n_kv_heads, c.head_dim, jnp.bfloat16)
  dc = dc._replace(length=jnp.asarray(lengths, jnp.int32))
  rows = full.hbm(dc)
  every = c.n_layers * 64 * c.n_kv_heads * 4 * c.head_dim   # XLA reads every slot
  dense = pcache.dense_hbm_bytes(lengths, n_layers=c.n_layers, n_kv_heads=c.n_kv_heads,
                                 head_dim=c.head_dim, window=P.DEFAULT_WINDOW)
  for r, d in zip(rows, dense):
    assert r["hbm_kv_bytes"] == every
    assert r["b_HBM"] == pytest.approx((w / 2 + every) / (w / 2 + d)) and r["b_HBM"] > 1


def test_bad_arguments_are_refused():
  cache, sph = _hand_caches()
  with pytest.raises(ValueError, match="granularity must be one of") as e:
    pcache.hbm_bytes(cache, granularity="sector")
  assert "\n" not in str(e.value)
  with pytest.raises(ValueError, match="read must be one of"):
    scache.tier_hbm_bytes(sph, read="dense")
  with pytest.raises(ValueError, match="batch must be >= 1"):
    pcache.hbm_bytes(cache, param_bytes=1.0, batch=0)
  assert math.isnan(hbm_rows([0.0], [0.0], 0.0, 1, "row")[0]["b_HBM"])
