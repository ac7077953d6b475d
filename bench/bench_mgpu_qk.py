"""Bandwidth of the Mosaic GPU QK prototype over INT4 and BF16 keys (issue 22, first stage).

Runs a sweep of (key dtype, tile, pipeline stages, context splits) at the 4B-like and 0.5B head
shapes, checks each variant against ``qk_reference`` (relative error norm) and prints one JSON
line per variant with the time and the rate over the bytes the kernel must read (codes + scales).

  python bench/bench_mgpu_qk.py --out $OUT/qk.jsonl [--quick]

``--paged``: the integration probe instead. Keys read straight from the cache's paged INT4 pool
(uint8 half-split nibbles, ``[P, page, Hkv, D/2]``, pages in shuffled order through a page
table; ``mgpu_qk.qk_paged``) against contiguous int4 keys (``mgpu_qk.qk``, tile = page), same
codes and scales, per page size and split count.
"""
from __future__ import annotations

import argparse
import itertools
import json
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.gpu import mgpu_qk
from pallas_kernels.testing.synth import paged_pool


def kernel_time(f, args, iters: int) -> float:
  """Median seconds per call: CUPTI kernel time where the profiler has it, else wall clock."""
  try:
    from jax.experimental.mosaic.gpu import profiler
    _, runtimes = profiler.measure(f, iterations=iters)(*args)
    if runtimes:
      return float(np.median(runtimes)) * 1e-3
  except Exception:   # noqa: BLE001 - fall back to the wall clock
    pass
  jax.block_until_ready(f(*args))
  t0 = time.perf_counter()
  for _ in range(iters):
    out = f(*args)
  jax.block_until_ready(out)
  return (time.perf_counter() - t0) / iters


def measure(row: dict, f, args, ref, nbytes: int, iters: int) -> None:
  """Into ``row``: relative error norm of ``f(*args)`` against ``ref``, kernel time, rate."""
  out = jax.block_until_ready(f(*args))
  err = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
  sec = kernel_time(f, args, iters)
  row.update(rel_err=err, us=sec * 1e6, bytes=nbytes, tbps=nbytes / sec / 1e12)


def failed(row: dict, e: Exception) -> None:
  row.update(error=f"{type(e).__name__}: {str(e)[:2000]}", tb=traceback.format_exc()[-3000:])


def emit(fo, row: dict) -> None:
  """One JSON line to stdout (without the traceback) and to the output file."""
  print(json.dumps({k: v for k, v in row.items() if k != "tb"}), flush=True)
  fo.write(json.dumps(row) + "\n")
  fo.flush()


def ints(text: str) -> tuple[int, ...]:
  return tuple(int(x) for x in text.split(","))


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", required=True)
  ap.add_argument("--quick", action="store_true")
  ap.add_argument("--iters", type=int, default=30)
  ap.add_argument("--tiles", default="64,128")
  ap.add_argument("--stages", default="2,4,6")
  ap.add_argument("--splits4b", default="2,4,8")
  ap.add_argument("--splits05b", default="8,16")
  ap.add_argument("--paged", action="store_true")
  a = ap.parse_args()
  if a.paged:
    return paged(a)
  shapes = [("4b", 64, 128, 32768), ("0.5b", 16, 64, 32768)]
  if a.quick:
    grid = {"4b": [(jnp.int4, 64, 4, 4), (jnp.bfloat16, 64, 4, 4)],
            "0.5b": [(jnp.int4, 64, 4, 8)]}
  else:
    grid = {
        "4b": list(itertools.product((jnp.int4, jnp.bfloat16), ints(a.tiles), ints(a.stages),
                                     ints(a.splits4b))),
        "0.5b": list(itertools.product((jnp.int4, jnp.bfloat16), ints(a.tiles), ints(a.stages),
                                       ints(a.splits05b))),
    }
  print(jax.devices(), jax.__version__, flush=True)
  with open(a.out, "w") as fo:
    for name, bh, d, n in shapes:
      key = jax.random.key(0)
      kq, kk, ks_ = jax.random.split(key, 3)
      q = jax.random.normal(kq, (bh, mgpu_qk.N_PAD, d), jnp.float32).astype(jnp.bfloat16)
      codes = jax.random.randint(kk, (bh, n, d), -7, 8, jnp.int32)
      scale = jax.random.uniform(ks_, (bh, n), jnp.float32, 0.01, 0.1)
      for kdt, tile, stages, splits in grid[name]:
        k = codes.astype(kdt)
        row = dict(shape=name, bh=bh, d=d, n=n, kdtype=jnp.dtype(kdt).name, tile=tile,
                   stages=stages, splits=splits)
        try:
          f = jax.jit(lambda q, k, s, t=tile, st=stages, sp=splits:
                      mgpu_qk.qk(q, k, s, tile=t, stages=st, splits=sp))
          ref = mgpu_qk.qk_reference(q, k, scale, tile=tile, splits=splits)
          nbytes = bh * n * (d * (4 if kdt == jnp.int4 else 16) // 8 + 4)
          measure(row, f, (q, k, scale), ref, nbytes, a.iters)
        except Exception as e:  # noqa: BLE001 - a sweep records failures and goes on
          failed(row, e)
        emit(fo, row)


def paged(a) -> None:
  shapes = [("4b", 8, 8, 128, 32768), ("0.5b", 8, 2, 64, 32768)]
  print(jax.devices(), jax.__version__, flush=True)
  with open(a.out, "w") as fo:
    for (name, batch, hkv, d, n), page in itertools.product(shapes, (64, 128)):
      q, pool, tbl, ks = paged_pool(batch, hkv, d, n, page, n_pad=mgpu_qk.N_PAD)
      k, kscale = mgpu_qk.paged_keys(pool, tbl, ks)
      k4 = k.astype(jnp.int4)
      qn, bias = mgpu_qk.nibble_q(q)
      nbytes = q.shape[0] * n * (d // 2 + 4)
      for splits in ((4, 8) if name == "4b" else (8, 16, 32)):
        ref = mgpu_qk.qk_reference(q, k, kscale, tile=page, splits=splits)
        for how in ("contiguous int4", "paged pool"):
          row = dict(shape=name, bh=q.shape[0], d=d, n=n, page=page, splits=splits, how=how)
          try:
            if how == "paged pool":
              f = jax.jit(lambda *x, sp=splits: mgpu_qk.qk_paged(*x, splits=sp))
              args = (qn, bias, pool, tbl, ks)
            else:
              f = jax.jit(lambda *x, t=page, sp=splits: mgpu_qk.qk(*x, tile=t, stages=2,
                                                                 splits=sp))
              args = (q, k4, kscale)
            measure(row, f, args, ref, nbytes, a.iters)
          except Exception as e:  # noqa: BLE001 - a sweep records failures and goes on
            failed(row, e)
          emit(fo, row)


if __name__ == "__main__":
  main()
