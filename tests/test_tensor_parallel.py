"""Tensor-parallel decode on a 1-D ``model`` mesh (pask_jax.mesh; issue 28), on CPU devices in a
subprocess (the device-count flag must be set before JAX starts; a host of 8 devices for the
runners, of 4 for the engine): greedy tokens (and ledgers) of TP = 2 and 4 equal TP = 1 with and
without a grammar, for the dense runner (and TP = 8) and the PASK runner (reference attention,
and the GPU and TPU Pallas kernels per shard through shard_map, in interpret mode, against the
reference's TP = 1), in both layer layouts (TP = 1 stacked is every run's reference; the mesh
runs alternate stacked and unrolled, whose fused q|k|v and gate|up columns are ordered for the
mesh); the compiled step's collectives are the planned ones (no KV gathered); each device holds
1/N of the attention and MLP weights and of the KV cache / pools; the baselines' runners (masked
H2O / SnapKV / MiKV, TriAxialKV, Spherical KV with its gated decode rule) at TP = 2 equal
TP = 1."""
import os
import subprocess
import sys

import pytest

from models import ModelConfig
from pask_jax import mesh as tp
from pask_jax.testing import xla_flags

# What both 4-device scripts begin with: tests/conftest.py's compile cache (the runs compile the
# same prefill and commit programs more than once), SmolLM2's tokenizer and one JSON grammar.
PRELUDE = r"""
import os, time
import jax
if os.environ.get("PASK_TEST_CACHE_DIR", "off") != "off":
  jax.config.update("jax_compilation_cache_dir", os.environ["PASK_TEST_CACHE_DIR"])
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
from pask_jax.testing import grammar_compiler, smollm2_tokenizer
assert len(jax.devices()) == int(os.environ["PASK_TEST_DEVICES"])
t0 = time.process_time()
tok = smollm2_tokenizer()
V = tok.vocab_size
grammar = grammar_compiler(tok, V).json_schema(
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "yz"]}},
     "required": ["a", "b"], "additionalProperties": False})
"""

