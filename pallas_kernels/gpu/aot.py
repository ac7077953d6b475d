"""Compile the GPU kernel to PTX for sm_90a on any host, and read ptxas's resource report.

Recipe (docs/DESIGN.md, "Compiling and checking kernels"): lower for "cuda" on a CPU host
(needs the jax CUDA plugin installed; run with JAX_PLATFORMS=cpu), pull the Triton IR out of
the ``__gpu$xla.gpu.triton`` custom call, compile it with jaxlib's Triton bindings (PTX + shared
memory bytes), then ``ptxas -arch=sm_90a -v`` for registers, spills and stack.
"""
from __future__ import annotations

import dataclasses
import functools
import glob
import os
import re
import shutil
import subprocess
import tempfile

import jax

# H100/H200 (sm_90) per-block limits.
SM90_MAX_SMEM = 227 * 1024
SM90_MAX_REGS = 255


@dataclasses.dataclass
class GpuReport:
  name: str
  smem_bytes: int
  registers: int | None = None
  spill_stores: int | None = None
  spill_loads: int | None = None
  stack_bytes: int | None = None
  ptx: str = dataclasses.field(default="", repr=False)

  def ok(self) -> bool:
    return (self.smem_bytes <= SM90_MAX_SMEM and self.registers is not None
            and self.registers <= SM90_MAX_REGS and self.spill_stores == 0
            and self.spill_loads == 0)

  def summary(self) -> str:
    return (f"regs={self.registers} smem={self.smem_bytes}B spills={self.spill_stores}/"
            f"{self.spill_loads} stack={self.stack_bytes}B")


# XLA's GPU target description of an H100 SXM (xla/tools/hlo_opt/gpu_specs/h100_sxm.txtpb): with
# it XLA compiles for sm_90 on a host without a GPU.  The H200 differs in memory size and bandwidth.
H100_TARGET = """gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132 fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: 3352320000000 l2_cache_size: 52428800 clock_rate_ghz: 1.98
  device_memory_size: 84978434048 shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 } registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
platform_name: "CUDA"
device_description_str: "NVIDIA H100 80GB HBM3"
"""


@functools.cache
def compile_only_device():
  """A compile-only sm_90 device (deviceless XLA GPU compile: whole programs, HLO inspectable)."""
  from jax.experimental import topologies
  return topologies.get_topology_desc("cuda", "cuda", target_config=H100_TARGET,
                                      topology="1x1x1").devices[0]


def compile_hlo(fn, *args) -> str:
  """Optimized HLO text of ``fn(*args)`` (arrays or ShapeDtypeStructs) compiled for sm_90."""
  from jax.sharding import SingleDeviceSharding
  sh = SingleDeviceSharding(compile_only_device())
  sds = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), args)
  return fn.trace(*sds).lower().compile().as_text()


def triton_modules(fn, *args, **kwargs) -> list[tuple[str, bytes, dict]]:
  """(name, Triton IR bytecode, launch params) of every Pallas-Triton call in ``fn(*args)``."""
  from jax._src.interpreters import mlir  # noqa: F401  (registers the dialects)
  sds = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)
  low = jax.jit(functools.partial(fn, **kwargs)).trace(*sds).lower(lowering_platforms=("cuda",))
  found = []

  def walk(op):
    for region in op.regions:
      for block in region.blocks:
        for o in block.operations:
          if o.operation.name == "stablehlo.custom_call":
            tgt = str(o.attributes["call_target_name"]).strip('"')
            if "triton" in tgt:
              cfg = o.attributes["mhlo.backend_config"]
              params = {k: int(str(cfg[k]).split(":")[0]) for k in
                        ("num_warps", "num_stages", "num_ctas") if k in cfg}
              found.append((str(cfg["name"]).strip('"'), cfg["ir"].value_bytes, params))
          walk(o)

  walk(low.compiler_ir("stablehlo").operation)
  return found


def find_ptxas() -> str:
  """A ptxas new enough for PTX 9.0 (CUDA 13): $PTXAS, PATH, /usr/local/cuda*, pip
  nvidia-cuda-nvcc."""
  cands = [os.environ.get("PTXAS"), shutil.which("ptxas")]
  cands += sorted(glob.glob("/usr/local/cuda*/bin/ptxas"), reverse=True)
  import site
  for sp in site.getsitepackages():
    cands += glob.glob(os.path.join(sp, "nvidia", "cu*", "bin", "ptxas"))
    cands += glob.glob(os.path.join(sp, "nvidia", "cuda_nvcc", "bin", "ptxas"))
  for c in cands:
    if not c or not os.path.exists(c):
      continue
    out = subprocess.run([c, "--version"], capture_output=True, text=True).stdout
    m = re.search(r"release (\d+)\.(\d+)", out)
    if m and int(m.group(1)) >= 13:
      return c
  raise FileNotFoundError("no ptxas from CUDA >= 13 found (install nvidia-cuda-nvcc or set PTXAS)")


def compile_report(name: str, ir: bytes, *, num_warps: int, num_stages: int,
                   arch: str = "9.0", ptxas: str | None = None) -> GpuReport:
  from jax._src.lib import triton as jtriton
  res = jtriton.compile("CUDA", ir, arch, num_warps=num_warps, num_ctas=1, num_stages=num_stages)
  rep = GpuReport(name=name, smem_bytes=int(res.smem_bytes), ptx=res.asm)
  ptxas = ptxas or find_ptxas()
  with tempfile.TemporaryDirectory() as tmp:
    src = os.path.join(tmp, "k.ptx")
    with open(src, "w") as f:
      f.write(res.asm)
    p = subprocess.run([ptxas, "-arch=sm_90a", "-v", src, "-o", os.path.join(tmp, "k.o")],
                       capture_output=True, text=True)
  if p.returncode:
    raise RuntimeError(f"ptxas failed: {p.stderr[-2000:]}")
  log = p.stderr + p.stdout
  if m := re.search(r"Used (\d+) registers", log):
    rep.registers = int(m.group(1))
  if m := re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads",
                    log):
    rep.stack_bytes, rep.spill_stores, rep.spill_loads = map(int, m.groups())
  return rep


def report(fn, *args, **kwargs) -> list[GpuReport]:
  """Compile every Triton kernel in ``fn(*args, **kwargs)`` with the launch parameters (warps,
  stages) that the lowering recorded for it."""
  mods = triton_modules(fn, *args, **kwargs)
  if not mods:
    raise RuntimeError("no Triton custom call found in the lowering")
  return [compile_report(n, ir, num_warps=prm["num_warps"], num_stages=prm["num_stages"])
          for n, ir, prm in mods]
