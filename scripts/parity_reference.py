"""Store the transformers reference log-probabilities (:mod:`pask_jax.testing.parity`) that
``tests/test_parity.py`` compares our decoder against.

    python scripts/parity_reference.py --model smollm2-135m-instruct \\
        --out tests/data/parity_smollm2.npz
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

from pask_jax.testing.parity import reference


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--model", default="smollm2-135m-instruct")
  ap.add_argument("--out", default=None)
  ap.add_argument("--new", type=int, default=16)
  ap.add_argument("--topk", type=int, default=64)
  args = ap.parse_args(argv)
  from models import registry
  ref = reference(registry.resolve(args.model), args.new, args.topk)
  if args.out:
    np.savez_compressed(args.out, **ref)
    print(f"wrote {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
