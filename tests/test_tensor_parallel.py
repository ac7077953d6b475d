"""Tensor-parallel decode on a 1-D ``model`` mesh (pask_jax.mesh; issue 28, stage 1), on 4 CPU
devices in a subprocess (the device-count flag must be set before JAX starts): greedy tokens of
TP = 2 and 4 equal TP = 1 with and without a grammar, the compiled step's collectives are the
planned ones, and each device holds 1/N of the attention and MLP weights and of the KV cache."""
import os
import subprocess
import sys

import pytest

from models import ModelConfig
from pask_jax import mesh as tp

TP = r"""
import collections, json, re, time
import jax, jax.numpy as jnp, numpy as np
from models import ModelConfig, random_model
from pask_jax import mesh as tp
from pask_jax.decode import Runner, Sampling, generate
from pask_jax.testing import grammar_compiler, smollm2_tokenizer
assert len(jax.devices()) == 4
t0 = time.perf_counter()
tok = smollm2_tokenizer()
V = tok.vocab_size
grammar = grammar_compiler(tok, V).json_schema(
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "yz"]}},
     "required": ["a", "b"], "additionalProperties": False})
prompts = [tok.encode("Answer in JSON:"), tok.encode("one two three four five six")]
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

report = {}
# qwen2: q/k/v biases and an lm_head of its own; llama: the embedding table is the lm_head
for arch, tie, sizes in (("qwen2", False, (1, 2, 4)), ("llama", True, (1, 4))):
  cfg = ModelConfig(arch=arch, vocab_size=V, hidden=64, intermediate=128, n_layers=2, n_heads=8,
                    n_kv_heads=4, head_dim=16, rope_theta=1e6, tie_embeddings=tie)
  ref = None
  for n in sizes:
    r = Runner(random_model(cfg, seed=5), batch=2, capacity=64, mesh=tp.model_mesh(n))
    out = [(x.tokens, x.finish) for x in generate(r, tok, prompts, grammars=[grammar, None],
                                                  sampling=Sampling(max_tokens=8))]
    ref = ref or out
    assert out == ref, (arch, n, out, ref)
    if n == 1:
      continue
    c = r.new_cache()
    B = r.batch
    args = (r.params, c, jnp.zeros(B, jnp.int32), jnp.zeros((B, -(-V // 32)), jnp.int32),
            jax.random.key(0), jnp.zeros(B), jnp.ones(B))
    comp = r.step.lower(*args).compile()
    comps, bodies = collectives(comp.as_text())
    body = sum((comps.get(b, collections.Counter()) for b in bodies), collections.Counter())
    rest = sum((v for k, v in comps.items() if k not in bodies), collections.Counter())
    # per layer: o-projection and MLP down projection; outside: the vocabulary-sharded embedding
    # lookup (all-reduce) and the masked logits gathered for sampling (all-gather of [B, V])
    assert dict(body) == {"all-reduce": 2}, (arch, n, comps, bodies)
    assert dict(rest) == {"all-reduce": 1, "all-gather": 1}, (arch, n, comps, bodies)
    assert "all-gather" not in str(comps) or all(
        "f32[%d,%d]" % (B, V) in l for l in comp.as_text().splitlines()
        if re.search(r"= [^=]*? all-gather(?:-start)?\(", l)), "an all-gather besides the logits"
    w = {k: r.params[k] for k in tp.SHARDED_WEIGHTS if k in r.params}
    fw, fc = tp.shard_fraction(w), tp.shard_fraction((c.k, c.v))
    assert abs(fw * n - 1) < 0.05 and abs(fc * n - 1) < 0.05, (fw, fc)
    ma = comp.memory_analysis()
    report[f"{arch} TP={n}"] = {"body": dict(body), "rest": dict(rest), "weights": fw,
                                "kv": fc, "arg_bytes": ma.argument_size_in_bytes}
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
