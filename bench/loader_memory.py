"""Host memory and time of loading a model: ``python bench/loader_memory.py [MODEL] [--dtype D]``.

Each measurement runs in a fresh process: JAX, flax and the loaders are imported and warmed up
first (a tiny random decoder built), then the model is loaded once.  Printed as one JSON line:
load seconds (wall, and CPU seconds of the process: steadier on a busy host), peak RSS added by
the load (``ru_maxrss`` after minus before, MiB), RSS after the load, and the parameters' size
in their dtype (MiB).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _rss_mib() -> float:
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("model", nargs="?", default=None, help="registered name, GGUF file or HF dir")
  ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  args = ap.parse_args()
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from models import load, random_model
  from models.config import ModelConfig
  dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[args.dtype]
  warm = random_model(ModelConfig(arch="llama", vocab_size=64, hidden=16, intermediate=32,
                                  n_layers=1, n_heads=2, n_kv_heads=1, head_dim=8), dtype=dtype)
  del warm
  before_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
  before = _rss_mib()
  t, c = time.perf_counter(), time.process_time()
  m = load(args.model, dtype=dtype)
  jax.block_until_ready(nnx.state(m.model))
  sec, cpu = time.perf_counter() - t, time.process_time() - c
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
  size = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(m.model))) / 2**20
  print(json.dumps({"model": args.model or "default", "dtype": args.dtype,
                    "load_s": round(sec, 2), "cpu_s": round(cpu, 2),
                    "rss_before_mib": round(before),
                    "peak_added_mib": round(peak - before_peak),
                    "rss_added_after_mib": round(_rss_mib() - before),
                    "params_mib": round(size)}))


if __name__ == "__main__":
  main()
