"""``decode_attention``'s GPU backend with the INT4 partition on the Mosaic GPU kernel
(pallas_kernels/gpu/mgpu_decode.py), on a CPU host: the glue (q padding and nibble split, the
layer's scales made head-major, unspecified table entries and garbage rows kept out, the layer
offset, the partials' layout and merge with the Triton kernel's BF16-pool and window partials)
end to end with the kernel's jnp reference in its place (``int4_kernel="mosaic_reference"``, the
Triton kernel in interpret mode) against the float32 reference, on poisoned random inputs; and the
whole call's lowering for CUDA. On the H200: ``bench/bench_kernels.py``."""
import math
import os
import re
import zlib

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from pallas_kernels.gpu import decode as gpu_decode  # noqa: E402
from pallas_kernels.gpu import decode_attention_gpu, mgpu_decode, partials_gpu  # noqa: E402
from pallas_kernels.testing import synth  # noqa: E402

pytestmark = pytest.mark.fast_compile

S, C = synth.Shape, synth.Case
# INT4 pages of 64 / 128 tokens; every GQA ratio (1, 2, 4, 7, 8), head dim 64 and 128; ragged,
# empty and full INT4 partitions; empty BF16 pool and window.
CASES = [
    C("g1_d64_p64", S(b=3, hq=2, hkv=2, d=64, page=64, w=24, lo_cap=256, hi_cap=128),
      (0, 1, 255), (127, 0, 17), (1, 24, 13)),
    C("g2_d128_p128", S(b=2, hq=4, hkv=2, d=128, page=128, w=32, lo_cap=384, hi_cap=128),
      (384, 129), (1, 127), (32, 1)),
    C("g4_d128_p64", S(b=2, hq=16, hkv=4, d=128, page=64, w=16, lo_cap=320, hi_cap=64),
      (300, 64), (64, 0), (7, 16)),
    C("g7_d64_p64", S(b=2, hq=14, hkv=2, d=64, page=64, w=32, lo_cap=256, hi_cap=64),
      (255, 65), (0, 50), (32, 5)),
    C("g8_d64_p128_hkv1", S(b=2, hq=8, hkv=1, d=64, page=128, w=16, lo_cap=256, hi_cap=64),
      (256, 3), (0, 0), (0, 2)),
]
SMALL = dict(block_hi=16, block_w=16, chunk_hi=48)


def merged(args, g, **kw):
  o, m, l = partials_gpu(*args, interpret=True, **SMALL, **kw)
  return synth.merged_f32(o, m, l, axis=2, hq=args[0].shape[1], g=g)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_mosaic_int4_partition_glue_matches_reference(case):
  args = case.make(seed=zlib.crc32(case.name.encode()) % 1000)
  want = synth.reference_f32(*args)
  got = merged(args, case.shape.g, int4_kernel="mosaic_reference")
  assert bool(jnp.isfinite(got).all())
  # The partition rounds P^T to bf16 once (the Triton INT4 path splits it in two): ~1e-3.
  assert synth.rel_err(got, want) < 6e-3


@pytest.mark.parametrize("case_index,lo_format,seed", [(2, "bytes", 21), (3, "int4", 22)])
def test_mosaic_glue_reads_the_traced_layer_of_a_stack(case_index, lo_format, seed):
  case = CASES[case_index]
  args = synth.stack_layers(case.make(seed=seed, lo_format=lo_format))
  f = jax.jit(lambda l, *a: partials_gpu(*a, l, interpret=True, int4_kernel="mosaic_reference",
                                        **SMALL))
  for layer in (0, 1, 2):
    want = synth.reference_f32(*synth.layer_of(args, layer))
    got = synth.merged_f32(*f(layer, *args), axis=2, hq=args[0].shape[1], g=case.shape.g)
    assert synth.rel_err(got, want) < 6e-3, layer


@pytest.mark.parametrize("lo_format", ["bytes", "int4"])
@pytest.mark.parametrize("splits", [1, 3])
def test_splits_that_do_not_divide_the_table_are_padded(splits, lo_format):
  case = CASES[1]          # 3 INT4 pages per sequence
  args = case.make(seed=5, lo_format=lo_format)
  got = merged(args, case.shape.g, int4_kernel="mosaic_reference", splits_lo=splits)
  assert synth.rel_err(got, synth.reference_f32(*args)) < 6e-3


