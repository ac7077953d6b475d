"""Ahead-of-time compiles on a CPU host: the TPU kernel through libtpu for v5e, v6e and tpu7x, and
the GPU kernel to PTX for sm_90a with ptxas's resource report checked against Hopper's limits.

Nothing here skips: a missing libtpu, CUDA plugin or ptxas is a failure (the ``aot`` extra and the
CUDA toolkit's ptxas, or pip ``nvidia-cuda-nvcc``, provide them).
"""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest

from pallas_kernels.testing import synth
from pallas_kernels.gpu import aot as gpu_aot
from pallas_kernels.gpu import decode_attention_gpu
from pallas_kernels.tpu import aot as tpu_aot
from pallas_kernels.tpu import decode_attention_tpu

# The two model shapes (Qwen3-4B-like 32q/8kv d128; Qwen2.5-0.5B 14q/2kv d64), small pools.
SHAPES = {
    "32q8kv_d128": synth.Case("a", synth.Shape(b=4, hq=32, hkv=8, d=128, page=16, w=64,
                                               lo_cap=1024, hi_cap=512), (900,), (300,), (64,)),
    "14q2kv_d64": synth.Case("b", synth.Shape(b=2, hq=14, hkv=2, d=64, page=16, w=32,
                                              lo_cap=512, hi_cap=256), (500,), (100,), (32,)),
}


@pytest.mark.parametrize("gen", sorted(tpu_aot.TOPOLOGIES))
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_tpu_kernel_compiles_for_generation(gen, shape):
  args = SHAPES[shape].make(poison=False)
  comp = tpu_aot.compile_for(gen, decode_attention_tpu, *args, splits=2)
  rep = tpu_aot.memory_report(comp)
  assert rep["argument_bytes"] > 0 and rep["code_bytes"] > 0
  assert "pask_decode_attention_tpu" in comp.as_text()


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_gpu_kernel_compiles_to_sm90a_within_limits(shape):
  args = SHAPES[shape].make(poison=False)
  reps = gpu_aot.report(decode_attention_gpu, *args)
  assert sorted(r.name for r in reps) == ["pask_decode_attention", "pask_merge"]
  for r in reps:
    assert ".target sm_90a" in r.ptx
    assert r.ok(), r.summary()
    assert r.registers <= gpu_aot.SM90_MAX_REGS and r.smem_bytes <= gpu_aot.SM90_MAX_SMEM


def test_stacked_layer_kernels_compile():
  """The decode step's form (pools and window stacked over 4 layers, traced layer index)
  compiles for sm_90a within limits and for one TPU generation."""
  import jax.numpy as jnp
  args = synth.stack_layers(SHAPES["32q8kv_d128"].make(poison=False)) + (jnp.int32(2),)
  reps = gpu_aot.report(decode_attention_gpu, *args)
  assert reps and all(r.ok() for r in reps), [r.summary() for r in reps]
  comp = tpu_aot.compile_for("v5e", decode_attention_tpu, *args, splits=2)
  assert "pask_decode_attention_tpu" in comp.as_text()


def test_pask_decode_step_updates_the_stacked_cache_in_place_on_gpu():
  """The whole jitted PASK step compiled for sm_90 without a GPU: the cache update is scatters
  into the stacked [L, ...] pools and window (no copy of them, no per-layer slice or write-back)
  and the Pallas kernel reads the stack."""
  import re
  import jax
  import jax.numpy as jnp
  from models import ModelConfig, random_model
  from pask_jax import ledger, policy as P
  from pask_jax.decode import PaskRunner
  from pask_jax.tracker import FREE_TAG
  cfg = ModelConfig(arch="qwen3", vocab_size=512, hidden=256, intermediate=512, n_layers=3,
                    n_heads=8, n_kv_heads=2, head_dim=64, rope_theta=1e6, tie_embeddings=True,
                    max_position=4096, name="tiny")
  pol = P.demo(cfg)
  B = 2
  r = PaskRunner(random_model(cfg, dtype=jnp.bfloat16), pol, batch=B, capacity=1000,
                 backend="gpu")
  cache = jax.eval_shape(r.new_cache)
  z = jnp.zeros((B,), jnp.int32)
  txt = gpu_aot.compile_hlo(r.decode_step, r.params, pol, cache, jnp.zeros((B,), jnp.float32),
                            ledger.init(B, pol.n_groups), z,
                            jnp.broadcast_to(jnp.asarray(FREE_TAG), (B, 4)), z - 1,
                            jnp.ones((B,), bool))
  # Every op whose output is as large as a stacked array or one layer of it, by (dtype, size);
  # the fp16 scales are left out (one layer of them is repacked per layer, on purpose).
  sizes = set()
  for x in jax.tree.leaves(cache.layers.replace(lo_s=cache.layers.lo_k)):
    dt = {"bfloat16": "bf16", "uint8": "u8"}[x.dtype.name]
    sizes |= {(dt, x.size), (dt, x.size // x.shape[0])}
  ops = set()
  for m in re.finditer(r"= (\w+)\[([\d,]+)\]\{[^}]*\} ([\w-]+)\((.*)", txt):
    n = 1
    for d in m.group(2).split(","):
      n *= int(d)
    if (m.group(1), n) in sizes and m.group(3) not in ("parameter", "get-tuple-element",
                                                        "bitcast", "tuple"):
      calls = re.search(r"calls=%([a-z_]+)", m.group(4))
      ops.add(m.group(3) + (":" + calls.group(1) if calls else ""))
  assert ops and all("scatter" in o for o in ops), ops
  assert "pask_decode_attention" in txt


def test_mosaic_int4_kernel_register_report(capsys):
  """bench/mgpu_regs.py: ptxas's report of the Mosaic GPU INT4 pool kernel, compiled for sm_90a
  here. early_v keeps V's operand live beside K's in flight: more registers than without."""
  from bench import mgpu_regs
  assert [mgpu_regs.blocks_by_registers(r) for r in (128, 168, 170, 176, 230, 255)] == \
      [4, 3, 2, 2, 2, 2]   # 170 is allocated as 176 (per warp in units of 256)
  assert mgpu_regs.main(["{}", '{"early_v": true}', '{"k_upcast": "nope"}']) == 0
  rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines()[2:]]
  (plain, regs, spills, _), (early, regs_e, spills_e, _), (bad, fail, _, _) = rows
  assert int(regs) > 64 and spills.strip() == spills_e.strip() == "0 / 0"
  assert int(regs_e) > int(regs)   # equal: the early conversion was dropped or not early
  assert "failed" in fail and "k_upcast must be one of" in fail
