"""What key centering (models.center) does to a real model's INT4 error, on the CPU.

    python bench/check_key_center.py --model qwen2.5-coder-1.5b-instruct [--json out.json]

One BFCL-like prompt (not the centering text) runs through the model with plain causal attention,
once with BF16-exact keys and values and once with every position past the first four through the
cache's per-token INT4 round trip (``pallas_kernels.int4``), before and after centering. Printed:
the logit RMS of INT4 against exact, the top-1 agreement, and how far centering moved the exact
logits (attention is shift invariant, so only rounding).
"""
from __future__ import annotations

import argparse
import json

import jax.numpy as jnp
import numpy as np
from flax import nnx

from models import center, load
from pallas_kernels import int4

PROMPT = ("You have access to: [{\"name\": \"calc_binomial_probability\", \"description\": "
          "\"Calculates the probability of getting k successes in n trials.\", \"parameters\": "
          "{\"type\": \"dict\", \"properties\": {\"n\": {\"type\": \"integer\"}, \"k\": {\"type\": "
          "\"integer\"}, \"p\": {\"type\": \"float\"}}, \"required\": [\"n\", \"k\", \"p\"]}}]\n"
          "User: Calculate the probability of getting exactly 5 heads in 10 coin flips.\n"
          "Assistant: calc_binomial_probability(n=10, k=5, p=0.5)") * 2


def attend(quantize: bool, n_layers: int):
  def f(c, idx, q, k, v, positions):
    if quantize:
      keep = (positions[0] < 4)[None, :, None, None]
      k = jnp.where(keep, k, int4.dequantize(*int4.quantize_packed(k), jnp.float32))
      v = jnp.where(keep, v, int4.dequantize(*int4.quantize_packed(v), jnp.float32))
    o, _ = center.record_attend(jnp.zeros((n_layers,) + k.shape[2:]), idx, q, k, v, positions)
    return o, c
  return f


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
  ap.add_argument("--json", default=None)
  a = ap.parse_args()
  m = load(a.model, dtype=jnp.float32, need_tokenizer=True)
  ids = jnp.asarray(m.tokenizer.encode(PROMPT), jnp.int32)[None]
  pos = jnp.arange(ids.shape[1], dtype=jnp.int32)[None]

  def logits(quantize):
    f = nnx.jit(lambda mod, ids, pos: mod(ids, pos, 0, attend(quantize, m.cfg.n_layers))[0])
    return np.asarray(f(m.model, ids, pos))[0]

  rms = lambda a, b: float(np.sqrt(np.mean((a - b) ** 2)))
  top1 = lambda a, b: float(np.mean(a.argmax(-1) == b.argmax(-1)))
  ref, q = logits(False), logits(True)
  center.center(m)
  ref_c, q_c = logits(False), logits(True)
  out = {"model": a.model, "tokens": int(ids.shape[1]),
         "raw": {"int4_logit_rms": rms(q, ref), "top1_agree": top1(q, ref)},
         "centered": {"int4_logit_rms": rms(q_c, ref_c), "top1_agree": top1(q_c, ref_c)},
         "exact_logits_moved_by_centering_max": float(np.abs(ref_c - ref).max())}
  print(json.dumps(out, indent=1))
  if a.json:
    with open(a.json, "w") as f:
      json.dump(out, f, indent=1)


if __name__ == "__main__":
  main()
