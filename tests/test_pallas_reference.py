"""The jnp reference against an independent float64 oracle, plus the merge and helpers."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels import common
from pallas_kernels.testing import synth

pytestmark = pytest.mark.fast_compile


@pytest.mark.parametrize("hq,hkv,d,page,lens", [
    (8, 2, 128, 16, ([0, 1, 250], [96, 0, 17], [1, 32, 23])),
    (14, 2, 64, 8, ([37, 256, 5], [3, 96, 0], [32, 1, 7])),
    (8, 8, 64, 1, ([0, 0, 9], [0, 5, 96], [4, 4, 4])),       # page 1 = the dense special case
    (7, 1, 128, 12, ([240, 13, 0], [95, 0, 1], [0, 3, 30])),  # page not a power of two
])
def test_reference_matches_float64_oracle(hq, hkv, d, page, lens):
  s = synth.Shape(b=3, hq=hq, hkv=hkv, d=d, page=page, w=32, lo_cap=page * (256 // page + 1),
                  hi_cap=page * (96 // page + 1))
  args = synth.make(s, *lens, seed=hq + d + page)
  want = synth.naive(*args)
  got32 = synth.reference_f32(*args)
  assert synth.rel_err(got32, want) < 2e-6
  out = pk.decode_attention_reference(*args)
  assert out.dtype == jnp.bfloat16 and out.shape == (3, hq, d)
  assert synth.rel_err(out, want) < 6e-3          # BF16 output rounding only


def test_scale_argument_and_dispatch():
  s = synth.Shape(b=2, hq=4, hkv=2, d=64)
  args = synth.make(s, [10, 3], [5, 0], [2, 9], seed=3)
  want = synth.naive(*args, scale=0.3)
  assert synth.rel_err(synth.reference_f32(*args, scale=0.3), want) < 2e-6
  assert pk.resolve_backend("auto") == "reference"       # CPU
  out = pk.decode_attention(*args, scale=0.3, backend="auto")
  np.testing.assert_array_equal(np.asarray(out, np.float32),
                                np.asarray(pk.decode_attention_reference(*args, scale=0.3),
                                           np.float32))
  with pytest.raises(ValueError):
    pk.decode_attention(*args, backend="cuda")


def test_no_visible_key_gives_zeros_not_nan():
  s = synth.Shape(b=2, hq=4, hkv=2, d=64)
  args = synth.make(s, [0, 4], [0, 0], [0, 0], seed=4)
  out = np.asarray(pk.decode_attention_reference(*args), np.float32)
  assert np.isfinite(out).all()
  assert (out[0] == 0).all() and np.abs(out[1]).sum() > 0


def test_merge_eq15_ignores_empty_partials_and_matches_joint_softmax():
  rng = np.random.default_rng(0)
  s = rng.standard_normal((5, 40)) * 3                    # 5 rows, 40 keys (log2 units)
  v = rng.standard_normal((40, 16))
  cuts = [0, 7, 7, 30, 40]                                # one empty partial
  o, m, l = [], [], []
  for a, b in zip(cuts[:-1], cuts[1:]):
    mj = s[:, a:b].max(1) if b > a else np.full(5, 123.0)  # an empty partial's m is garbage
    p = np.exp2(s[:, a:b] - mj[:, None])
    o.append(p @ v[a:b] if b > a else np.full((5, 16), np.nan))
    m.append(mj)
    l.append(p.sum(1))
  out, _ = common.merge(jnp.asarray(np.stack(o, 1)), jnp.asarray(np.stack(m, 1)),
                        jnp.asarray(np.stack(l, 1)), axis=1)
  p = np.exp2(s - s.max(1, keepdims=True))
  want = p @ v / p.sum(1, keepdims=True)
  assert synth.rel_err(out, want) < 1e-6
  zero, den = common.merge(jnp.zeros((2, 3, 4)), jnp.full((2, 3), -jnp.inf), jnp.zeros((2, 3)), 1)
  assert (np.asarray(zero) == 0).all() and (np.asarray(den) == 0).all()


def test_f16_bits_decode_is_exact_for_all_finite_halves():
  bits = np.arange(1 << 16, dtype=np.uint32)
  h = bits.astype(np.uint16).view(np.float16)
  fin = np.isfinite(h)
  got = np.asarray(common.f16_bits_to_f32(jnp.asarray(bits.astype(np.int32))))
  np.testing.assert_array_equal(got[fin], h[fin].astype(np.float32))


def test_scale_bits_packs_k_low_v_high():
  sc = jnp.asarray(np.array([[1.5, -0.25], [6e-8, 65504.0]], np.float16))
  packed = np.asarray(common.scale_bits(sc)).astype(np.int64) & 0xFFFFFFFF
  k = (packed & 0xFFFF).astype(np.uint16).view(np.float16)
  v = (packed >> 16).astype(np.uint16).view(np.float16)
  np.testing.assert_array_equal(k, np.asarray(sc[:, 0]))
  np.testing.assert_array_equal(v, np.asarray(sc[:, 1]))


def test_reference_is_jittable_and_vmappable_over_layers():
  s = synth.Shape(b=2, hq=4, hkv=2, d=64)
  a0 = synth.make(s, [10, 3], [5, 0], [2, 9], seed=5)
  a1 = synth.make(s, [1, 30], [16, 2], [9, 2], seed=6)
  stacked = jax.tree.map(lambda x, y: jnp.stack([x, y]), a0, a1)
  out = jax.vmap(lambda *a: pk.decode_attention(*a, backend="reference"))(*stacked)
  for i, a in enumerate((a0, a1)):
    assert synth.rel_err(out[i], synth.naive(*a)) < 6e-3


def test_stacked_layers_with_traced_layer_index():
  """``layer=``: pools and window stacked [L, ...], the layer a traced index, equals the same
  layer's arrays passed alone (the decode step's no-copy form)."""
  args = synth.stack_layers(synth.CASES[2].make(seed=31))
  f = jax.jit(lambda l, *a: pk.decode_attention(*a, layer=l, backend="reference"))
  for layer in (0, 2):
    want = pk.decode_attention(*synth.layer_of(args, layer), backend="reference")
    np.testing.assert_array_equal(np.asarray(f(layer, *args), np.float32),
                                  np.asarray(want, np.float32))


@pytest.mark.parametrize("case", synth.CASES, ids=lambda c: c.name)
def test_reference_reads_the_int4_format_as_the_bytes_format(case):
  """The same codes stored head-major as jax int4 (V dim-major) give exactly the bytes format's
  result, within the float64 oracle's bound, poisoned invisible rows included."""
  seed = 40 + synth.CASES.index(case)
  args = case.make(seed=seed, lo_format="int4")
  assert args[3].format == "int4" and args[3].page == case.shape.page
  got = synth.reference_f32(*args)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(synth.reference_f32(*case.make(
      seed=seed))))
  assert synth.rel_err(got, synth.naive(*args)) < 2e-6


def test_int4_format_stacked_layers_with_traced_layer_index():
  args = synth.stack_layers(synth.CASES[3].make(seed=32, lo_format="int4"))
  f = jax.jit(lambda l, *a: pk.decode_attention(*a, layer=l, backend="reference"))
  for layer in (0, 1, 2):
    want = pk.decode_attention(*synth.layer_of(args, layer), backend="reference")
    np.testing.assert_array_equal(np.asarray(f(layer, *args), np.float32),
                                  np.asarray(want, np.float32))
    assert synth.rel_err(want, synth.naive(*synth.layer_of(args, layer))) < 6e-3