TP = PRELUDE + r"""
import collections, dataclasses, json, math, re
import jax.numpy as jnp, numpy as np
from models import ModelConfig, decoder, random_model
from pask_jax import ledger, mesh as tp, policy as P
from pask_jax.decode import PaskRunner, Runner, Sampling, generate
prompts = [tok.encode("Answer in JSON: the quick brown fox jumps over the lazy dog"),
           tok.encode("one two three four five six")]
COLL = r"(all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all)(?:-start)?\("

def collectives(hlo):
  # {computation: Counter(op)}, and the name of the while loop's body (the scan over layers)
  comps, name = {}, None
  for line in hlo.splitlines():
    m = re.match(r"(?:ENTRY )?%(\S+) .*\{$", line)
    if m:
      name = m.group(1)
    for op in re.findall(r"= [^=]*? " + COLL, line):
      comps.setdefault(name, collections.Counter())[op] += 1
  bodies = set(re.findall(r"body=%([\w.\-]+)", hlo))
  return comps, bodies

def model(cfg, layout):
  return decoder.set_layout(random_model(cfg, seed=5), layout)   # an explicit choice: kept

def check_step(name, r, n, args, kv, layout, decisions=0):
  # the step's collectives, as planned, and 1/N of the sharded bytes on each device;
  # ``decisions``: all-gathers of per-head decision features allowed besides (Spherical KV's gated
  # rule), each smaller than one layer's keys of one token (no head-dim axis: no KV gathered)
  tc = time.process_time()
  comp = r.step.lower(*args).compile()
  tc = round(time.process_time() - tc, 2)   # ~0 where generate() compiled these arguments
  hlo = comp.as_text()
  comps, bodies = collectives(hlo)
  body = sum((comps.get(b, collections.Counter()) for b in bodies), collections.Counter())
  rest = sum((v for k, v in comps.items() if k not in bodies), collections.Counter())
  # per layer (the scan's body, or each unrolled layer): after the o-projection and after the
  # MLP's down projection (nothing where the unrolled layout splits its fused projections);
  # outside: the vocabulary-sharded embedding lookup (all-reduce) and the masked logits gathered
  # for sampling (all-gather of [B, V], nothing else gathered: no KV)
  per_layer = {"stacked": 0, "unrolled": 2 * r.cfg.n_layers}[layout]
  assert dict(body) == ({"all-reduce": 2} if layout == "stacked" else {}), (name, n, comps)
  assert dict(rest) == {"all-reduce": 1 + per_layer, "all-gather": 1 + decisions}, (
      name, n, comps, bodies)
  gathers = [l for l in hlo.splitlines() if re.search(r"= [^=]*? all-gather(?:-start)?\(", l)]
  small = [l for l in gathers if f"f32[{r.batch},{V}]" not in l]
  elems = [math.prod(int(d) for d in re.search(r"= \S*?\[([\d,]*)\]", l).group(1).split(","))
           for l in small]
  assert len(small) == decisions and all(
      e < r.batch * r.cfg.n_kv_heads * r.cfg.head_dim for e in elems), gathers
  fw, fc = tp.shard_fraction(tp.sharded_weights(r.params)), tp.shard_fraction(kv)
  assert abs(fw * n - 1) < 0.05 and abs(fc * n - 1) < 0.05, (fw, fc)
  # the compiled step's memory analysis: its arguments on one device are the first device's
  # shards of the placed inputs (an input off the mesh: whole, replicated)
  dev0 = r.tp_mesh.devices.flat[0]
  def on_dev0(x):
    if not isinstance(x, jax.Array):
      return np.asarray(x).nbytes
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      x = jax.random.key_data(x)
    return next((sh.data.nbytes for sh in x.addressable_shards if sh.device == dev0), x.nbytes)
  mine = sum(on_dev0(x) for x in jax.tree.leaves(args))
  arg_bytes = comp.memory_analysis().argument_size_in_bytes
  assert abs(arg_bytes / mine - 1) < 0.05, (name, arg_bytes, mine)
  report[f"{name} {layout} TP={n}"] = {
      "layer_loop": dict(body), "outside": dict(rest), "weights": fw, "kv": fc,
      "arg_bytes": arg_bytes, "compile_cpu_s": tc}

def placed(r, *xs):
  # replicated on the runner's mesh, as the step's own outputs are: the arguments of the calls
  # generate() made, so lowering them again finds the compiled step instead of compiling anew
  return jax.device_put(xs, tp.replicated(r.tp_mesh))

report = {}
B = 2
bits0 = jnp.zeros((B, -(-V // 32)), jnp.int32)
samp = (jax.random.key(0), jnp.zeros(B), jnp.ones(B))
# dense: qwen2 (q/k/v biases, an lm_head of its own), 8 KV heads (GQA groups of 2) so that it
# splits over all 8 devices too; PASK below: llama (the embedding table is the lm_head)
cfg = ModelConfig(arch="qwen2", vocab_size=V, hidden=64, intermediate=128, n_layers=2,
                  n_heads=16, n_kv_heads=8, head_dim=16, rope_theta=1e6)
ref = None
for n, layout in ((1, "stacked"), (2, "unrolled"), (4, "stacked"), (8, "unrolled")):
  r = Runner(model(cfg, layout), batch=B, capacity=64, mesh=tp.model_mesh(n))
  out = [(x.tokens, x.finish) for x in generate(r, tok, prompts, grammars=[grammar, None],
                                                sampling=Sampling(max_tokens=6))]
  ref = ref or out
  assert out == ref, (n, layout, out, ref)
  if n > 1:
    c = r.new_cache()
    check_step("dense", r, n, (r.params, c, jnp.zeros(B, jnp.int32), bits0) + samp, (c.k, c.v),
               layout)

# PASK (reference attention): pools and window by KV head, controller and ledger replicated
cfg = ModelConfig(arch="llama", vocab_size=V, hidden=64, intermediate=128, n_layers=2, n_heads=8,
                  n_kv_heads=4, head_dim=16, rope_theta=1e6, tie_embeddings=True)
pol = dataclasses.replace(P.demo(cfg), window=4)
# (unrolled on the mesh here and with the kernels below, all against TP = 1 stacked)
ref = None
for n, layout in ((1, "stacked"), (4, "unrolled")):
  r = PaskRunner(model(cfg, layout), pol, batch=B, capacity=64, mesh=tp.model_mesh(n),
                 backend="reference")
  out = [(x.tokens, x.finish, x.ledger) for x in generate(
      r, tok, prompts, grammars=[grammar, None], sampling=Sampling(max_tokens=6))]
  ref = ref or out
  assert out == ref, (n, layout, out, ref)
  if n > 1:
    c = r.new_cache()
    state = (c,) + placed(r, jnp.zeros(B, jnp.float32), ledger.init(B, pol.n_groups))
    args = (r.params, pol, state, jnp.zeros(B, jnp.int32), jnp.zeros((B, 4), jnp.int32),
            jnp.zeros(B, jnp.int32), jnp.ones(B, bool), bits0) + samp
    check_step("pask", r, n, args, c.layers, layout)
assert ref[0][2]["measured_B"] < 1   # the demo policy compressed something
report["cpu_s"] = {"reference": round(time.process_time() - t0, 1)}

# PASK with the Pallas kernels per shard (shard_map over the KV heads; interpret mode on the CPU)
# against the reference attention's TP = 1 above: the same tokens, finishes and ledgers (one KV
# head per device on the GPU kernel's mesh of 4, two per device on the TPU kernel's of 2)
for backend, n in (("gpu", 4), ("tpu", 2)):
  t1, layout = time.process_time(), "unrolled"
  r = PaskRunner(model(cfg, layout), pol, batch=B, capacity=64, mesh=tp.model_mesh(n),
                 backend=backend, kernel_knobs=dict(interpret=True))
  out = [(x.tokens, x.finish, x.ledger) for x in generate(
      r, tok, prompts, grammars=[grammar, None], sampling=Sampling(max_tokens=6))]
  assert out == ref, (backend, n, out, ref)
  if backend == "gpu":   # the kernel's inputs are the local shards: nothing gathered
    c = r.new_cache()
    state = (c,) + placed(r, jnp.zeros(B, jnp.float32), ledger.init(B, pol.n_groups))
    args = (r.params, pol, state, jnp.zeros(B, jnp.int32), jnp.zeros((B, 4), jnp.int32),
            jnp.zeros(B, jnp.int32), jnp.ones(B, bool), bits0) + samp
    check_step(f"pask {backend}", r, n, args, c.layers, layout)
  report["cpu_s"][backend] = round(time.process_time() - t1, 1)

# The baselines' runners: H2O / SnapKV / MiKV (one masked runner, knobs traced), TriAxialKV and
# Spherical KV (the gated rule: RDR's plan and the gate rank every head's items), their state by
# KV head (Spherical KV's tier pools by page, each device's block its KV heads' pages);
# StreamingLLM and INT4 are PaskRunner policies (above).  Longer prompts so that every method
# compresses something.
from pask_jax import tags as T
from pask_jax.baselines import triaxial as TX
from pask_jax.baselines.masked import Config, MaskedRunner
from pask_jax.spherical.runner import SphRunner
t1, ref = time.process_time(), {}
rng = np.random.default_rng(3)
long = [[int(x) for x in rng.integers(1, V, k)] for k in (40, 23)]
lab = [T.prompt(T.PromptLabel.PROTECTED_CONTENT), T.prompt(T.PromptLabel.FUNCTION_NAME)]
ptags = [np.stack([T.candidates(lab[i % 2]) for i in range(len(p))]) for p in long]
kn = TX.Knobs(prefix=2, low=2, high=8, window=4)
alloc = {"knobs": kn.asdict(), "budget": 0.5, "n_groups": 3,
         "units": {str(lab[0]): [2, 4, 8], str(lab[1]): [8, 3, 2],
                   str(T.fc(T.Cls.FREE_GENERATION)): [4, 2, 8]}}
methods = (Config("h2o", ratio=0.5, sink=2, recent=4), Config("mikv", ratio=0.4, sink=2, recent=4),
           Config("snapkv", target=0.5, obs=4, gen=8),
           Config("rocketkv", ratio=0.5, obs=4, kernel=31))
step_args = lambda r, st, *extra: (r.params, st, jnp.zeros(B, jnp.int32)) + extra + (
    jnp.ones(B, bool), bits0) + samp
for n in (1, 2):
  m = random_model(cfg, seed=5)
  mr = MaskedRunner(m, batch=B, capacity=64, mesh=tp.model_mesh(n))
  for c in methods:
    out = [(x.tokens, x.ledger) for x in generate(mr.configure(c), tok, long,
                                                   sampling=Sampling(max_tokens=8))]
    ref.setdefault(c.method, out)
    assert out == ref[c.method], (c.method, n, out, ref[c.method])
    assert out[0][1]["measured_B"] < 0.7, (c.method, out)
  assert mr.traces["step"] == 1
  # (the masked runner stacked on the mesh, TriAxialKV unrolled)
  tx = TX.TriaxialRunner(model(cfg, "stacked" if n == 1 else "unrolled"), batch=B, capacity=64,
                         mesh=tp.model_mesh(n)).configure(kn, alloc)
  out = [(x.tokens, x.ledger) for x in generate(tx, tok, long, prompt_tags=ptags,
                                                 sampling=Sampling(max_tokens=8))]
  ref.setdefault("triaxial", out)
  assert out == ref["triaxial"] and out[0][1]["measured_B"] < 0.7, (n, out, ref["triaxial"])
  if n > 1:   # the same collectives as the other runners (the MiKV demotion is per shard)
    st = mr.new_state(np.array([len(p) for p in long]))
    check_step("masked", mr, n, step_args(mr, st), (st.k, st.v), "stacked")
    # the prompt selection (SnapKV's pooling, shared by every masked method) is per KV head too
    hlo = mr.compress.lower(st).compile().as_text()
    assert not re.search(r"all-gather|all-to-all|collective-permute", hlo), "masked compress"
    st = tx.new_state(ptags, np.array([len(p) for p in long]))
    check_step("triaxial", tx, n, step_args(tx, st, jnp.zeros((B, 4), jnp.int32)),
               (st.cache.k, st.cache.v), "unrolled")
  # Spherical KV on the masked runner's model, its prefill shared (the statistics runner)
  sr = SphRunner(m, batch=B, capacity=64, window=4, sink=2, obs=8, decode="gated", stats=mr,
                 mesh=tp.model_mesh(n)).configure(0.3)
  out = [(x.tokens, x.ledger) for x in generate(sr, tok, long, sampling=Sampling(max_tokens=8))]
  ref.setdefault("sphkv", out)
  assert out == ref["sphkv"], (n, out, ref["sphkv"])
  items = out[0][1]["items"]
  assert items["drop"] and items["A2"] and items["A42"] and items["A4"] and items["bf16"], items
  assert sr.traces == {"commit": 1, "step": 1}, sr.traces
  if n > 1:   # three small gathers of the gated rule's per-head features, no KV
    cache, sph = jax.jit(sr._new_states, out_shardings=sr.state_sharding())()
    st = (cache, sph) + placed(sr, jnp.zeros(B, jnp.float32), jnp.zeros(B, jnp.int32),
                               jnp.zeros((B, sr.n_groups), jnp.float32))
    check_step("sphkv", sr, n, (sr.params, None, st, jnp.zeros(B, jnp.int32), None, None,
                                jnp.ones(B, bool), bits0) + samp,
               (cache.layers, sph.pools), "stacked", decisions=3)
    for kw, msg in ((dict(read="reconstruct"), "read 'reconstruct' (ablation A1) does not run on "
                     "a mesh of 2 devices"), (dict(stats=mr1), "the statistics runner runs on "
                                              "another mesh than this runner")):
      try:
        SphRunner(m, batch=B, capacity=64, mesh=tp.model_mesh(n), **kw)
        raise AssertionError(f"SphRunner({kw}) on a mesh was not refused")
      except ValueError as e:
        assert msg in str(e) and "\n" not in str(e), e
  mr1 = mr
report["cpu_s"]["baselines"] = round(time.process_time() - t1, 1)
print("TP-OK", json.dumps(report), round(time.process_time() - t0, 1))
"""


