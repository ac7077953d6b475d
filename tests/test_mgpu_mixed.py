"""The fused Mosaic GPU kernel (pallas_kernels/gpu/mgpu_mixed.py: INT4 pool and BF16 pool in one
launch, ``int4_kernel="fused"``) on a CPU host.

The glue (q padding, tables clamped and padded to the splits, layer offsets, the window's jnp
partial, the one merge) runs end to end with the kernel's jnp reference in its place against the
float32 reference, on poisoned random inputs (NaN in invisible BF16 rows and scales, garbage
table entries, shuffled pages); the kernel itself is checked by its lowering for CUDA at the 4B
and 0.5B shapes. On the H200: ``scripts/h200_fused.sh``.
"""
import os
import zlib

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import pytest  # noqa: E402

from pallas_kernels import HighPool, LowPool, PageMaps, Window, decode_attention  # noqa: E402
from pallas_kernels.gpu import decode_attention_gpu, mgpu_mixed as MX, partials_gpu  # noqa: E402
from pallas_kernels.gpu import mgpu_common  # noqa: E402
from pallas_kernels.testing import synth  # noqa: E402
from pallas_kernels.testing.mgpu import assert_narrow_lowers  # noqa: E402

pytestmark = pytest.mark.fast_compile

S, C = synth.Shape, synth.Case
# Pages of 64 / 128 rows in both pools; GQA 1, 4, 7 (Qwen2.5-0.5B), 8; head dim 64 and 128;
# ragged lengths, an empty BF16 partition, an empty INT4 partition, one key, full tables.
CASES = [
    C("g4_d128_p128", S(b=2, hq=16, hkv=4, d=128, page=128, w=16, lo_cap=384, hi_cap=256),
      (300, 129), (200, 1), (7, 16)),
    C("g7_d64_p64_empty_hi", S(b=2, hq=14, hkv=2, d=64, page=64, w=32, lo_cap=256, hi_cap=128),
      (255, 65), (0, 0), (32, 5)),
    C("g1_d64_p64_empty_lo", S(b=3, hq=2, hkv=2, d=64, page=64, w=24, lo_cap=128, hi_cap=192),
      (0, 0, 0), (191, 1, 64), (1, 24, 13)),
    C("g8_d128_p64_hkv1", S(b=2, hq=8, hkv=1, d=128, page=64, w=16, lo_cap=256, hi_cap=128),
      (256, 1), (128, 63), (0, 2)),
]
LOG2E = mgpu_common.LOG2E


def _fused_f32(args, layer=None, **kw):
  d = args[0].shape[-1]
  return MX.mixed_attention(*args, layer, c=d ** -0.5 * LOG2E, reference=True, **kw)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_fused_glue_matches_float32_reference(case):
  args = case.make(seed=zlib.crc32(case.name.encode()) % 1000, lo_format="int4")
  want = synth.reference_f32(*args)
  got = _fused_f32(args)
  assert bool(jnp.isfinite(got).all())
  # P^T enters the MMAs as bf16 once per partition: ~1e-3.
  assert synth.rel_err(got, want) < 4e-3
  for b in range(args[0].shape[0]):     # each sequence too: a wrong short one cannot hide
    assert synth.rel_err(got[b], want[b]) < 6e-3, b


@pytest.mark.parametrize("splits_lo,splits_hi,tile_hi", [(1, 1, 128), (3, 2, 64), (5, 6, 64)])
def test_any_splits_and_tiles_give_the_same_attention(splits_lo, splits_hi, tile_hi):
  """Splits that do not divide the tables (padded with page 0, masked) and half-page tiles;
  more splits than pages / tiles: whole splits without a visible key (zero-length splits,
  l = 0, which the merge drops)."""
  case = CASES[0]              # 3 INT4 pages and 2 BF16 pages of 128 per sequence
  args = case.make(seed=11, lo_format="int4")
  got = _fused_f32(args, splits_lo=splits_lo, splits_hi=splits_hi, tile_hi=tile_hi)
  assert synth.rel_err(got, synth.reference_f32(*args)) < 4e-3


def test_a_pool_without_pages_and_a_window_alone():
  no_hi = C("no_hi", S(b=2, hq=8, hkv=2, d=64, page=64, w=16, lo_cap=128, hi_cap=0),
            (100, 3), (0, 0), (5, 16), spare_pages=0)
  args = no_hi.make(seed=4, lo_format="int4")
  assert synth.rel_err(_fused_f32(args), synth.reference_f32(*args)) < 4e-3
  win = C("win", S(b=2, hq=8, hkv=2, d=64, page=64, w=16, lo_cap=0, hi_cap=0),
          (0, 0), (0, 0), (9, 16), spare_pages=0)
  args = win.make(seed=5, lo_format="int4")
  assert synth.rel_err(_fused_f32(args), synth.reference_f32(*args)) < 1e-5   # f32, no kernel


