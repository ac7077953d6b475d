"""The GPU (Pallas Triton) kernel of the Spherical KV tier partitions (pallas_kernels.gpu.spherical)
in interpret mode against the jnp reference (reference.sph_partials) and the float64 oracle
(sph_synth.naive), on fresh random inputs with every invisible slot poisoned (NaN radii, scales
and values, random angle bytes, garbage page-table entries): ragged lengths, a (sequence, head)
with no rows, an all-empty tier, every layout and both value formats, GQA 1/4/7, shuffled page
tables, split-KV, stacked layers with a traced layer index.  Tolerances are relative error norms.

Plus an ahead-of-time compile of every tier format to PTX for sm_90a at the issue's two model
shapes, with ptxas's registers / spills / shared memory checked against Hopper's limits; as in
tests/test_pallas_aot.py nothing skips: a missing CUDA plugin or ptxas is a failure.
"""
import functools
import os
import re

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels import common
from pallas_kernels import reference
from pallas_kernels import spherical
from pallas_kernels.gpu import aot as gpu_aot
from pallas_kernels.gpu import decode_attention_sph_gpu, sph_partials_gpu
from pallas_kernels.gpu import spherical as gpu_sph
from pallas_kernels.sph_types import TierSpec
from pallas_kernels.testing import sph_synth
from pallas_kernels.testing import synth

pytestmark = pytest.mark.fast_compile

TOL = 3e-5   # the GPU kernel's interpret-mode tolerance (tests/test_pallas_gpu.py)


def _compare(q, sph, layer=None, **kw):
  """Kernel partials against sph_partials, tier by tier -> the largest relative error."""
  got = sph_partials_gpu(q, sph, layer, interpret=True, **kw)
  want = reference.sph_partials(q, sph, layer, scale=kw.get("scale"))
  # Max logits (log2 units): the three-pass bf16 MMAs carry ~2^-16 of |q'|·r̃·scale per term.
  return sph_synth.compare_tiers(got, want, logit_atol=1e-4)


def test_sincos_polynomial():
  th = jnp.linspace(-np.pi, np.pi, 20001, dtype=jnp.float32)
  c, s = gpu_sph.sincos(th)
  t = np.asarray(th, np.float64)
  assert np.abs(np.asarray(c) - np.cos(t)).max() < 2e-7
  assert np.abs(np.asarray(s) - np.sin(t)).max() < 2e-7


@pytest.mark.parametrize("trig,expand,codes", [("code", "joins", "row"),
                                               ("poly", "joins", "levels"),
                                               ("table", "direct", "row"),
                                               ("poly", "direct", "levels"),
                                               ("table", "joins", "levels")])
def test_every_format_ragged_empty_and_shuffled(trig, expand, codes):
  """All three layouts in one call (one launch per tier; A4 int4 and A42 bf16 are in
  test_gqa_ratios_and_shapes), GQA 4, D 64: ragged lengths, a (sequence, head) with no rows,
  exactly one full page, an all-empty tier, shuffled page tables with garbage past each head's
  pages, split-KV with partial blocks; every trig source, tree expansion and code read (the
  first case is the defaults; the per-level reads with the two-rounding multiply-adds)."""
  d, b, hkv, g, page = 64, 2, 2, 4, 16
  tiers = [TierSpec("A4", "bf16", d), TierSpec("A42", "int4", d), TierSpec("A2", "int4", d),
           TierSpec("A2", "bf16", d)]
  rng = np.random.default_rng(51)
  lens = [rng.integers(1, 60, (b, hkv)) for _ in tiers]
  lens[0][1, 0] = 0                                   # a head with no rows in tier 0
  lens[1][0, 1] = page                                # exactly one full page
  lens[3][:] = 0                                      # an all-empty tier
  sph = sph_synth.layer_of(sph_synth.make(tiers, lens, b=b, hkv=hkv, page=page, seed=52), 0)
  q = jax.random.normal(jax.random.PRNGKey(53), (b, hkv * g, d), jnp.float32)
  err = _compare(q, sph, splits=2, block=16, trig=trig, expand=expand, codes=codes,
                 fma=codes == "row")
  assert err < TOL, err


