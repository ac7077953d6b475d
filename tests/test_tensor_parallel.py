"""Tensor-parallel decode on a 1-D ``model`` mesh (pask_jax.mesh; issue 28, stage 1), on 4 CPU
devices in a subprocess (the device-count flag must be set before JAX starts): greedy tokens (and
PASK ledgers) of TP = 2 and 4 equal TP = 1 with and without a grammar, for the dense runner and
the PASK runner (reference attention, and the GPU and TPU Pallas kernels per shard through
shard_map, in interpret mode); the compiled step's collectives are the planned ones (no KV
gathered); each device holds 1/N of the attention and MLP weights and of the KV cache / pools;
the baselines' runners (masked H2O / SnapKV / MiKV, TriAxialKV) at TP = 2 equal TP = 1, and
Spherical KV on a mesh is refused."""
import os
import subprocess
import sys

import pytest

from models import ModelConfig
from pask_jax import mesh as tp

TP = r"""
import collections, dataclasses, json, os, re, time
import jax, jax.numpy as jnp, numpy as np
if os.environ.get("PASK_TEST_CACHE_DIR", "off") != "off":   # tests/conftest.py's compile cache:
  # the runs below compile the same prefill and commit programs for both Pallas backends
  jax.config.update("jax_compilation_cache_dir", os.environ["PASK_TEST_CACHE_DIR"])
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
from models import ModelConfig, random_model
from pask_jax import ledger, mesh as tp, policy as P
from pask_jax.decode import PaskRunner, Runner, Sampling, generate
from pask_jax.testing import grammar_compiler, smollm2_tokenizer
assert len(jax.devices()) == 4
t0 = time.perf_counter()
tok = smollm2_tokenizer()
V = tok.vocab_size
grammar = grammar_compiler(tok, V).json_schema(
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "yz"]}},
     "required": ["a", "b"], "additionalProperties": False})
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

def check_step(name, r, n, args, kv):
  # the step's collectives, as planned, and 1/N of the sharded bytes on each device
  comp = r.step.lower(*args).compile()
  hlo = comp.as_text()
  comps, bodies = collectives(hlo)
  body = sum((comps.get(b, collections.Counter()) for b in bodies), collections.Counter())
  rest = sum((v for k, v in comps.items() if k not in bodies), collections.Counter())
  # per layer (the scan's body): after the o-projection and after the MLP's down projection;
  # outside: the vocabulary-sharded embedding lookup (all-reduce) and the masked logits gathered
  # for sampling (all-gather of [B, V], nothing else gathered: no KV)
  assert dict(body) == {"all-reduce": 2}, (name, n, comps, bodies)
  assert dict(rest) == {"all-reduce": 1, "all-gather": 1}, (name, n, comps, bodies)
  gathers = [l for l in hlo.splitlines() if re.search(r"= [^=]*? all-gather(?:-start)?\(", l)]
  assert all(f"f32[{r.batch},{V}]" in l for l in gathers), gathers
  w = {k: r.params[k] for k in tp.SHARDED_WEIGHTS if k in r.params}
  fw, fc = tp.shard_fraction(w), tp.shard_fraction(kv)
  assert abs(fw * n - 1) < 0.05 and abs(fc * n - 1) < 0.05, (fw, fc)
  report[f"{name} TP={n}"] = {"layer_loop": dict(body), "outside": dict(rest), "weights": fw,
                              "kv": fc, "arg_bytes": comp.memory_analysis().argument_size_in_bytes}

report = {}
B = 2
bits0 = jnp.zeros((B, -(-V // 32)), jnp.int32)
samp = (jax.random.key(0), jnp.zeros(B), jnp.ones(B))
# dense: qwen2 (q/k/v biases, an lm_head of its own); PASK below: llama (the embedding table is
# the lm_head)
cfg = ModelConfig(arch="qwen2", vocab_size=V, hidden=64, intermediate=128, n_layers=2, n_heads=8,
                  n_kv_heads=4, head_dim=16, rope_theta=1e6)
ref = None
for n in (1, 2, 4):
  r = Runner(random_model(cfg, seed=5), batch=B, capacity=64, mesh=tp.model_mesh(n))
  out = [(x.tokens, x.finish) for x in generate(r, tok, prompts, grammars=[grammar, None],
                                                sampling=Sampling(max_tokens=6))]
  ref = ref or out
  assert out == ref, (n, out, ref)
  if n > 1:
    c = r.new_cache()
    check_step("dense", r, n, (r.params, c, jnp.zeros(B, jnp.int32), bits0) + samp, (c.k, c.v))

# PASK (reference attention): pools and window by KV head, controller and ledger replicated
cfg = ModelConfig(arch="llama", vocab_size=V, hidden=64, intermediate=128, n_layers=2, n_heads=8,
                  n_kv_heads=4, head_dim=16, rope_theta=1e6, tie_embeddings=True)
pol = dataclasses.replace(P.demo(cfg), window=4)
ref = None
for n in (1, 4):
  r = PaskRunner(random_model(cfg, seed=5), pol, batch=B, capacity=64, mesh=tp.model_mesh(n),
                 backend="reference")
  out = [(x.tokens, x.finish, x.ledger) for x in generate(
      r, tok, prompts, grammars=[grammar, None], sampling=Sampling(max_tokens=6))]
  ref = ref or out
  assert out == ref, (n, out, ref)
  if n > 1:
    c = r.new_cache()
    state = (c, jnp.zeros(B, jnp.float32), ledger.init(B, pol.n_groups))
    args = (r.params, pol, state, jnp.zeros(B, jnp.int32), jnp.zeros((B, 4), jnp.int32),
            jnp.zeros(B, jnp.int32), jnp.ones(B, bool), bits0) + samp
    check_step("pask", r, n, args, c.layers)
assert ref[0][2]["measured_B"] < 1   # the demo policy compressed something
report["seconds"] = {"reference": round(time.perf_counter() - t0, 1)}

# PASK with the Pallas kernels per shard (shard_map over the KV heads; interpret mode on the CPU)
for backend in ("gpu", "tpu"):
  t1, ref = time.perf_counter(), None
  for n in (1, 2, 4):
    r = PaskRunner(random_model(cfg, seed=5), pol, batch=B, capacity=64, mesh=tp.model_mesh(n),
                   backend=backend, kernel_knobs=dict(interpret=True))
    out = [(x.tokens, x.finish, x.ledger) for x in generate(
        r, tok, prompts, grammars=[grammar, None], sampling=Sampling(max_tokens=6))]
    ref = ref or out
    assert out == ref, (backend, n, out, ref)
    if n == 4 and backend == "gpu":   # the kernel's inputs are the local shards: nothing gathered
      c = r.new_cache()
      state = (c, jnp.zeros(B, jnp.float32), ledger.init(B, pol.n_groups))
      args = (r.params, pol, state, jnp.zeros(B, jnp.int32), jnp.zeros((B, 4), jnp.int32),
              jnp.zeros(B, jnp.int32), jnp.ones(B, bool), bits0) + samp
      check_step(f"pask {backend}", r, n, args, c.layers)
  assert ref[0][2]["measured_B"] < 1
  report["seconds"][backend] = round(time.perf_counter() - t1, 1)

# The baselines' runners: H2O / SnapKV / MiKV (one masked runner, knobs traced) and TriAxialKV,
# their state by KV head; StreamingLLM and INT4 are PaskRunner policies (above); Spherical KV is
# refused.  Longer prompts so that every method compresses something.
from pask_jax import tags as T
from pask_jax.baselines import triaxial as TX
from pask_jax.baselines.masked import Config, MaskedRunner
from pask_jax.spherical.runner import SphRunner
t1, ref = time.perf_counter(), {}
rng = np.random.default_rng(3)
long = [[int(x) for x in rng.integers(1, V, k)] for k in (40, 23)]
lab = [T.prompt(T.PromptLabel.PROTECTED_CONTENT), T.prompt(T.PromptLabel.FUNCTION_NAME)]
ptags = [np.stack([T.candidates(lab[i % 2]) for i in range(len(p))]) for p in long]
kn = TX.Knobs(prefix=2, low=2, high=8, window=4)
alloc = {"knobs": kn.asdict(), "budget": 0.5, "n_groups": 3,
         "units": {str(lab[0]): [2, 4, 8], str(lab[1]): [8, 3, 2],
                   str(T.fc(T.Cls.FREE_GENERATION)): [4, 2, 8]}}
methods = (Config("h2o", ratio=0.5, sink=2, recent=4), Config("mikv", ratio=0.4, sink=2, recent=4),
           Config("snapkv", target=0.5, obs=4, gen=8))
step_args = lambda r, st, *extra: (r.params, st, jnp.zeros(B, jnp.int32)) + extra + (
    jnp.ones(B, bool), bits0) + samp
for n in (1, 2):
  mr = MaskedRunner(random_model(cfg, seed=5), batch=B, capacity=64, mesh=tp.model_mesh(n))
  for c in methods:
    out = [(x.tokens, x.ledger) for x in generate(mr.configure(c), tok, long,
                                                   sampling=Sampling(max_tokens=8))]
    ref.setdefault(c.method, out)
    assert out == ref[c.method], (c.method, n, out, ref[c.method])
    assert out[0][1]["measured_B"] < 0.7, (c.method, out)
  assert mr.traces["step"] == 1
  tx = TX.TriaxialRunner(random_model(cfg, seed=5), batch=B, capacity=64,
                         mesh=tp.model_mesh(n)).configure(kn, alloc)
  out = [(x.tokens, x.ledger) for x in generate(tx, tok, long, prompt_tags=ptags,
                                                 sampling=Sampling(max_tokens=8))]
  ref.setdefault("triaxial", out)
  assert out == ref["triaxial"] and out[0][1]["measured_B"] < 0.7, (n, out, ref["triaxial"])
  if n > 1:   # the same collectives as the other runners (the MiKV demotion is per shard)
    st = mr.new_state(np.array([len(p) for p in long]))
    check_step("masked", mr, n, step_args(mr, st), (st.k, st.v))
    st = tx.new_state(ptags, np.array([len(p) for p in long]))
    check_step("triaxial", tx, n, step_args(tx, st, jnp.zeros((B, 4), jnp.int32)),
               (st.cache.k, st.cache.v))
try:
  SphRunner(random_model(cfg), batch=B, capacity=64, mesh=tp.model_mesh(2))
  raise AssertionError("Spherical KV on a mesh was not refused")
except ValueError as e:
  assert "SphRunner" in str(e) and "2 devices" in str(e), e
report["seconds"]["baselines"] = round(time.perf_counter() - t1, 1)
print("TP-OK", json.dumps(report), round(time.perf_counter() - t0, 1))
"""


@pytest.mark.fast_compile   # tiny random models (tests/conftest.py); the subprocess inherits it
def test_tensor_parallel_decode_on_four_cpu_devices():
  import jax
  fast = jax.config.values["jax_disable_most_optimizations"]
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu",
             JAX_DISABLE_MOST_OPTIMIZATIONS=str(int(fast)))
  r = subprocess.run([sys.executable, "-c", TP], capture_output=True, text=True, env=env,
                     cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  assert "TP-OK" in r.stdout, r.stdout[-3000:]
  print(r.stdout)


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
