"""Run the Mosaic GPU INT4 partition's variants a few times each, without any profiler of its own,
for an outside one (Nsight Compute) or for the compiler's dumps (ptxas report, SASS).

  MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_SASS=1 python bench/profile_mgpu_int4.py
  ncu --clock-control none --section Occupancy --section WarpStateStats \\
      python bench/profile_mgpu_int4.py --shape 4b

Variants: the committed kernel (``partition``, dim-major V, 8 splits at 4B / 32 at 0.5B) and the
warp-specialized one (``partition_ws``, 2 compute warpgroups), both with approximate exp2 and no
automatic barriers, at B=8 and 32K keys. ``--pool``: instead, the kernel as ``decode_attention``
runs it on the cache's int4 pool (paged, pages of 128, ``cols=8``, the same fast knobs).
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from bench.bench_mgpu_int4 import inputs, pool_inputs
from pallas_kernels.gpu import mgpu_int4 as M
from pallas_kernels.gpu import mgpu_upcast as U

SPLITS = {"4b": 8, "0.5b": 32}


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--shape", choices=sorted(SPLITS), default="4b")
  ap.add_argument("--reps", type=int, default=2)
  ap.add_argument("--pool", action="store_true", help="the paged kernel of the decode path")
  ap.add_argument("--upcast", default="bf16", help="with --pool: the kernel's k_upcast")
  ap.add_argument("--vupcast", default="bf16", help="with --pool: the kernel's v_upcast (codes "
                  "stored in mgpu_upcast.store_order for bf16_perm)")
  ap.add_argument("--splits", type=int, default=None,
                  help="with --pool: context splits (default: 8 at 4b, 32 at 0.5b)")
  a = ap.parse_args()
  if a.pool:
    return pool(a)
  q, k, ks, v, vs, lens, _, _ = inputs(a.shape, 32768)
  vt = jnp.swapaxes(v, 1, 2)
  vb = M.block_v(vt, 128)
  full = jnp.full_like(lens, k.shape[1])
  sp = SPLITS[a.shape]
  fast = dict(approx_math=True, no_auto_barriers=True, qk_scale=0.1)
  runs = {"partition": (M.partition, vt, dict(splits=sp, **fast)),
          "partition_ws2": (M.partition_ws, vb, dict(splits=sp // 2, wgs=2, **fast))}
  jax.block_until_ready((q, k, ks, vt, vb, vs, full))
  for name, (fn, vin, kn) in runs.items():
    for _ in range(a.reps):
      jax.block_until_ready(fn(q, k, ks, vin, vs, full, **kn))
    print(name, "ran", a.reps, flush=True)


def pool(a) -> None:
  q, k, ks, vv, vs, lens, tbl, _, d = pool_inputs(a.shape, 32768, 128)
  full = jnp.full_like(lens, 32768)
  kn = dict(tile=128, splits=a.splits or SPLITS[a.shape], v_major="dim",
            qk_scale=d ** -0.5 * M.LOG2E, cols=8, approx_math=True, no_auto_barriers=True,
            k_upcast=a.upcast, v_upcast=a.vupcast)
  v = vv["dim"] if a.vupcast != "bf16_perm" else U.store_order(vv["dim"])
  # splits that do not divide the pages: padded with page 0 past every length, as the decode
  # path's mgpu_decode.int4_partials pads its table
  tbl = jnp.pad(tbl, ((0, 0), (0, (-tbl.shape[1]) % kn["splits"])))
  f = jax.jit(lambda q, k, ks, v, vs, lens, tbl: M.partition(q, k, ks, v, vs, lens, None, tbl,
                                                             **kn))
  for _ in range(a.reps):
    jax.block_until_ready(f(q, k, ks, v, vs, full, tbl))
  print("pool partition", a.upcast, a.vupcast, kn["splits"], "splits ran", a.reps, flush=True)


if __name__ == "__main__":
  main()
