"""Kernels of SphRunner's step and of its control plane alone, compiled for sm_90 (deviceless),
and the step's conditional thunks.  From a checkout:
  PYTHONPATH=$PWD python bench/results/2026-12-07_session35/g6_kernels/count.py METHOD [CONTEXT]"""
import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx
from jax.sharding import SingleDeviceSharding
try:
  from jax._src.pallas.triton import gpu_info as _gi
  _gi.get_device_kind = lambda: "NVIDIA H100 80GB HBM3"
except ImportError:
  pass
from bench.bench_decode import SHAPES
from bench.count_step_kernels import count
from models import ModelConfig, random_model, decoder as _dec
from pallas_kernels.gpu import aot
from pask_jax.decode import capacity_for
from pask_jax.spherical.runner import SphRunner
from pask_jax import tags as T
method = sys.argv[1] if len(sys.argv) > 1 else "spherical"
cfg = ModelConfig(**SHAPES["qwen2.5-0.5b"])
model = nnx.eval_shape(lambda: _dec.set_layout(random_model(cfg, dtype=jnp.bfloat16), "unrolled"))
B, cap = 8, capacity_for(int(sys.argv[2]) if len(sys.argv) > 2 else 4096, 18)
r = SphRunner.for_method(model, method, batch=B, capacity=cap, backend="gpu")
r.configure(0.35)
cache, sph = jax.eval_shape(r._new_states)
G = r.n_groups
S = jax.ShapeDtypeStruct
state = (cache, sph, S((B,), jnp.float32), S((B,), jnp.int32), S((B, G), jnp.float32))
params = jax.tree.map(lambda x: S(x.shape, x.dtype), r.params)
V = cfg.vocab_size
tags, sids, act = S((B, T.N_CAND), jnp.int32), S((B,), jnp.int32), S((B,), jnp.bool_)
tpol = jax.eval_shape(lambda: r.tag_policy) if r.tag_policy is not None else None
step_args = (params, tpol, state, S((B,), jnp.int32), tags, sids, act,
             S((B, -(-V // 32)), jnp.int32), jax.eval_shape(lambda: jax.random.key(0)),
             S((B,), jnp.float32), S((B,), jnp.float32))
sh = SingleDeviceSharding(aot.compile_only_device())
put = lambda t: jax.tree.map(lambda x: S(x.shape, x.dtype, sharding=sh), t)
def outputs(tp, st, tg, si, ac):
  route, _, s = r._control(tp, st, tg, si, ac)
  return route, s.balance, s.route
out = {}
for name, fn, args in (("step", jax.jit(r._step, donate_argnums=(2,)), step_args),
                       ("control", jax.jit(outputs), (tpol, state, tags, sids, act))):
  t0 = time.time()
  hlo = fn.trace(*put(args)).lower().compile().as_text()
  c = count(hlo)
  out[name] = {"thunks": c["thunks"], "by_op": c["by_op"], "compile_s": round(time.time() - t0, 1)}
print(json.dumps({"method": method, "capacity": cap, **out}))
hlo = jax.jit(r._step, donate_argnums=(2,)).trace(*put(step_args)).lower().compile().as_text()
entry = hlo[hlo.index("\nENTRY "):]
for line in entry.splitlines():
  if " conditional(" in line:
    print(line[:600])
open("/tmp/g6/step.hlo", "w").write(hlo)