def test_auto_is_triton_off_hopper_and_names_bad_choices():
  case = CASES[0]
  args = case.make(seed=7)
  assert not mgpu_decode.hopper()
  got = partials_gpu(*args, interpret=True, **SMALL)
  want = partials_gpu(*args, interpret=True, int4_kernel="triton", **SMALL)
  for a, b in zip(got, want):
    assert bool(jnp.array_equal(a, b, equal_nan=True))
  with pytest.raises(ValueError, match="^int4_kernel must be 'auto', 'triton', 'mosaic'"):
    partials_gpu(*args, interpret=True, int4_kernel="mgpu")
  small = synth.CASES[2].make(seed=3)          # pages of 16
  with pytest.raises(ValueError, match="^the Mosaic GPU INT4 partition takes pages"):
    partials_gpu(*small, interpret=True, int4_kernel="mosaic_reference")


def test_splits_fill_the_gpu():
  assert mgpu_decode.splits_for(64, 256) == 8          # bytes pool, 4B-like B=8: 8 KV heads
  assert mgpu_decode.splits_for(16, 256) == 32         # 0.5B-like B=8: 2 KV heads
  assert mgpu_decode.splits_for(1024, 4) == 1
  assert mgpu_decode.splits_for(4, 3) == 3             # never more splits than pages