@pytest.mark.parametrize("expand,trig", [("joins", "poly"), ("direct", "code")])
def test_row_codes_and_fma_knobs(expand, trig):
  """``codes="row"`` (A4 tiers read each key's code bytes once and split them into levels; the
  A42 tier beside them reads its two regions once and keeps levels 1 and 2 in halves) and
  ``fma=True`` (plain multiply-adds in interpret
  mode): ragged lengths, an empty head, split-KV with partial blocks, GQA 3, both head dims'
  level counts (D 64: 6 levels, D 128: 7; the direct expansion, with ``trig="code"``'s factors,
  at D 64)."""
  for d in (64, 128) if expand == "joins" else (64,):
    b, hkv, g, page = 2, 2, 3, 16
    tiers = [TierSpec("A4", "int4", d), TierSpec("A4", "bf16", d), TierSpec("A42", "int4", d)]
    rng = np.random.default_rng(d)
    lens = [rng.integers(1, 70, (b, hkv)) for _ in tiers]
    lens[1][0, 1] = 0
    sph = sph_synth.layer_of(sph_synth.make(tiers, lens, b=b, hkv=hkv, page=page, seed=d + 1), 0)
    q = jax.random.normal(jax.random.PRNGKey(d + 2), (b, hkv * g, d), jnp.float32)
    err = _compare(q, sph, splits=3, block=16, expand=expand, trig=trig, codes="row", fma=True)
    assert err < TOL, (d, err)


def test_how_each_layout_reads_its_codes():
  """``codes="row"``: A4 from one row load; A42 and A2 in halves where the joins expansion runs
  and each half's logit MMA contracts over D/4 >= 16; per level otherwise."""
  how = lambda lay, d, expand="joins", codes="row": gpu_sph.codes_from(
      codes, TierSpec(lay, "int4", d).key, expand)
  assert [how(lay, 64) for lay in ("A4", "A42", "A2")] == ["row", "halves", "halves"]
  assert how("A42", 128) == how("A2", 128) == "halves" and how("A4", 32) == "row"
  assert how("A42", 32) == how("A2", 32) == "levels"                  # D/4 = 8: no MMA
  assert how("A42", 64, "direct") == how("A2", 128, "direct") == "levels"
  assert {how(lay, 64, codes="levels") for lay in ("A4", "A42", "A2")} == {"levels"}


def test_sincos_with_fused_multiply_adds():
  """The polynomials in Horner form by single-rounding FMAs (what ``fma=True`` compiles to),
  emulated in float64 and rounded once: as accurate as the two-rounding form."""
  # f32 operands (as the kernel's constants are), the product exact in f64, one final rounding
  f64 = lambda x: np.asarray(x, np.float32).astype(np.float64)
  fma = lambda a, b, c: (f64(a) * f64(b) + f64(c)).astype(np.float32)
  th = np.linspace(-np.pi, np.pi, 20001, dtype=np.float32)
  c, s = gpu_sph.sincos(jnp.asarray(th), fma=lambda a, b, c: jnp.asarray(fma(a, b, c)))
  t = th.astype(np.float64)
  assert np.abs(np.asarray(c) - np.cos(t)).max() < 2e-7
  assert np.abs(np.asarray(s) - np.sin(t)).max() < 2e-7


@pytest.mark.parametrize("d", [8, 64, 128])
def test_sincos_code_every_level_and_code(d):
  """``trig="code"``: cos and sin of every code of every level of every layout (the quarter
  turn from level 1's top bits, each level's polynomial degree from its range) against the
  float64 decoded angles, with two-rounding multiply-adds and with emulated single-rounding
  FMAs; an error in a sign or a swap would be O(1)."""
  f64 = lambda x: np.asarray(x, np.float32).astype(np.float64)
  fma = lambda a, b, c: jnp.asarray((f64(a) * f64(b) + f64(c)).astype(np.float32))
  for lay in ("A4", "A42", "A2"):
    sp = spherical.spec(lay, d)
    for lvl in range(1, sp.levels + 1):
      want = spherical.centers(sp, lvl)
      codes = jnp.asarray(np.random.default_rng(lvl).permutation(want.size), jnp.int32)
      for f in (gpu_sph.mul_add, fma):
        c, s = gpu_sph.sincos_code(codes, sp, lvl, f)
        t = want[np.asarray(codes)]
        err = max(np.abs(np.asarray(c, np.float64) - np.cos(t)).max(),
                  np.abs(np.asarray(s, np.float64) - np.sin(t)).max())
        assert err < 2e-7, (lay, lvl, err)


