"""Decoder correctness on random configs, HF-checkpoint loading against transformers, bad input."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pask_jax.testing import TINY, full_logprobs, relerr
from models import ModelConfig, UnknownArchitectureError, load, load_gguf, load_hf, random_model
from pask_jax import kv_dense
from pask_jax.decode import CapacityError, Runner, Sampling, generate

pytestmark = pytest.mark.fast_compile


@pytest.mark.parametrize("arch", sorted(TINY))
def test_decode_equals_prefill(arch):
  """Token-by-token decode through the cache gives the logits of one full forward."""
  cfg = TINY[arch]
  model = random_model(cfg, seed=1)
  rng = np.random.default_rng(0)
  B, T, P = 2, 12, 5
  ids = rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32)
  cache = kv_dense.init(cfg.n_layers, B, T, cfg.n_kv_heads, cfg.head_dim, jnp.float32)
  full, _ = model(jnp.asarray(ids), jnp.broadcast_to(jnp.arange(T), (B, T)),
                  cache._replace(length=jnp.full((B,), T, jnp.int32)), kv_dense.attend)
  runner = Runner(model, batch=B, capacity=T, cache_dtype=jnp.float32)
  logits, cache = runner.prefill_all(runner.new_cache(), ids[:, :P], np.full((B,), P, np.int32))
  steps = [logits]
  bits = jnp.full((B, -(-cfg.vocab_size // 32)), -1, jnp.int32)
  for t in range(P, T):
    _, logits, cache = runner.step(runner.params, cache, jnp.asarray(ids[:, t]), bits,
                                   jax.random.key(0), jnp.zeros(B), jnp.ones(B))
    steps.append(np.asarray(logits))   # on a GPU the next step recycles the logits' buffer
  got = np.stack([np.asarray(s) for s in steps], 1)
  assert relerr(got, np.asarray(full)[:, P - 1:T]) < 1e-5
  assert runner.traces["step"] == 1


def test_ragged_batch_matches_single():
  """Prompts of different lengths in one batch give the same logits as run alone."""
  cfg = TINY["qwen2"]
  model = random_model(cfg, seed=2)
  rng = np.random.default_rng(1)
  prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (3, 9, 6)]
  runner = Runner(model, batch=3, capacity=32, cache_dtype=jnp.float32)
  from pask_jax.decode import pad_prompts
  toks, lens = pad_prompts(prompts, 3, 32)
  logits, _ = runner.prefill_all(runner.new_cache(), toks, lens)
  for i, p in enumerate(prompts):
    lp = full_logprobs(model, p)[-1]
    assert relerr(jax.nn.log_softmax(logits[i]), lp) < 1e-5


def test_chunked_prefill_matches_one_pass(monkeypatch):
  """Prompts longer than a chunk: same last-token logits and same cache as one big chunk."""
  import pask_jax.decode as dec
  cfg = TINY["llama"]
  model = random_model(cfg, seed=4)
  rng = np.random.default_rng(5)
  prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (70, 17, 64)]
  runner = Runner(model, batch=3, capacity=192, cache_dtype=jnp.float32)
  toks, lens = dec.pad_prompts(prompts, 3, 192)
  one, c1 = runner.prefill_all(runner.new_cache(), toks, lens)
  monkeypatch.setattr(dec, "PREFILL_CHUNK", 32)
  toks2, _ = dec.pad_prompts(prompts, 3, 192)
  chunked, c2 = runner.prefill_all(runner.new_cache(), toks2, lens)
  assert relerr(chunked, one) < 1e-5
  for b, n in enumerate(lens):
    assert relerr(c2.k[:, b, :n], c1.k[:, b, :n]) < 1e-6


def test_step_compiles_once_per_shape():
  cfg = TINY["llama"]
  model = random_model(cfg)

  class Tok:  # minimal tokenizer: no stop tokens
    stop_ids = ()
    decode = staticmethod(lambda ids: " ".join(map(str, ids)))

  runner = Runner(model, batch=2, capacity=64)
  for seed, temp, prompts in [(0, 0.0, [[1, 2, 3], [4] * 7]), (1, 0.8, [[5] * 11, [6, 7]]),
                              (2, 1.3, [[9, 9]])]:
    res = generate(runner, Tok(), prompts, sampling=Sampling(max_tokens=6, temperature=temp,
                                                               top_p=0.9, seed=seed))
    assert all(len(r.tokens) == 6 for r in res)
  # temperatures are traced: one step for both sampled runs (the sampler's static branches,
  # ``how``, are one compile for greedy and one for temperature with top_p < 1)
  assert runner.traces["step"] == 2 and runner.traces["prefill"] == 1


def test_sampling_is_seeded():
  cfg = TINY["qwen3"]
  runner = Runner(random_model(cfg), batch=1, capacity=64)

  class Tok:
    stop_ids = ()
    decode = staticmethod(str)

  run = lambda seed: generate(runner, Tok(), [[1, 2, 3]],
                              sampling=Sampling(max_tokens=12, temperature=1.0,
                                                seed=seed))[0].tokens
  assert run(3) == run(3)
  assert run(3) != run(4)


# --- HF checkpoint directory, against transformers' own modelling code -----------------------

def _hf_config(cfg: ModelConfig) -> dict:
  d = {"model_type": cfg.arch, "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden,
       "intermediate_size": cfg.intermediate, "num_hidden_layers": cfg.n_layers,
       "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
       "head_dim": cfg.head_dim, "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.rms_eps,
       "tie_word_embeddings": cfg.tie_embeddings, "max_position_embeddings": 128,
       "hidden_act": "silu", "attention_bias": cfg.arch == "qwen2"}
  if cfg.rope_scaling:
    d["rope_scaling"] = dict(cfg.rope_scaling)
  return d


@pytest.mark.parametrize("arch", sorted(TINY))
def test_hf_checkpoint_matches_transformers(arch, tmp_path):
  import torch
  import transformers
  cfg = TINY[arch]
  hf_cfg = transformers.AutoConfig.for_model(**_hf_config(cfg))
  torch.manual_seed(0)
  ref = transformers.AutoModelForCausalLM.from_config(hf_cfg).eval()
  with torch.no_grad():  # non-trivial norms and biases
    for name, p in ref.named_parameters():
      if "norm" in name or name.endswith("bias"):
        p.add_(0.1 * torch.randn_like(p))
  ref.save_pretrained(tmp_path, max_shard_size="100KB")  # sharded *.safetensors + index
  assert len(list(tmp_path.glob("*.safetensors"))) > 1
  ours = load_hf(tmp_path)
  assert ours.cfg.arch == arch and ours.cfg.tie_embeddings == cfg.tie_embeddings
  ids = np.random.default_rng(3).integers(0, cfg.vocab_size, 20).tolist()
  with torch.no_grad():
    want = torch.log_softmax(ref(torch.tensor([ids])).logits[0].float(), -1).numpy()
  assert relerr(full_logprobs(ours.model, ids), want) < 1e-5


# --- bad input --------------------------------------------------------------------------------

def test_missing_files_are_named(tmp_path):
  with pytest.raises(FileNotFoundError, match="nope.gguf"):
    load(tmp_path / "nope.gguf")
  with pytest.raises(FileNotFoundError, match="no.gguf"):
    load_gguf(tmp_path / "no.gguf")
  (tmp_path / "ckpt").mkdir()
  with pytest.raises(FileNotFoundError, match="config.json"):
    load_hf(tmp_path / "ckpt")
  junk = tmp_path / "junk.bin"
  junk.write_bytes(b"not a model at all")
  with pytest.raises(ValueError, match="neither a GGUF"):
    load(junk)


def test_unknown_architecture(tmp_path):
  (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba", "vocab_size": 5}))
  with pytest.raises(UnknownArchitectureError, match="mamba"):
    load(tmp_path)
  with pytest.raises(UnknownArchitectureError, match="gpt2"):
    ModelConfig.from_gguf_fields({"general.architecture": "gpt2"}, set())


def test_prompt_over_capacity():
  runner = Runner(random_model(TINY["llama"]), batch=1, capacity=16)

  class Tok:
    stop_ids = ()
    decode = staticmethod(str)

  with pytest.raises(CapacityError, match="capacity 16"):
    generate(runner, Tok(), [list(range(12))], sampling=Sampling(max_tokens=8))


# --- Mistral (the llama family), early and named checkpoint errors ----------------------------

def _mistral_dir(tmp_path, **over):
  import torch
  import transformers
  kw = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
            rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, sliding_window=None)
  kw.update(over)
  torch.manual_seed(1)
  ref = transformers.AutoModelForCausalLM.from_config(transformers.MistralConfig(**kw)).eval()
  with torch.no_grad():
    for name, p in ref.named_parameters():
      if "norm" in name:
        p.add_(0.1 * torch.randn_like(p))
  ref.save_pretrained(tmp_path)
  assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "mistral"
  return ref


@pytest.mark.parametrize("window, context", [(None, 128), (4096, 128), (16, 16)])
def test_mistral_checkpoint_matches_transformers(tmp_path, window, context):
  """model_type mistral loads as the llama family; a sliding window at or beyond the context is
  full attention; a shorter one becomes the context limit (exact up to it)."""
  import torch
  ref = _mistral_dir(tmp_path, sliding_window=window)
  ours = load_hf(tmp_path)
  assert ours.cfg.arch == "llama" and ours.cfg.max_position == context
  ids = np.random.default_rng(4).integers(0, 97, min(context, 20)).tolist()
  with torch.no_grad():
    want = torch.log_softmax(ref(torch.tensor([ids])).logits[0].float(), -1).numpy()
  assert relerr(full_logprobs(ours.model, ids), want) < 1e-5


def test_unsupported_variants_are_refused_by_name(tmp_path):
  from models import UnsupportedConfigError
  base = {"model_type": "llama", "vocab_size": 97, "hidden_size": 64, "intermediate_size": 96,
          "num_hidden_layers": 2, "num_attention_heads": 4}
  for extra, msg in (({"attention_bias": True}, "attention_bias"), ({"mlp_bias": True}, "mlp_bias"),
                     ({"hidden_act": "gelu"}, "hidden_act")):
    with pytest.raises(UnsupportedConfigError, match=msg):
      ModelConfig.from_hf(dict(base, **extra))
  with pytest.raises(ValueError, match="no 'hidden_size'"):
    ModelConfig.from_hf({k: v for k, v in base.items() if k != "hidden_size"})
  # A tensor the decoder would not use (here: a llama checkpoint with q/k/v biases whose config
  # does not say so) is an error, not a silently different model.
  import transformers
  cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96,
                                 num_hidden_layers=2, num_attention_heads=4, attention_bias=True)
  transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
  conf = json.loads((tmp_path / "config.json").read_text())
  conf["attention_bias"] = False
  (tmp_path / "config.json").write_text(json.dumps(conf))
  with pytest.raises(ValueError, match="does not use.*q_proj.bias"):
    load_hf(tmp_path)


def test_checkpoint_errors_come_before_any_weight_loads(tmp_path, monkeypatch):
  import models.loaders as L
  def no_weights(*a, **k):
    raise AssertionError("weights were read before the error")
  monkeypatch.setattr(L, "_assemble", no_weights)
  d = tmp_path / "ckpt"
  d.mkdir()
  (d / "config.json").write_text(json.dumps(_hf_config(TINY["llama"])))
  with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
    load(d, need_tokenizer=True)
  (d / "model.safetensors").write_bytes(b"\0" * 64)   # unreadable: never opened before the check
  with pytest.raises(FileNotFoundError, match="no tokenizer.json in .*ckpt"):
    load(d, need_tokenizer=True)
  (d / "tokenizer.json").write_text("{not json")
  with pytest.raises(ValueError, match="not a readable tokenizer.json"):
    load(d)
  (d / "tokenizer.json").unlink()
  (d / "model.safetensors.index.json").write_text(json.dumps(
      {"weight_map": {"a": "model-00001-of-00002.safetensors"}}))
  with pytest.raises(FileNotFoundError, match="model-00001-of-00002.safetensors"):
    load(d)
  (d / "config.json").write_text(json.dumps({"model_type": "mamba"}))
  with pytest.raises(UnknownArchitectureError, match="mamba"):
    load(d, need_tokenizer=True)
  from pask_jax import cli
  (d / "config.json").write_text(json.dumps(_hf_config(TINY["llama"])))
  (d / "model.safetensors.index.json").unlink()
  with pytest.raises(SystemExit, match="no tokenizer.json"):
    cli.main(["generate", "--model", str(d), "--prompt", "hi", "--max-tokens", "2"])


def test_fingerprint_tells_models_apart():
  from models import fingerprint
  a, b = random_model(TINY["llama"], seed=0), random_model(TINY["llama"], seed=0)
  assert fingerprint(a) == fingerprint(b)
  assert fingerprint(random_model(TINY["llama"], seed=1))["weights"] != fingerprint(a)["weights"]
  assert fingerprint(random_model(TINY["llama"], seed=0, dtype=jnp.bfloat16))["dtype"] == "bfloat16"
  from models import decoder
  decoder.set_layout(b, "unrolled")   # what a GPU runner does in place: same weights, same print
  assert fingerprint(b) == fingerprint(a) and b.layout == "unrolled"
