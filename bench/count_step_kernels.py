"""The kernels of one PASK decode step, compiled for sm_90 on any host (no GPU needed).

XLA launches one thunk per op of the optimized entry computation (fusions, cuBLAS/Triton GEMM
fusions, Pallas custom calls, copies; a ``while`` is counted once, its body's thunks are not);
at small models each costs launch time comparable to its work (issue 24), so their number per
step is a figure of merit beside device time.  This
compiles the whole jitted step (``PaskRunner.decode_step``, the unrolled layer layout) for sm_90
(``pallas_kernels.gpu.aot.compile_hlo``) and counts the entry computation's thunks by kind.

  python bench/count_step_kernels.py --shape qwen2.5-0.5b --knobs '{"merge": "sets"}'

Prints one JSON line: thunks per step and per layer, by op and by fusion name; and
``host_launches``: the top-level thunks of XLA's thunk sequence after its thunk passes (from an
XLA dump of the step), which is what the host launches one by one per step — a
``kCommandBuffer`` is one CUDA-graph launch of the kernels it captured, a ``kWhile`` steps its
body from the host, a ``kCustomCall`` is launched on its own and splits the graphs around it.
The deviceless compile leaves the Mosaic GPU kernels (``mosaic_gpu_v2``) outside the graphs;
on an H100 with jax 0.11.2 XLA captures them too, and the whole step is one graph
(bench/RESULTS.md, "Session of 2026-12-07 (second)"): read Mosaic custom calls here as an upper
bound, and dump the thunk sequence on the device for the real one.
"""
from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench.bench_decode import SHAPES  # noqa: E402
from models import ModelConfig, decoder, random_model  # noqa: E402
from pallas_kernels.gpu import aot as gpu_aot  # noqa: E402
from pask_jax import cache as pc  # noqa: E402
from pask_jax import ledger  # noqa: E402
from pask_jax import policy as P  # noqa: E402
from pask_jax.decode import PaskRunner  # noqa: E402
from pask_jax.tracker import FREE_TAG  # noqa: E402

_SKIP = ("parameter", "get-tuple-element", "bitcast", "tuple", "constant")


def count(hlo: str) -> dict:
  """Thunks of an optimized HLO module's entry computation, by op and by fusion/target name.
  A ``while`` counts as one: the thunks of its body (per iteration) are not counted."""
  entry = hlo[hlo.index("\nENTRY "):]
  entry = re.sub(r"/\*index=\d+\*/", "", entry)   # XLA's markers inside long tuple types
  ops, names = collections.Counter(), collections.Counter()
  # results may be tuples ("(f32[..], f32[..]) custom-call(...)"): match them whole
  for m in re.finditer(r"= (?:\([^=]*?\)|\S+) ([\w-]+)\((.*)", entry):
    op = m.group(1)
    if op in _SKIP:
      continue
    ops[op] += 1
    if op == "fusion":
      c = re.search(r"calls=%([\w.-]+)", m.group(2))
      n = re.sub(r"[._]\d+$", "", c.group(1)) if c else "?"
      names["gemm_fusion" if n.startswith("gemm_fusion") else n] += 1
    elif op == "custom-call":
      t = re.search(r'custom_call_target="([^"]+)"', m.group(2))
      names[t.group(1) if t else "?"] += 1
  return {"thunks": sum(ops.values()), "by_op": dict(ops.most_common()),
          "by_name": dict(names.most_common())}


_TOP = re.compile(r"^\d+: (k\w+)", re.M)   # nested thunks are indented


def host_launches(thunks: str) -> dict:
  """Top-level thunks of XLA's thunk-sequence dump (``*thunk_sequence_after_thunk_passes.txt``),
  by kind: what the host launches per step (nested thunks, indented, run inside their parent)."""
  return dict(collections.Counter(_TOP.findall(thunks)).most_common())


def _dumped_launches(dump: str) -> dict | None:
  got = glob.glob(os.path.join(dump, "*decode_fn*thunk_sequence_after_thunk_passes.txt"))
  if not got:
    return None
  with open(max(got, key=os.path.getmtime)) as f:   # this run's, in a kept dump folder
    return host_launches(f.read())


def compile_step(cfg: ModelConfig, batch: int, context: int, knobs: dict,
                 lo_format: str = "int4") -> str:
  """Optimized HLO of one PASK decode step (``PaskRunner.decode_step``, unrolled layers, the
  demo policy, random weights) compiled for sm_90 on this host."""
  pol = P.demo(cfg)
  B, C = batch, context + 17
  model = random_model(cfg, dtype=jnp.bfloat16)
  decoder.prepare(model, "unrolled")
  r = PaskRunner(model, pol, batch=B, capacity=C, backend="gpu", kernel_knobs=knobs)
  cache = jax.eval_shape(lambda: pc.init_for(cfg, B, pol, capacity=C, page=r.page, lo_page=128,
                                             lo_format=lo_format, hi_capacity=C // 4,
                                             lo_capacity=C // 2))
  z = jnp.zeros((B,), jnp.int32)
  return gpu_aot.compile_hlo(r.decode_step, r.params, pol, cache, jnp.zeros((B,), jnp.float32),
                             ledger.init(B, pol.n_groups), z,
                             jnp.broadcast_to(jnp.asarray(FREE_TAG), (B, 4)), z - 1,
                             jnp.ones((B,), bool))


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(SHAPES))
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--context", type=int, default=8192)
  ap.add_argument("--lo-format", default="int4", choices=["bytes", "int4"])
  ap.add_argument("--knobs", default='{"int4_kernel": "mosaic"}',
                  help="JSON kernel knobs (pallas_kernels.decode_attention)")
  a = ap.parse_args(argv)
  # XLA reads its flags at the first compile: the step's thunk sequence is dumped for
  # host_launches (set here, not at import, so importing count() changes no flag); a dump
  # folder already named in XLA_FLAGS is used and kept
  given = re.search(r"--xla_dump_to=(\S+)", os.environ.get("XLA_FLAGS", ""))
  dump = given.group(1) if given else tempfile.mkdtemp(prefix="step_thunks_")
  if not given:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_dump_to={dump} --xla_dump_hlo_module_re=decode_fn").strip()
  cfg = ModelConfig(**SHAPES[a.shape])
  hlo = compile_step(cfg, a.batch, a.context, json.loads(a.knobs), a.lo_format)
  got = count(hlo)
  got["host_launches"] = _dumped_launches(dump)
  if not given:
    shutil.rmtree(dump, ignore_errors=True)
  print(json.dumps({"shape": a.shape, "batch": a.batch, "context": a.context, "knobs": a.knobs,
                    "layers": cfg.n_layers, "per_layer": round(got["thunks"] / cfg.n_layers, 2),
                    **got}))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
