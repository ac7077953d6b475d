"""The integration probe of the Mosaic GPU INT4 partition (pallas_kernels/gpu/mgpu_qk.py,
``qk_paged``): QK statistics read straight from the cache's paged INT4 pool, on a CPU host.

Mosaic GPU refuses 8-bit arithmetic, so the kernel splits a pool byte with bitwise operations
only and moves the difference into q (1/16 on its high half) and a per-row bias. The tests check
that arithmetic (emulated in jnp on the same bytes, gathered through shuffled page tables)
against the float32 math on the original q, the page gather against the pool, and the kernel's
lowering to Mosaic GPU for CUDA. The kernel itself runs on the H200: ``bench/bench_mgpu_qk.py
--paged``.
"""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from pallas_kernels import int4  # noqa: E402
from pallas_kernels.gpu import mgpu_qk as M  # noqa: E402
from pallas_kernels.testing.synth import paged_pool  # noqa: E402

pytestmark = pytest.mark.fast_compile


@pytest.mark.parametrize("hkv,d,page,splits", [(2, 64, 64, 2), (3, 128, 64, 4), (1, 128, 128, 1)])
def test_nibble_arithmetic_equals_float32_scores(hkv, d, page, splits):
  q, pool, tbl, ks = paged_pool(2, hkv, d, 4 * page, page, seed=hkv + d, n_pad=M.N_PAD)
  assert jnp.unique(tbl).size == tbl.size and int(tbl.max()) < pool.shape[0]
  qn, bias = M.nibble_q(q)
  ref = M.qk_paged_reference(q, pool, tbl, ks, splits=splits)
  got = M.qk_paged_emulated(qn, bias, pool, tbl, ks, splits=splits)
  assert float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref)) < 1e-5


def test_paged_keys_follow_the_table():
  q, pool, tbl, ks = paged_pool(2, 3, 64, 128, 64, seed=7, n_pad=M.N_PAD)
  k, s = M.paged_keys(pool, tbl, ks)
  codes, hkv, page = np.asarray(int4.unpack(pool)), 3, 64
  for b, j, h in [(0, 0, 0), (1, 127, 2), (1, 64, 1)]:
    pg, r = int(tbl[b, j // page]), j % page
    np.testing.assert_array_equal(np.asarray(k[b * hkv + h, j]), codes[pg, r, h])
    assert float(s[b * hkv + h, j]) == float(ks[h, pg, r])


def test_bad_shapes_are_one_line_errors():
  q, pool, tbl, ks = paged_pool(2, 2, 64, 256, 64, seed=1, n_pad=M.N_PAD)
  qn, bias = M.nibble_q(q)
  with pytest.raises(ValueError, match="does not match"):
    M.qk_paged(qn[:, :, :32], bias, pool, tbl, ks)
  with pytest.raises(ValueError, match="must divide into 3 splits"):
    M.qk_paged(qn, bias, pool, tbl, ks, splits=3)


@pytest.mark.parametrize("d,page", [(128, 128), (64, 64), (128, 64)])
def test_paged_probe_lowers_to_mosaic_gpu(d, page):
  s = jax.ShapeDtypeStruct
  hkv, b = 2, 2
  args = (s((b * hkv, M.N_PAD, d), jnp.bfloat16), s((b * hkv, 4, M.N_PAD), jnp.float32),
          s((40, page, hkv, d // 2), jnp.uint8), s((b, 8), jnp.int32),
          s((hkv, 40, page), jnp.float32))
  text = M.qk_paged.trace(*args, splits=4).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text