def test_trig_table_is_the_reference_table():
  for lay in ("A4", "A42", "A2"):
    sp = TierSpec(lay, "bf16", 64).key
    tab, offs = gpu_sph.trig_table(sp)
    ct, st = spherical.trig_tables(sp)
    for lvl in range(1, sp.levels + 1):
      row = 64 - 64 // 2 ** (lvl - 1)
      n = 2 ** (sp.b1 if lvl == 1 else sp.bh)
      got = tab[offs[lvl - 1]: offs[lvl - 1] + 2 * n].reshape(n, 2)
      np.testing.assert_array_equal(got, np.stack([ct[row, :n], st[row, :n]], -1))
      assert (lvl == sp.levels) == (offs[lvl - 1] + 2 * n == tab.size)


@pytest.mark.parametrize("g,d,tier,page", [(1, 128, ("A42", "bf16"), 16),
                                           (7, 32, ("A4", "int4"), 8)],
                         ids=["g1_d128_A42", "g7_d32_A4_int4_page8"])
def test_gqa_ratios_and_shapes(g, d, tier, page):
  b, hkv = 2, 2
  rng = np.random.default_rng(g * d)
  lens = rng.integers(0, 45, (b, hkv))
  lens[0, 0] = 1
  sph = sph_synth.layer_of(sph_synth.make([TierSpec(*tier, d)], [lens], b=b, hkv=hkv, page=page,
                                          seed=g), 0)
  q = jax.random.normal(jax.random.PRNGKey(g), (b, hkv * g, d), jnp.float32).astype(jnp.bfloat16)
  err = _compare(q, sph, scale=0.07)
  assert err < TOL, err


def test_decode_attention_gpu_backend_with_tiers_and_stacked_layers(monkeypatch):
  """decode_attention(sph=, backend="gpu", layer=traced, return_lse=True) = softmax over the union
  of every stored key of that layer (float64 oracle) and its LSE; the single-bf16-pass logits
  (qk_passes=1) are really rounded; backend="auto" on a GPU resolves to this path."""
  case = next(c for c in synth.CASES if c.name == "g4_d64_page12_hkv3")
  s = case.shape
  args = synth.stack_layers(case.make(seed=55))
  tiers = [TierSpec("A42", "int4", s.d)]      # several tiers per call: the tests above
  rng = np.random.default_rng(56)
  lens = [rng.integers(0, 40, (s.b, s.hkv)) for _ in tiers]
  sph = sph_synth.make(tiers, lens, b=s.b, hkv=s.hkv, page=s.page, layers=3, seed=57)
  layer = 2
  f = jax.jit(lambda lyr: pk.decode_attention(*args, sph=sph, layer=lyr, backend="gpu",
                                              return_lse=True, interpret=True,
                                              sph_knobs=dict(block=16)))
  one, sph1 = synth.layer_of(args, layer), sph_synth.layer_of(sph, layer)
  out, lse = f(jnp.int32(layer))
  want, want_lse = sph_synth.naive(*one, sph1)
  assert out.dtype == jnp.bfloat16 and out.shape == (s.b, s.hq, s.d)
  assert synth.rel_err(out, want) < 6e-3                            # BF16 output rounding only
  assert synth.rel_err(lse, want_lse) <= 1e-5
  # The f32 outputs before the BF16 cast, against the reference partials merged the same way.
  o, m, l = sph_partials_gpu(args[0], sph, jnp.int32(layer), interpret=True, qk_passes=1)
  ro, rm, rl = reference.sph_partials(args[0], sph, layer)
  err1 = synth.rel_err(common.merge(o, m, l, 2)[0], common.merge(ro, rm, rl, 2)[0])
  assert 1e-5 < err1 < 2e-2, err1          # one bf16 pass is rounded; three passes are exact
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  assert pk.resolve_backend("auto") == "gpu"


