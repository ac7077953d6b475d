"""The Mosaic GPU INT4 partition over the paged pool (pallas_kernels/gpu/mgpu_paged.py) on a CPU
host: its algorithm through ``partition_paged_reference`` (the pool gathered through shuffled
page tables) against float32 attention, the bitwise nibble split on every byte, and the kernel's
lowering to Mosaic GPU for CUDA. On the H200: ``bench/bench_mgpu_int4.py --paged``."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from pallas_kernels import int4  # noqa: E402
from pallas_kernels.gpu import mgpu_int4 as M  # noqa: E402
from pallas_kernels.gpu import mgpu_paged as MP  # noqa: E402
from pallas_kernels.testing.synth import paged_pool  # noqa: E402
from pallas_kernels.testing.mgpu import assert_narrow_lowers  # noqa: E402

pytestmark = pytest.mark.fast_compile


def make(b, hkv, g, d, page, n_pages, lens, seed):
  """q (G real rows of 16), K and V pools with shuffled tables, head-major scales, lengths."""
  q, kpool, tbl, ks = paged_pool(b, hkv, d, n_pages * page, page, n_pad=M.N_PAD, seed=seed)
  q = q.at[:, g:].set(0)
  _, vpool, _, vs = paged_pool(b, hkv, d, n_pages * page, page, n_pad=M.N_PAD, seed=seed + 1)
  return q, kpool, ks, vpool, vs, tbl, jnp.asarray(lens, jnp.int32)


@pytest.mark.parametrize("hkv,g,d,page,splits,layout", [
    (2, 7, 64, 64, 2, "token"), (2, 4, 128, 128, 2, "head"), (1, 8, 128, 64, 4, "token"),
    (3, 1, 64, 64, 1, "head"), (2, 2, 64, 128, 2, "head")])
def test_algorithm_matches_float32_attention(hkv, g, d, page, splits, layout):
  n_pages, b = 4, 3
  lens = [n_pages * page, page + 5, 0][:b]          # full, ragged mid-page, empty
  q, kp, ks, vp, vs, tbl, lens = make(b, hkv, g, d, page, n_pages, lens, seed=hkv * d + g)
  sm = d ** -0.5
  pool = (lambda x: x) if layout == "token" else (lambda x: jnp.swapaxes(x, 1, 2))
  o, m, l = MP.partition_paged_reference(q, pool(kp), ks, pool(vp), vs, tbl, lens,
                                         splits=splits, qk_scale=sm * M.LOG2E, layout=layout)
  got = M.merge(o, m, l)[:, :g]
  kc, kss = MP.gather(kp, tbl, ks)
  vc, vss = MP.gather(vp, tbl, vs)
  ref = M.attend_reference(q, kc, kss, vc, vss, jnp.repeat(lens, hkv), sm_scale=sm)[:, :g]
  assert not jnp.isnan(got).any()
  assert float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref)) < 4e-3
  empty = np.repeat(np.asarray(lens) == 0, hkv)
  assert float(jnp.abs(got[empty]).max()) == 0.0


def test_bitwise_halves_of_every_byte_are_the_two_elements():
  """What the kernel does to a byte, on all 256: ``((x & 15) ^ 8) - 8`` is the low element and
  ``(x & -16) / 16`` the high one, as ``int4.unpack`` reads them."""
  x = jnp.arange(256, dtype=jnp.int32).astype(jnp.uint8)[None, :]
  want = np.asarray(int4.unpack(x), np.float32)[0]            # [512]: 256 low, then 256 high
  s = jax.lax.bitcast_convert_type(x, jnp.int8)[0]
  lo = (((s & jnp.int8(15)) ^ jnp.int8(8)).astype(jnp.bfloat16) - 8).astype(jnp.float32)
  hi = (s & jnp.int8(-16)).astype(jnp.bfloat16).astype(jnp.float32) / 16
  np.testing.assert_array_equal(np.asarray(lo), want[:256])
  np.testing.assert_array_equal(np.asarray(hi), want[256:])


def test_gather_follows_the_tables():
  q, kp, ks, vp, vs, tbl, lens = make(2, 3, 2, 64, 64, 2, [128, 3], seed=5)
  c, s = MP.gather(kp, tbl, ks)
  codes = np.asarray(int4.unpack(kp))
  for b, j, h in [(0, 0, 0), (1, 127, 2), (1, 64, 1)]:
    pg, r = int(tbl[b, j // 64]), j % 64
    np.testing.assert_array_equal(np.asarray(c[b * 3 + h, j], np.int8), codes[pg, r, h])
    assert float(s[b * 3 + h, j]) == float(ks[h, pg, r])


def test_bad_input_is_one_line():
  q, kp, ks, vp, vs, tbl, lens = make(2, 2, 4, 64, 64, 4, [256, 10], seed=3)
  qn, bias = MP.nibble_q(q)
  call = lambda **kw: MP.partition_paged(*[kw.get(n, a) for n, a in zip(
      ("q", "bias", "k", "ks", "v", "vs", "tbl", "lens"), (qn, bias, kp, ks, vp, vs, tbl, lens))],
      splits=kw.get("splits", 2))
  with pytest.raises(ValueError, match=r"^q must have shape \(4, 16, 64\)"):
    call(q=qn[:, :8])
  with pytest.raises(ValueError, match="^k must be the uint8 pool"):
    call(k=kp.astype(jnp.int8))
  with pytest.raises(ValueError, match=r"^ks must have shape \(2, 10, 64\)"):
    call(ks=ks[:, :, :32])
  with pytest.raises(ValueError, match="^4 pages must divide into 3 splits"):
    call(splits=3)
  with pytest.raises(ValueError, match="^layout must be 'token'"):
    MP.partition_paged(qn, bias, kp, ks, vp, vs, tbl, lens, splits=2, layout="page")
  with pytest.raises(ValueError, match="cols must be 8 or 16"):
    MP.partition_paged(qn, bias, kp, ks, vp, vs, tbl, lens, splits=2, cols=4)


def _lower(d, page, hkv=2, b=2, n_pages=8, **kw):
  s = jax.ShapeDtypeStruct
  p = b * n_pages + 3
  pool = s((p, hkv, page, d // 2) if kw.get("layout") == "head" else (p, page, hkv, d // 2),
           jnp.uint8)
  sc = s((hkv, p, page), jnp.float32)
  args = (s((b * hkv, M.N_PAD, d), jnp.bfloat16), s((b * hkv, 4, M.N_PAD), jnp.float32), pool, sc,
          pool, sc, s((b, n_pages), jnp.int32), s((b,), jnp.int32))
  return MP.partition_paged.trace(*args, splits=4, qk_scale=0.1, **kw).lower(
      lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("d,page,layout", [(128, 128, "token"), (64, 64, "token"),
                                           (128, 64, "head"), (64, 128, "head")])
def test_kernel_lowers_to_mosaic_gpu(d, page, layout):
  assert "mosaic_gpu" in _lower(d, page, approx_math=True, no_auto_barriers=True, layout=layout)


def test_narrow_columns_lower_or_name_what_they_need():
  assert_narrow_lowers(lambda **kw: _lower(128, 128, **kw))
