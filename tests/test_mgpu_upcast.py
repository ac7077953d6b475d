"""The INT4 -> bf16 A-operand upcast by 32-bit loads (pallas_kernels.gpu.mgpu_upcast).

CI has no GPU: the register mapping is replayed in numpy from Mosaic GPU's own layout
definitions (which thread holds which elements in which register, for the 4x-upcast load and for
the wgmma operand), the conversion bit for bit, and the kernel that uses it is lowered for CUDA.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.mosaic.gpu import fragmented_array as fa

from pallas_kernels.gpu import mgpu_int4 as M
from pallas_kernels.gpu import mgpu_upcast as U


def closed_form(cols: int) -> np.ndarray:
  """Column 32b + 8t + k (+ 4) of the 4x-upcast tile -> column 32b + 8k + 2t (+ 1) of the wgmma
  operand: thread t of a row holds columns 8t..8t+7 of each 32 in the first, 8j+2t, 8j+2t+1
  of each 8-column block j in the second; pair k of a word is codes k and k + 4."""
  pi = np.empty(cols, np.int64)
  for b in range(cols // 32):
    for t in range(4):
      for k in range(4):
        pi[32 * b + 8 * t + k] = 32 * b + 8 * k + 2 * t
        pi[32 * b + 8 * t + k + 4] = 32 * b + 8 * k + 2 * t + 1
  return pi


@pytest.mark.parametrize("rows,cols", [(64, 64), (128, 64), (64, 128), (128, 128), (64, 256)])
def test_perm_from_the_layouts_is_the_closed_form(rows, cols):
  assert U.perm(rows, cols).tolist() == closed_form(cols).tolist()


def test_convert_reference_decodes_every_code_in_every_position():
  rng = np.random.default_rng(0)
  codes = rng.integers(-8, 8, size=(257, 8))
  codes[:16, :] = np.arange(-8, 8)[:, None]            # every code in every nibble
  words = np.zeros(len(codes), np.uint64)
  for i in range(8):
    words |= (codes[:, i].astype(np.int64) & 0xF).astype(np.uint64) << np.uint64(4 * i)
  out = U.convert_reference(words.astype(np.uint32))
  want = np.stack([codes[:, :4], codes[:, 4:]], axis=-1).astype(np.float32)   # pair k: k, k+4
  np.testing.assert_array_equal(out, want)
  np.testing.assert_array_equal(U.convert_reference(words.astype(np.uint32), sub=False),
                                want + 136)


def test_convert_reference_over_all_256_byte_values_in_each_byte():
  """The dequant bit trick on every byte value (two codes) at each of a word's four bytes, the
  other bytes random: byte j holds codes 2j, 2j + 1, which land in pairs j // 2 ... (k, k + 4)."""
  rng = np.random.default_rng(1)
  vals = np.arange(256, dtype=np.uint32)
  sign = lambda x: np.where(x >= 8, x.astype(np.int64) - 16, x.astype(np.int64))
  for j in range(4):
    words = rng.integers(0, 2 ** 32, size=256, dtype=np.uint64).astype(np.uint32)
    words = (words & ~np.uint32(0xFF << (8 * j))) | (vals << np.uint32(8 * j))
    out = U.convert_reference(words)                  # [256, 4, 2]: pair k = codes k, k + 4
    codes = np.stack([sign((words >> np.uint32(4 * i)) & np.uint32(0xF)) for i in range(8)], 1)
    np.testing.assert_array_equal(out[..., 0], codes[:, :4])
    np.testing.assert_array_equal(out[..., 1], codes[:, 4:])
    np.testing.assert_array_equal(codes[:, 2 * j], sign(vals & 0xF))
    np.testing.assert_array_equal(codes[:, 2 * j + 1], sign(vals >> 4))


def replay(tile: np.ndarray) -> np.ndarray:
  """What the kernel's registers hold as the wgmma operand, replayed: each thread's 4x-upcast
  registers packed into 32-bit words as memory holds them (code i in bits 4i..4i+3), converted
  pair by pair, each pair put in the register and elements the kernel puts it in."""
  rows, cols = tile.shape
  ur, wr, axis = U.register_blocks(tile.shape)
  u = U.elements(fa.WGMMA_LAYOUT_UPCAST_4X, tile.shape)
  w = U.elements(fa.WGMMA_LAYOUT, tile.shape)
  w_index = {ti: i for i, ti in enumerate(np.ndindex(wr))}
  flat = tile.reshape(-1)
  out = np.full(rows * cols, np.nan)
  for i, ui in enumerate(np.ndindex(ur)):
    nib = (flat[u[i]].astype(np.int64) & 0xF).astype(np.uint64)          # [128, 8]
    words = (nib << (4 * np.arange(8, dtype=np.uint64))).sum(axis=1).astype(np.uint32)
    pairs = U.convert_reference(words)                                   # [128, 4, 2]
    for k in range(4):
      j = w_index[U.target_register(ui, k, axis)]
      out[w[j]] = pairs[:, k, :]
  return out.reshape(rows, cols)


