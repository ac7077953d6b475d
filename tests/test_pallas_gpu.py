"""The GPU (Pallas Triton) kernel in interpret mode against the reference, on fresh random inputs.

Partials are merged in FP32 and compared with the reference's FP32 result by relative error norm;
the kernel's bf16 hi+lo p @ V keeps it within ~1e-5 (the single-bf16 variant within ~5e-3).
Every invisible slot of the inputs is NaN, so an unmasked read shows as a failure.
"""
import os
import zlib

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np
import pytest

from pallas_kernels.testing import synth
from pallas_kernels.gpu import decode_attention_gpu, partials_gpu

pytestmark = pytest.mark.fast_compile

# Small blocks and chunks force several splits per partition and partial last blocks.
SMALL = dict(block_lo=32, block_hi=16, block_w=16, chunk_lo=96, chunk_hi=48)


@pytest.mark.parametrize("case", synth.CASES, ids=lambda c: c.name)
def test_gpu_kernel_matches_reference(case):
  args = case.make(seed=zlib.crc32(case.name.encode()) % 1000)
  q = args[0]
  g = case.shape.g
  want = synth.reference_f32(*args)
  o, m, l = partials_gpu(*args, interpret=True, **SMALL)
  got = synth.merged_f32(o, m, l, axis=2, hq=q.shape[1], g=g)
  assert synth.rel_err(got, want) < 3e-5


def test_gpu_default_knobs_and_bf16_output():
  case = synth.CASES[3]
  args = case.make(seed=11)
  out = decode_attention_gpu(*args, interpret=True)
  ref = synth.naive(*args)
  assert out.dtype.name == "bfloat16"
  assert synth.rel_err(out, ref) < 6e-3


def test_gpu_single_bf16_pv_is_within_bf16_tolerance():
  case = synth.CASES[2]
  args = case.make(seed=12)
  o, m, l = partials_gpu(*args, interpret=True, exact_pv=False, **SMALL)
  got = synth.merged_f32(o, m, l, axis=2, hq=args[0].shape[1], g=case.shape.g)
  err = synth.rel_err(got, synth.reference_f32(*args))
  assert 1e-5 < err < 8e-3, err   # really rounded (so the exact path is really exact), not broken


def test_gpu_scale_argument():
  case = synth.CASES[0]
  args = case.make(seed=13)
  o, m, l = partials_gpu(*args, scale=0.07, interpret=True, **SMALL)
  got = synth.merged_f32(o, m, l, axis=2, hq=args[0].shape[1], g=case.shape.g)
  assert synth.rel_err(got, synth.reference_f32(*args, scale=0.07)) < 3e-5
  assert np.isfinite(np.asarray(got)).all()


def test_gpu_int4_cvt_dequant_matches_bits_dequant():
  case = synth.CASES[3]   # g = 7, D = 64
  args = case.make(seed=14)
  want = synth.reference_f32(*args)
  for mode in ("cvt", "bits"):
    o, m, l = partials_gpu(*args, interpret=True, int4_dequant=mode, **SMALL)
    got = synth.merged_f32(o, m, l, axis=2, hq=args[0].shape[1], g=case.shape.g)
    assert synth.rel_err(got, want) < 3e-5, mode


@pytest.mark.parametrize("case", [synth.CASES[i] for i in (0, 3, 4, 7)], ids=lambda c: c.name)
def test_gpu_int4_prefetch_and_unfused_match_reference(case):
  """The register-prefetched INT4 loop and the separate-launch layout compute the same partials
  (the prefetch runs past the last block with masked loads; the page table is poisoned there)."""
  args = case.make(seed=zlib.crc32(case.name.encode()) % 997)
  want = synth.reference_f32(*args)
  for kn in (dict(int4_prefetch=True), dict(int4_prefetch=True, fuse=False, num_warps_lo=4),
             dict(fuse=False, int4_dequant="asm")):   # "asm" runs as "bits" when interpreted
    o, m, l = partials_gpu(*args, interpret=True, **SMALL, **kn)
    got = synth.merged_f32(o, m, l, axis=2, hq=args[0].shape[1], g=case.shape.g)
    assert synth.rel_err(got, want) < 3e-5, kn


@pytest.mark.fast_compile(False)   # ptxas's resource report of the default compile
def test_gpu_large_int4_pool_gets_its_own_launch_within_sm90a_limits():
  """fuse="auto": an INT4 partition with >= one program per SM runs as its own kernel (2 warps,
  register prefetch, inline-PTX dequant); both kernels and the merge compile for sm_90a without
  spills."""
  from pallas_kernels.gpu import aot
  shape = synth.Shape(b=8, hq=32, hkv=8, d=128, page=16, w=64, lo_cap=4096, hi_cap=512)
  args = synth.make(shape, 4000, 500, 64, poison=False)
  reps = aot.report(decode_attention_gpu, *args)
  assert sorted(r.name for r in reps) == ["pask_decode_attention", "pask_decode_attention_int4",
                                          "pask_merge"]
  for r in reps:
    assert r.ok(), (r.name, r.summary())
  int4 = next(r for r in reps if r.name.endswith("int4"))
  assert "prmt.b32" in int4.ptx and "lop3.b32" in int4.ptx     # the inline-PTX unpack is there


