"""Registers and spills of the Mosaic GPU INT4 pool kernel per knob set, on any host (no GPU).

The kernel is compiled for sm_90a through XLA's deviceless GPU compile
(``pallas_kernels.gpu.aot.compile_only_device``) with ``MOSAIC_GPU_DUMP_PTXAS=1``, which makes
Mosaic GPU print ptxas's resource report; this reads it and adds how many 128-thread blocks the
registers allow per SM (65,536 registers, allocated per warp in units of 256). Each knob set
compiles in its own process (the dump goes to the process's stdout).

  JAX_PLATFORMS=cpu python bench/mgpu_regs.py '{}' '{"k_upcast": "bf16_perm"}' \\
      '{"k_upcast": "bf16_perm", "early_v": true}'

The shape is the decode path's at the 4B-like head shape (pool pages of 128, dim-major V, 8
splits, both fast knobs); ``--cols 8`` needs jax >= 0.11 (the device's), this host's jax may
only take 16.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

USED = re.compile(r"Used (\d+) registers")
SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
REGS_PER_SM, THREADS = 65536, 128


def blocks_by_registers(regs: int) -> int:
  """128-thread blocks per SM that ``regs`` registers per thread allow (per-warp units of 256)."""
  per_warp = -(-regs * 32 // 256) * 256
  return REGS_PER_SM // (per_warp * THREADS // 32)


def compile_one(knobs: dict, d: int, cols: int) -> None:
  import jax
  import jax.numpy as jnp
  from jax.sharding import SingleDeviceSharding

  from pallas_kernels.gpu import aot
  from pallas_kernels.gpu import mgpu_int4 as M

  sh = SingleDeviceSharding(aot.compile_only_device())
  sds = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=sh)
  hkv, b, n, tile = 8, 8, 32768, 128
  pages = b * n // tile
  f = jax.jit(lambda q, k, ks, v, lens, tbl: M.partition(
      q, k, ks, v, None, lens, None, tbl, tile=tile, splits=8, v_major="dim", qk_scale=0.1,
      cols=cols, approx_math=True, no_auto_barriers=True, **knobs))
  f.trace(sds((b * hkv, M.N_PAD, d), jnp.bfloat16), sds((pages, hkv, tile, d), jnp.int4),
          sds((pages, hkv, 2, tile), jnp.float16), sds((pages, hkv, d, tile), jnp.int4),
          sds((b * hkv,), jnp.int32), sds((b, n // tile), jnp.int32)).lower().compile()


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("knobs", nargs="*", default=["{}"], help="JSON knob dicts of mgpu_int4.partition")
  ap.add_argument("--d", type=int, default=128, help="head dim")
  ap.add_argument("--cols", type=int, default=16, help="softmax columns (8 needs jax >= 0.11)")
  ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
  a = ap.parse_args(argv)
  if a.one is not None:
    compile_one(json.loads(a.one), a.d, a.cols)
    return 0
  env = {**os.environ, "MOSAIC_GPU_DUMP_PTXAS": "1", "JAX_PLATFORMS": "cpu"}
  print("| knobs | registers | spills (stores / loads, bytes) | blocks per SM by registers |")
  print("|---|---|---|---|")
  for kn in a.knobs:
    out = subprocess.run([sys.executable, "-m", "bench.mgpu_regs", "--one", kn, "--d", str(a.d),
                          "--cols", str(a.cols)], env=env, capture_output=True, text=True)
    text = out.stdout + out.stderr
    used, spill = USED.search(text), SPILL.search(text)
    if out.returncode or not used:
      errs = [ln for ln in text.splitlines() if re.match(r"\w*(Error|Exception): ", ln)]
      print(f"| `{kn}` | failed: {(errs or ['no register report'])[-1][:200]} | | |")
      continue
    regs = int(used.group(1))
    print(f"| `{kn}` | {regs} | {spill.group(1)} / {spill.group(2)} | "
          f"{blocks_by_registers(regs)} |", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
