"""The Spherical KV tier kernel's main loop in SASS, per knob set, on any host (no GPU): the
kernel is lowered and compiled for sm_90a as in ``pallas_kernels.gpu.aot``, ptxas assembles the
PTX, nvdisasm (shipped with the triton wheel) disassembles it, and the largest backward branch's
body -- the loop over key blocks -- is counted by opcode.

  python bench/sph_sass.py --shape 15b --format A4/int4 \\
      --knobs '[{}, {"fma": true}, {"trig": "code", "codes": "row", "fma": true, "num_warps": 4}]'

One line per knob set: ptxas's registers / shared memory / spills, the loop's SASS instructions
per warp and per key (x warps / block), and its most frequent opcodes.  Issued instructions are
not time (the kernel is latency-bound at one 8-warp block per SM): the device sweep
(``check_sph_gpu.py --sweep``) decides, this says which knob sets are worth its time.
"""
from __future__ import annotations

import argparse
import collections
import functools
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax.numpy as jnp

from pallas_kernels.gpu import aot as gpu_aot
from pallas_kernels.gpu import sph_partials_gpu
from pallas_kernels.sph_types import TierSpec
from pallas_kernels.testing import sph_synth

SHAPES = {"15b": (12, 2, 128), "05b": (14, 2, 64)}   # q heads, KV heads, head dim
# the kernel's own defaults of the knobs a knob set leaves out
DEFAULTS = {k: p.default for k, p in inspect.signature(sph_partials_gpu).parameters.items()
            if p.default is not inspect.Parameter.empty}
_INSN = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*)")


def nvdisasm() -> str:
  import triton
  path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
  if not os.path.exists(path):
    raise RuntimeError(f"nvdisasm not found at {path} (it ships with the triton wheel)")
  return path


def loop_opcodes(ptx: str) -> tuple[int, collections.Counter]:
  """(all SASS instructions, opcode counts of the largest loop body) of a PTX module."""
  with tempfile.TemporaryDirectory() as tmp:
    src, obj = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
    with open(src, "w") as f:
      f.write(ptx)
    subprocess.run([gpu_aot.find_ptxas(), "-arch=sm_90a", "-o", obj, src], check=True)
    out = subprocess.run([nvdisasm(), "-c", obj], capture_output=True, text=True,
                         check=True).stdout
  lines = out.splitlines()
  insns, labels = [], {}
  for i, line in enumerate(lines):
    if m := re.match(r"^(\.L_x_\d+):", line):
      nxt = next((_INSN.match(x) for x in lines[i + 1:] if _INSN.match(x)), None)
      if nxt:
        labels[m.group(1)] = int(nxt.group(1), 16)
    elif m := _INSN.match(line):
      text = re.sub(r"^@!?U?P\w+\s+", "", m.group(2))
      insns.append((int(m.group(1), 16), text.split(" ")[0].rstrip(";"), text))
  span = (0, -1)
  for at, op, text in insns:
    m = re.search(r"BRA `\((\.L_x_\d+)\)", text)
    if m and labels.get(m.group(1), at + 1) <= at and at - labels[m.group(1)] > span[1] - span[0]:
      span = (labels[m.group(1)], at)
  body = collections.Counter(op.split(".")[0] for at, op, _ in insns if span[0] <= at <= span[1])
  return len(insns), body


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--shape", choices=sorted(SHAPES), default="15b")
  ap.add_argument("--format", default="A4/int4", help="layout/values, e.g. A42/bf16")
  ap.add_argument("--knobs", default="[{}]", help="JSON list of sph_partials_gpu knob sets")
  ap.add_argument("--top", type=int, default=12)
  a = ap.parse_args(argv)
  hq, hkv, d = SHAPES[a.shape]
  lay, val = a.format.split("/")
  sph = sph_synth.zeros([TierSpec(lay, val, d)], b=2, hkv=hkv, page=16, n=64, layers=2)
  q = jnp.zeros((2, hq, d), jnp.bfloat16)
  for kn in json.loads(a.knobs):
    rep, = gpu_aot.report(functools.partial(sph_partials_gpu, **kn), q, sph, jnp.int32(1))
    total, body = loop_opcodes(rep.ptx)
    per_warp = sum(body.values())
    per_key = per_warp * kn.get("num_warps", DEFAULTS["num_warps"]) / kn.get(
        "block", DEFAULTS["block"])
    print(f"{a.shape} {a.format} {kn}: {rep.summary()}; SASS {total}, loop {per_warp} per warp "
          f"= {per_key:.0f} warp-instructions per key; "
          + " ".join(f"{k} {v}" for k, v in body.most_common(a.top)), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