def test_errors_are_one_line():
  d = 64
  sph = sph_synth.layer_of(sph_synth.make([TierSpec("A2", "bf16", d)], [[[3, 4]]], b=1, hkv=2,
                                          page=16), 0)
  with pytest.raises(ValueError, match="^tier spec has head dim 64, queries have 128"):
    sph_partials_gpu(jnp.ones((1, 4, 128)), sph, interpret=True)
  with pytest.raises(ValueError, match="^query heads 5 not a multiple of KV heads 2"):
    sph_partials_gpu(jnp.ones((1, 5, d)), sph, interpret=True)
  small = sph_synth.zeros([TierSpec("A2", "bf16", 16)], b=1, hkv=2, page=8, n=1, layers=1)
  with pytest.raises(ValueError, match="^the GPU tier kernel needs head dim >= 32"):
    sph_partials_gpu(jnp.ones((1, 2, 16)), small, 0, interpret=True)
  with pytest.raises(ValueError, match=r"^a A2 tier pool at D=64 needs ang \[L, P, page, NB\]"):
    sph_partials_gpu(jnp.ones((1, 4, d)), sph, 0, interpret=True)     # one layer's pools
  with pytest.raises(ValueError, match="^block must be a power of two >= 16, got 24"):
    sph_partials_gpu(jnp.ones((1, 4, d)), sph, block=24, interpret=True)
  args = synth.make(synth.Shape(b=1, hq=3, hkv=3, d=d, page=16, w=8, lo_cap=16, hi_cap=16),
                    1, 1, 1)
  with pytest.raises(ValueError, match="^tier maps have 2 KV heads, the window has 3"):
    decode_attention_sph_gpu(*args, sph, interpret=True)
  args = synth.make(synth.Shape(b=1, hq=4, hkv=2, d=d, page=16, w=8, lo_cap=16, hi_cap=16),
                    1, 1, 1)
  with pytest.raises(ValueError, match="^int4_kernel='fused' merges its own partials"):
    pk.decode_attention(*args, sph=sph, backend="gpu", interpret=True, int4_kernel="fused")


# The model shapes: 1.5B (12 q / 2 kv, d128) and 0.5B (14 q / 2 kv, d64); pools stacked
# over layers with a traced layer index; every layout at each shape, the value formats
# alternating (all six formats across both shapes).
AOT_SHAPES = {"12q2kv_d128": (12, 128, ("bf16", "int4", "bf16")),
              "14q2kv_d64": (14, 64, ("int4", "bf16", "int4"))}


@pytest.mark.fast_compile(False)
@pytest.mark.parametrize("shape", sorted(AOT_SHAPES))
def test_tier_kernel_compiles_to_sm90a_within_limits(shape):
  hq, d, values = AOT_SHAPES[shape]
  tiers = [TierSpec(lay, val, d) for lay, val in zip(("A4", "A42", "A2"), values)]
  sph = sph_synth.zeros(tiers, b=2, hkv=2, page=16, n=64, layers=2)
  reps = gpu_aot.report(sph_partials_gpu, jnp.zeros((2, hq, d), jnp.bfloat16), sph, jnp.int32(1))
  assert [r.name for r in reps] == [f"sph_tier_{t.layout}_{t.values}_gpu" for t in tiers]
  for r in reps:
    print(shape, r.name, r.summary())
    assert ".target sm_90a" in r.ptx
    assert r.ok(), (r.name, r.summary())


