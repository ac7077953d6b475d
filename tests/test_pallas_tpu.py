"""The TPU (Pallas Mosaic) kernel in interpret mode against the reference, on fresh random inputs.

Most cases use the fast HLO interpreter (``interpret=True``); a few run the TPU interpreter
``pltpu.InterpretParams()``, which poisons uninitialized memory with NaN and raises on
out-of-bounds reads (slow, so small shapes).  Invisible slots of the inputs are NaN as well.
"""
import os
import zlib

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import pytest
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.testing import synth
from pallas_kernels.tpu import decode_attention_tpu, partials_tpu

pytestmark = pytest.mark.fast_compile


def _check(case, seed, tol=3e-5, **kw):
  args = case.make(seed=seed)
  want = synth.reference_f32(*args, scale=kw.get("scale"))
  o, m, l = partials_tpu(*args, **kw)
  got = synth.merged_f32(o, m, l, axis=1, hq=args[0].shape[1])
  err = synth.rel_err(got, want)
  assert err < tol, err
  return err


@pytest.mark.parametrize("case", synth.CASES, ids=lambda c: c.name)
def test_tpu_kernel_matches_reference(case):
  # Two sequential-step splits (split-KV) on odd cases, one on even ones: both code paths.
  splits = 1 + synth.CASES.index(case) % 2 * 2
  _check(case, zlib.crc32(case.name.encode()) % 1000, interpret=True, splits=splits)


@pytest.mark.parametrize("case", [synth.CASES[3], synth.CASES[6]], ids=lambda c: c.name)
def test_tpu_kernel_under_tpu_interpreter(case):
  small = synth.Case(case.name, synth.dataclasses.replace(
      case.shape, lo_cap=min(case.shape.lo_cap, 64), hi_cap=min(case.shape.hi_cap, 48)),
      tuple(min(x, 64) for x in case.lo), tuple(min(x, 48) for x in case.hi), case.win,
      case.spare_pages)
  _check(small, 21, interpret=pltpu.InterpretParams(), splits=2)


def test_tpu_single_bf16_pv_and_output():
  case = synth.CASES[2]
  err = _check(case, 22, tol=8e-3, interpret=True, exact_pv=False)
  assert err > 1e-5
  args = case.make(seed=23)
  out = decode_attention_tpu(*args, interpret=True, scale=0.05)
  assert out.dtype.name == "bfloat16"
  assert synth.rel_err(out, synth.naive(*args, scale=0.05)) < 6e-3


def test_tpu_stacked_layers_match_single_layer():
  """Stacked pools and window with the layer as a scalar prefetch (index maps pick its blocks)."""
  case = synth.CASES[1]
  args = synth.stack_layers(case.make(seed=24))
  f = jax.jit(lambda l, *a: partials_tpu(*a, l, interpret=True, splits=2))
  for layer in (1, 2):
    want = synth.reference_f32(*synth.layer_of(args, layer))
    got = synth.merged_f32(*f(layer, *args), axis=1, hq=args[0].shape[1])
    assert synth.rel_err(got, want) < 3e-5, layer


def test_tpu_refuses_an_int4_format_pool_in_one_line():
  args = synth.CASES[2].make(seed=25, lo_format="int4")
  with pytest.raises(NotImplementedError, match="^the TPU kernel reads the INT4 pool as uint8 "
                                                "half-split bytes only"):
    partials_tpu(*args, interpret=True)
  with pytest.raises(NotImplementedError, match="^the TPU kernel reads the INT4 pool"):
    decode_attention_tpu(*synth.stack_layers(args), 1, interpret=True)