@pytest.mark.parametrize("fuse", [True, False])
def test_gpu_stacked_layers_match_single_layer(fuse):
  """Pools and window stacked over layers with a traced layer index: the kernel offsets its
  row gathers by the layer and reads that layer only (the other layers differ)."""
  case = synth.CASES[5]   # page 12, 3 KV heads
  args = synth.stack_layers(case.make(seed=15))
  kn = dict(SMALL, fuse=fuse)
  f = jax.jit(lambda l, *a: partials_gpu(*a, l, interpret=True, **kn))
  for layer in (1, 2):
    want = synth.reference_f32(*synth.layer_of(args, layer))
    got = synth.merged_f32(*f(layer, *args), axis=2, hq=args[0].shape[1], g=case.shape.g)
    assert synth.rel_err(got, want) < 3e-5, layer


_BYTES = {"i1": 1, "i8": 1, "ui8": 1, "i16": 2, "ui16": 2, "bf16": 2, "f16": 2, "i32": 4, "ui32": 4,
          "f32": 4, "i64": 8, "ui64": 8, "f64": 8}


def _triton_operands(fn, *args):
  """(shape, element bytes) of every operand of every Pallas-Triton call in ``fn(*args)``,
  lowered for the GPU on this host (abstract arguments: nothing is allocated)."""
  import re

  from jax._src.interpreters import mlir  # noqa: F401  (registers the dialects)
  low = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
  found = []

  def walk(op):
    for region in op.regions:
      for block in region.blocks:
        for o in block.operations:
          if (o.operation.name == "stablehlo.custom_call"
              and "triton" in str(o.attributes["call_target_name"])):
            for v in o.operands:
              m = re.fullmatch(r"tensor<(?:([\dx]+)x)?(\w+)>", str(v.type))
              dims = [int(x) for x in m.group(1).split("x")] if m.group(1) else []
              found.append((tuple(dims), _BYTES[m.group(2)]))
          walk(o)

  walk(low.compiler_ir("stablehlo").operation)
  return found


def test_gpu_kernel_operands_are_indexed_without_offset_overflow():
  """Regression (the 1.5B calibration: 960 stacked rows at capacity 1024, every layer past the
  17th attended to garbage INT4 keys).  Pallas Triton indexes an operand with 32-bit offsets,
  added as signed, unless it exceeds 2**32 bytes; the stacked uint8 INT4 pools were a 3.5 GB
  operand, so offsets past 2**31 wrapped.  At those shapes, lowered for the GPU, every operand of
  the kernels must have elements <= 2**31 or bytes > 2**32."""
  import jax.numpy as jnp

  from pallas_kernels.gpu import decode as gd
  from pallas_kernels.types import HighPool, LowPool, PageMaps, Window
  L, B, hq, hkv, d, page, cap, w = 28, 960, 12, 2, 128, 16, 1024, 16
  P = B * cap // page
  S = jax.ShapeDtypeStruct
  bf, i32 = jnp.bfloat16, jnp.int32
  args = (S((B, hq, d), bf),
          Window(S((L, B, w, hkv, d), bf), S((L, B, w, hkv, d), bf), S((B,), i32)),
          HighPool(S((L, P, page, hkv, d), bf), S((L, P, page, hkv, d), bf)),
          LowPool(S((L, P, page, hkv, d // 2), jnp.uint8), S((L, P, page, hkv, d // 2), jnp.uint8),
                  S((L, P, page, hkv, 2), jnp.float16)),
          PageMaps(S((B, cap // page), i32), S((B,), i32), S((B, cap // page), i32), S((B,), i32)),
          S((), i32))
  ops = _triton_operands(partials_gpu, *args)
  size = lambda dims: int(np.prod(dims, dtype=np.int64))
  assert any(2**31 < size(s) * n <= 2**32 for s, n in ops)   # the INT4 pools: 2-4 GiB each
  bad = [(s, n) for s, n in ops if size(s) > 2**31 and size(s) * n <= 2**32]
  assert not bad, bad
  assert all(gd.offsets_fit(S(s, {1: jnp.uint8, 2: bf, 4: i32, 8: jnp.int64}[n])) for s, n in ops)


def test_triton_refuses_an_int4_format_pool_in_one_line():
  """The Triton kernel reads uint8 half-split bytes; an int4-format pool (pask_jax.cache's
  lo_format="int4") is the Mosaic GPU kernel's (tests/test_mgpu_decode.py)."""
  args = synth.CASES[2].make(seed=26, lo_format="int4")
  with pytest.raises(ValueError, match="^the Triton kernel reads the INT4 pool as uint8 "
                                       "half-split bytes only: an int4-format pool takes "
                                       "int4_kernel 'auto', 'mosaic' or 'mosaic_reference'"):
    partials_gpu(*args, interpret=True, int4_kernel="triton", **SMALL)
  with pytest.raises(ValueError, match="^the Triton kernel reads the INT4 pool"):
    decode_attention_gpu(*args, interpret=True, int4_kernel="triton")
