"""What the host launches for the serving engine's pick, compiled for sm_90 on any host (issue 24).

XLA's GPU runtime runs a ``kConditional`` thunk on the host: it copies the predicate back and
waits for the device, so a pick whose program holds one returns from its launch only once the
forward launched before it has run.  This compiles ``serve.engine.step.pick_packed`` for sm_90
(``pallas_kernels.gpu.aot``) with its branches chosen on the device (``how=None``, ``lax.cond``)
and for each static ``how``, and prints the top-level thunks of XLA's thunk sequence (a
``kCommandBuffer`` is one CUDA-graph launch).

    python bench/pick_thunks.py --batch 8 --vocab 151936
"""
from __future__ import annotations

import argparse
import functools
import glob
import json
import os
import re
import tempfile


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--vocab", type=int, default=151936)
  a = ap.parse_args(argv)
  dump = tempfile.mkdtemp(prefix="pick_thunks_")
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             f" --xla_dump_to={dump} --xla_dump_hlo_module_re=.*pick.*").strip()
  import jax
  import jax.numpy as jnp
  from pallas_kernels.gpu import aot as gpu_aot
  from serve.engine.step import pick_packed
  B, nw = a.batch, (a.vocab + 31) // 32
  logits = jnp.zeros((B, a.vocab), jnp.float32)
  packed = jnp.zeros((B, nw + 5), jnp.int32)
  for how in (None, (False, False, False), (False, False, True), (True, False, False),
              (True, True, True)):
    before = set(glob.glob(os.path.join(dump, "*thunk_sequence_after_thunk_passes.txt")))
    f = jax.jit(functools.partial(pick_packed, how=how))
    f.__name__ = "pick"
    gpu_aot.compile_hlo(f, logits, packed)
    new = set(glob.glob(os.path.join(dump, "*thunk_sequence_after_thunk_passes.txt"))) - before
    text = open(new.pop()).read() if new else ""
    top = re.findall(r"^\d+: (k\w+)", text, re.M)
    print(json.dumps({"how": how, "top_level_thunks": top,
                      "conditionals": len(re.findall(r"kConditional", text))}))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