ENGINE = PRELUDE + r"""
import dataclasses
import jax.numpy as jnp
from models import ModelConfig, decoder, random_model
from pask_jax import mesh as tp, policy as P
from pask_jax.grammar.prompt_spans import label_prompt
from pask_jax.tracker import Tracker
from serve.engine import Engine, Request
# tests/test_engine.py's model with 4 KV heads (GQA groups of 2: whole groups on 4 devices) and
# its demo policy, 3 layer groups
cfg = ModelConfig(arch="llama", vocab_size=V, hidden=64, intermediate=128, n_layers=3, n_heads=8,
                  n_kv_heads=4, head_dim=16, tie_embeddings=True)
pol = P.build(P.demo_entries(3), cfg, b_d=0.5, b_p=0.5, window=8, sink=2)
PAGE, CTX = 4, 128

def requests():
  out = []
  for i in range(4):
    ids, tags = label_prompt(tok, tok.apply_chat_template(
        [{"role": "user", "content": "Weather in Paris? " * (1 + i % 3)}]))
    out.append(Request(ids=ids, tags=tags, max_tokens=16 + 4 * i,
                       tracker=Tracker(grammar if i % 2 else None)))
  return out

def run(e):
  reqs, done = requests(), {}
  for r in reqs:
    r.emit = lambda kind, payload, r=r: done.__setitem__(r.rid, payload) if kind == "done" else None
    e.submit(r)
  e.run_until_idle(max_iterations=5000)
  return [done[r.rid] for r in reqs]

# pools that hold the largest request alone but not all four at once: preemption (replay)
worst = max(-(-(len(r.ids) + r.max_tokens - pol.window) // PAGE) for r in requests())
# --gpu-memory-utilization on a mesh: the budget of the device with the least free memory (CPU
# devices report none: stubbed, the last the poorest; the pool sizes above override the budget's)
from serve.engine import sizing
GB = 1 << 30
sizing.memory_stats = lambda d: {"bytes_limit": 8 * GB, "bytes_in_use": (1 + 2 * d.id) * GB}
# TP = 1 and 2 in the layer layout a CPU takes (stacked), TP = 4 unrolled (chosen explicitly:
# kept, its fused columns ordered for 4 devices); TP = 2 with the INT4 pool in the int4 format
# (head-major pages, split on their second axis: what "auto" picks on Hopper), bit-exact to bytes
ref, cpu_s = None, {}
for n in (1, 2, 4):
  t1 = time.process_time()
  util = dict(gpu_memory_utilization=0.5) if n > 1 else {}
  m = random_model(cfg, seed=0)
  if n == 4:
    decoder.set_layout(m, "unrolled")
  e = Engine(m, tok, pol, slots=4, context=CTX, page=PAGE,
             hi_pages=worst + 1, lo_pages=worst + 1, mesh=tp.serving_mesh(n, cfg),
             lo_format="int4" if n == 2 else "bytes", **util)
  assert (m.layout, m.fused_tp) == (("unrolled", 4) if n == 4 else ("stacked", 1))
  out = [(x["tokens"], x["finish"], x["ledger"]) for x in run(e)]
  cpu_s[n] = round(time.process_time() - t1, 1)
  assert e.m["preemptions"] > 0 and e.m["resumed"] == e.m["preemptions"], (n, e.m)
  assert e.traces["fwd"] == 1 and e.traces["insert"] == 1, e.traces   # one compile each
  assert e.step.state[0].layers.lo_k.dtype == (jnp.int4 if n == 2 else jnp.uint8)
  ref = ref or out
  assert out == ref, (n, out, ref)
  if n > 1:
    assert e.sizing.shards == n and f"per device ({n} devices" in e.sizing.describe()
    want = sizing.kv_bytes_for_utilization(0.5, cfg, CTX, [jax.devices()[n - 1]], shards=n)
    assert e.sizing.kv_bytes == want < (9 - 2 * n) * GB // 2, (e.sizing.kv_bytes, want)
    assert abs(tp.shard_fraction(e.step.state[0].layers) * n - 1) < 0.05
    # one placed copy of the weights: the PASK runner's are the prefill runner's buffers
    ptr = lambda ps: [x.addressable_shards[0].data.unsafe_buffer_pointer()
                      for x in jax.tree.leaves(ps)]
    assert ptr(e.step.runner.params) == ptr(e.dense.params)
assert ref[0][2]["measured_B"] < 1
gqa4 = dataclasses.replace(cfg, n_heads=8, n_kv_heads=2)
for n, c, want in ((8, cfg, "tensor_parallel_size 8 is more than the 4 local cpu devices"),
                   (4, gqa4, "2 KV heads (GQA groups of 4 query heads, 8 query heads in all)")):
  try:
    tp.serving_mesh(n, c)
    raise AssertionError(f"tensor_parallel_size {n} was not refused")
  except ValueError as e:
    assert want in str(e) and "\n" not in str(e), e
print("ENGINE-OK", round(time.process_time() - t0, 1), "per TP size:", cpu_s)
"""


