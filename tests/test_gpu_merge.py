"""The Pallas Triton merge kernel (pallas_kernels/gpu/merge.py) on a CPU host: Pallas interpret
mode against ``decode.merge_sets`` (the reference semantics) on random partial sets that honour the
partials' contract and poison everything it calls unspecified (empty partials with NaN o and m,
query rows >= g, splits past S in the padded blocks); ``decode_attention_gpu(merge="kernel")``
end to end; and the kernel compiled for sm_90a with ptxas's resource report (no spills)."""
import functools
import importlib.util
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from pallas_kernels import compare  # noqa: E402
from pallas_kernels.gpu import decode as gpu_decode  # noqa: E402
from pallas_kernels.gpu import merge as gpu_merge  # noqa: E402
from pallas_kernels.testing import synth  # noqa: E402

pytestmark = pytest.mark.fast_compile

ROWS = 16     # M: the Triton kernel's rows (max(16, next_pow2(g)), g <= 16), the Mosaic GPU N_PAD
# Error bounds.  Kernel and reference sum the same f32 terms in a different order (the kernel
# rescales per chunk of splits): ~1e-7 apart in f32, so their bf16 outputs differ by one bf16 ulp
# only where the f32 value sits that close to a rounding boundary: norm-wise far below 1e-3.
# Against the f32 merge, bf16 rounding alone: |x - bf16(x)| <= 2^-8 |x| per element.
TOL_BF16 = 1e-3
TOL_F32 = 2.0 ** -8


def partial_set(rng, b, hkv, s, d, g, kernel_layout, dead=0.3):
  """((o, m, l), kernel_layout) with ~``dead`` of the partials empty (l = 0, o and m NaN, -inf
  or huge), rows >= g poisoned, and every split of (sequence 0, head 0, row 0) empty."""
  o = rng.standard_normal((b, hkv, s, ROWS, d)) * rng.uniform(0.5, 20.0, (b, hkv, s, ROWS, 1))
  m = rng.uniform(-40.0, 10.0, (b, hkv, s, ROWS))   # log2 units: weights 2^-50 .. 1
  l = rng.uniform(0.5, 50.0, (b, hkv, s, ROWS))
  empty = rng.random((b, hkv, s, ROWS)) < dead
  empty[0, 0, :, 0] = True
  junk = rng.choice(np.array([np.nan, -np.inf, 1e30, 3.0], np.float32), size=empty.shape)
  m = np.where(empty, junk, m)
  o = np.where(empty[..., None], np.nan, o)
  l = np.where(empty, 0.0, l)
  # Rows >= g are never written by the kernels: anything, live-looking included.
  m[..., g:], l[..., g:], o[..., g:, :] = 1e4, np.nan, np.inf
  if kernel_layout:
    # as the Mosaic GPU kernel writes them: O^T [B, Hkv, S, D, 16], m and l of the same shape
    # with their values in row 0 of D (the other rows never written: poisoned here)
    o = np.swapaxes(o, 3, 4)
    spread = lambda x: np.concatenate(
        [x[:, :, :, None], np.full((b, hkv, s, d - 1, ROWS), np.nan)], axis=3)
    m, l = spread(m), spread(l)
  return tuple(jnp.asarray(x, jnp.float32) for x in (o, m, l)), kernel_layout


def make_sets(seed, b, hkv, d, g, splits, layouts):
  rng = np.random.default_rng(seed)
  return [partial_set(rng, b, hkv, s, d, g, kl) for s, kl in zip(splits, layouts)]


@functools.partial(jax.jit, static_argnames=("g", "layouts"))
def merge_f32(parts, g, layouts):
  """``decode.merge_sets`` (jitted: eager, its many small ops took most of this file's time)."""
  return gpu_decode.merge_sets(list(zip(parts, layouts)), g)          # [B, Hkv, g, D] f32


def check(sets, g, **kw):
  got = gpu_merge.merge_kernel(sets, g, interpret=True, **kw)
  want = gpu_merge.merge_reference(sets, g)
  f32 = merge_f32(tuple(x for x, _ in sets), g, tuple(k for _, k in sets))
  b, hkv, _, d = f32.shape
  assert got.shape == want.shape == (b, hkv * g, d) and got.dtype == jnp.bfloat16
  assert bool(jnp.isfinite(got.astype(jnp.float32)).all())
  assert synth.rel_err(got, want) < TOL_BF16
  assert synth.rel_err(got, f32.reshape(b, hkv * g, d)) <= TOL_F32
  assert not bool(got[0, 0].astype(jnp.float32).any())      # every split empty -> 0
  return got


