"""Property tests of the INT4 quantizer (paper B.5, DESIGN.md "INT4")."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings, strategies as st
from hypothesis.extra import numpy as hnp

from pask_jax import quant

D = 8
# Magnitudes from subnormal-fp16 scales (max|x| ~ 1e-7) to large activations; bf16-representable
# values, since K/V arrive in BF16.
_floats = st.floats(-300.0, 300.0, allow_nan=False, allow_subnormal=False, width=32)
_tiny = st.floats(-2.0**-17, 2.0**-17, allow_nan=False, allow_subnormal=False, width=32)
# One row scaled by 2**e: covers subnormal fp16 scales (e <= -12), where nearest rounding of the
# scale alone would break the s/2 bound.
_scaled = st.builds(lambda m, e: m * np.float32(2.0 ** e),
                    hnp.arrays(np.float32, (1, D), elements=st.floats(-1, 1, width=32)),
                    st.integers(-26, 8))
_rows = st.one_of(
    _scaled,
    hnp.arrays(np.float32, (3, D), elements=_floats),
    hnp.arrays(np.float32, (3, D), elements=_tiny),
    hnp.arrays(np.float32, (3, D), elements=st.sampled_from([0.0, 1e-8, -3e-7, 5e-6, 2.0, -7.5])),
)

_qp = jax.jit(quant.quantize_packed)
_dq = jax.jit(quant.dequantize)


def _bf16(x):
  return np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))


@settings(max_examples=60, deadline=None)
@given(_rows)
def test_error_within_half_scale(x):
  x = _bf16(x)
  p, s = _qp(jnp.asarray(x, jnp.bfloat16))
  y = np.asarray(_dq(p, s))
  s32 = np.asarray(s, np.float32)[:, None]
  err = np.abs(x - y)
  # s/2 per element; the tiny slack covers the f32 rounding of x/s at an exact tie.
  assert np.all(err <= s32 / 2 * (1 + 1e-6)), (x, y, s32)


def test_subnormal_scale_regression():
  # max|x| = 7·1.45·2**-24: nearest-fp16 scale 2**-24 would clip 10.15 to 7 (error 3.15 s).
  x = jnp.zeros((1, D), jnp.float32).at[0, 0].set(7 * 1.45 * 2.0**-24)
  p, s = quant.quantize_packed(x)
  err = float(jnp.abs(x - quant.dequantize(p, s))[0, 0])
  assert err <= float(s[0]) / 2


@settings(max_examples=40, deadline=None)
@given(hnp.arrays(np.int8, (4, D), elements=st.integers(-8, 7)))
def test_pack_unpack_roundtrip(codes):
  packed = quant.pack(jnp.asarray(codes))
  assert packed.dtype == jnp.uint8 and packed.shape == (4, D // 2)
  np.testing.assert_array_equal(np.asarray(quant.unpack(packed)), codes.astype(np.int32))


def test_half_split_layout():
  codes = jnp.asarray([[1, 2, 3, 4, -1, -2, -3, -4]], jnp.int8)
  packed = np.asarray(quant.pack(codes))
  # byte i = element i (low nibble) | element i + D/2 (high nibble), 4-bit two's complement
  assert packed.tolist() == [[0xF1, 0xE2, 0xD3, 0xC4]]


def test_zero_rows_and_fp16_floor():
  x = jnp.zeros((2, D), jnp.float32).at[1, 3].set(1e-12)
  codes, s = quant.quantize(x)
  assert s.dtype == jnp.float16
  assert float(s[0]) == 1.0 and not np.any(np.asarray(codes[0]))          # zero row: scale 1
  assert float(s[1]) == quant.FP16_TINY                                     # floored, never 0
  assert np.all(np.isfinite(np.asarray(quant.dequantize(*quant.quantize_packed(x)))))


def test_codes_in_range_and_scale_dtype():
  x = jax.random.normal(jax.random.PRNGKey(0), (64, D)) * 50
  codes, s = quant.quantize(x)
  assert codes.dtype == jnp.int8 and s.dtype == jnp.float16 and s.shape == (64,)
  assert int(jnp.max(jnp.abs(codes))) == 7          # the max element maps to ±7
  assert int(jnp.min(codes)) >= -7


def test_odd_dimension_rejected():
  try:
    quant.quantize(jnp.zeros((2, 5)))
  except ValueError:
    return
  raise AssertionError("odd D accepted")
