"""Does reading our half-split uint8 rows as jax int4 (``mgpu_int4.int4_view``) cost a copy?

Compiles the view of a 4B-shape INT4 pool (64 x 32K rows of 64 bytes) on the default device,
prints the compiled program's root and fusions, and times it.

  python bench/check_int4_view.py
"""
import time

import jax
import jax.numpy as jnp

from pallas_kernels.gpu import mgpu_int4 as M


def main() -> None:
  x = jax.random.randint(jax.random.key(0), (64, 32768, 64), 0, 256, jnp.int32)
  x = x.astype(jnp.uint8)
  f = jax.jit(M.int4_view)
  txt = f.lower(x).compile().as_text()
  ops = [ln.strip()[:120] for ln in txt.splitlines() if "ROOT" in ln or "fusion" in ln.lower()]
  print("ops:", ops[:8])
  jax.block_until_ready(f(x))
  t = time.perf_counter()
  for _ in range(20):
    y = f(x)
  jax.block_until_ready(y)
  print("int4_view us per call", (time.perf_counter() - t) / 20 * 1e6)


if __name__ == "__main__":
  main()