# (g, D, splits per set, layouts: True = Mosaic GPU O^T, False = Triton).  Every GQA ratio, both
# head dims, non-power-of-two S, one Triton set, Mosaic + Triton, and two Triton sets (fuse=False).
CASES = [
    (1, 64, (21, 13), (True, False)),
    (2, 128, (21,), (False,)),
    (4, 64, (40, 13), (True, False)),
    (7, 64, (40, 13), (True, False)),
    (7, 128, (5,), (False,)),
    (8, 128, (40, 13), (True, False)),
    (16, 64, (3, 21), (False, False)),
    (16, 128, (21, 13), (True, False)),
]


@pytest.mark.parametrize("g,d,splits,layouts", CASES,
                         ids=[f"g{c[0]}_d{c[1]}_s{'+'.join(map(str, c[2]))}" for c in CASES])
def test_kernel_matches_the_reference(g, d, splits, layouts):
  sets = make_sets(g * 1000 + d + sum(splits), 2, 2, d, g, splits, layouts)
  check(sets, g)


@pytest.mark.parametrize("g,tile,block_d,splits", [
    (7, 256, 16, (40, 21)), (16, 512, 64, (40, 21)), (2, 32, 8, (40, 21)),
    (7, 1024, 8, (13, 5))])
def test_sets_too_large_for_the_tile_run_in_turn(g, tile, block_d, splits):
  """A small ``tile``: each set's splits in a loop of chunks of 2, 1 and 2 splits (online max
  rescale, the last chunk ragged), or (last case) one chunk a set but the sets in turn."""
  sets = make_sets(50 + g, 1, 2, 64, g, splits, (True, False))
  check(sets, g, tile=tile, block_d=block_d)


def test_a_dominant_set_and_an_all_empty_set():
  """One set's maxima 30 (log2) above the others' (they rescale to ~2^-30 of it) and a third set
  whose every partial is empty, which leaves the output exactly as it is."""
  hi, lo, none = make_sets(7, 1, 2, 64, 4, (13, 21, 5), (False, True, False))
  hi = ((hi[0][0], hi[0][1] + 30.0, hi[0][2]), False)
  none = ((none[0][0], none[0][1], jnp.zeros_like(none[0][2])), False)
  got = check([lo, hi, none], 4)
  assert synth.rel_err(got, check([lo, hi], 4)) == 0.0


def test_bad_block_d_is_one_line():
  sets = make_sets(3, 1, 1, 64, 2, (5,), (False,))
  with pytest.raises(ValueError, match="^block_d must be a power of two dividing the head dim "
                                       "64, got 48"):
    gpu_merge.merge_kernel(sets, 2, interpret=True, block_d=48)


