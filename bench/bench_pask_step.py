"""PASK decode step vs Full-KV decode step at the same shape (random weights, synthetic cache).

The PASK cache is filled by ``materialize_prefill`` from random K/V with a random per-token plan
(fractions ``--mix R L H`` of released / INT4 / BF16 tokens beyond the window), then the whole
jitted PASK decode step (controller, cache update, per-layer mixed-precision attention through
``pallas_kernels.decode_attention`` with backend auto) is timed against the Full-KV step of
``pask_jax.decode.Runner`` with a dense cache of the same context.

    python bench/bench_pask_step.py --shape qwen3-4b --batch 8 --context 8192 --mix 0.2 0.7 0.1

``--updates copy scatter`` times the step with each per-layer cache update in the same process:
``scatter`` is ``PaskRunner._attend`` as it is (the kernel reads the stacked pools at a layer
index; only the new rows are scattered), ``copy`` the earlier form that sliced each layer's
arrays out of the stack and wrote the whole layer back (``layer_slice`` + ``set_layer``).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--shape", default="qwen2.5-0.5b")
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--context", type=int, default=8192)
  ap.add_argument("--mix", type=float, nargs=3, default=[0.2, 0.7, 0.1], metavar=("R", "L", "H"))
  ap.add_argument("--steps", type=int, default=16)
  ap.add_argument("--updates", nargs="+", default=["scatter"], choices=["scatter", "copy"])
  ap.add_argument("--json", default=None)
  a = ap.parse_args(argv)
  if "JAX_PLATFORMS" not in os.environ and not os.path.exists("/dev/nvidia0"):
    os.environ["JAX_PLATFORMS"] = "cpu"
  import jax
  import jax.numpy as jnp
  import numpy as np
  from bench.bench_decode import SHAPES
  from models import ModelConfig, random_model
  from pask_jax import cache as pc, controller, ledger, policy as P
  from pask_jax.decode import FREE_TAG, PaskRunner, Runner

  cfg = ModelConfig(**SHAPES[a.shape])
  dt = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
  model = random_model(cfg, dtype=dt)
  B, C, S = a.batch, a.context, a.steps
  pol = P.demo(cfg)
  G, W = pol.n_groups, pol.window
  key = jax.random.key(0)
  shape = (cfg.n_layers, B, C, cfg.n_kv_heads, cfg.head_dim)
  k = jax.random.normal(key, shape, jnp.bfloat16)
  v = jax.random.normal(jax.random.key(1), shape, jnp.bfloat16)
  probs = np.asarray(a.mix) / np.sum(a.mix)
  plan = jnp.asarray(np.random.default_rng(0).choice(3, size=(B, C, G), p=probs), jnp.int8)
  lengths = jnp.full((B,), C, jnp.int32)
  tags = jnp.broadcast_to(jnp.asarray(FREE_TAG), (B, 4))
  sid, act = jnp.full((B,), -1, jnp.int32), jnp.ones((B,), bool)
  tok = jnp.zeros((B,), jnp.int32)

  def copy_attend(runner):
    """The per-layer update before the stacked-kernel form: slice, write, write back."""
    import pallas_kernels

    def attend(carry, layer, q, k_, v_, positions):
      cache, plan = carry
      g = pc.group_array(cache)[layer]
      lkv = pc.write_layer(pc.layer_slice(cache, layer), plan, g, k_[:, 0], v_[:, 0])
      out = pallas_kernels.decode_attention(q[:, 0], *pc.kernel_inputs(lkv, cache, g),
                                            backend=runner.backend)
      return out[:, None].astype(q.dtype), (pc.set_layer(cache, layer, lkv), plan)
    return attend

  t_pask, stored_b = {}, None
  for upd in a.updates:
    runner = PaskRunner(model, pol, batch=B, capacity=C + S + 1)
    if upd == "copy":
      runner._attend = copy_attend(runner)
    cache = jax.jit(pc.materialize_prefill)(runner.new_cache(), k, v, plan, lengths)
    cache = cache.replace(count=jnp.full((B,), C, jnp.int32))
    stored_b = float(np.asarray(ledger.live_payload(cache, pol.cost, pol.c_full)).mean()) / (
        C * float(pol.c_full))
    budget = jnp.full((B,), controller.initial_balance(pol), jnp.float32)
    led = ledger.init(B, G)
    out = runner.decode_step(runner.params, pol, cache, budget, led, tok, tags, sid, act)
    jax.block_until_ready(out)
    _, cache, budget, led, _ = out
    t0 = time.perf_counter()
    for _ in range(S):
      logits, cache, budget, led, _ = runner.decode_step(runner.params, pol, cache, budget, led,
                                                         tok, tags, sid, act)
    logits.block_until_ready()
    t_pask[upd] = (time.perf_counter() - t0) / S
    del cache, out, runner
  del k, v
  full = Runner(model, batch=B, capacity=C + S + 1, cache_dtype=jnp.bfloat16)
  fc = full.new_cache()._replace(length=jnp.full((B,), C, jnp.int32))
  bits = jnp.full((B, -(-cfg.vocab_size // 32)), -1, jnp.int32)
  z, o = jnp.zeros((B,)), jnp.ones((B,))
  nxt, _, fc = full.step(full.params, fc, tok, bits, key, z, o)
  nxt.block_until_ready()
  t0 = time.perf_counter()
  for _ in range(S):
    nxt, _, fc = full.step(full.params, fc, nxt, bits, key, z, o)
  nxt.block_until_ready()
  t_full = (time.perf_counter() - t0) / S
  for upd, t in t_pask.items():
    row = {"shape": a.shape, "batch": B, "context": C, "mix_RLH": list(map(float, probs)),
           "update": upd, "live_B": stored_b, "pask_ms": t * 1e3, "full_ms": t_full * 1e3,
           "speedup": t_full / t, "device": jax.devices()[0].device_kind}
    print(json.dumps(row), flush=True)
    if a.json:
      with open(a.json, "a") as f:
        f.write(json.dumps(row) + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