@pytest.mark.parametrize("rows,cols", [(64, 64), (128, 128), (128, 64)])
def test_registers_hold_the_tile_with_its_columns_permuted(rows, cols):
  rng = np.random.default_rng(rows + cols)
  k = rng.integers(-8, 8, size=(rows, cols))
  got = replay(k)
  assert not np.isnan(got).any()                       # every element written once
  pi = U.perm(rows, cols)
  np.testing.assert_array_equal(got[:, pi], k)
  # ... so the scores against q permuted the same way are the plain scores.
  q = rng.standard_normal((16, cols))
  qp = np.asarray(U.permute_minor(jnp.asarray(q, jnp.float32), rows), np.float64)
  s = got @ qp.T
  ref = k @ q.T
  assert np.linalg.norm(s - ref) / np.linalg.norm(ref) < 1e-6


@pytest.mark.parametrize("d", [128, 64])
def test_kernel_with_permuted_k_lowers(d):
  S = jax.ShapeDtypeStruct
  bh, n = 4, 4096
  args = (S((bh, M.N_PAD, d), jnp.bfloat16), S((bh, n, d), jnp.int4), S((bh, n), jnp.float32),
          S((bh, d, n), jnp.int4), S((bh, n), jnp.float32), S((bh,), jnp.int32))
  text = M.partition.trace(*args, tile=128, splits=4, qk_scale=0.1, k_upcast="bf16_perm",
                           ).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text


def test_bad_upcasts_are_one_line_errors():
  S = jax.ShapeDtypeStruct
  args = (S((4, M.N_PAD, 64), jnp.bfloat16), S((4, 4096, 64), jnp.int4), S((4, 4096), jnp.float32),
          S((4, 64, 4096), jnp.int4), S((4, 4096), jnp.float32), S((4,), jnp.int32))
  with pytest.raises(ValueError, match="k_upcast must be one of"):
    M.partition.trace(*args, tile=128, splits=4, k_upcast="perm")
  with pytest.raises(ValueError, match="v_upcast must be one of"):
    M.partition.trace(*args, tile=128, splits=4, v_upcast="s8")
  tok = args[:3] + (S((4, 4096, 64), jnp.int4),) + args[4:]
  with pytest.raises(ValueError, match="^v_upcast='bf16_perm' reads dim-major V"):
    M.partition.trace(*tok, tile=128, splits=4, v_major="token", v_upcast="bf16_perm")
  with pytest.raises(ValueError, match="multiples of 32"):
    U.perm(64, 48)


def test_store_order_round_trips_and_repeats_every_32_tokens():
  x = jnp.arange(3 * 256).reshape(3, 256)
  st = U.store_order(x)
  assert bool(jnp.array_equal(U.token_order(st), x))
  assert bool(jnp.array_equal(st[:, 32:64] - 32, st[:, :32]))      # each 32 keeps its tokens
  assert sorted(np.asarray(st[0, :32]).tolist()) == list(range(32))


@pytest.mark.parametrize("d", [64, 128])
def test_v_registers_hold_the_tokens_in_order_from_the_stored_order(d):
  """V^T [D, T] stored with its tokens in store_order: the operand the kernel builds (replayed)
  holds every token's values in token order, so P^T's rows need no change."""
  rng = np.random.default_rng(d)
  vt = rng.integers(-8, 8, size=(d, 128))
  got = replay(np.asarray(U.store_order(jnp.asarray(vt))))
  np.testing.assert_array_equal(got, vt)