def test_decode_attention_reads_the_traced_layer_of_a_stack():
  case = CASES[1]
  args = synth.stack_layers(case.make(seed=22, lo_format="int4"))
  f = jax.jit(lambda l, *a: decode_attention(*a, layer=l, backend="gpu",
                                             int4_kernel="fused_reference"))
  for layer in (0, 2):
    want = synth.reference_f32(*synth.layer_of(args, layer))
    got = f(layer, *args)
    assert got.dtype == jnp.bfloat16
    assert synth.rel_err(got, want) < 6e-3, layer     # bf16 output


def test_plan_shares_blocks_by_bytes():
  # 4B-like B=8 x 8 heads at the bench's mix: 205 INT4 pages, 31 BF16 pages of 128 rows.
  lo, hi = MX.plan(64, 205, 128, 31, 128, 128, 64)
  assert (lo, hi) == (5, 3)
  assert MX.plan(64, 205, 128, 0, 128, 128, 64) == (8, 0)
  assert MX.plan(64, 0, 128, 31, 128, 128, 64) == (0, 8)
  assert MX.plan(64, 0, 128, 31, 128, 128, 64, splits_lo=4, splits_hi=2) == (0, 2)
  assert MX.plan(16, 2, 128, 1, 128, 64, 64, splits_hi=2)[1] == 2      # given splits kept
  assert MX.plan(16, 2, 128, 1, 128, 64, 64)[0] <= 2                    # never more than tiles


# ---- one-line errors -------------------------------------------------------------------------

def test_unsupported_inputs_are_named_in_one_line():
  small = synth.CASES[0].make(seed=3, lo_format="int4")          # pages of 16
  with pytest.raises(ValueError, match="^the fused Mosaic GPU kernel takes pages and head dim "
                                       "in multiples of 64"):
    decode_attention_gpu(*small, int4_kernel="fused_reference")
  args = CASES[0].make(seed=3)                                     # a bytes pool
  with pytest.raises(ValueError, match="^int4_kernel='fused' reads the INT4 pool in the 'int4' "
                                       "storage format"):
    decode_attention_gpu(*args, int4_kernel="fused")
  with pytest.raises(ValueError, match="^int4_kernel='fused' writes its partials in its own"):
    partials_gpu(*args, int4_kernel="fused", interpret=True)
  with pytest.raises(ValueError, match=r"^\['tile_hi'\] are knobs of int4_kernel='fused' only"):
    decode_attention_gpu(*args, interpret=True, tile_hi=64)
  with pytest.raises(ValueError, match="^int4_kernel='fused_reference' takes the knobs"):
    decode_attention_gpu(*CASES[0].make(seed=3, lo_format="int4"),
                         int4_kernel="fused_reference", block_hi=32)


def _kernel_args(b=8, hkv=8, d=128, page_lo=128, page_hi=128, n_lo=8, n_hi=4, layers=2):
  sds = jax.ShapeDtypeStruct
  p_lo, p_hi = layers * b * n_lo, layers * b * n_hi
  return (sds((b * hkv, mgpu_common.N_PAD, d), jnp.bfloat16),
          sds((p_lo, hkv, page_lo, d), jnp.int4), sds((p_lo, hkv, 2, page_lo), jnp.float16),
          sds((p_lo, hkv, d, page_lo), jnp.int4), sds((p_hi, page_hi, hkv, d), jnp.bfloat16),
          sds((p_hi, page_hi, hkv, d), jnp.bfloat16), sds((b, n_lo), jnp.int32),
          sds((b, n_hi), jnp.int32), sds((b, 2), jnp.int32), sds((2,), jnp.int32))


def _lower_kernel(args, **kw):
  return MX.partition_mixed.trace(*args, qk_scale=0.1, **kw).lower(
      lowering_platforms=("cuda",)).as_text()


def test_kernel_shapes_are_checked_before_mosaic():
  args = _kernel_args(page_hi=96 * 2)
  with pytest.raises(ValueError, match="^tile_hi 128 must be a multiple of 64 dividing"):
    _lower_kernel(args, splits_lo=2, splits_hi=2, tile_hi=128)
  args = _kernel_args(page_lo=96)
  with pytest.raises(ValueError, match="^INT4 pages of 96 rows: the fused kernel takes pages"):
    _lower_kernel(args, splits_lo=2, splits_hi=2)
  args = _kernel_args(n_lo=6)
  with pytest.raises(ValueError, match="must divide into 4 splits"):
    _lower_kernel(args, splits_lo=4, splits_hi=2)
  with pytest.raises(ValueError, match="^stages 2 .INT4. / 4 .BF16, 128-row tiles. need"):
    _lower_kernel(_kernel_args(), splits_lo=2, splits_hi=2, tile_hi=128, stages_hi=4)
  with pytest.raises(ValueError, match="^no partition to read"):
    _lower_kernel(_kernel_args(), splits_lo=0, splits_hi=0)


