"""Deviceless sm_90 compile of one decode_attention_gpu call (the int4 pool, Mosaic GPU INT4 +
Triton BF16) with stream_lo 0 and 1: the entry computation's schedule, bitcasts, tuples and
constants left out.  Run from the repository root:

  JAX_PLATFORMS=cpu PYTHONPATH=.:tests python bench/results/2026-12-08_session36/stream_schedule.py
"""
import re

import jax
import jax.numpy as jnp
from test_mgpu_decode import CASES

from pallas_kernels.gpu import aot as gpu_aot
from pallas_kernels.gpu import decode_attention_gpu
from pallas_kernels.testing import synth

args = synth.stack_layers(CASES[2].make(poison=False, lo_format="int4")) + (jnp.int32(1),)
for st in (0, 1):
  fn = jax.jit(lambda *a, st=st: decode_attention_gpu(*a, int4_kernel="mosaic", stream_lo=st))
  txt = gpu_aot.compile_hlo(fn, *args)
  print(f"--- stream_lo={st}")
  for line in txt[txt.index("\nENTRY "):].splitlines():
    m = re.match(r"\s*(?:ROOT )?%([\w.-]+) = .*? ([\w-]+)\(", line)
    if m and m.group(2) not in ("bitcast", "get-tuple-element", "parameter", "constant", "tuple"):
      attrs = re.findall(r"_xla_stream_annotation=\"\d\"|_scheduling_group_id=\"\d+\"", line)
      print(m.group(1), m.group(2), *attrs)
