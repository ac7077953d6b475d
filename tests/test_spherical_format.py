"""The Spherical KV key format (pallas_kernels.spherical; docs/SPHERICAL_KV.md §2.1–2.3):
the quantizer against a float64 atan2 oracle, code ranges, bit-exactness under jit and eagerly,
packing of every byte value, the decode tables, CosFromAngles against the decoded dot product, and
the tier byte sizes of the §2.3 table."""

import math
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import spherical as S

pytestmark = pytest.mark.fast_compile

DIMS = (64, 128)
CASES = [(lay, d) for d in DIMS for lay in S.LAYOUTS]


def _keys(seed, n, d):
  """Anisotropic Gaussian keys with per-row scales over four decades (never zero)."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((n, d)) * rng.uniform(0.2, 3.0, d)[None, :]
  return (x * 10.0 ** rng.uniform(-2, 2, (n, 1))).astype(np.float32)


def _level_bits(sp):
  lv = S.level_of_position(sp.d)
  return lv, np.where(lv == 1, sp.b1, np.where(lv == 0, 0, sp.bh))


@pytest.mark.parametrize("layout,d", CASES)
def test_codes_match_the_float64_atan2_definition_away_from_boundaries(layout, d):
  sp = S.spec(layout, d)
  x = _keys(1 + d, 3000, d)
  codes, r = jax.jit(S.encode, static_argnums=1)(jnp.asarray(x), sp)
  codes = np.asarray(codes)
  ref, r_ref, phi = S.encode_numpy(x, sp)
  lv = S.level_of_position(d)
  # Distance of every angle to the nearest boundary of its level (cyclic on level 1).
  near = np.zeros(phi.shape, bool)
  for lvl in range(1, sp.levels + 1):
    b = S.boundaries(sp, lvl)
    dist = np.abs(phi[..., lv == lvl, None] - b)
    if lvl == 1:
      dist = np.minimum(dist, 2 * np.pi - dist)
    near[..., lv == lvl] = dist.min(-1) < 1e-5
  diff = codes != ref
  assert not np.any(diff & ~near), "codes differ from atan2's away from a bin boundary"
  # Near a boundary the two may disagree by one bin only.
  step = np.abs(codes.astype(int) - ref)
  cyc = np.where(lv == 1, np.minimum(step, 2**sp.b1 - step), step)
  assert np.all(cyc[diff] == 1)
  np.testing.assert_allclose(np.asarray(r), r_ref, rtol=2e-6)


@pytest.mark.parametrize("layout,d", CASES)
def test_code_ranges_pad_and_radius(layout, d):
  sp = S.spec(layout, d)
  x = _keys(7 * d, 2000, d)
  codes, r = S.encode(jnp.asarray(x), sp)
  codes = np.asarray(codes)
  lv, bits = _level_bits(sp)
  assert codes.shape == (2000, d)
  assert np.all(codes >= 0) and np.all(codes < 2 ** bits[None, :] + (bits == 0))
  assert np.all(codes[:, lv == 0] == 0)
  # Every code of every level is used on random data (the quantizer covers its range).
  for lvl in range(1, sp.levels + 1):
    nb = sp.b1 if lvl == 1 else sp.bh
    used = np.unique(codes[:, lv == lvl])
    if lvl <= 3:
      assert len(used) == 2**nb, (lvl, used)
  np.testing.assert_allclose(
    np.asarray(r), np.linalg.norm(x.astype(np.float64), axis=-1), rtol=2e-6
  )


@pytest.mark.parametrize("layout,d", CASES)
def test_decoded_angles_are_within_half_a_bin(layout, d):
  sp = S.spec(layout, d)
  x = _keys(3 * d + 1, 1000, d)
  codes, _ = S.encode(jnp.asarray(x), sp)
  codes = np.asarray(codes)
  _, _, phi = S.encode_numpy(x, sp)
  lv = S.level_of_position(d)
  dl = S.steps(sp)
  for lvl in range(1, sp.levels + 1):
    m = lv == lvl
    dec = S.centers(sp, lvl)[codes[:, m]]
    err = np.abs(dec - phi[:, m])
    if lvl == 1:
      err = np.minimum(err, 2 * np.pi - err)
      assert np.all(err <= dl[0] / 2 + 1e-5)
    else:
      inner = np.abs(phi[:, m] - np.pi / 4) < (2 ** (sp.bh - 1)) * dl[lvl - 1]
      assert np.all(err[inner] <= dl[lvl - 1] / 2 + 1e-5)
      # Outside the inner range the outer bin's centre is the nearest one.
      assert np.all(np.isin(codes[:, m][~inner], [0, 2**sp.bh - 1]))


@pytest.mark.parametrize("layout,d", CASES)
def test_jit_and_eager_store_the_same_bits(layout, d):
  sp = S.spec(layout, d)
  rng = np.random.default_rng(11 + d)
  k = jnp.asarray(_keys(5 + d, 512, d).reshape(256, 2, d), jnp.bfloat16)
  mu = jnp.asarray(rng.standard_normal((2, d)), jnp.float32)
  rot = S.rotation(d, layer=3)
  p_e, s_e = S.encode_key(k, mu, rot, sp)
  p_j, s_j = jax.jit(S.encode_key, static_argnums=3)(k, mu, rot, sp)
  assert p_e.dtype == jnp.uint8 and p_e.shape == (256, 2, sp.code_bytes)
  np.testing.assert_array_equal(np.asarray(p_e), np.asarray(p_j))
  np.testing.assert_array_equal(np.asarray(s_e), np.asarray(s_j))
  k_e = S.decode_key(p_e, s_e, mu, rot, sp)
  k_j = jax.jit(S.decode_key, static_argnums=4)(p_e, s_e, mu, rot, sp)
  np.testing.assert_array_equal(np.asarray(k_e), np.asarray(k_j))


@pytest.mark.parametrize("layout,d", CASES)
def test_pack_unpack_round_trip(layout, d):
  sp = S.spec(layout, d)
  rng = np.random.default_rng(d + len(layout))
  _, bits = _level_bits(sp)
  bits = np.where(bits == 0, sp.bh, bits)  # the pad slot round-trips any code too
  codes = rng.integers(0, 2**bits, (500, d)).astype(np.int32)
  p = S.pack(jnp.asarray(codes), sp)
  assert p.dtype == jnp.uint8 and p.shape == (500, sp.code_bytes)
  np.testing.assert_array_equal(np.asarray(S.unpack(p, sp)), codes)
  np.testing.assert_array_equal(
    np.asarray(jax.jit(S.pack, static_argnums=1)(jnp.asarray(codes), sp)), np.asarray(p)
  )


def _unpack_oracle(p, sp):
  """The byte layouts of §2.1 written out per code (no shared helper with the module)."""
  d = sp.d
  out = np.zeros(p.shape[:-1] + (d,), np.int64)
  for pos in range(d):
    if sp.layout == "A4":
      byte, shift = pos % (d // 2), 4 * (pos // (d // 2))
      out[..., pos] = (p[..., byte] >> shift) & 15
    elif sp.layout == "A2":
      byte, shift = pos % (d // 4), 2 * (pos // (d // 4))
      out[..., pos] = (p[..., byte] >> shift) & 3
    elif pos < d // 2:
      byte, shift = pos % (d // 4), 4 * (pos // (d // 4))
      out[..., pos] = (p[..., byte] >> shift) & 15
    else:
      j = pos - d // 2
      byte, shift = d // 4 + j % (d // 8), 2 * (j // (d // 8))
      out[..., pos] = (p[..., byte] >> shift) & 3
  return out


@pytest.mark.parametrize("layout,d", CASES)
def test_every_byte_value_unpacks_as_the_layout_says(layout, d):
  sp = S.spec(layout, d)
  nb = sp.code_bytes
  rng = np.random.default_rng(d)
  # Row r, slot j holds (r + 37 j) mod 256: every value in every byte slot, rows shuffled.
  vals = (np.arange(256)[:, None] + 37 * np.arange(nb)[None, :]) % 256
  vals = vals[rng.permutation(256)].astype(np.uint8)
  for slot in range(nb):
    assert len(np.unique(vals[:, slot])) == 256
  got = np.asarray(S.unpack(jnp.asarray(vals), sp))
  np.testing.assert_array_equal(got, _unpack_oracle(vals.astype(np.int64), sp))
  np.testing.assert_array_equal(np.asarray(S.pack(jnp.asarray(got), sp)), vals)
  np.testing.assert_array_equal(
    np.asarray(jax.jit(S.unpack, static_argnums=1)(jnp.asarray(vals), sp)), got
  )


@pytest.mark.parametrize("layout,d", CASES)
def test_decode_tables_are_the_float64_trig_of_the_bin_centres(layout, d):
  sp = S.spec(layout, d)
  ct, st = S.trig_tables(sp)
  lv = S.level_of_position(d)
  for pos in (0, d // 2 - 1, d // 2, d - 2):
    lvl = lv[pos]
    nb = sp.b1 if lvl == 1 else sp.bh
    dl = S.steps(sp)[lvl - 1]
    base = -math.pi if lvl == 1 else math.pi / 4 - 2 ** (nb - 1) * dl
    ang = base + (np.arange(2**nb) + 0.5) * dl
    np.testing.assert_array_equal(ct[pos, : 2**nb], np.cos(ang).astype(np.float32))
    np.testing.assert_array_equal(st[pos, : 2**nb], np.sin(ang).astype(np.float32))
  c, s = S.angle_trig(jnp.asarray(np.full((1, d), 1, np.int32)), sp)
  np.testing.assert_array_equal(np.asarray(c)[0, lv == 2], ct[lv == 2, 1])


@pytest.mark.parametrize("layout,d", CASES)
def test_cos_from_angles_equals_the_decoded_dot(layout, d):
  sp = S.spec(layout, d)
  rng = np.random.default_rng(100 + d)
  codes, _ = S.encode(jnp.asarray(_keys(d, 300, d)), sp)
  cos, sin = S.angle_trig(codes, sp)
  u = S.direction(cos, sin)
  np.testing.assert_allclose(np.linalg.norm(np.asarray(u, np.float64), axis=-1), 1.0, atol=1e-6)
  qr = jnp.asarray(rng.standard_normal((7, 1, d)) * rng.uniform(0.1, 20.0, (7, 1, 1)), jnp.float32)
  got = np.asarray(S.cos_from_angles(qr, cos[None], sin[None]))  # [7, 300]
  want = np.einsum("qd,td->qt", np.asarray(qr[:, 0], np.float64), np.asarray(u, np.float64))
  qn = np.linalg.norm(np.asarray(qr[:, 0], np.float64), axis=-1)[:, None]
  assert got.shape == (7, 300)
  assert np.max(np.abs(got - want) / qn) < 1e-5


@pytest.mark.parametrize("layout,d", CASES)
def test_scores_without_a_dense_key_equal_q_dot_decoded_key(layout, d):
  sp = S.spec(layout, d)
  rng = np.random.default_rng(200 + d)
  k = jnp.asarray(_keys(d + 3, 2 * 128, d).reshape(128, 2, d) * 0.1 + 0.5, jnp.bfloat16)
  mu = jnp.asarray(S.key_mean(np.asarray(k, np.float32), sink=4))
  rot = S.rotation(d, layer=5)
  packed, side = S.encode_key(k, mu, rot, sp)
  q = jnp.asarray(rng.standard_normal((3, 1, 2, d)) * 4, jnp.float32)
  got = np.asarray(S.scores(q, packed[None], side[None], mu, rot, sp))  # [3, 128, 2]
  kt = np.asarray(S.decode_key(packed, side, mu, rot, sp), np.float64)
  want = np.einsum("qhd,thd->qth", np.asarray(q[:, 0], np.float64), kt) / math.sqrt(d)
  mag = (
    np.linalg.norm(np.asarray(q[:, 0], np.float64), axis=-1)[:, None, :]
    * np.linalg.norm(kt, axis=-1)[None]
    / math.sqrt(d)
  )
  assert np.max(np.abs(got - want) / mag) < 1e-5
  # And the decoded key is close to the key: the direction within the tier's error, the radius fp16.
  kf = np.asarray(k, np.float64)
  x0, xt = kf - np.asarray(mu), kt - np.asarray(mu)
  cosang = np.sum(x0 * xt, -1) / np.linalg.norm(x0, axis=-1) / np.linalg.norm(xt, axis=-1)
  assert np.mean(1 - cosang) < {"A4": 0.015, "A42": 0.03, "A2": 0.2}[layout]
  np.testing.assert_allclose(np.linalg.norm(xt, axis=-1), np.linalg.norm(x0, axis=-1), rtol=2e-3)


@pytest.mark.parametrize("d", DIMS)
def test_isotropic_error_matches_the_design_table(d):
  x = np.random.default_rng(d + 9).standard_normal((8000, d)).astype(np.float32)
  xh = x / np.linalg.norm(x, axis=-1, keepdims=True)
  for layout, want in (("A4", 0.0074), ("A42", 0.018), ("A2", 0.11)):
    sp = S.spec(layout, d)
    codes, _ = S.encode(jnp.asarray(x), sp)
    u = np.asarray(S.direction(*S.angle_trig(codes, sp)))
    got = float(np.mean(1 - np.sum(xh * u, -1)))
    assert abs(got - want) < 0.06 * want, (layout, got, want)


def test_rotation_is_orthogonal_and_fixed_per_layer():
  for d in DIMS:
    r = S.rotation(d, layer=2).astype(np.float64)
    np.testing.assert_allclose(r @ r.T, np.eye(d), atol=1e-6)
    np.testing.assert_array_equal(S.rotation(d, layer=2), S.rotation(d, layer=2))
    assert not np.array_equal(S.rotation_signs(d, 2), S.rotation_signs(d, 3))
  h = S.hadamard(8)
  np.testing.assert_array_equal(h @ h.T, 8 * np.eye(8))


def test_side_word_round_trip():
  rng = np.random.default_rng(3)
  r = jnp.asarray(rng.uniform(0.01, 500.0, 64), jnp.float32)
  v = jnp.asarray(rng.uniform(1e-3, 2.0, 64), jnp.float32)
  w = S.side_word(r, v)
  assert w.dtype == jnp.uint32
  np.testing.assert_array_equal(
    np.asarray(S.side_radius(w)), np.asarray(r).astype(np.float16).astype(np.float32)
  )
  np.testing.assert_array_equal(
    np.asarray(S.side_value_scale(w)), np.asarray(v).astype(np.float16).astype(np.float32)
  )
  assert np.all(np.asarray(S.side_value_scale(S.side_word(r))) == 0)
  assert float(S.side_radius(S.side_word(jnp.asarray([1e9])))[0]) == S.FP16_MAX


def test_tier_bytes_match_the_design_table():
  # §2.3: (layout, values) -> bytes at D = 64, 128, every byte counted.
  table = {
    ("A2", "bf16"): (148, 292),
    ("A42", "bf16"): (156, 308),
    ("A4", "bf16"): (164, 324),
    ("A42", "int4"): (60, 116),
    ("A4", "int4"): (68, 132),
  }
  for (layout, values), want in table.items():
    assert tuple(S.tier_bytes(layout, d, values) for d in DIMS) == want, (layout, values)
  assert {lay: S.spec(lay, 128).code_bytes for lay in S.LAYOUTS} == {"A4": 64, "A42": 48, "A2": 32}
  assert S.dense_bytes(64) == 256 and S.dense_bytes(128) == 512
  # Item cost: per-layer bytes of the group + position, flag bit, amortized page-table entry.
  assert S.item_bytes("A4", 128, layers=4) == 4 * 324 + 4 + 1 / 8 + 4 / 16


def test_bad_input_is_refused():
  with pytest.raises(ValueError, match="power of two"):
    S.spec("A4", 96)
  with pytest.raises(ValueError, match="layout"):
    S.spec("A3", 64)
  with pytest.raises(ValueError, match="sigma"):
    S.spec("A4", 64, sigma=[0.1, 0.2])
  with pytest.raises(ValueError, match="bytes"):
    S.unpack(jnp.zeros((2, 31), jnp.uint8), S.spec("A4", 64))
  with pytest.raises(ValueError, match="dim"):
    S.encode(jnp.ones((2, 32)), S.spec("A4", 64))
  with pytest.raises(ValueError, match="values"):
    S.tier_bytes("A4", 64, "fp8")


def test_calibrated_sigma_changes_the_steps():
  sp = S.spec("A42", 64, sigma=[0.3, 0.2, 0.1, 0.05, 0.02])
  dl = S.steps(sp)
  np.testing.assert_allclose(
    dl[1:], np.minimum(S.MAX_STEP[2] * np.array([0.3, 0.2, 0.1, 0.05, 0.02]), np.pi / 8)
  )
  assert dl[0] == 2 * np.pi / 16
  x = _keys(5, 200, 64)
  c0, _ = S.encode(jnp.asarray(x), S.spec("A42", 64))
  c1, _ = S.encode(jnp.asarray(x), sp)
  assert not np.array_equal(np.asarray(c0)[:, 32:], np.asarray(c1)[:, 32:])
  np.testing.assert_array_equal(np.asarray(c0)[:, :32], np.asarray(c1)[:, :32])


@pytest.mark.parametrize("layout", tuple(S.LAYOUTS))
def test_a_key_equal_to_the_mean_decodes_to_the_mean(layout):
  # x = 0 has no direction: codes are fixed (level 1 code 0), the radius is 0, nothing is NaN.
  d = 64
  sp = S.spec(layout, d)
  mu = jnp.asarray(np.random.default_rng(8).standard_normal((2, d)), jnp.bfloat16).astype(
    jnp.float32
  )
  k = jnp.broadcast_to(mu, (3, 2, d)).astype(jnp.bfloat16)
  packed, side = jax.jit(S.encode_key, static_argnums=3)(k, mu, S.rotation(d, 0), sp)
  codes = np.asarray(S.unpack(packed, sp))
  assert np.all(codes[..., : d // 2] == 0)
  assert np.all(np.asarray(S.side_radius(side)) == 0)
  kt = np.asarray(S.decode_key(packed, side, mu, S.rotation(d, 0), sp))
  np.testing.assert_array_equal(kt, np.broadcast_to(np.asarray(mu), kt.shape))