# ---- lowering for CUDA -----------------------------------------------------------------------

def _lower_call(b, hq, hkv, d, page, n_lo, n_hi, w=64, **kw):
  """decode_attention_gpu(int4_kernel="fused") on a stack of 2 layers, a traced layer."""
  sds = jax.ShapeDtypeStruct
  lo, hi = b * n_lo, b * n_hi
  win = Window(sds((2, b, w, hkv, d), jnp.bfloat16), sds((2, b, w, hkv, d), jnp.bfloat16),
               sds((b,), jnp.int32))
  hp = HighPool(sds((2, hi, page, hkv, d), jnp.bfloat16),
                sds((2, hi, page, hkv, d), jnp.bfloat16))
  lp = LowPool(sds((2, lo, hkv, page, d), jnp.int4), sds((2, lo, hkv, d, page), jnp.int4),
               sds((2, lo, hkv, 2, page), jnp.float16))
  maps = PageMaps(sds((b, n_hi), jnp.int32), sds((b,), jnp.int32),
                  sds((b, n_lo), jnp.int32), sds((b,), jnp.int32))
  return decode_attention_gpu.trace(sds((b, hq, d), jnp.bfloat16), win, hp, lp, maps,
                                    sds((), jnp.int32), int4_kernel="fused", **kw).lower(
                                        lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("b,hq,hkv,d,kw", [
    (8, 32, 8, 128, {}),                                            # 4B-like
    (8, 14, 2, 64, dict(tile_hi=128, stages_lo=3, splits_hi=3)),    # Qwen2.5-0.5B
])
def test_whole_fused_call_lowers_for_cuda(b, hq, hkv, d, kw):
  text = _lower_call(b, hq, hkv, d, 128, n_lo=6, n_hi=3, **kw)
  assert "mosaic_gpu" in text and "triton" not in text      # one kernel, no Triton launch


@pytest.mark.parametrize("case", ["tiny_lo", "tiny_hi", "tiny_mix", "tiny_mix8"])
def test_device_smoke_cases_lower_for_cuda(case):
  """The device script's first launches (bench/check_fused.py: the INT4 pipeline alone, the
  BF16 pipeline alone, both, both over 8 softmax columns; an empty INT4 partition and a one-key
  BF16 one) lower for CUDA from the inputs that script builds (8 columns: where this jax has
  the register concatenate), and its reference takes them."""
  from bench import check_fused as CF
  s_lo, s_hi, cols = CF.TINY[case]
  args = CF.tiny_case().make(seed=5, lo_format="int4")
  kargs = CF.kernel_args(args, 7, s_lo, s_hi)
  kk = dict(splits_lo=s_lo, splits_hi=s_hi, qk_scale=0.1)
  lower = lambda: MX.partition_mixed.trace(*kargs, no_auto_barriers=True, cols=cols, **kk).lower(
      lowering_platforms=("cuda",)).as_text()
  if cols < mgpu_common.N_PAD and not mgpu_common.HAS_CONCAT:
    with pytest.raises(ValueError, match="^cols=8 needs Pallas Mosaic GPU's concatenate"):
      lower()
  else:
    assert "mosaic_gpu" in lower()
  o, ml = MX.partition_mixed_reference(*kargs, **kk)
  assert o.shape[1] == s_lo + s_hi and bool(jnp.isfinite(o).all())
  assert bool((ml[2:, :s_lo, MX.ML_ROWS // 2] == 0).all())    # sequence 1 (rows 2, 3): no INT4 key


def test_device_check_runs_smallest_cases_first():
  """The device script runs bench/check_fused.py's cases in --list order, one process each:
  the kernel alone (INT4 pipeline, BF16 pipeline, both) before the synth cases and those
  before the bench-size variants."""
  from bench import check_fused as CF
  ids = [c for c, _ in CF.case_list()]
  assert ids[:4] == ["tiny_lo", "tiny_hi", "tiny_mix", "tiny_mix8"]
  assert max(i for i, c in enumerate(ids) if c.startswith("synth_")) < min(
      i for i, c in enumerate(ids) if c.startswith("big_"))
  assert ids.index("big_0.5B") < ids.index("big_4B")


def test_narrow_columns_lower_or_name_what_they_need():
  lower = lambda **kn: _lower_kernel(_kernel_args(b=2, hkv=2, d=64), splits_lo=2, splits_hi=2,
                                     **kn)
  assert_narrow_lowers(lower)