def _on_cpu_devices(script: str, ok: str, devices: int) -> str:
  """Run ``script`` in a Python with ``devices`` CPU devices (the device-count flag must be set
  before JAX starts) and this process's compile settings -> its stdout."""
  import jax
  fast = jax.config.values["jax_disable_most_optimizations"]
  env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_DISABLE_MOST_OPTIMIZATIONS=str(int(fast)),
             XLA_FLAGS=xla_flags(f"--xla_force_host_platform_device_count={devices}"),
             PASK_TEST_DEVICES=str(devices))
  r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                     cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  assert ok in r.stdout, r.stdout[-3000:]
  print(r.stdout)
  return r.stdout


@pytest.mark.fast_compile   # tiny random models (tests/conftest.py); the subprocess inherits it
def test_tensor_parallel_decode_on_eight_cpu_devices():
  """Every runner at TP = 2 and 4 (the dense one at 8 too) on a host of 8 CPU devices, each mesh
  its first N (the engine's test below runs on a host of 4)."""
  _on_cpu_devices(TP, "TP-OK", 8)


@pytest.mark.fast_compile
def test_engine_on_two_and_four_cpu_devices_with_preemption():
  """serve.engine.Engine(mesh=serving_mesh(N)), N = 2 (stacked layout, the INT4 pool in the int4
  format) and 4 (unrolled): the same tokens, ledgers and preemptions as on one device, one
  compile per jitted function, the pools split by KV head and sized per device
  (``gpu_memory_utilization``: from the mesh device with the least free memory); a
  tensor-parallel size over the device count or the KV heads refused in one line."""
  _on_cpu_devices(ENGINE, "ENGINE-OK", 4)


