"""Compiled memory of the masked baselines' runner (H2O / SnapKV / MiKV) at evaluation sizes.

``pask-jax eval --method mikv --batch 120`` on Qwen2.5-0.5B (BFCL live categories: prompts up to
~2.9K tokens, so a 3072-slot cache and 512-token prefill chunks) asked the GPU for 122 GiB in its
prefill: a chunk's [B, Hkv, G, T, S] attention probabilities are larger than the whole cache there,
and XLA's GPU scheduler kept many layers' of them alive.  The CPU compile of that prefill kept
three (3.5 times the cache here), so the bound below catches it on the CPU too.  Nothing runs the
model: each jitted function is compiled on the CPU for abstract inputs and its temporary buffers
are bounded by the bytes of the float32 K/V cache it works on, at that model's attention shape (24
layers, 14 query / 2 KV heads of 64) with tiny projections, so the bound scales with the cache.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import ModelConfig, decoder, random_model
from pask_jax.baselines.masked import Config, MaskedRunner
from pask_jax.decode import PREFILL_CHUNK

# Qwen2.5-0.5B's attention (what the cache and the probabilities scale with), tiny elsewhere.
CFG = ModelConfig(arch="qwen2", vocab_size=256, hidden=64, intermediate=128, n_layers=24,
                  n_heads=14, n_kv_heads=2, head_dim=64, name="qwen2.5-0.5b attention shape")
CAPACITY = 3072          # the longest live_multiple prompt (~2.9K tokens) + 128 new tokens
# Temporaries at most this many times the K/V cache's bytes.  Prefill holds a few blocks of
# attention probabilities (~0.15 of the cache each at this shape; one whole chunk's were 1.2, and
# the CPU compile of that kept three); a decode step's copy of K or V would be 0.5.
TEMP_PER_CACHE = 1.0

# Compiled with XLA's expensive optimizations off (tests/conftest.py): they change the LLVM code,
# not the HLO passes nor the buffer assignment that memory_analysis reports.  The unrolled layout's
# prefill (batch 64) and step (batch 120) report the same temporary bytes either way (4,101,091,520
# and 5,129,058,112, 2026-12-05) for a fifth of the compile time (step: 27.5 -> 7.7 s of CPU).
pytestmark = pytest.mark.fast_compile


@pytest.fixture(scope="module", params=["stacked", "unrolled"])
def model(request):
  return decoder.set_layout(random_model(CFG, dtype=jnp.bfloat16), request.param)


def _abstract(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def _temp_and_cache(model, batch: int, fn: str) -> tuple[int, int]:
  r = MaskedRunner(model, batch=batch, capacity=CAPACITY).configure(Config("mikv", ratio=0.3))
  st = jax.eval_shape(lambda: r.new_state(np.full((batch,), CAPACITY - 128, np.int32)))
  params = _abstract(r.params)
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
  f32 = jax.ShapeDtypeStruct((batch,), jnp.float32)
  if fn == "prefill":
    jitted, args = r.prefill, (params, st, i32(batch, PREFILL_CHUNK), i32(), i32(batch))
  elif fn == "compress":
    jitted, args = r.compress, (st,)
  else:
    key = jax.eval_shape(lambda: jax.random.key(0))
    bits = i32(batch, (CFG.vocab_size + 31) // 32)
    jitted, args = r.step, (params, st, i32(batch), jax.ShapeDtypeStruct((batch,), bool), bits,
                            key, f32, f32)
  mem = jitted.lower(*args).compile().memory_analysis()
  return mem.temp_size_in_bytes, 2 * st.k.size * st.k.dtype.itemsize


@pytest.mark.parametrize("batch", [64, 120])   # eval's default --batch and the failing run's
def test_prefill_temporaries_bounded_by_the_cache(model, batch):
  temp, cache = _temp_and_cache(model, batch, "prefill")
  assert temp <= TEMP_PER_CACHE * cache, (
      f"{model.layout} prefill at batch {batch}: {temp / 2**30:.2f} GiB of temporaries for a "
      f"{cache / 2**30:.2f} GiB cache")


@pytest.mark.parametrize("fn", ["compress", "step"])
def test_compress_and_step_temporaries_bounded_by_the_cache(model, fn):
  temp, cache = _temp_and_cache(model, 120, fn)
  assert temp <= TEMP_PER_CACHE * cache, (
      f"{model.layout} {fn} at batch 120: {temp / 2**30:.2f} GiB of temporaries for a "
      f"{cache / 2**30:.2f} GiB cache")
