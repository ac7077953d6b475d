"""The Mosaic GPU INT4 partition (pallas_kernels/gpu/mgpu_int4.py) on a CPU host.

CI has no GPU and jax 0.10's Mosaic GPU interpreter cannot run a wgmma whose A operand is in
registers, so the kernel is covered in two halves: its algorithm (tiles, context splits, masks,
base-2 online softmax with per-element row sums, scale folding, bf16 roundings, the log-sum-exp
merge) through ``partition_reference`` against the float32 math, and the kernel itself through
Pallas -> Mosaic GPU lowering for CUDA, which checks its layouts, swizzles, wgmma operands and
shared-memory budget. The kernel against the same reference on the H200: bench/bench_mgpu_int4.py.
"""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from pallas_kernels import int4  # noqa: E402
from pallas_kernels.gpu import mgpu_int4 as M  # noqa: E402
from pallas_kernels.testing.mgpu import assert_narrow_lowers  # noqa: E402

pytestmark = pytest.mark.fast_compile


def make(g: int, d: int, n: int, lens, seed: int, hkv: int = 2):
  """Fresh random q (G real rows of 16), int4 K/V codes, scales and the given lengths."""
  bh = len(lens)
  ks = jax.random.split(jax.random.key(seed), 5)
  q = jnp.zeros((bh, M.N_PAD, d), jnp.bfloat16)
  q = q.at[:, :g].set(jax.random.normal(ks[0], (bh, g, d)).astype(jnp.bfloat16))
  k = jax.random.randint(ks[1], (bh, n, d), -7, 8).astype(jnp.int4)
  v = jax.random.randint(ks[2], (bh, n, d), -7, 8).astype(jnp.int4)
  kscale = jax.random.uniform(ks[3], (bh, n), jnp.float32, 0.02, 0.4)
  vscale = jax.random.uniform(ks[4], (bh, n), jnp.float32, 0.02, 0.4)
  return q, k, kscale, v, vscale, jnp.asarray(lens, jnp.int32)


def rel(a, b) -> float:
  return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