def test_tensor_parallel_size_refused_before_loading_a_model():
  """``pask-jax serve --tensor-parallel-size N`` and ``start_engine(tensor_parallel_size=N)``
  with N over the local devices: one line, before any weights load."""
  import types

  import jax

  from pask_jax import api, cli
  n = len(jax.local_devices()) + 1
  with pytest.raises(SystemExit) as e:
    cli.main(["serve", "--tensor-parallel-size", str(n)])
  msg = str(e.value.code)
  assert msg.startswith(f"error: tensor_parallel_size {n} is more than the") and "\n" not in msg
  cfg = ModelConfig(arch="llama", vocab_size=96, hidden=64, intermediate=128, n_layers=1,
                    n_heads=8, n_kv_heads=4, head_dim=16)
  with pytest.raises(ValueError, match=f"tensor_parallel_size {n} is more than the"):
    api.start_engine(types.SimpleNamespace(cfg=cfg), tensor_parallel_size=n)
  with pytest.raises(ValueError, match="tensor_parallel_size must be a positive int"):
    tp.serving_mesh(0)
  assert tp.serving_mesh(1, cfg) is None


def test_serve_passes_the_tensor_parallel_size(monkeypatch):
  from serve_helpers import serve_kwargs
  assert serve_kwargs(monkeypatch, [])["tensor_parallel_size"] == 1
  assert serve_kwargs(monkeypatch, ["-tp", "2"])["tensor_parallel_size"] == 2


