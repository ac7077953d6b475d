"""The INT4 quantizer stores the same bits on this backend (jit and eager) as the float64 oracle.

    python bench/check_int4_backend.py      # prints mismatches per path; exit 1 on any
"""
import sys

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import int4
from pallas_kernels.testing.quant import adversarial_rows


def main() -> int:
  x = adversarial_rows(np.random.default_rng(11), n=4096)
  want_c, want_s = int4.quantize_numpy(x)
  bad = 0
  for name, f in (("eager", int4.quantize), ("jit", jax.jit(int4.quantize))):
    c, s = f(jnp.asarray(x))
    ms = int((np.asarray(s).view(np.uint16) != want_s.view(np.uint16)).sum())
    mc = int((np.asarray(c) != want_c).sum())
    print(f"{jax.default_backend()} {name}: scale mismatches {ms} / {want_s.size}, "
          f"code mismatches {mc} / {want_c.size}")
    bad += ms + mc
  return int(bad > 0)


if __name__ == "__main__":
  sys.exit(main())
