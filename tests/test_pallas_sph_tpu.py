"""The TPU (Pallas Mosaic) kernel of the Spherical KV tier partitions (pallas_kernels.tpu.spherical)
in interpret mode against the jnp reference (reference.sph_partials, decode_attention_sph_reference)
and the float64 oracle (sph_synth.naive), on fresh random inputs with every invisible slot poisoned
(NaN radii, scales and values, random angle bytes, garbage page-table entries): ragged lengths, a
(sequence, head) with no rows, an all-empty tier, every layout with both value formats, GQA 1/4/7,
shuffled page tables, split-KV, stacked layers; one case under the TPU interpreter (NaN-poisoned
scratch, out-of-bounds reads raise).  Plus ahead-of-time compiles for v5e and v6e through libtpu,
which, as in tests/test_pallas_aot.py, never skip: a missing libtpu is a failure.
"""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

import pallas_kernels as pk
from pallas_kernels import reference
from pallas_kernels import spherical
from pallas_kernels.sph_types import TierSpec
from pallas_kernels.testing import sph_synth
from pallas_kernels.testing import synth
from pallas_kernels.tpu import aot as tpu_aot
from pallas_kernels.tpu import decode_attention_sph_tpu, sph_partials_tpu
from pallas_kernels.tpu import spherical as tpu_sph

pytestmark = pytest.mark.fast_compile

TOL = 3e-5   # the INT4 partition's interpret-mode tolerance (tests/test_pallas_tpu.py)


def _compare(q, sph, layer=None, **kw):
  """Kernel partials against sph_partials, tier by tier -> the largest relative error."""
  got = sph_partials_tpu(q, sph, layer, interpret=kw.pop("interpret", True), **kw)
  want = reference.sph_partials(q, sph, layer, scale=kw.get("scale"))
  return sph_synth.compare_tiers(got, want, logit_atol=1e-5)