def test_pools_sized_per_device():
  """A page costs 1/N of its bytes on each of N devices: a per-device budget holds about N times
  the pages (the page tables, replicated, are not split)."""
  from pask_jax import policy as P
  from serve.engine import page_bytes, size_pools
  cfg = ModelConfig(arch="llama", vocab_size=96, hidden=64, intermediate=128, n_layers=3,
                    n_heads=8, n_kv_heads=4, head_dim=16)
  pol = P.demo(cfg)
  assert page_bytes(cfg, 16, 4) == tuple(b // 4 for b in page_bytes(cfg, 16))
  one, four = (size_pools(cfg, pol, slots=4, context=256, kv_bytes=4 << 20, shards=n)
               for n in (1, 4))
  assert four.shards == 4 and four.total_bytes <= 4 << 20 and one.total_bytes <= 4 << 20
  assert 3.5 < four.hi_pages / one.hi_pages <= 4.1 and 3.5 < four.lo_pages / one.lo_pages <= 4.1
  assert "per device (4 devices" in four.describe()


def test_utilization_budget_from_the_device_with_the_least_free_memory(monkeypatch):
  """``--gpu-memory-utilization`` on a mesh: the fraction of the least free memory over its
  devices (each holds the same pools); a device that reports none refused in one line.  (Stubbed
  device memory: CPU devices report none; the engine's use of its mesh is in the 2-device run.)"""
  import types

  from serve.engine import sizing
  cfg = ModelConfig(arch="llama", vocab_size=96, hidden=64, intermediate=128, n_layers=3,
                    n_heads=8, n_kv_heads=4, head_dim=16)
  GB = 1 << 30
  used = {0: 1 * GB, 1: 5 * GB, 2: 3 * GB, 3: None}
  devs = [types.SimpleNamespace(id=i, platform="gpu") for i in range(4)]
  monkeypatch.setattr(sizing, "memory_stats", lambda d: used[d.id] and {
      "bytes_limit": 8 * GB, "bytes_in_use": used[d.id]})
  assert sizing.free_memory(devs[:3]) == 3 * GB
  mesh3 = sizing.kv_bytes_for_utilization(0.5, cfg, 256, devs[:3], shards=3)
  poorest = sizing.kv_bytes_for_utilization(0.5, cfg, 256, devs[1:2], shards=3)
  richest = sizing.kv_bytes_for_utilization(0.5, cfg, 256, devs[:1], shards=3)
  assert mesh3 == poorest < richest and richest - poorest == 2 * GB
  with pytest.raises(ValueError, match="gpu device 3 does not: give the KV budget") as e:
    sizing.kv_bytes_for_utilization(0.5, cfg, 256, devs, shards=4)
  assert "\n" not in str(e.value)


@pytest.mark.parametrize("kw, n, msg", [
    (dict(n_kv_heads=2, n_heads=8), 4, "2 KV heads .GQA groups of 4 query heads.* multiple of 4"),
    (dict(intermediate=130), 4, "intermediate size 130 is not a multiple of 4"),
    (dict(vocab_size=98), 4, "vocabulary of 98 tokens is not a multiple of 4"),
])
def test_groups_that_do_not_split_are_refused(kw, n, msg):
  base = dict(arch="llama", vocab_size=96, hidden=64, intermediate=128, n_layers=1, n_heads=8,
              n_kv_heads=4, head_dim=16)
  cfg = ModelConfig(**{**base, **kw})
  with pytest.raises(ValueError, match=msg):
    tp.check(cfg, n)
  if "vocab_size" in kw:
    tp.check(cfg, n, shard_vocab=False)   # replicated tables: any vocabulary
