"""The Mosaic GPU INT4 partition over a paged pool of head-major int4 pages
(``mgpu_int4.partition`` with a page table) on a CPU host: the gather through shuffled tables,
its algorithm through ``pool_reference`` against float32 attention (every supported GQA ratio,
ragged and empty rows, both V layouts), one-line errors, and the kernel's lowering to Mosaic GPU
for CUDA. On the H200: ``bench/bench_mgpu_int4.py --paged``."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from pallas_kernels.gpu import mgpu_int4 as M  # noqa: E402
from pallas_kernels.testing.mgpu import assert_narrow_lowers  # noqa: E402

pytestmark = pytest.mark.fast_compile


def pool(b, hkv, g, d, tile, n_pages, lens, seed, v_major="dim"):
  """q (G real rows of 16), an int4 pool with one spare page per sequence handed out in a
  shuffled order, its table, f32 scales and per-row lengths ``[B * Hkv]``."""
  ks_ = jax.random.split(jax.random.key(seed), 6)
  p = b * (n_pages + 1)
  shapes = M.pool_shapes(p, hkv, tile, d, v_major)
  codes = lambda key, shape: jax.random.randint(key, shape, -7, 8, jnp.int32).astype(jnp.int4)
  k, v = codes(ks_[0], shapes["k"]), codes(ks_[1], shapes["v"])
  ks = jax.random.uniform(ks_[2], shapes["ks"], jnp.float32, 0.02, 0.3)
  vs = jax.random.uniform(ks_[3], shapes["vs"], jnp.float32, 0.02, 0.3)
  tbl = jax.random.permutation(ks_[4], p)[:b * n_pages].reshape(b, n_pages).astype(jnp.int32)
  q = jnp.zeros((b * hkv, M.N_PAD, d), jnp.bfloat16)
  q = q.at[:, :g].set(jax.random.normal(ks_[5], (b * hkv, g, d)).astype(jnp.bfloat16))
  return q, k, ks, v, vs, jnp.repeat(jnp.asarray(lens, jnp.int32), hkv), tbl


def test_gather_follows_the_tables():
  b, hkv, d, tile, n_pages = 2, 3, 64, 64, 2
  q, k, ks, v, vs, lens, tbl = pool(b, hkv, 1, d, tile, n_pages, [128, 5], seed=1)
  kc, ksc, vc, vsc = M.pool_gather(k, ks, v, vs, tbl)
  kn, vn = np.asarray(k, np.int8), np.asarray(v, np.int8)
  for s, j, h in [(0, 0, 0), (1, 127, 2), (1, 64, 1), (0, 70, 2)]:
    pg, r = int(tbl[s, j // tile]), j % tile
    row = s * hkv + h
    np.testing.assert_array_equal(np.asarray(kc[row, j], np.int8), kn[pg, h, r])
    np.testing.assert_array_equal(np.asarray(vc[row, :, j], np.int8), vn[pg, h, :, r])
    assert float(ksc[row, j]) == float(ks[pg, h, r])
    assert float(vsc[row, j]) == float(vs[pg, h, r])


@pytest.mark.parametrize("hkv,g,d,tile,v_major,splits", [
    (2, 1, 64, 64, "dim", 2), (2, 2, 128, 128, "dim", 1), (1, 4, 128, 64, "token", 4),
    (2, 7, 64, 128, "dim", 2), (3, 8, 64, 64, "token", 2)])
def test_algorithm_matches_float32_attention(hkv, g, d, tile, v_major, splits):
  n_pages, b = 4, 3
  lens = [n_pages * tile, tile + 5, 0]          # full, ragged mid-page, empty
  q, k, ks, v, vs, lens, tbl = pool(b, hkv, g, d, tile, n_pages, lens, seed=hkv * d + g,
                                    v_major=v_major)
  sm = d ** -0.5
  got = M.merge(*M.pool_reference(q, k, ks, v, vs, lens, tbl, v_major=v_major, splits=splits,
                                  qk_scale=sm * M.LOG2E))[:, :g]
  kc, ksc, vc, vsc = M.pool_gather(k, ks, v, vs, tbl, v_major=v_major)
  vt = vc if v_major == "token" else jnp.swapaxes(vc, 1, 2)
  ref = M.attend_reference(q, kc, ksc, vt, vsc, lens, sm_scale=sm)[:, :g]
  assert not jnp.isnan(got).any()
  live = np.asarray(lens) > 0
  err = float(jnp.linalg.norm(got[live] - ref[live]) / jnp.linalg.norm(ref[live]))
  assert err < 4e-3, err
  assert float(jnp.abs(got[~live]).max()) == 0.0


def test_bad_pool_input_is_one_line():
  q, k, ks, v, vs, lens, tbl = pool(2, 2, 4, 64, 64, 4, [256, 10], seed=3)
  call = lambda **kw: M.partition(*[kw.get(n, a) for n, a in zip(
      ("q", "k", "ks", "v", "vs", "lens"), (q, k, ks, v, vs, lens))], None,
      kw.get("tbl", tbl), tile=kw.get("tile", 64), splits=kw.get("splits", 2),
      v_major=kw.get("v_major", "dim"))
  with pytest.raises(ValueError, match="^the pool's pages hold 64 tokens but tile is 128"):
    call(tile=128)
  with pytest.raises(ValueError, match=r"^v must have shape \(10, 2, 64, 64\)"):
    call(v=v[:, :, :32])
  with pytest.raises(ValueError, match=r"^tbl must be int32 \[B, n_pages\]"):
    call(tbl=tbl.astype(jnp.float32))
  with pytest.raises(ValueError, match="^a paged pool takes v_major 'token' or 'dim'"):
    call(v_major="block")
  with pytest.raises(ValueError, match=r"^lens must have shape \(4,\)"):
    call(lens=lens[:2])
  with pytest.raises(ValueError, match="must divide into 3 splits"):
    call(splits=3)


def _lower(d, tile, v_major="dim", b=2, hkv=2, n_pages=8, **kw):
  S = jax.ShapeDtypeStruct
  p = b * n_pages + 3
  sh = M.pool_shapes(p, hkv, tile, d, v_major)
  args = (S((b * hkv, M.N_PAD, d), jnp.bfloat16), S(sh["k"], jnp.int4),
          S(sh["ks"], jnp.float32), S(sh["v"], jnp.int4), S(sh["vs"], jnp.float32),
          S((b * hkv,), jnp.int32), None, S((b, n_pages), jnp.int32))
  return M.partition.trace(*args, tile=tile, splits=kw.pop("splits", 4), v_major=v_major,
                           qk_scale=0.1, **kw).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("d,tile,v_major", [(128, 128, "dim"), (64, 128, "dim"),
                                            (128, 64, "token"), (64, 64, "dim")])
def test_kernel_lowers_to_mosaic_gpu(d, tile, v_major):
  assert "mosaic_gpu" in _lower(d, tile, v_major, approx_math=True, no_auto_barriers=True)


def test_narrow_columns_lower_or_name_what_they_need():
  assert_narrow_lowers(lambda **kw: _lower(128, 128, **kw))



# ---- base: the codes of a layer stack read at one layer's pages (mgpu_decode's int4 pool) -----

def _stack(n_layers, b, hkv, g, d, tile, n_pages, lens, seed):
  """``pool`` for ``n_layers`` layers: codes stacked ``[L * P, ...]``, scales per layer."""
  parts = [pool(b, hkv, g, d, tile, n_pages, lens, seed + i) for i in range(n_layers)]
  q, _, _, _, _, lens, tbl = parts[0]
  k = jnp.concatenate([x[1] for x in parts])
  v = jnp.concatenate([x[3] for x in parts])
  return q, k, v, [(x[2], x[4]) for x in parts], [(x[1], x[3]) for x in parts], lens, tbl


@pytest.mark.parametrize("hkv,g,d,tile", [(2, 7, 64, 64), (1, 8, 128, 128)])
def test_base_reads_the_codes_of_one_layer_of_a_stack(hkv, g, d, tile):
  b, n_pages = 2, 3
  q, k, v, scales, layers, lens, tbl = _stack(3, b, hkv, g, d, tile, n_pages,
                                              [n_pages * tile - 3, 1], seed=40 + d)
  p = k.shape[0] // 3
  sm = d ** -0.5
  f = jax.jit(lambda base, ks, vs: M.merge(*M.pool_reference(
      q, k, ks, v, vs, lens, tbl, base, splits=3, qk_scale=sm * M.LOG2E)))
  rel = lambda x, y: float(jnp.linalg.norm(x - y) / jnp.linalg.norm(y))
  for layer in (0, 2, 1):
    (ks, vs), (kl, vl) = scales[layer], layers[layer]
    got = f(jnp.asarray([layer * p], jnp.int32), ks, vs)[:, :g]
    alone = M.merge(*M.pool_reference(q, kl, ks, vl, vs, lens, tbl, splits=3,
                                      qk_scale=sm * M.LOG2E))[:, :g]
    assert rel(got, alone) < 1e-6, layer          # the same math (jit and eager round apart)
    other = f(jnp.asarray([(layer + 1) % 3 * p], jnp.int32), ks, vs)[:, :g]
    assert rel(other, alone) > 0.1, layer         # another layer's codes: another result
    kc, ksc, vc, vsc = M.pool_gather(kl, ks, vl, vs, tbl)
    ref = M.attend_reference(q, kc, ksc, jnp.swapaxes(vc, 1, 2), vsc, lens, sm_scale=sm)[:, :g]
    assert float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref)) < 4e-3, layer


def test_base_lowers_and_is_checked():
  S = jax.ShapeDtypeStruct
  b, hkv, d, tile, n_pages, n_l = 2, 2, 128, 128, 8, 3
  p = b * n_pages + 3
  sh = M.pool_shapes(p, hkv, tile, d)
  stack = lambda shape: S((n_l * shape[0],) + shape[1:], jnp.int4)
  args = (S((b * hkv, M.N_PAD, d), jnp.bfloat16), stack(sh["k"]), S(sh["ks"], jnp.float32),
          stack(sh["v"]), S(sh["vs"], jnp.float32), S((b * hkv,), jnp.int32), None,
          S((b, n_pages), jnp.int32), S((1,), jnp.int32))
  text = M.partition.trace(*args, tile=tile, splits=4, qk_scale=0.1, approx_math=True,
                           no_auto_barriers=True).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text
  q, k, ks, v, vs, lens, tbl = pool(2, 2, 4, 64, 64, 4, [256, 10], seed=3)
  with pytest.raises(ValueError, match="^base offsets the page ids of a paged pool: it needs tbl"):
    M.partition(q, k[0], ks[0], jnp.swapaxes(v[0], 1, 2), vs[0], lens, None, None,
                jnp.zeros((1,), jnp.int32), tile=64, splits=1)
  with pytest.raises(ValueError, match=r"^ks must have shape \(10, 2, 64\)"):
    M.partition(q, k, ks[:3], v, vs, lens, None, tbl, tile=64, splits=2)   # no base: one layer
  two = jnp.concatenate([k, k])
  with pytest.raises(ValueError, match=r"^ks must have shape \(20, 2, 64\)"):
    M.partition(q, two, ks[:3], jnp.concatenate([v, v]), vs[:3], lens, None, tbl,
                jnp.zeros((1,), jnp.int32), tile=64, splits=2)           # 3 does not divide 20


# ---- scale planes: the cache's "int4" scales [L * P, Hkv, 2, page] f16, as stored -------------

def test_scale_planes_read_like_separate_scales_at_the_codes_layer():
  b, hkv, g, d, tile, n_pages = 2, 2, 7, 64, 64, 3
  q, k, v, scales, layers, lens, tbl = _stack(3, b, hkv, g, d, tile, n_pages,
                                              [n_pages * tile - 3, 1], seed=70)
  p = k.shape[0] // 3
  # planes of every layer, fp16 as the cache stores them; NaN past each row's length (a page's
  # unwritten rows may hold any bits): the kernel's masking keeps them out
  planes = jnp.concatenate([jnp.stack([ks, vs], 2) for ks, vs in scales]).astype(jnp.float16)
  r = jnp.arange(tile)
  for s in range(b):
    last = int(tbl[s, (int(lens[s * hkv]) - 1) // tile]) if int(lens[s * hkv]) else None
    if last is not None:
      cut = (int(lens[s * hkv]) - 1) % tile + 1
      planes = planes.at[last::p, :, :, :].set(
          jnp.where(r >= cut, jnp.float16(jnp.nan), planes[last::p]))
  sm = d ** -0.5
  for layer in (2, 0):
    (ks, vs), _ = scales[layer], layers[layer]
    base = jnp.asarray([layer * p], jnp.int32)
    got = M.merge(*M.pool_reference(q, k, planes, v, None, lens, tbl, base, splits=3,
                                    qk_scale=sm * M.LOG2E))[:, :g]
    sep = M.merge(*M.pool_reference(q, k, ks.astype(jnp.float16).astype(jnp.float32), v,
                                    vs.astype(jnp.float16).astype(jnp.float32), lens, tbl, base,
                                    splits=3, qk_scale=sm * M.LOG2E))[:, :g]
    assert bool(jnp.isfinite(got).all())
    assert float(jnp.linalg.norm(got - sep) / jnp.linalg.norm(sep)) < 1e-6, layer
  S = jax.ShapeDtypeStruct
  args = (S(q.shape, q.dtype), S(k.shape, k.dtype), S(planes.shape, jnp.float16),
          S(v.shape, v.dtype), None, S(lens.shape, jnp.int32), None, S(tbl.shape, jnp.int32),
          S((1,), jnp.int32))
  text = M.partition.trace(*args, tile=tile, splits=3, qk_scale=0.1, approx_math=True,
                           no_auto_barriers=True).lower(
                               lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text
  with pytest.raises(ValueError, match=r"^ks must have shape \(24, 2, 2, 64\)"):
    M.partition(q, k, planes[:, :, 0], v, None, lens, None, tbl, base, tile=64, splits=3)
  with pytest.raises(ValueError, match="^scale planes must be float16 or float32"):
    M.partition(q, k, planes.astype(jnp.bfloat16), v, None, lens, None, tbl, base, tile=64,
                splits=3)
  with pytest.raises(ValueError, match="^vs=None .* needs tbl"):
    M.partition(q, k[0], planes[0, 0], v[0], None, lens, tile=64, splits=1)


# ---- the warp-specialized kernel over the pool (partition_ws with a page table) ---------------

@pytest.mark.parametrize("hkv,g,d,wgs,splits", [
    (2, 1, 64, 2, 1), (1, 2, 128, 3, 1), (2, 4, 128, 2, 2), (2, 7, 64, 3, 1), (1, 8, 64, 2, 1)])
def test_warp_specialized_pool_algorithm_matches_float32_attention(hkv, g, d, wgs, splits):
  """One partial per (split, warpgroup), merged to float32 attention: ragged, empty and full
  rows, every GQA ratio. (Which pages a partial reads is the kernel's index maps: checked on the
  GPU against this reference, ``bench/bench_mgpu_int4.py --paged``.)"""
  tile, b = 64, 3
  n_pages = 2 * wgs * splits
  lens = [n_pages * tile, tile * wgs + 5, 0]
  q, k, ks, v, vs, lens, tbl = pool(b, hkv, g, d, tile, n_pages, lens, seed=7 * wgs + g)
  sm = d ** -0.5
  o, m, l = M.pool_reference(q, k, ks, v, vs, lens, tbl, splits=splits, wgs=wgs,
                             qk_scale=sm * M.LOG2E)
  assert o.shape == (b * hkv, splits * wgs, d, M.N_PAD)
  got = M.merge(o, m, l)[:, :g]
  kc, ksc, vc, vsc = M.pool_gather(k, ks, v, vs, tbl)
  ref = M.attend_reference(q, kc, ksc, jnp.swapaxes(vc, 1, 2), vsc, lens, sm_scale=sm)[:, :g]
  live = np.asarray(lens) > 0
  err = float(jnp.linalg.norm(got[live] - ref[live]) / jnp.linalg.norm(ref[live]))
  assert err < 4e-3, err
  assert float(jnp.abs(got[~live]).max()) == 0.0


def _lower_ws(d, wgs, planes, cols=M.N_PAD, table="gmem"):
  S = jax.ShapeDtypeStruct
  b, hkv, tile, n_pages, n_l = 2, 2, 128, 4 * wgs, 3
  p = b * n_pages + 3
  sh = M.pool_shapes(p, hkv, tile, d)
  stack = lambda shape, dt: S((n_l * shape[0],) + shape[1:], dt)
  if planes:    # the cache's stacked fp16 K/V planes, offset by base like the codes
    sc = (stack(sh["s"], jnp.float16), stack(sh["v"], jnp.int4), None)
  else:
    sc = (S(sh["ks"], jnp.float32), stack(sh["v"], jnp.int4), S(sh["vs"], jnp.float32))
  args = (S((b * hkv, M.N_PAD, d), jnp.bfloat16), stack(sh["k"], jnp.int4), *sc,
          S((b * hkv,), jnp.int32), S((b, n_pages), jnp.int32), S((1,), jnp.int32))
  return M.partition_ws.trace(*args, tile=tile, splits=2, wgs=wgs, qk_scale=0.1, cols=cols,
                              approx_math=True, no_auto_barriers=True, table=table).lower(
                                  lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("d,wgs,planes,table", [(128, 2, True, "gmem"), (64, 3, False, "smem"),
                                                (64, 2, True, "smem")])
def test_warp_specialized_pool_kernel_lowers_to_mosaic_gpu(d, wgs, planes, table):
  assert "mosaic_gpu" in _lower_ws(d, wgs, planes, table=table)


def test_warp_specialized_narrow_columns_lower_or_name_what_they_need():
  assert_narrow_lowers(lambda cols=M.N_PAD, **kw: _lower_ws(128, 2, True, cols=cols))


def test_warp_specialized_pool_input_is_checked():
  q, k, ks, v, vs, lens, tbl = pool(2, 2, 4, 64, 64, 4, [256, 10], seed=3)
  ws = lambda **kw: M.partition_ws(q, k, ks, v, vs, lens, tbl, **{"tile": 64, **kw})
  with pytest.raises(ValueError, match="must divide into 6 splits"):
    ws(splits=3, wgs=2)
  with pytest.raises(ValueError, match=r"^wgs \(compute warpgroups\) must be 1, 2 or 3, got 4"):
    ws(splits=1, wgs=4)
  with pytest.raises(ValueError, match="^the pool's pages hold 64 tokens but tile is 128"):
    ws(tile=128, splits=1)
  with pytest.raises(ValueError, match="^base and vs=None .* need tbl"):
    M.partition_ws(q, k[0], ks[0], v[0], None, lens, None, tile=64, splits=1)


@pytest.mark.parametrize("steps", [3, 40])
def test_page_ids_in_shared_memory_lower_and_are_checked(steps):
  """``table="smem"``: each block's page ids copied once into shared memory (padded to 128
  bytes, the copy unit Mosaic GPU takes), fewer and more ids than one 32-id box."""
  lower = lambda **kw: _lower(128, 128, n_pages=2 * steps, splits=2, approx_math=True,
                             no_auto_barriers=True, **kw)
  smem = lower(table="smem")
  assert "mosaic_gpu" in smem and smem != lower()
  q, k, ks, v, vs, lens, tbl = pool(2, 2, 4, 64, 64, 4, [256, 10], seed=3)
  with pytest.raises(ValueError, match="^table must be 'gmem' or 'smem', got 'tmem'"):
    M.partition(q, k, ks, v, vs, lens, None, tbl, tile=64, splits=2, table="tmem")