def test_default_block_d_fills_the_gpu_and_fits_the_tile():
  assert gpu_merge.default_block_d(1, 1, 128) == 8          # few heads: the smallest chunk
  assert gpu_merge.default_block_d(64, 8, 128) == 128       # 512 (sequence, head) programs
  assert gpu_merge.default_block_d(16, 8, 64) == 16         # 128 x 4 = 512 programs
  # The 4B shape at batch 64, S = 21 + 13 -> Sp = 32 + 16, G = 4: 192 floats a D column.
  assert gpu_merge.default_block_d(64, 8, 128, 192, 8192) == 32
  for b, hkv, d in [(4, 8, 128), (8, 2, 64), (1, 2, 64)]:
    bd = gpu_merge.default_block_d(b, hkv, d)
    assert d % bd == 0 and (bd == 8 or b * hkv * d // bd >= 2 * 132)


# ---- decode_attention_gpu(merge="kernel") end to end ----------------------------------------

# A small cache as tests/test_mgpu_decode.py builds one: GQA 7, head dim 64, INT4 pages of 64
# tokens in the "int4" format (the Mosaic GPU partition's set, in its O^T layout) beside the
# Triton kernel's BF16-pool and window set; ragged and empty partitions, poisoned pools.
E2E = synth.Case("g7_d64_p64", synth.Shape(b=2, hq=14, hkv=2, d=64, page=64, w=32, lo_cap=256,
                                           hi_cap=64), (255, 65), (0, 50), (32, 5))
SMALL = dict(block_hi=16, block_w=16, chunk_hi=48)


def test_decode_attention_merge_kernel_equals_merge_sets():
  args = E2E.make(seed=70, lo_format="int4")
  kn = dict(interpret=True, int4_kernel="mosaic_reference", **SMALL)
  layouts = []

  def arrays(*a):            # traced only: which layouts the sets come in
    sets = gpu_decode.partial_sets(*a, **kn)
    layouts.extend(k for _, k in sets)
    return [x for x, _ in sets]

  jax.eval_shape(arrays, *args)
  assert layouts == [True, False]       # the Mosaic GPU set (O^T) and the Triton set
  got = gpu_decode.decode_attention_gpu(*args, merge="kernel", **kn)
  want = gpu_decode.decode_attention_gpu(*args, merge="sets", **kn)
  assert got.shape == want.shape and got.dtype == want.dtype == jnp.bfloat16
  assert synth.rel_err(got, want) < TOL_BF16
  assert synth.rel_err(got, synth.reference_f32(*args)) < 6e-3   # the attention's own error
  with pytest.raises(ValueError, match="^merge must be 'sets', 'concat' or 'kernel', got 'pal"):
    gpu_decode.decode_attention_gpu(*args, merge="pallas", **kn)


def test_whole_call_lowers_for_cuda_with_the_merge_in_one_triton_call():
  """The decode step's form (stacked layers, traced layer, the Mosaic GPU INT4 partition) lowered
  for CUDA: merge="kernel" leaves no XLA reduction (merge="sets" has one per sum of Eq. 15)."""
  args = synth.stack_layers(E2E.make(poison=False, lo_format="int4")) + (jnp.int32(1),)
  sds = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.asarray(x).dtype), args)
  lower = lambda merge: gpu_decode.decode_attention_gpu.trace(
      *sds, int4_kernel="mosaic", merge=merge).lower(lowering_platforms=("cuda",)).as_text()
  text, old = lower("kernel"), lower("sets")
  assert "pask_merge" in text and "mosaic_gpu" in text and "pask_merge" not in old
  assert "stablehlo.reduce" in old and "stablehlo.reduce" not in text


# ---- ahead-of-time compile for sm_90a -----------------------------------------------------------

def _cuda_plugin() -> bool:
  """jax's CUDA plugin (Triton's compiler), as compare-kernels decides (compare.CUDA_PLUGINS)."""
  return any(importlib.util.find_spec(n) is not None for n in compare.CUDA_PLUGINS)


@pytest.mark.fast_compile(False)
@pytest.mark.skipif(not _cuda_plugin(), reason="jax's CUDA plugin is not installed")
@pytest.mark.parametrize("b,hkv,d,g,splits,layouts", [
    (4, 8, 128, 8, (40, 13), (True, False)),       # 32q/8kv d128 (Qwen3-4B-like)
    (8, 2, 64, 7, (40, 13), (True, False)),        # 14q/2kv d64 (Qwen2.5-0.5B)
    (4, 8, 128, 16, (64, 64), (True, False)),      # the most rows: the sets in turn
    (8, 2, 64, 16, (200, 7), (True, False)),       # a long set: a loop of 64-split chunks
])
def test_kernel_compiles_for_sm90a_without_spills(b, hkv, d, g, splits, layouts):
  from pallas_kernels.gpu import aot

  def fn(*a):
    sets = [(tuple(a[3 * i:3 * i + 3]), kl) for i, kl in enumerate(layouts)]
    return gpu_merge.merge_kernel(sets, g)

  sds = []
  for s, kl in zip(splits, layouts):
    o = (b, hkv, s, d, ROWS) if kl else (b, hkv, s, ROWS, d)
    ml = o if kl else (b, hkv, s, ROWS)               # the Mosaic set's m, l as written
    sds += [jax.ShapeDtypeStruct(o, jnp.float32)] + [jax.ShapeDtypeStruct(ml, jnp.float32)] * 2
  reps = aot.report(fn, *sds)
  assert [r.name for r in reps] == ["pask_merge"]
  r = reps[0]
  assert ".target sm_90a" in r.ptx
  assert r.spill_stores == 0 and r.spill_loads == 0, r.summary()
  assert r.registers <= aot.SM90_MAX_REGS and r.ok(), r.summary()