@pytest.mark.parametrize("g", [1, 2, 4, 7, 8])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("v_major", ["dim", "token"])
def test_algorithm_matches_float32_attention(g, d, v_major):
  n, tile, splits = 1024, 64, 4
  rng = np.random.default_rng(g * 1000 + d)
  # Ragged: a full row, a row ending inside the first split (later splits empty), one key, random.
  lens = [n, int(rng.integers(2, n // splits)), 1, int(rng.integers(1, n + 1))]
  q, k, ks, v, vs, lens = make(g, d, n, lens, seed=g + d)
  sm = d ** -0.5
  vin = v if v_major == "token" else jnp.swapaxes(v, 1, 2)
  parts = M.partition_reference(q, k, ks, vin, vs, lens, tile=tile, splits=splits,
                                v_major=v_major, qk_scale=sm * M.LOG2E)
  assert all(p.shape == (4, splits, d, M.N_PAD) for p in parts)
  out = M.merge(*parts)[:, :g]
  ref = M.attend_reference(q, k, ks, v, vs, lens, sm_scale=sm)[:, :g]
  assert rel(out, ref) < 2.5e-3        # the bf16 floor: P and q enter the MMAs as bf16
  # Each row separately too, so a wrong short row cannot hide behind the long ones.
  for b in range(4):
    assert rel(out[b], ref[b]) < 4e-3, b


@pytest.mark.parametrize("g,d", [(1, 64), (7, 64), (4, 128), (8, 128)])
def test_int8_split_scores_match_float32_attention(g, d):
  """k_upcast="s8": q as two int8 halves, two exact integer products per tile, combined in f32."""
  n = 1024
  q, k, ks, v, vs, lens = make(g, d, n, [n, 333, 1, 900], seed=40 + g)
  sm = d ** -0.5
  q8, qscale = M.split_q(q)
  assert q8.dtype == jnp.int8 and q8.shape == (4, 2, M.N_PAD, d) and qscale.shape == (4,)
  back = qscale[:, None, None] * (q8[:, 0].astype(jnp.float32) + q8[:, 1] / M.Q_LO)
  err = jnp.abs(back - q.astype(jnp.float32)).max(axis=(1, 2))
  assert bool(jnp.all(err <= qscale / M.Q_LO * 0.5 + 1e-7))   # half a low-half step
  parts = M.partition_reference(q8, k, ks, jnp.swapaxes(v, 1, 2), vs, lens, qscale, tile=64,
                                splits=4, k_upcast="s8", qk_scale=sm * M.LOG2E)
  out = M.merge(*parts)[:, :g]
  ref = M.attend_reference(q, k, ks, v, vs, lens, sm_scale=sm)[:, :g]
  bf16 = M.merge(*M.partition_reference(q, k, ks, jnp.swapaxes(v, 1, 2), vs, lens, tile=64,
                                        splits=4, qk_scale=sm * M.LOG2E))[:, :g]
  # The bf16 P^T of the PV MMA sets the floor (1.6-2.8e-3 by seed); the int8 split of q adds
  # nothing visible on top of it.
  assert rel(out, ref) < 3e-3 and rel(out, ref) <= rel(bf16, ref) + 1e-4
  with pytest.raises(ValueError, match="split_q"):
    M.partition_reference(q, k, ks, jnp.swapaxes(v, 1, 2), vs, lens, tile=64, splits=4,
                          k_upcast="s8")


def test_empty_rows_give_zeros_not_nan():
  q, k, ks, v, vs, _ = make(4, 64, 512, [0, 0], seed=3)
  lens = jnp.asarray([0, 300], jnp.int32)
  out = M.merge(*M.partition_reference(q, k, ks, jnp.swapaxes(v, 1, 2), vs, lens,
                                       tile=64, splits=4))
  assert bool(jnp.all(jnp.isfinite(out)))
  assert float(jnp.abs(out[0]).max()) == 0.0 and float(jnp.abs(out[1, :4]).max()) > 0


def test_scale_fold_keeps_q_unrounded():
  """q scaled by sm_scale*log2(e) and then rounded to bf16 (the first prototype) lands above
  the bf16 floor; folding the factor into the K scale keeps it there."""
  d = 128
  q, k, ks, v, vs, lens = make(4, d, 1024, [1024, 700], seed=11)
  sm = d ** -0.5
  ref = M.attend_reference(q, k, ks, v, vs, lens, sm_scale=sm)[:, :4]
  vt = jnp.swapaxes(v, 1, 2)
  folded = M.merge(*M.partition_reference(q, k, ks, vt, vs, lens, tile=64, splits=2,
                                          qk_scale=sm * M.LOG2E))[:, :4]
  pre = (q.astype(jnp.float32) * sm * M.LOG2E).astype(jnp.bfloat16)
  prescaled = M.merge(*M.partition_reference(pre, k, ks, vt, vs, lens, tile=64, splits=2))[:, :4]
  assert rel(folded, ref) < rel(prescaled, ref)


def test_int4_view_of_half_split_bytes_is_the_interleaved_row():
  """Our packed rows read as jax int4 are a column permutation that ``interleave`` undoes on q:
  every byte value (all 256 nibble pairs) at every position."""
  d = 32
  codes = np.stack(np.meshgrid(np.arange(-8, 8), np.arange(-8, 8)), -1).reshape(256, 2)
  row = np.zeros((256, d), np.int8)
  rng = np.random.default_rng(0)
  for j in range(d // 2):
    perm = rng.permutation(256)
    row[:, j], row[:, j + d // 2] = codes[perm, 0], codes[perm, 1]
  packed = int4.pack(jnp.asarray(row))
  view = M.int4_view(packed)
  assert view.dtype == jnp.int4 and view.shape == (256, d)
  np.testing.assert_array_equal(np.asarray(view.astype(jnp.int32)),
                                np.asarray(M.interleave(jnp.asarray(row, jnp.int32))))
  q = jax.random.normal(jax.random.key(1), (3, d))
  np.testing.assert_allclose(np.asarray(M.interleave(q) @ view.astype(jnp.float32).T),
                             np.asarray(q @ jnp.asarray(row, jnp.float32).T), rtol=1e-5,
                             atol=1e-4)


def test_bad_shapes_are_one_line_errors():
  q, k, ks, v, vs, lens = make(4, 64, 512, [512, 100], seed=5)
  with pytest.raises(ValueError, match="q must have shape"):
    M.partition_reference(q[:, :8], k, ks, jnp.swapaxes(v, 1, 2), vs, lens, tile=64, splits=2)
  with pytest.raises(ValueError, match="v must have shape"):
    M.partition_reference(q, k, ks, v, vs, lens, tile=64, splits=2, v_major="dim")
  with pytest.raises(ValueError, match="divide into"):
    M.partition_reference(q, k, ks, v, vs, lens, tile=64, splits=3, v_major="token")
  with pytest.raises(ValueError, match="v_major"):
    M.partition_reference(q, k, ks, v, vs, lens, tile=64, splits=2, v_major="rows")
  with pytest.raises(ValueError, match="wgs"):
    M.partition_reference(q, k, ks, M.block_v(jnp.swapaxes(v, 1, 2), 64), vs, lens, tile=64,
                          splits=2, v_major="block", wgs=4)
  with pytest.raises(ValueError, match="v must have shape"):
    M.partition_ws(q, k, ks, jnp.swapaxes(v, 1, 2), vs, lens, tile=64, splits=2, wgs=2)


def _lower(d, v_major, tile, stages=2, splits=4, bh=4, n=4096, k_upcast="bf16",
           v_upcast="bf16", **knobs):
  S = jax.ShapeDtypeStruct
  v_shape = (bh, n, d) if v_major == "token" else (bh, d, n)
  s8 = k_upcast == "s8"
  q = S((bh, 2, M.N_PAD, d), jnp.int8) if s8 else S((bh, M.N_PAD, d), jnp.bfloat16)
  args = (q, S((bh, n, d), jnp.int4), S((bh, n), jnp.float32),
          S(v_shape, jnp.int4), S((bh, n), jnp.float32), S((bh,), jnp.int32))
  args += (S((bh,), jnp.float32),) if s8 else ()
  return M.partition.trace(*args, tile=tile, stages=stages, splits=splits, v_major=v_major,
                           qk_scale=0.1, k_upcast=k_upcast, v_upcast=v_upcast,
                           **knobs).lower(lowering_platforms=("cuda",))


@pytest.mark.parametrize("d,v_major,tile,k_upcast,v_upcast", [
    (128, "dim", 128, "bf16", "bf16"), (64, "dim", 128, "bf16", "bf16"),
    (128, "token", 64, "bf16", "bf16"), (64, "token", 128, "bf16", "bf16"),
    (128, "dim", 128, "bf16_up4", "bf16_up4"), (64, "dim", 128, "s8", "bf16_up4")])
def test_kernel_lowers_to_mosaic_gpu(d, v_major, tile, k_upcast, v_upcast):
  text = _lower(d, v_major, tile, k_upcast=k_upcast, v_upcast=v_upcast).as_text()
  assert "mosaic_gpu" in text


@pytest.mark.parametrize("d,k_upcast", [(128, "bf16"), (64, "bf16_perm"),
                                         (128, "bf16_perm_offset")])
def test_early_v_lowers_and_is_checked(d, k_upcast):
  """early_v moves V's upcast between the scores' MMAs and their wait: a different kernel."""
  text = _lower(d, "dim", 128, k_upcast=k_upcast, early_v=True).as_text()
  assert "mosaic_gpu" in text and text != _lower(d, "dim", 128, k_upcast=k_upcast).as_text()
  for bad in (dict(v_major="token"), dict(k_upcast="s8", v_major="dim")):
    with pytest.raises(ValueError, match="^early_v upcasts dim-major V beside bf16 K tiles; got "):
      _lower(d, **{"v_major": "dim", "tile": 128, **bad}, early_v=True)


@pytest.mark.parametrize("d,wgs,knobs", [
    (128, 2, {}), (64, 2, {}), (128, 3, dict(approx_math=True, no_auto_barriers=True)),
    (64, 3, dict(stages=4))])
def test_warp_specialized_kernel_lowers_to_mosaic_gpu(d, wgs, knobs):
  S = jax.ShapeDtypeStruct
  bh, n, tile = 4, 128 * wgs * 4 * 2, 128
  args = (S((bh, M.N_PAD, d), jnp.bfloat16), S((bh, n, d), jnp.int4), S((bh, n), jnp.float32),
          S((bh, n // tile, d, tile), jnp.int4), S((bh, n), jnp.float32), S((bh,), jnp.int32))
  text = M.partition_ws.trace(*args, tile=tile, splits=4, wgs=wgs, qk_scale=0.1,
                              **knobs).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text


def test_compiler_params_knobs_lower():
  text = _lower(64, "dim", 128).as_text()
  S = jax.ShapeDtypeStruct
  args = (S((4, M.N_PAD, 64), jnp.bfloat16), S((4, 4096, 64), jnp.int4), S((4, 4096), jnp.float32),
          S((4, 64, 4096), jnp.int4), S((4, 4096), jnp.float32), S((4,), jnp.int32))
  fast = M.partition.trace(*args, tile=128, splits=4, qk_scale=0.1, approx_math=True,
                           no_auto_barriers=True).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in fast and fast != text


def test_narrow_softmax_columns_lower_or_name_what_they_need():
  """cols=8 (<= 8 query heads per KV head) concatenates registers, which jax 0.10's Mosaic GPU
  cannot lower: there it is a one-line error naming the need; with jax >= 0.11 it lowers."""
  S = jax.ShapeDtypeStruct
  args = (S((4, M.N_PAD, 64), jnp.bfloat16), S((4, 4096, 64), jnp.int4), S((4, 4096), jnp.float32),
          S((4, 64, 4096), jnp.int4), S((4, 4096), jnp.float32), S((4,), jnp.int32))
  lower = lambda **kn: M.partition.trace(*args, tile=128, splits=4, qk_scale=0.1,
                                         **kn).lower(lowering_platforms=("cuda",)).as_text()
  with pytest.raises(ValueError, match="cols must be 8 or 16"):
    lower(cols=12)
  assert_narrow_lowers(lower)


def test_shared_memory_budget_is_checked_before_the_device():
  """CPU lowering does not know the device's limit, so the kernel checks its own estimate: it
  admits the largest configuration the H200 ran (128-row tiles, 4 stages, token-major V) and
  refuses one far over the limit with a one-line error."""
  assert M.smem_bytes(128, 128, 4, "token") < M.SM90_SMEM
  assert M.smem_bytes(128, 128, 4, "dim") < M.smem_bytes(128, 128, 4, "token")
  with pytest.raises(ValueError, match="shared memory"):
    _lower(128, "token", 256, stages=8)
