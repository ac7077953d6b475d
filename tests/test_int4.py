"""The INT4 storage format (pallas_kernels.int4; B.5, docs/DESIGN.md): error bound, layout,
bit-exactness across jit/eager/an independent oracle, fp16 range, and the GPU kernel's bit
tricks."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.extra import numpy as hnp

from pallas_kernels import int4
from pallas_kernels.testing.quant import adversarial_rows

pytestmark = pytest.mark.fast_compile

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

_qp = jax.jit(int4.quantize_packed)
_dq = jax.jit(int4.dequantize)


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
  p, s = int4.quantize_packed(x)
  err = float(jnp.abs(x - int4.dequantize(p, s))[0, 0])
  assert err <= float(s[0]) / 2


@settings(max_examples=40, deadline=None)
@given(hnp.arrays(np.int8, (4, D), elements=st.integers(-8, 7)))
def test_pack_unpack_roundtrip(codes):
  packed = int4.pack(jnp.asarray(codes))
  assert packed.dtype == jnp.uint8 and packed.shape == (4, D // 2)
  np.testing.assert_array_equal(np.asarray(int4.unpack(packed)), codes.astype(np.int32))


def test_half_split_layout():
  codes = jnp.asarray([[1, 2, 3, 4, -1, -2, -3, -4]], jnp.int8)
  packed = np.asarray(int4.pack(codes))
  # byte i = element i (low nibble) | element i + D/2 (high nibble), 4-bit two's complement
  assert packed.tolist() == [[0xF1, 0xE2, 0xD3, 0xC4]]


def test_zero_rows_and_fp16_floor():
  x = jnp.zeros((2, D), jnp.float32).at[1, 3].set(1e-12)
  codes, s = int4.quantize(x)
  assert s.dtype == jnp.float16
  assert float(s[0]) == 1.0 and not np.any(np.asarray(codes[0]))          # zero row: scale 1
  assert float(s[1]) == int4.FP16_TINY                                     # floored, never 0
  assert np.all(np.isfinite(np.asarray(int4.dequantize(*int4.quantize_packed(x)))))


def test_codes_in_range_and_scale_dtype():
  x = jax.random.normal(jax.random.PRNGKey(0), (64, D)) * 50
  codes, s = int4.quantize(x)
  assert codes.dtype == jnp.int8 and s.dtype == jnp.float16 and s.shape == (64,)
  assert int(jnp.max(jnp.abs(codes))) == 7          # the max element maps to ±7
  assert int(jnp.min(codes)) >= -7


def test_odd_dimension_rejected():
  try:
    int4.quantize(jnp.zeros((2, 5)))
  except ValueError:
    return
  raise AssertionError("odd D accepted")


def test_same_bits_under_jit_eager_and_oracle():
  rng = np.random.default_rng(11)
  x = adversarial_rows(rng, d=D)
  want_c, want_s = int4.quantize_numpy(x)
  eager_c, eager_s = int4.quantize(jnp.asarray(x))
  jit_c, jit_s = jax.jit(int4.quantize)(jnp.asarray(x))
  for c, s in ((eager_c, eager_s), (jit_c, jit_s)):
    np.testing.assert_array_equal(np.asarray(s).view(np.uint16), want_s.view(np.uint16))
    np.testing.assert_array_equal(np.asarray(c), want_c)


def test_scale_never_overflows_fp16():
  x = jnp.asarray([[1e6, -3e6, 2.0, 0, 0, 0, 0, 0], [7 * 65504.0, 1, 0, 0, 0, 0, 0, 0]],
                  jnp.float32)
  c, s = int4.quantize(x)
  assert np.all(np.isfinite(np.asarray(s, np.float32)))
  assert float(s[0]) == int4.FP16_MAX
  y = np.asarray(int4.dequantize(int4.pack(c), s))
  assert np.all(np.isfinite(y)) and y[0, 1] == -7 * int4.FP16_MAX    # saturates, never NaN
  assert abs(float(y[1, 0]) - 7 * 65504.0) <= float(s[1]) / 2


# --- the GPU kernel's INT4 -> bf16 bit tricks, emulated in numpy over all 256 byte values ------

def _prmt(a: np.ndarray, b: np.ndarray, sel: int) -> np.ndarray:
  """PTX prmt.b32 (default mode): byte j of the result = byte sel[j] of the 8-byte {b, a}."""
  pool = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
  out = np.zeros_like(a)
  for j in range(4):
    nib = (sel >> (4 * j)) & 0xF
    byte = pool[nib & 7]
    if nib & 8:                      # sign-replicate mode bit (not used by the kernel)
      byte = np.where(byte & 0x80, 0xFF, 0)
    out |= byte << (8 * j)
  return out


def _lop3(a, b, c, lut: int):
  """PTX lop3.b32: bitwise f(a, b, c) where the truth table is indexed by (a=0xF0, b=0xCC,
  c=0xAA)."""
  out = np.zeros_like(a)
  for bit in range(8):
    if lut >> bit & 1:
      ma = a if bit & 4 else ~a
      mb = b if bit & 2 else ~b
      mc = c if bit & 1 else ~c
      out |= ma & mb & mc
  return out & 0xFFFFFFFF


def _asm_unpack(words: np.ndarray, high: bool) -> np.ndarray:
  """The inline PTX of pallas_kernels/gpu/decode.py (ASM_UNPACK_LO/HI), 4 bytes per 32-bit
  register in element order (Triton's elementwise_inline_asm with pack=4), -> 4 bf16 bit patterns
  per word (two 16-bit lanes of $0, then of $1)."""
  from pallas_kernels.gpu import decode as g
  src = g.ASM_UNPACK_HI if high else g.ASM_UNPACK_LO
  # Pin the exact instruction sequence this emulation models.
  ops = [ln.split()[0] for ln in src.splitlines() if ln.strip().endswith(";") and "reg" not in ln]
  assert ops == (["prmt.b32"] * 2 + (["shr.u32"] * 2 if high else []) + ["lop3.b32"] * 2)
  assert "0x3130" in src and "0x3332" in src and "0x000F000F, 0x43084308, 0x6A" in src
  w = words.astype(np.int64)
  t0, t1 = _prmt(w, w, 0x3130), _prmt(w, w, 0x3332)
  if high:
    t0, t1 = t0 >> 4, t1 >> 4
  r0 = _lop3(t0, np.int64(0x000F000F), np.int64(0x43084308), 0x6A)
  r1 = _lop3(t1, np.int64(0x000F000F), np.int64(0x43084308), 0x6A)
  return np.stack([r0 & 0xFFFF, r0 >> 16, r1 & 0xFFFF, r1 >> 16], -1).astype(np.uint16)


def _bf16_value(bits: np.ndarray) -> np.ndarray:
  return (bits.astype(np.uint32) << 16).view(np.float32)


def test_asm_dequant_matches_codes_for_every_byte():
  from pallas_kernels.gpu import decode as g
  rng = np.random.default_rng(3)
  # Every byte value in every one of the 4 byte positions of a word.
  for pos in range(4):
    others = rng.integers(0, 256, (256, 4)).astype(np.uint32)
    others[:, pos] = np.arange(256)
    words = others[:, 0] | others[:, 1] << 8 | others[:, 2] << 16 | others[:, 3] << 24
    codes = np.asarray(int4.unpack(jnp.asarray(others.astype(np.uint8))))   # [256, 8]
    for high in (False, True):
      got = _bf16_value(_asm_unpack(words.astype(np.uint32), high))         # [256, 4]
      want = codes[:, 4:] if high else codes[:, :4]
      np.testing.assert_array_equal(got, want.astype(np.float32) + g.BITS_OFFSET)


def test_bits_dequant_matches_asm_emulation():
  """The "bits" path (what interpret mode runs) gives the same bf16 patterns as the asm."""
  from pallas_kernels.gpu import decode as g
  x = jnp.arange(256, dtype=jnp.uint8).reshape(64, 4)
  lo, hi = g.unpack_halves(x, "bits")
  words = np.asarray(x).astype(np.uint32)
  words = words[:, 0] | words[:, 1] << 8 | words[:, 2] << 16 | words[:, 3] << 24
  for got, high in ((lo, False), (hi, True)):
    bits = np.asarray(jax.lax.bitcast_convert_type(got, jnp.uint16))
    np.testing.assert_array_equal(bits, _asm_unpack(words, high))