def test_int4_splits_fill_whole_waves():
  """The int4 pool's default splits are the measured best (H100, 132 SMs, 3 blocks each:
  bench/RESULTS.md 2026-12-06 (fifth)) at every measured shape, and in general use 95% of the
  block slots of the waves the grid spans, or the most any allowed split count can, never below
  MIN_PAGES pages per split."""
  ws = mgpu_decode.wave_splits
  assert ws(64, 256, sms=132) == 6                     # 4B-like B=8, 32K: 384 blocks
  assert ws(16, 256, d=64, sms=132) == 24              # 0.5B-like B=8, 32K
  assert ws(256, 64, sms=132) == 3                     # 4B-like B=32, 8K: 768 = 2 waves
  assert ws(64, 256, wgs=3, sms=132) == 2              # one block per SM: 128 blocks
  assert ws(64, 256, early_v=True, sms=132) == 4       # 213 registers: 2 per SM, 256 of 264
  assert ws(64, 256, d=256, sms=132) == 2              # not measured: one per SM
  assert ws(64, 256, sms=114) == 16                    # H100 PCIe: 1024 of 3 x 342 slots
  assert ws(2000, 512, sms=132) == 1                   # the pairs alone span 5 waves
  assert ws(0, 256, sms=132) >= 1
  rng = np.random.default_rng(0)
  for bh, n_pages, wgs in zip(rng.integers(1, 1500, 300), rng.integers(1, 600, 300),
                              rng.choice([1, 2, 3], 300)):
    bh, n_pages, wgs = int(bh), int(n_pages), int(wgs)
    s = ws(bh, n_pages, wgs=wgs, sms=132)
    slots = 132 * (3 if wgs == 1 else 1)
    waves = -(-bh * s // slots)                          # block slots the grid spans
    top = max(1, min(mgpu_decode.MAX_SPLITS, n_pages // (mgpu_decode.MIN_PAGES * wgs)))
    assert 1 <= s <= top and (s == 1 or n_pages // (s * wgs) >= mgpu_decode.MIN_PAGES)
    if bh < 4 * slots and bh * s < 0.95 * waves * slots:   # not 95% used: nothing better fits
      assert all(bh * k / (-(-bh * k // slots) * slots) <= bh * s / (waves * slots)
                 for k in range(1, top + 1))


def test_whole_call_lowers_for_cuda_with_both_kernels():
  case = CASES[2]
  args = synth.stack_layers(case.make(poison=False)) + (jnp.int32(1),)
  sds = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.asarray(x).dtype), args)
  text = partials_gpu.trace(*sds, int4_kernel="mosaic").lower(
      lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text and "triton" in text



# ---- the int4 storage format (head-major int4 pages, V dim-major): mgpu_int4.partition ---------

@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_int4_format_glue_matches_reference(case):
  """An int4-format pool through mgpu_int4.partition's paged mode (its jnp reference): every GQA
  ratio, head dim 64 and 128, ragged, empty and full INT4 partitions, poisoned invisible rows
  (NaN scales, garbage table entries) against the float32 reference; the same case in the bytes
  format gives the same reference."""
  seed = zlib.crc32(case.name.encode()) % 1000
  args = case.make(seed=seed, lo_format="int4")
  assert args[3].format == "int4" and args[3].k.dtype == jnp.int4
  want = synth.reference_f32(*args)
  assert bool(jnp.array_equal(want, synth.reference_f32(*case.make(seed=seed))))
  got = merged(args, case.shape.g, int4_kernel="mosaic_reference")
  assert bool(jnp.isfinite(got).all())
  assert synth.rel_err(got, want) < 6e-3


@pytest.mark.parametrize("wgs,splits", [(2, None), (3, 1), (2, 2)])
@pytest.mark.parametrize("case_index", [0, 3, 4])
def test_warp_specialized_int4_glue_matches_reference(case_index, wgs, splits):
  """``wgs_lo`` > 1 (the warp-specialized kernel's reference in its place): partials per (split,
  warpgroup), the table padded to splits x warpgroups, the same merge; ragged, empty and full
  INT4 partitions at GQA 1, 7 and 8 against the float32 reference; one partial per (split,
  warpgroup)."""
  case = CASES[case_index]
  args = case.make(seed=40 + case_index, lo_format="int4")
  want = synth.reference_f32(*args)
  got = merged(args, case.shape.g, int4_kernel="mosaic_reference", wgs_lo=wgs, splits_lo=splits)
  assert bool(jnp.isfinite(got).all())
  assert synth.rel_err(got, want) < 6e-3
  qp, lo, maps, layer = _glue_inputs(args)
  o, m, l = mgpu_decode.int4_partials(qp, lo, maps, layer, c=0.1, g=case.shape.g, splits=splits,
                                      wgs=wgs, reference=True)
  bh, n_pages = qp.shape[0] * qp.shape[1], maps.lo_pages.shape[1]
  assert o.shape[2] == wgs * (splits or mgpu_decode.wave_splits(bh, n_pages, wgs=wgs))
  assert m.shape == l.shape == o.shape[:4]


def _glue_inputs(args):
  """(qp [B, Hkv, 16, D], lo, maps, layer) as ``partials_gpu`` hands them to ``int4_partials``."""
  q, window, hi, lo, maps = args[:5]
  b, hq, d = q.shape
  hkv = window.k.shape[-2]
  qp = jnp.pad(q.reshape(b, hkv, hq // hkv, d), ((0, 0), (0, 0), (0, 16 - hq // hkv), (0, 0)))
  add = lambda t: type(t)(*(x[None] for x in t))
  return qp, add(lo), maps, jnp.int32(0)


def test_warp_specialized_knob_is_checked():
  args = CASES[0].make(seed=9, lo_format="int4")
  with pytest.raises(ValueError, match="^wgs .compute warpgroups. must be 1, 2 or 3, got 4"):
    partials_gpu(*args, interpret=True, int4_kernel="mosaic_reference", wgs_lo=4, **SMALL)
  with pytest.raises(ValueError, match="^wgs_lo=2 is the warp-specialized Mosaic GPU kernel of "
                                       "the int4 storage format; this call reads a 'bytes'"):
    partials_gpu(*CASES[0].make(seed=9), interpret=True, int4_kernel="mosaic_reference",
                 wgs_lo=2, **SMALL)


def test_warp_specialized_whole_call_lowers_for_cuda():
  text = _lower_int4(int4_kernel="mosaic", wgs_lo=2)
  assert "mosaic_gpu" in text and "triton" in text and text != _lower_int4(int4_kernel="mosaic")


def test_permuted_upcast_whole_call_lowers_and_is_checked():
  """"bf16_perm" is the int4 format's default (and lowers unlike "bf16"); the bytes format's
  default stays "bf16" (it has no other)."""
  text = _lower_int4(int4_kernel="mosaic", upcast_lo="bf16_perm")
  plain = _lower_int4(int4_kernel="mosaic", upcast_lo="bf16")
  assert "mosaic_gpu" in text and text != plain and text == _lower_int4(int4_kernel="mosaic")
  ws = _lower_int4(int4_kernel="mosaic", upcast_lo="bf16_perm", wgs_lo=2)
  assert "mosaic_gpu" in ws and ws != _lower_int4(int4_kernel="mosaic", upcast_lo="bf16",
                                                   wgs_lo=2)
  assert ws == _lower_int4(int4_kernel="mosaic", wgs_lo=2)
  args = CASES[0].make(seed=9, lo_format="int4")
  with pytest.raises(ValueError, match="^upcast must be one of .'bf16', 'bf16_perm', "
                                       "'bf16_perm_offset'., got 's8'"):
    partials_gpu(*args, interpret=True, int4_kernel="mosaic_reference", upcast_lo="s8", **SMALL)
  with pytest.raises(ValueError, match="^upcast_lo='bf16_perm': knobs of the Mosaic GPU kernel "
                                       "of the int4 storage format; this call reads a 'bytes' "
                                       "pool with int4_kernel='mosaic_reference'"):
    partials_gpu(*CASES[0].make(seed=9), interpret=True, int4_kernel="mosaic_reference",
                 upcast_lo="bf16_perm", **SMALL)


def test_early_v_whole_call_lowers_and_is_checked():
  text = _lower_int4(int4_kernel="mosaic", early_v_lo=True)
  assert "mosaic_gpu" in text and text != _lower_int4(int4_kernel="mosaic")
  with pytest.raises(ValueError, match="^early_v_lo=True: knobs of the Mosaic GPU kernel of the "
                                       "int4 storage format; this call reads a 'bytes' pool with "
                                       "int4_kernel='mosaic_reference'"):
    partials_gpu(*CASES[0].make(seed=9), interpret=True, int4_kernel="mosaic_reference",
                 early_v_lo=True, **SMALL)
  # int4_partials' own checks (called directly, not through partials_gpu)
  qp, lo, maps, layer = _glue_inputs(CASES[0].make(seed=9))
  for kn, msg in ((dict(upcast="bf16_perm"), "^upcast='bf16_perm' is a knob of the int4 storage "
                   "format's kernels; this pool is 'bytes'"),
                  (dict(early_v=True), "^early_v is a knob of the int4 storage format's kernel "
                   "with one compute warpgroup; got format 'bytes', wgs=1")):
    with pytest.raises(ValueError, match=msg):
      mgpu_decode.int4_partials(qp, lo, maps, layer, c=0.1, g=CASES[0].shape.g, reference=True,
                                **kn)
  # never silently dropped where the Triton kernel reads the pool
  for kn in (dict(early_v_lo=True), dict(upcast_lo="bf16_perm", early_v_lo=True)):
    with pytest.raises(ValueError, match="^(upcast_lo='bf16_perm', )?early_v_lo=True: knobs of "
                                         "the Mosaic GPU kernel of the int4 storage format; this "
                                         "call reads a 'bytes' pool with int4_kernel='triton'"):
      partials_gpu(*CASES[0].make(seed=9), interpret=True, int4_kernel="triton", **kn, **SMALL)
  with pytest.raises(ValueError, match="^early_v is a knob .* got format 'int4', wgs=2"):
    partials_gpu(*CASES[0].make(seed=9, lo_format="int4"), interpret=True,
                 int4_kernel="mosaic_reference", early_v_lo=True, wgs_lo=2, **SMALL)


def test_int4_format_goes_to_mosaic_and_never_to_triton():
  case = CASES[0]
  args = case.make(seed=8, lo_format="int4")
  auto = partials_gpu(*args, interpret=True, **SMALL)     # interpret: the kernel's reference
  ref = partials_gpu(*args, interpret=True, int4_kernel="mosaic_reference", **SMALL)
  for a, b in zip(auto, ref):
    assert bool(jnp.array_equal(a, b, equal_nan=True))
  with pytest.raises(ValueError, match="^the Triton kernel reads the INT4 pool as uint8 "
                                       "half-split bytes only: an int4-format pool takes"):
    partials_gpu(*args, interpret=True, int4_kernel="triton", **SMALL)
  small = synth.CASES[2].make(seed=3, lo_format="int4")     # pages of 16
  with pytest.raises(ValueError, match="^the Mosaic GPU INT4 partition takes pages"):
    partials_gpu(*small, interpret=True)


def _lower_int4(**kw):
  case = CASES[2]
  args = synth.stack_layers(case.make(poison=False, lo_format="int4")) + (jnp.int32(1),)
  sds = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.asarray(x).dtype), args)
  return partials_gpu.trace(*sds, **kw).lower(lowering_platforms=("cuda",)).as_text()


def test_stream_knob_keeps_the_values_and_annotates_both_launches():
  """``stream_lo``: the INT4 partition and the BF16/window launch as async calls on XLA streams
  N and N + 1 in one scheduling group; the output is the one-stream call's, bit for bit."""
  for case_index, fmt in ((3, "int4"), (1, "bytes")):
    args = CASES[case_index].make(seed=31 + case_index, lo_format=fmt)
    one = decode_attention_gpu(*args, interpret=True, int4_kernel="mosaic_reference", **SMALL)
    two = decode_attention_gpu(*args, interpret=True, int4_kernel="mosaic_reference",
                               stream_lo=2, **SMALL)
    assert bool(jnp.array_equal(one, two))
  text = _lower_int4(int4_kernel="mosaic", stream_lo=1)
  assert "mosaic_gpu" in text and "triton" in text
  for n in ("1", "2"):
    assert re.search(r"call @\w+\(.*_xla_stream_annotation = \"" + n + '"', text), n
  assert "_scheduling_group_id" in text and "_xla_stream_annotation" not in _lower_int4(
      int4_kernel="mosaic")
  with pytest.raises(ValueError, match="^stream_lo must be a non-negative int"):
    partials_gpu(*CASES[0].make(seed=9), interpret=True, int4_kernel="mosaic_reference",
                 stream_lo=-1, **SMALL)
  with pytest.raises(ValueError, match="^stream_lo=1 launches the Mosaic GPU INT4 kernel on "
                                       "another stream; this call reads its INT4 pool with the "
                                       "Triton kernel"):
    partials_gpu(*CASES[0].make(seed=9), interpret=True, int4_kernel="triton", stream_lo=1,
                 **SMALL)


@pytest.mark.parametrize("kernel", ["mosaic", "auto"])
def test_int4_format_whole_call_lowers_for_cuda_with_both_kernels(kernel):
  text = _lower_int4(int4_kernel=kernel)
  assert "mosaic_gpu" in text and "triton" in text


# ---- the merge over partial sets read in place (decode_attention_gpu) ---------------------------

@pytest.mark.parametrize("case_index,lo_format,knobs", [
    (0, "int4", {}), (3, "int4", dict(wgs_lo=2)), (4, "int4", {}), (1, "bytes", {}),
    (2, "bytes", dict(int4_kernel="triton", fuse=False))])
def test_merge_in_place_equals_merging_the_concatenated_partials(case_index, lo_format, knobs):
  """``merge_sets`` over the Mosaic GPU kernel's O^T and the Triton partials, each in its own
  layout, equals ``common.merge`` over ``partials_gpu``'s concatenation to float32 rounding
  (every GQA ratio of the cases, ragged, empty and poisoned partitions)."""
  case = CASES[case_index]
  args = case.make(seed=60 + case_index, lo_format=lo_format)
  kn = dict(interpret=True, **SMALL, **({"int4_kernel": "mosaic_reference"} | knobs))
  g, hq = case.shape.g, args[0].shape[1]
  want = synth.merged_f32(*partials_gpu(*args, **kn), axis=2, hq=hq, g=g)
  sets = gpu_decode.partial_sets(*args, **kn)
  assert [k for _, k in sets] == ([True, False] if kn["int4_kernel"] == "mosaic_reference"
                                  else [False] * len(sets))
  got = gpu_decode.merge_sets(sets, g).reshape(want.shape)
  assert bool(jnp.isfinite(got).all())
  assert synth.rel_err(got, want) < 1e-6
  out = decode_attention_gpu(*args, **kn)
  assert synth.rel_err(out.astype(jnp.float32), synth.reference_f32(*args)) < 6e-3
  old = decode_attention_gpu(*args, merge="concat", **kn)      # the concatenating merge
  assert synth.rel_err(out.astype(jnp.float32), old.astype(jnp.float32)) < 4e-3
  with pytest.raises(ValueError, match="^merge must be 'sets', 'concat' or 'kernel', got 'both'"):
    decode_attention_gpu(*args, merge="both", **kn)


def test_merge_in_place_has_no_concatenation_or_big_transpose():
  """The lowered call (CUDA) merges without concatenating the (f32) partials or transposing the
  kernel's O^T: its only f32 transposes are of the [B, Hkv, D, g] result (the bf16 one is q's
  head-dim permutation for the int4 kernel's K upcast, mgpu_upcast.permute_minor)."""
  case = CASES[2]
  args = synth.stack_layers(case.make(poison=False, lo_format="int4")) + (jnp.int32(1),)
  sds = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.asarray(x).dtype), args)
  text = decode_attention_gpu.trace(*sds, int4_kernel="mosaic").lower(
      lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text and "triton" in text
  s = case.shape
  for line in text.splitlines():
    if "stablehlo.concatenate" in line:   # the Triton kernel's int32 lengths only
      assert "f32" not in line, line
    if "stablehlo.transpose" in line and "xf32>" in line:
      assert f"tensor<{s.b}x{s.hkv}x{s.d}x{s.g}xf32>" in line, line
    elif "stablehlo.transpose" in line:   # q [B, Hkv, 16, D] bf16, permuted in its own shape
      n = s.b * s.hkv * 16 * s.d
      shapes = re.findall(r"tensor<([0-9x]+)xbf16>", line)
      assert shapes and all(math.prod(map(int, t.split("x"))) == n for t in shapes), line
