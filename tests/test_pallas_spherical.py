"""The Spherical KV tier partitions of the jnp reference (pallas_kernels.reference.sph_partials,
decode_attention(..., sph=...)) against a float64 numpy attention over the decoded keys and values
(pallas_kernels.testing.sph_synth.naive): ragged lengths per (sequence, head), empty tiers, GQA
ratios 1/2/4/7/8, D 64 and 128, every tier format, stacked layers, CosFromAngles = decoded dot,
LSE."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels import common
from pallas_kernels import reference
from pallas_kernels.testing import sph_synth
from pallas_kernels import spherical
from pallas_kernels.sph_types import SphInputs, SphMaps, TierSpec
from pallas_kernels.testing import synth

pytestmark = pytest.mark.fast_compile

FORMATS = [(lay, val) for lay in spherical.LAYOUTS for val in spherical.VALUE_FORMATS]


def _merged(o, m, l, hq):
  out, _ = common.merge(o, m, l, axis=2)
  return out.reshape(out.shape[0], hq, out.shape[-1])


def _tier_only_oracle(q, sph, hkv, w=4):
  """The oracle with every base partition empty (window length 0, empty pools)."""
  b, _, d = q.shape
  s = synth.Shape(b=b, hq=q.shape[1], hkv=hkv, d=d, page=16, w=w, lo_cap=16, hi_cap=16)
  args = synth.make(s, 0, 0, 0, seed=1)
  return args[1:], sph_synth.naive(q, *args[1:], sph)


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  assert np.isfinite(a).all()
  return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.mark.parametrize("d", (64, 128))
@pytest.mark.parametrize("layout,values", FORMATS)
def test_each_tier_format_matches_float64_oracle(layout, values, d):
  b, hkv, g, page = 2, 2, 4, 16
  lens = np.array([[37, 1], [16, 70]])
  sph = sph_synth.layer_of(sph_synth.make([TierSpec(layout, values, d)], [lens], b=b, hkv=hkv,
                                          page=page, seed=d + len(layout)), 0)
  q = jax.random.normal(jax.random.PRNGKey(d), (b, hkv * g, d), jnp.float32)
  _, (want, want_lse) = _tier_only_oracle(q, sph, hkv)
  o, m, l = reference.sph_partials(q, sph)
  assert o.shape == (b, hkv, 1, g, d) and m.shape == l.shape == (b, hkv, 1, g)
  assert _rel(_merged(o, m, l, hkv * g), want) <= 1e-5
  assert _rel(reference.lse_of(m, l, axis=2).reshape(b, -1), want_lse) <= 1e-5


@pytest.mark.parametrize("g", (1, 2, 4, 7, 8))
@pytest.mark.parametrize("d", (64, 128))
def test_gqa_ragged_and_empty_tiers(g, d):
  b, hkv, page = 3, 2, 8
  tiers = [TierSpec("A4", "bf16", d), TierSpec("A42", "int4", d), TierSpec("A2", "bf16", d),
           TierSpec("A42", "bf16", d)]
  rng = np.random.default_rng(g * d)
  lens = [rng.integers(0, 50, (b, hkv)), np.array([[0, 9], [33, 0], [1, 16]]),
          np.zeros((b, hkv), int), rng.integers(1, 20, (b, hkv))]
  lens[0][0, 0] = 0                              # a (sequence, head) with no rows in tier 0
  sph = sph_synth.layer_of(sph_synth.make(tiers, lens, b=b, hkv=hkv, page=page, seed=g), 0)
  q = jax.random.normal(jax.random.PRNGKey(g), (b, hkv * g, d), jnp.float32)
  _, (want, _) = _tier_only_oracle(q, sph, hkv)
  o, m, l = reference.sph_partials(q, sph)
  assert np.all(np.asarray(l[:, :, 2]) == 0)     # the empty tier is empty everywhere
  assert _rel(_merged(o, m, l, hkv * g), want) <= 1e-5
  # Dropping the empty tier changes nothing.
  keep = [0, 1, 3]
  pick = lambda t: tuple(t[i] for i in keep)
  sub = SphInputs(pick(sph.pools), SphMaps(pick(sph.maps.pages), pick(sph.maps.length)),
                  sph.consts, pick(sph.spec))
  o2, m2, l2 = reference.sph_partials(q, sub)
  np.testing.assert_array_equal(np.asarray(_merged(o2, m2, l2, hkv * g)),
                                np.asarray(_merged(o, m, l, hkv * g)))


@pytest.mark.parametrize("layout,values", FORMATS)
def test_cos_from_angles_equals_decoded_dot(layout, values):
  d, b, hkv, g = 128, 2, 2, 3
  sph = sph_synth.layer_of(sph_synth.make([TierSpec(layout, values, d)], [[[20, 5], [0, 31]]],
                                          b=b, hkv=hkv, page=16, seed=7), 0)
  q = jax.random.normal(jax.random.PRNGKey(3), (b, hkv * g, d), jnp.float32)
  a = reference.sph_partials(q, sph, logits="angles")
  c = reference.sph_partials(q, sph, logits="decoded")
  assert _rel(_merged(*a, hkv * g), _merged(*c, hkv * g)) <= 1e-6
  # Per key: spherical.scores (CosFromAngles) against decode-to-Cartesian-then-dot.
  pool, sp = sph.pools[0], sph.spec[0].key
  rot = reference.sph_rotation(sph.consts.signs)
  mu = sph.consts.mu[0]
  ang, side = pool.ang[:4].reshape(-1, sp.code_bytes), pool.side[:4].reshape(-1)
  ok = np.isfinite(np.asarray(spherical.side_radius(side)))
  ang, side = ang[ok], side[ok]
  s1 = spherical.scores(q[0, 0][None], ang, side, mu, rot, sp)
  s2 = reference.decoded_dot(q[0, 0][None], ang, side, mu, rot, sp)
  assert len(s1) > 10
  np.testing.assert_allclose(np.asarray(s1), np.asarray(s2), rtol=1e-5, atol=1e-5)


# Three of the substrate's cases (page 8 at d128, GQA 7, three KV heads with an empty tier): the
# tier partition's own shapes are swept above; each case here compiles the whole entry point.
UNION = ("g2_d128_p8", "g7_d64", "g4_d64_page12_hkv3")


@pytest.mark.parametrize("case", [c for c in synth.CASES if c.name in UNION],
                         ids=lambda c: c.name)
def test_full_decode_attention_equals_union_of_stored_keys(case):
  s = case.shape
  args = case.make(seed=11)
  q = args[0]
  rng = np.random.default_rng(len(case.name))
  tiers = [TierSpec("A4", "bf16", s.d), TierSpec("A42", "int4", s.d), TierSpec("A2", "int4", s.d)]
  lens = [rng.integers(0, 45, (s.b, s.hkv)) for _ in tiers]
  lens[1][:] = 0 if s.hkv > 2 else lens[1]       # an all-empty tier in some cases
  sph = sph_synth.layer_of(sph_synth.make(tiers, lens, b=s.b, hkv=s.hkv, page=s.page, seed=5), 0)
  want, want_lse = sph_synth.naive(*args, sph)
  # FP32: base partials + tier partials, merged by Eq. 15.
  o, m, l = reference.partials(*args)
  so, sm, sl = reference.sph_partials(q, sph)
  cat = [jnp.concatenate(x, axis=2) for x in ((o, so), (m, sm), (l, sl))]
  assert _rel(_merged(*cat, s.hq), want) <= 1e-5
  out, lse = pk.decode_attention(*args, sph=sph, return_lse=True, backend="reference")
  assert out.dtype == jnp.bfloat16 and out.shape == (s.b, s.hq, s.d)
  assert synth.rel_err(out, want) < 6e-3            # BF16 output rounding only
  assert _rel(lse, want_lse) <= 1e-5
  # Without sph, nothing changes; sph=None with return_lse gives the base LSE.
  base = pk.decode_attention(*args, backend="reference")
  np.testing.assert_array_equal(np.asarray(base, np.float32),
                                np.asarray(pk.decode_attention_reference(*args), np.float32))
  base_out, base_lse = pk.decode_attention(*args, return_lse=True, backend="reference")
  np.testing.assert_array_equal(np.asarray(base_out, np.float32), np.asarray(base, np.float32))
  want_base = sph_synth.naive(*args, None)[1]
  live = np.isfinite(want_base)
  assert np.array_equal(np.isfinite(np.asarray(base_lse)), live)
  assert _rel(np.asarray(base_lse)[live], want_base[live]) <= 1e-5


def test_stacked_layers_pick_their_own_pools_and_constants():
  s = synth.Shape(b=2, hq=8, hkv=2, d=64, page=16, w=16, lo_cap=64, hi_cap=32)
  args = synth.stack_layers(synth.make(s, [40, 3], [17, 30], [16, 2], seed=2))
  tiers = [TierSpec("A42", "bf16", 64), TierSpec("A4", "int4", 64)]
  lens = [np.array([[10, 40], [0, 3]]), np.array([[5, 0], [27, 16]])]
  sph = sph_synth.make(tiers, lens, b=2, hkv=2, page=16, layers=3, seed=4)
  for layer in range(3):
    one = synth.layer_of(args, layer)
    want = pk.decode_attention(*one, sph=sph_synth.layer_of(sph, layer), backend="reference")
    got = jax.jit(lambda a, x, i: pk.decode_attention(*a, sph=x, layer=i, backend="reference"))(
      args, sph, jnp.int32(layer))
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    ref = sph_synth.naive(*one, sph_synth.layer_of(sph, layer))[0]
    assert synth.rel_err(got, ref) < 6e-3


@pytest.mark.parametrize("layout", spherical.LAYOUTS)
def test_numpy_unpack_twin_matches(layout):
  sp = spherical.spec(layout, 64)
  b = np.random.default_rng(0).integers(0, 256, (300, sp.code_bytes)).astype(np.uint8)
  np.testing.assert_array_equal(sph_synth.unpack_numpy(b, sp),
                                np.asarray(spherical.unpack(jnp.asarray(b), sp)))


def test_spec_is_static_and_errors_are_clear():
  d = 64
  sph = sph_synth.make([TierSpec("A2", "bf16", d)], [[[3, 4]]], b=1, hkv=2, page=16)
  leaves, tree = jax.tree.flatten(sph)
  assert all(isinstance(x, jax.Array) for x in leaves)
  assert jax.tree.unflatten(tree, leaves).spec == sph.spec
  with pytest.raises(ValueError, match="values must be one of"):
    TierSpec("A4", "fp8", d)
  with pytest.raises(ValueError, match="not a tier layout|layout must be one of"):
    TierSpec("A3", "bf16", d)
  with pytest.raises(ValueError, match="one pool, page table and length per tier"):
    SphInputs(sph.pools, sph.maps, sph.consts, sph.spec * 2)
  s = synth.Shape(b=1, hq=4, hkv=2, d=d, page=16, w=8, lo_cap=16, hi_cap=16)
  args = synth.make(s, 1, 1, 1)
  # the GPU backend has a tier kernel now (pallas_kernels/gpu/spherical.py): same answer
  one = sph_synth.layer_of(sph, 0)
  got = pk.decode_attention(*args, sph=one, backend="gpu", interpret=True)
  want = pk.decode_attention(*args, sph=one, backend="reference")
  err = float(jnp.linalg.norm((got - want).astype(jnp.float32))
              / jnp.linalg.norm(want.astype(jnp.float32)))
  assert err < 6e-3, err
  with pytest.raises(ValueError, match="head dim"):
    reference.sph_partials(jnp.ones((1, 4, 128)), sph_synth.layer_of(sph, 0))
  assert TierSpec("A42", "int4", 128).bytes == 116 and TierSpec("A4", "bf16", 64).bytes == 164
