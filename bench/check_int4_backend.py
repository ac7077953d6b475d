"""The INT4 quantizer stores the same bits on this backend (jit and eager) as the float64 oracle.

    python bench/check_int4_backend.py      # prints mismatches per path; exit 1 on any
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels import int4  # noqa: E402


def main() -> int:
  from test_int4 import _adversarial_rows
  x = _adversarial_rows(np.random.default_rng(11), n=4096)
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