def test_plan_places_every_code_once():
  """The static lane plan: every leaf has one even/odd query lane, every leaf gets one factor
  per level above it (each row of the stacked 0/1 matrices' columns sums to levels - 1)."""
  for layout in spherical.LAYOUTS:
    for d in (16, 64, 128):
      ts = TierSpec(layout, "bf16", d)
      p = tpu_sph.plan(ts)
      assert p.nb == ts.code_bytes
      pos = p.pos[p.pos >= 0]
      assert sorted(pos.tolist()) == list(range(d))            # each tree position once
      leaves = np.sort(p.qidx[p.qmask > 0])
      np.testing.assert_array_equal(leaves, np.arange(d // 2))
      per_leaf = np.zeros((len(p.leaves), p.nb))
      for (f, _, _), mat in zip(p.mats, p.mat):
        per_leaf[f] += mat.sum(0)
      np.testing.assert_array_equal(per_leaf, (d.bit_length() - 2) * p.qmask)


def test_every_format_ragged_empty_and_shuffled():
  """All three layouts in one call (one launch per tier; the other value format of each layout is
  in test_gqa_ratios_and_shapes), GQA 4, D 64:
  ragged lengths, a (sequence, head) with no rows, an all-empty tier, shuffled page tables with
  garbage past each head's pages, split-KV over a head's pages."""
  d, b, hkv, g, page = 64, 2, 2, 4, 16
  tiers = [TierSpec("A4", "bf16", d), TierSpec("A42", "int4", d), TierSpec("A2", "bf16", d),
           TierSpec("A4", "bf16", d)]
  rng = np.random.default_rng(41)
  lens = [rng.integers(1, 60, (b, hkv)) for _ in tiers]
  lens[0][1, 0] = 0                                   # a head with no rows in tier 0
  lens[1][0, 1] = page                                # exactly one full page
  lens[3][:] = 0                                      # an all-empty tier
  sph = sph_synth.layer_of(sph_synth.make(tiers, lens, b=b, hkv=hkv, page=page, seed=42), 0)
  q = jax.random.normal(jax.random.PRNGKey(43), (b, hkv * g, d), jnp.float32)
  err = _compare(q, sph, splits=2)
  assert err < TOL, err


@pytest.mark.parametrize("g,d,tier,page", [(1, 128, ("A42", "bf16"), 16),
                                           (7, 128, ("A4", "int4"), 8),
                                           (4, 32, ("A2", "int4"), 12)],
                         ids=["g1_d128_A42", "g7_d128_A4_page8", "g4_d32_A2_page12"])
def test_gqa_ratios_and_shapes(g, d, tier, page):
  b, hkv = 3, 2
  rng = np.random.default_rng(g * d)
  lens = rng.integers(0, 45, (b, hkv))
  lens[0, 0] = 1
  sph = sph_synth.layer_of(sph_synth.make([TierSpec(*tier, d)], [lens], b=b, hkv=hkv, page=page,
                                          seed=g), 0)
  q = jax.random.normal(jax.random.PRNGKey(g), (b, hkv * g, d), jnp.float32).astype(jnp.bfloat16)
  err = _compare(q, sph, scale=0.07)
  assert err < TOL, err


def test_tpu_interpreter_catches_no_oob_or_nan():
  """The TPU interpreter poisons scratch with NaN and raises on out-of-bounds reads."""
  d, b, hkv, g = 64, 1, 2, 2
  sph = sph_synth.layer_of(sph_synth.make([TierSpec("A42", "int4", d)], [np.array([[20, 3]])],
                                          b=b, hkv=hkv, page=8, seed=44), 0)
  q = jax.random.normal(jax.random.PRNGKey(44), (b, hkv * g, d), jnp.float32)
  err = _compare(q, sph, interpret=pltpu.InterpretParams(), splits=2)
  assert err < TOL, err


def test_decode_attention_tpu_backend_with_tiers_and_stacked_layers(monkeypatch):
  """decode_attention(sph=, backend="tpu", layer=traced, return_lse=True) = softmax over the union
  of every stored key of that layer (float64 oracle; the reference backend meets the same oracle
  in tests/test_pallas_spherical.py) and its LSE; backend="auto" on a TPU takes the same path."""
  case = next(c for c in synth.CASES if c.name == "g4_d64_page12_hkv3")
  s = case.shape
  args = synth.stack_layers(case.make(seed=45))
  tiers = [TierSpec("A42", "int4", s.d)]      # several tiers per call: the tests above
  lens = [np.random.default_rng(46).integers(0, 40, (s.b, s.hkv))]
  sph = sph_synth.make(tiers, lens, b=s.b, hkv=s.hkv, page=s.page, layers=3, seed=47)
  layer = 2
  f = lambda backend: pk.decode_attention(*args, sph=sph, layer=jnp.int32(layer), backend=backend,
                                          return_lse=True, interpret=True, splits=2)
  one, sph1 = synth.layer_of(args, layer), sph_synth.layer_of(sph, layer)
  out, lse = f("tpu")
  want, want_lse = sph_synth.naive(*one, sph1)
  assert out.dtype == jnp.bfloat16 and out.shape == (s.b, s.hq, s.d)
  assert synth.rel_err(out, want) < 6e-3                            # BF16 output rounding only
  assert synth.rel_err(lse, want_lse) <= 1e-5
  monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
  assert pk.resolve_backend("auto") == "tpu"
  auto_out, auto_lse = f("auto")
  np.testing.assert_array_equal(np.asarray(auto_out, np.float32), np.asarray(out, np.float32))
  np.testing.assert_array_equal(np.asarray(auto_lse), np.asarray(lse))


def test_errors_are_one_line():
  d = 64
  sph = sph_synth.layer_of(sph_synth.make([TierSpec("A2", "bf16", d)], [[[3, 4]]], b=1, hkv=2,
                                          page=16), 0)
  with pytest.raises(ValueError, match="^tier spec has head dim 64, queries have 128"):
    sph_partials_tpu(jnp.ones((1, 4, 128)), sph, interpret=True)
  with pytest.raises(ValueError, match="^query heads 5 not a multiple of KV heads 2"):
    sph_partials_tpu(jnp.ones((1, 5, d)), sph, interpret=True)
  big = sph_synth.zeros([TierSpec("A2", "bf16", 1024)], b=1, hkv=2, page=8, n=1)
  with pytest.raises(ValueError, match="^the TPU tier kernel takes head dims up to 512, got 1024"):
    sph_partials_tpu(jnp.ones((1, 2, 1024)), big, interpret=True)
  with pytest.raises(ValueError, match=r"^a A2 tier pool at D=64 needs ang \[L, P, page, NB\]"):
    sph_partials_tpu(jnp.ones((1, 4, d)), sph, 0, interpret=True)     # one layer's pools
  args = synth.make(synth.Shape(b=1, hq=3, hkv=3, d=d, page=16, w=8, lo_cap=16, hi_cap=16),
                    1, 1, 1)
  with pytest.raises(ValueError, match="^tier maps have 2 KV heads, the window has 3"):
    decode_attention_sph_tpu(*args, sph, interpret=True)
  # (The GPU backend's tier kernel and its errors: tests/test_pallas_sph_gpu.py.)


# The model shapes, one per generation: 1.5B (12 q / 2 kv, d128) on v5e, 0.5B (14 q / 2 kv,
# d64) on v6e; a decode step's form (pools and window stacked over layers, traced layer) and
# return_lse; each layout on each generation, the value formats alternating (all six across both).
AOT_CASES = {"v5e": ((2, 12, 2, 128), ("bf16", "int4", "bf16")),
             "v6e": ((2, 14, 2, 64), ("int4", "bf16", "int4"))}


@pytest.mark.fast_compile(False)
@pytest.mark.parametrize("gen", sorted(AOT_CASES))
def test_tier_kernel_compiles_for_generation(gen):
  (b, hq, hkv, d), values = AOT_CASES[gen]
  case = synth.Case("aot", synth.Shape(b=b, hq=hq, hkv=hkv, d=d, page=16, w=32, lo_cap=256,
                                       hi_cap=64), (200,), (40,), (32,))
  args = synth.stack_layers(case.make(poison=False))
  tiers = [TierSpec(lay, val, d) for lay, val in zip(spherical.LAYOUTS, values)]
  n = 64                                        # pages per (sequence, head) of every tier
  sph = sph_synth.zeros(tiers, b=b, hkv=hkv, page=16, n=n, layers=2)
  comp = tpu_aot.compile_for(gen, decode_attention_sph_tpu, *args, sph, jnp.int32(1), splits=2,
                             return_lse=True)
  txt = comp.as_text()
  for ts in tiers:
    assert f"sph_tier_{ts.layout}_{ts.values}_tpu" in txt
  assert "pask_decode_attention_tpu" in txt
  rep = tpu_aot.memory_report(comp)
  assert rep["argument_bytes"] > 0 and rep["code_bytes"] > 0
  # No dense key in HBM: the program's scratch is below one tier-layer's keys rebuilt in BF16.
  assert rep["temp_bytes"] < b * hkv * n * 16 * d * 2, rep