@pytest.mark.parametrize("g,d", [(4, 128), (7, 64), (8, 128), (1, 64)])
def test_reference_reads_the_stored_order_as_the_kernel_does(g, d):
  """partition_reference with v_upcast='bf16_perm' on codes in store_order equals the plain
  reference on the same codes in token order (ragged lengths, an empty row)."""
  bh, n, tile = 3, 512, 128
  ks = jax.random.split(jax.random.key(g * d), 6)
  q = jnp.zeros((bh, M.N_PAD, d), jnp.bfloat16).at[:, :g].set(
      jax.random.normal(ks[0], (bh, g, d)).astype(jnp.bfloat16))
  codes = lambda key, shape: jax.random.randint(key, shape, -8, 8).astype(jnp.int4)
  k, v = codes(ks[1], (bh, n, d)), codes(ks[2], (bh, d, n))
  sk = jax.random.uniform(ks[3], (bh, n), minval=0.05, maxval=0.3)
  sv = jax.random.uniform(ks[4], (bh, n), minval=0.05, maxval=0.3)
  lens = jnp.array([n, 300, 0], jnp.int32)
  kn = dict(tile=tile, splits=2, v_major="dim", qk_scale=0.2)
  want = M.partition_reference(q, k, sk, v, sv, lens, **kn)
  got = M.partition_reference(q, k, sk, U.store_order(v), sv, lens, v_upcast="bf16_perm",
                              k_upcast="bf16_perm", **kn)
  for a, b in zip(got, want):
    assert bool(jnp.array_equal(a, b))


@pytest.mark.parametrize("d,wgs", [(128, 2), (64, 3)])
def test_warp_specialized_kernel_with_permuted_k_lowers(d, wgs):
  S = jax.ShapeDtypeStruct
  bh, n, tile = 4, 128 * wgs * 4 * 2, 128
  args = (S((bh, M.N_PAD, d), jnp.bfloat16), S((bh, n, d), jnp.int4), S((bh, n), jnp.float32),
          S((bh, n // tile, d, tile), jnp.int4), S((bh, n), jnp.float32), S((bh,), jnp.int32))
  text = M.partition_ws.trace(*args, tile=tile, splits=4, wgs=wgs, qk_scale=0.1,
                              k_upcast="bf16_perm").lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text
  with pytest.raises(ValueError, match="^the warp-specialized kernel takes k_upcast"):
    M.partition_ws.trace(*args, tile=tile, splits=4, wgs=wgs, k_upcast="bf16_up4")


def _lowered(paged: bool, **kn) -> str:
  """``partition`` (4B-like head dim, tiles of 128) lowered for CUDA, contiguous or over a pool."""
  S = jax.ShapeDtypeStruct
  bh, n, d, tile = 4, 4096, 128, 128
  q, lens = S((bh, M.N_PAD, d), jnp.bfloat16), S((bh,), jnp.int32)
  if paged:
    p, hkv = 70, 2
    args = (q, S((p, hkv, tile, d), jnp.int4), S((p, hkv, 2, tile), jnp.float16),
            S((p, hkv, d, tile), jnp.int4), None, lens, None, S((bh // hkv, 32), jnp.int32))
  else:
    args = (q, S((bh, n, d), jnp.int4), S((bh, n), jnp.float32), S((bh, d, n), jnp.int4),
            S((bh, n), jnp.float32), lens)
  return M.partition.trace(*args, tile=tile, splits=4, qk_scale=0.1, **kn).lower(
      lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("paged", [False, True])
def test_kernel_with_permuted_k_and_v_lowers(paged):
  assert "mosaic_gpu" in _lowered(paged, k_upcast="bf16_perm", v_upcast="bf16_perm")


@pytest.mark.parametrize("paged", [False, True])
def test_offset_k_kernel_lowers(paged):
  """k_upcast='bf16_perm_offset': the K operand without the conversion's subtract (code + 136)
  and 136 * sum(q) taken off the scores after the MMA."""
  text = _lowered(paged, k_upcast="bf16_perm_offset")
  assert "mosaic_gpu" in text and text != _lowered(paged, k_upcast="bf16_perm")


def test_offset_scores_lose_nothing_against_the_bf16_floor():
  """(K + 136) . q - 136 sum(q) in float32 (the MMA's accumulator) against K . q in float64,
  with query outliers like Qwen's (a few dims x30): the error is far below bf16's 4e-3."""
  rng = np.random.default_rng(5)
  q = rng.standard_normal((16, 128)).astype(np.float32)
  q[:, [3, 77]] *= 30
  q = np.asarray(jnp.asarray(q).astype(jnp.bfloat16).astype(jnp.float32))
  k = rng.integers(-8, 8, size=(512, 128)).astype(np.float32)
  got = ((k + U.OFFSET) @ q.T).astype(np.float32) - np.float32(U.OFFSET) * q.sum(-1)
  want = k.astype(np.float64) @ q.T.astype(np.float64)
  assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5


@pytest.mark.parametrize("d", [64, 128, 256])
def test_permute_minor_moves_each_column_where_perm_says(d):
  x = jnp.arange(3 * d).reshape(3, d)
  got = np.asarray(U.permute_minor(x))
  np.testing.assert_array_equal(got[:, U.perm(64, d)], np.asarray(x))