def test_step_kernel_count_reads_the_entry_computation():
  """bench/count_step_kernels.count: thunks of the entry computation only (not of the fused
  computations), tuple-typed custom calls included, bookkeeping ops left out."""
  from bench.count_step_kernels import count
  hlo = """HloModule m
%fused_add.3 (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %a = f32[4]{0} add(f32[4]{0} %p, f32[4]{0} %p)
}

ENTRY %main (x: f32[4]) -> (f32[4], f32[4]) {
  %x = f32[4]{0} parameter(0)
  %f = f32[4]{0} fusion(f32[4]{0} %x), kind=kLoop, calls=%fused_add.3
  %g = f32[4]{0} fusion(f32[4]{0} %f), kind=kCustom, calls=%gemm_fusion_dot.12_computation
  %c = (f32[4], f32[4], /*index=2*/f32[4]) custom-call(%g), custom_call_target="mosaic_gpu_v2"
  %t = f32[4]{0} get-tuple-element((f32[4]{0}, f32[4]{0}) %c), index=0
  %y = f32[4]{0} copy(f32[4]{0} %t)
  ROOT %r = (f32[4]{0}, f32[4]{0}) tuple(f32[4]{0} %y, f32[4]{0} %t)
}
"""
  got = count(hlo)
  assert got["thunks"] == 4
  assert got["by_op"] == {"fusion": 2, "custom-call": 1, "copy": 1}
  assert got["by_name"] == {"fused_add": 1, "gemm_fusion": 1, "mosaic_gpu_v2": 1}


def test_step_host_launches_count_top_level_thunks_only():
  """bench/count_step_kernels.host_launches: the top-level thunks of XLA's thunk-sequence dump
  (what the host launches per step); thunks nested in a command buffer or a while body are not."""
  from bench.count_step_kernels import host_launches
  seq = """000: kCommandBuffer [source       | next=009 (1)]
    001: kCopy         [source       | next=007 (6)] kCopy
    002: kCustomKernel [source       | next=003 (1)] input_reduce_fusion_2 grid: [1, 1, 1]
009: kWhile         [prev=000 (1) | next=015 (1)]
condition:
    010: kCustomKernel [source | sink] loop_compare_fusion grid: [1, 1, 1]
  body:
    000: kCommandBuffer [source | sink]
        020: kCustomKernel [source       | next=021 (1)] loop_and_fusion grid: [1, 1, 1]
015: kCustomCall    [prev=009 (1) | next=000 (1)] kCustomCall
000: kCommandBuffer [prev=015 (1) | sink]
    016: kCustomKernel [source       | sink] wrapped_iota grid: [1, 1, 1]
"""
  assert host_launches(seq) == {"kCommandBuffer": 2, "kWhile": 1, "kCustomCall": 1}


def test_decode_step_for_sm90_copies_no_window_and_fuses_the_controller():
  """The whole PASK decode step compiled for sm_90 (deviceless): the evicted rows are read
  before any window write is scheduled (no copy of a stacked window: it was 1.5 MB and two
  launches per 0.5B step), and Alg. 2 fuses into a few kernels (~49 as a batched loop)."""
  import re
  from bench.count_step_kernels import compile_step
  from models import ModelConfig
  # The 0.5B's 24 layers and width (small vocabulary and MLP): fewer layers or a narrower
  # model did not show the copy (XLA's scheduling)
  cfg = ModelConfig(arch="qwen2", vocab_size=512, hidden=896, intermediate=1024, n_layers=24,
                    n_heads=14, n_kv_heads=2, head_dim=64)
  hlo = compile_step(cfg, 8, 1024, {"int4_kernel": "mosaic"})
  entry = hlo[hlo.index("\nENTRY "):]
  copies = re.findall(r"= (bf16\[[\d,]+\])\S* copy\(", entry)
  assert not copies, copies
  names = {m.group(1): m.group(2) for m in re.finditer(r"\n%([\w.-]+) \([^\n]*\{\n(.*?)\n\}",
                                                       hlo, re.S)}
  called = re.findall(r"fusion\(.*calls=%([\w.-]+)", entry)
  ctl = [c for c in called if "/controller/" in names.get(c, "")]
  assert 0 < len(ctl) <= 8, ctl