@pytest.mark.fast_compile(False)
def test_row_codes_and_fma_compile_to_sm90a():
  """``codes="row"``, ``fma=True`` and ``trig="code"`` at the 1.5B shape (A4, INT4 values) for
  sm_90a with 4 warps (at 8 ptxas caps the row variant at 128 registers and spills a few bytes):
  within ptxas's limits, explicit FMAs in the PTX, fewer global loads per block than the
  per-level gathers (one row load instead of one byte gather per level and layout), no quadrant
  reduction with ``trig="code"``, and fewer SASS instructions in the loop."""
  d, hq = 128, 12
  sph = sph_synth.zeros([TierSpec("A4", "int4", d)], b=2, hkv=2, page=16, n=64, layers=2)
  q = jnp.zeros((2, hq, d), jnp.bfloat16)
  base, = gpu_aot.report(functools.partial(sph_partials_gpu, num_warps=4, codes="levels",
                                           trig="poly", fma=False), q, sph, jnp.int32(1))
  fast, = gpu_aot.report(functools.partial(sph_partials_gpu, codes="row", fma=True, trig="poly",
                                           num_warps=4), q, sph, jnp.int32(1))
  code, = gpu_aot.report(functools.partial(sph_partials_gpu, codes="row", fma=True, trig="code",
                                           num_warps=4), q, sph, jnp.int32(1))
  print("levels:", base.summary(), "| row+fma:", fast.summary(), "| +code:", code.summary())
  assert fast.ok(), fast.summary()
  assert code.ok(), code.summary()
  assert "fma.rn.f32" in fast.ptx and "fma.rn.f32" not in base.ptx
  loads = lambda r: len(re.findall(r"\bld\.global", r.ptx))
  assert loads(fast) < loads(base), (loads(fast), loads(base))
  # trig="code" has no quadrant reduction: no floor, and a fraction of the selects
  selects = lambda r: len(re.findall(r"\bselp\.", r.ptx))
  assert "cvt.rmi" in fast.ptx and "cvt.rmi" not in code.ptx
  assert selects(code) < selects(fast) / 2, (selects(code), selects(fast))
  # and bench/sph_sass.py finds the loop over key blocks and counts fewer SASS instructions in it
  from bench import sph_sass
  (_, n_base), (_, n_code) = (sph_sass.loop_opcodes(r.ptx) for r in (base, code))
  assert n_base["HMMA"] > 0 and n_code["HMMA"] > 0, (n_base, n_code)
  assert sum(n_code.values()) < 0.8 * sum(n_base.values()), (n_code.total(), n_base.total())


def test_bf16_split_survives_xla_on_gpu():
  """The rotated query's hi/lo split happens in XLA, whose GPU pipeline folds f32 -> bf16 -> f32
  round trips: with ``astype`` the low half became ``x - x = 0`` and the three-pass logits were
  one bf16 pass (2e-3 on an H100).  common.split_bf16 rounds by bit ops; it must equal the
  plain conversion on the host and keep its subtraction in the sm_90 compile."""
  rng = np.random.default_rng(7)
  x = np.concatenate([rng.standard_normal(4096) * 10.0 ** rng.integers(-30, 30, 4096),
                      np.float32(1 + np.arange(-8, 9) * 2.0 ** -8),   # ties: round to even
                      [0.0, -0.0, 1e-40, -3e38]]).astype(np.float32)
  want = np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32))
  np.testing.assert_array_equal(np.asarray(common.round_bf16(jnp.asarray(x))), want)
  hi, lo = common.split_bf16(jnp.asarray(x))
  np.testing.assert_array_equal(np.asarray(hi.astype(jnp.float32)), want)
  big = np.abs(x) > 1e-30
  err = np.abs(np.asarray(hi, np.float64) + np.asarray(lo, np.float64) - x)[big] / np.abs(x[big])
  assert err.max() <= 2.0 ** -16
  folded = r"subtract\((%[\w.-]+), \1\)"
  plain = gpu_aot.compile_hlo(jax.jit(lambda v: gpu_sph.split_bf16(v * 1.5)), jnp.ones((16, 64)))
  assert re.search(folded, plain), "XLA no longer folds the round trip: revisit common.split_bf16"
  d = 64
  sph = sph_synth.zeros([TierSpec("A4", "bf16", d)], b=1, hkv=2, page=16, n=4, layers=1)
  hlo = gpu_aot.compile_hlo(jax.jit(sph_partials_gpu), jnp.ones((1, 8, d), jnp.bfloat16), sph,
                            jnp.int32(0))
  assert not re.search(folded, hlo)
  assert "subtract" in hlo
