"""Ahead-of-time compile of the TPU kernel for real TPU generations on a CPU host (libtpu).

``jax.experimental.topologies.get_topology_desc(name, "tpu")`` gives compile-only devices; tracing
with ShapeDtypeStructs placed on one of them runs Mosaic's real passes (docs/DESIGN.md,
"Compiling and checking kernels").
"""
from __future__ import annotations

import functools

import jax
from jax.sharding import SingleDeviceSharding

# Topology names accepted by libtpu and the chips' HBM bandwidth (bytes/s, vendor figures) used
# for the roofline *estimates* of compare-kernels.
TOPOLOGIES = {"v5e": "v5e:2x2", "v6e": "v6e:2x2", "tpu7x": "tpu7x:2x2x1"}
HBM_BW = {"v5e": 819e9, "v6e": 1640e9, "tpu7x": 7380e9}


@functools.cache
def device(gen: str):
  from jax.experimental import topologies
  return topologies.get_topology_desc(TOPOLOGIES.get(gen, gen), "tpu").devices[0]


def compile_for(gen: str, fn, *args, **kwargs):
  """Compiled executable of ``fn(*args, **kwargs)`` for TPU generation ``gen``."""
  dev = device(gen)
  sds = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=SingleDeviceSharding(dev)), args)
  return jax.jit(functools.partial(fn, **kwargs)).trace(*sds).lower().compile()


def memory_report(compiled) -> dict:
  ma = compiled.memory_analysis()
  return {"argument_bytes": int(ma.argument_size_in_bytes),
          "output_bytes": int(ma.output_size_in_bytes),
          "temp_bytes": int(ma.temp_size_in_bytes),
          "code_bytes": int(ma.generated_code_size_in_bytes)}
