"""Regenerate the shipped model-independent policies: ``python policies/make.py``.

``all-high`` (the reference π_ref: B_D = 1, floors H, Γ = 0) and ``demo`` (hand-written,
compresses; not calibrated) are templates without a model identity: ``policy.load(dir, model)``
binds them to any model's cost model.  tests/test_policy.py checks they equal the constructors.
"""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from pask_jax import policy as P

if __name__ == "__main__":
  for name, ctor in P.BUILTIN.items():
    P.save(ctor(), os.path.join(P.POLICIES_DIR, name))
    print("wrote", os.path.join(P.POLICIES_DIR, name))
