"""Full-KV decode throughput: the baseline every PASK speed-up is measured against.

For each (batch, context) the dense cache is filled to ``context`` tokens (prefill of random
tokens), then ``--steps`` greedy decode steps are timed after one warm-up step (compile excluded).
Reports ms/step and generated tokens/s (batch x steps / time).

    python bench/bench_decode.py --model smollm2-135m-instruct --batch 1 --context 1024
    python bench/bench_decode.py --model random:qwen3-4b --batch 1 8 --context 1024 8192
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

SHAPES = {  # random-weight configs for speed runs (weights' values do not change the timing)
    "qwen3-4b": dict(arch="qwen3", vocab_size=151936, hidden=2560, intermediate=9728, n_layers=36,
                     n_heads=32, n_kv_heads=8, head_dim=128, rope_theta=1e6, tie_embeddings=True,
                     max_position=40960, name="Qwen3-4B shape (random weights)"),
    "qwen2.5-0.5b": dict(arch="qwen2", vocab_size=151936, hidden=896, intermediate=4864,
                         n_layers=24, n_heads=14, n_kv_heads=2, head_dim=64, rope_theta=1e6,
                         tie_embeddings=False, max_position=32768,
                         name="Qwen2.5-0.5B shape (random weights)"),
    # CPU smoke tests of the benchmarks
    "tiny": dict(arch="qwen3", vocab_size=512, hidden=64, intermediate=128, n_layers=3, n_heads=4,
                 n_kv_heads=2, head_dim=32, rope_theta=1e4, tie_embeddings=True, max_position=4096,
                 name="tiny qwen3 (random weights)"),
}


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--model", default="smollm2-135m-instruct",
                  help="a model for models.load, or random:<shape> with shape in "
                       + ", ".join(SHAPES))
  ap.add_argument("--batch", type=int, nargs="+", default=[1])
  ap.add_argument("--context", type=int, nargs="+", default=[1024])
  ap.add_argument("--steps", type=int, default=32)
  ap.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto")
  ap.add_argument("--json", default=None, help="append one JSON line per result to this file")
  a = ap.parse_args(argv)
  if "JAX_PLATFORMS" not in os.environ and not os.path.exists("/dev/nvidia0"):
    os.environ["JAX_PLATFORMS"] = "cpu"
  import jax
  import jax.numpy as jnp
  import numpy as np
  from models import ModelConfig, load, random_model
  from pask_jax.decode import Runner
  from pask_jax.sample import how_of

  dtype = {"auto": jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16,
           "float32": jnp.float32, "bfloat16": jnp.bfloat16}[a.dtype]
  if a.model.startswith("random:"):
    cfg = ModelConfig(**SHAPES[a.model.split(":", 1)[1]])
    model = random_model(cfg, dtype=dtype)
  else:
    model = load(a.model, dtype=dtype).model
    cfg = model.cfg
  n_params = sum(x.size for x in jax.tree.leaves(nnx_state(model)))
  print(f"# {cfg.name}: {n_params / 1e6:.0f}M params, {jnp.dtype(dtype).name}, "
        f"backend={jax.default_backend()} ({jax.devices()[0].device_kind})", flush=True)
  print(f"{'batch':>5} {'context':>7} {'ms/step':>9} {'tokens/s':>10} {'GB/s(est)':>10}",
        flush=True)
  for B in a.batch:
    for C in a.context:
      runner = Runner(model, batch=B, capacity=C + a.steps + 1)
      rng = np.random.default_rng(0)
      toks = rng.integers(0, cfg.vocab_size, (B, C)).astype(np.int32)
      logits, cache = runner.prefill_all(runner.new_cache(), toks, np.full((B,), C, np.int32))
      V = cfg.vocab_size
      bits = jnp.full((B, -(-V // 32)), -1, jnp.int32)
      key, zero, one = jax.random.key(0), jnp.zeros((B,)), jnp.ones((B,))
      nxt = jnp.argmax(logits, -1).astype(jnp.int32)
      how = how_of(0.0, 1.0)   # greedy: the sampler's branch static (no conditional)
      nxt, _, cache = runner.step(runner.params, cache, nxt, bits, key, zero, one, how)  # compile
      nxt.block_until_ready()
      t0 = time.perf_counter()
      for _ in range(a.steps):
        nxt, _, cache = runner.step(runner.params, cache, nxt, bits, key, zero, one, how)
      nxt.block_until_ready()
      dt = (time.perf_counter() - t0) / a.steps
      # Bytes a step must read at least: all weights + the K/V of the whole capacity.
      cap = C + a.steps + 1
      kv = 2 * cfg.n_layers * B * cap * cfg.n_kv_heads * cfg.head_dim * jnp.dtype(dtype).itemsize
      gbs = (n_params * jnp.dtype(dtype).itemsize + kv) / dt / 1e9
      print(f"{B:>5} {C:>7} {dt * 1e3:>9.2f} {B / dt:>10.1f} {gbs:>10.1f}", flush=True)
      if a.json:
        with open(a.json, "a") as f:
          f.write(json.dumps({"model": cfg.name, "batch": B, "context": C, "ms_per_step": dt * 1e3,
                              "tokens_per_s": B / dt, "est_GBps": gbs,
                              "dtype": jnp.dtype(dtype).name,
                              "device": jax.devices()[0].device_kind}) + "\n")
      del cache
  return 0


def nnx_state(model):
  from flax import nnx
  return nnx.state(model, nnx.Param)


if __name__ == "__main__":
  sys.exit(main())
