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
  register prefetch, inline-PTX dequant); both kernels compile for sm_90a without spills."""
  from pallas_kernels.gpu import aot
  shape = synth.Shape(b=8, hq=32, hkv=8, d=128, page=16, w=64, lo_cap=4096, hi_cap=512)
  args = synth.make(shape, 4000, 500, 64, poison=False)
  reps = aot.report(decode_attention_gpu, *args)
  assert sorted(r.name for r in reps) == ["pask_decode_attention", "pask_decode_attention_int4"]
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
