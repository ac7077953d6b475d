"""Model and tokenizer fixtures: tiny configs, the embedded SmolLM2, teacher-forced log-probs."""
from __future__ import annotations

import contextlib

import functools
import gzip
import json
import os

import numpy as np

from models import ModelConfig, load, random_model

TINY = {
    "llama": ModelConfig(arch="llama", vocab_size=97, hidden=64, intermediate=96, n_layers=3,
                         n_heads=4, n_kv_heads=2, head_dim=16, rope_theta=10000.0,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 32},
                         rms_eps=1e-5, tie_embeddings=True),
    "qwen2": ModelConfig(arch="qwen2", vocab_size=101, hidden=56, intermediate=80, n_layers=2,
                         n_heads=7, n_kv_heads=1, head_dim=8, rope_theta=1e6, tie_embeddings=False),
    "qwen3": ModelConfig(arch="qwen3", vocab_size=89, hidden=48, intermediate=64, n_layers=2,
                         n_heads=4, n_kv_heads=2, head_dim=16, rope_theta=1e6, tie_embeddings=True),
}


@functools.lru_cache(maxsize=None)
def smollm2():
  """The embedded default model (SmolLM2-135M-Instruct), loaded once per process."""
  return load()


@functools.lru_cache(maxsize=None)
def smollm2_tokenizer():
  """SmolLM2's tokenizer from the GGUF metadata alone (no weights loaded)."""
  from models import gguf_io, registry
  from models.tokenizer import Tokenizer
  return Tokenizer.from_gguf_metadata(gguf_io.read(registry.smollm2_path()).meta)


@functools.lru_cache(maxsize=None)
def smollm2_grammars():
  """``(tokenizer, GrammarCompiler)`` for SmolLM2 (no weights loaded), made once per process."""
  tok = smollm2_tokenizer()
  return tok, grammar_compiler(tok)


def grammar_compiler(tok, vocab_size: int | None = None):
  """One ``GrammarCompiler`` per tokenizer object and logits width (default: the tokenizer's),
  made once per process: building one walks the whole vocabulary, and XGrammar's compiled-grammar
  cache is then shared by every test that compiles the same grammar."""
  return _compiler(tok, tok.vocab_size if vocab_size is None else vocab_size)


@functools.lru_cache(maxsize=None)
def _compiler(tok, vocab_size: int):
  from pask_jax.grammar import GrammarCompiler
  return GrammarCompiler(tok, vocab_size)


def tiny_llama(vocab: int, seed: int = 0):
  """A 3-layer random-weight llama decoder (GQA 4:2, head dim 16) over ``vocab`` tokens."""
  cfg = ModelConfig(arch="llama", vocab_size=vocab, hidden=64, intermediate=96, n_layers=3,
                    n_heads=4, n_kv_heads=2, head_dim=16, rope_theta=10000.0,
                    tie_embeddings=True)
  return random_model(cfg, seed=seed)


def tiny_qwen(tok, seed: int = 0):
  """A ``models.Loaded`` 2-layer random-weight qwen2 decoder (GQA 4:2, head dim 8) over
  ``tok``'s vocabulary, with ``tok`` (the harness's tests: BFCL prompts need qwen's template)."""
  from models import Loaded
  cfg = ModelConfig(arch="qwen2", vocab_size=tok.vocab_size, hidden=32, intermediate=48,
                    n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, rope_theta=1e6,
                    tie_embeddings=True)
  return Loaded(cfg, random_model(cfg, seed=seed), tok)


def full_logprobs(model, ids) -> np.ndarray:
  """Teacher-forced log-softmax over a whole sequence [T, V] (one forward, dense cache)."""
  import jax
  import jax.numpy as jnp

  from pask_jax import kv_dense
  cfg = model.cfg
  T = len(ids)
  cache = kv_dense.init(cfg.n_layers, 1, T, cfg.n_kv_heads, cfg.head_dim, jnp.float32)
  cache = cache._replace(length=jnp.array([T], jnp.int32))
  logits, _ = model(jnp.asarray([ids], jnp.int32), jnp.arange(T)[None], cache, kv_dense.attend)
  return np.asarray(jax.nn.log_softmax(logits[0], axis=-1))


def relerr(out, ref) -> float:
  """‖out − ref‖ / ‖ref‖ in float64."""
  out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
  return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def accepts_text(tok, grammar, text: str) -> bool:
  """Whether ``grammar`` accepts ``text`` (as ``tok`` encodes it) followed by a stop token."""
  m = grammar.matcher()
  for t in tok.encode(text):
    if not m.accept(t):
      return False
  return m.accept(tok.stop_ids[0])


def export_tokenizer(gguf_path: str, out: str) -> dict:
  """A GGUF model's tokenizer (tokenizer.json, chat template, stop ids) -> a small .json.gz
  (``scripts/export_tokenizer.py``; tests use the committed ``tests/data/qwen_tokenizer.json.gz``
  because CI has no Qwen GGUF)."""
  from models import gguf_io
  from models.tokenizer import Tokenizer
  tok = Tokenizer.from_gguf_metadata(gguf_io.read(gguf_path).meta)
  rec = {"tokenizer": json.loads(tok.tok.to_str()), "chat_template": tok.chat_template,
         "stop_ids": list(tok.stop_ids), "bos_id": tok.bos_id, "add_bos": tok.add_bos,
         "vocab_size": tok.vocab_size, "special_tokens": tok.special_tokens, "hash": tok.hash(),
         "source": os.path.basename(gguf_path)}
  # Compact JSON and maximum compression: the file is committed.
  with gzip.GzipFile(out, "wb", compresslevel=9, mtime=0) as f:
    f.write(json.dumps(rec, separators=(",", ":"), ensure_ascii=False).encode())
  return rec


@functools.lru_cache(maxsize=None)
def stored_tokenizer(path: str):
  """:func:`load_tokenizer` once per process and path (tests share the tokenizer object)."""
  return load_tokenizer(os.path.abspath(path))


def load_tokenizer(path: str):
  """The Tokenizer stored by :func:`export_tokenizer` (no GGUF needed)."""
  from tokenizers import Tokenizer as HFTokenizer

  from models.tokenizer import Tokenizer
  with gzip.open(path, "rb") as f:
    rec = json.loads(f.read())
  return Tokenizer(HFTokenizer.from_str(json.dumps(rec["tokenizer"])),
                   chat_template=rec["chat_template"], stop_ids=rec["stop_ids"],
                   bos_id=rec["bos_id"], add_bos=rec["add_bos"], vocab_size=rec["vocab_size"],
                   special_tokens=rec.get("special_tokens"))


def xla_flags(*flags: str) -> str:
  """The ``XLA_FLAGS`` for a test's subprocess that starts a CPU client: ``$XLA_FLAGS``, the
  suite's compile-speed flags (``$PASK_TEST_XLA_FLAGS``, set by tests/conftest.py, which keeps
  them out of ``XLA_FLAGS`` itself: libtpu aborts on them) and ``flags``
  (``--xla_force_host_platform_device_count=4``)."""
  return " ".join(filter(None, [os.environ.get("XLA_FLAGS"),
                                os.environ.get("PASK_TEST_XLA_FLAGS"), *flags]))


@contextlib.contextmanager
def fast_compile(on: bool = True):
  """XLA's most expensive optimizations off (``on``) or at their defaults inside, whatever the
  level outside (``jax_disable_most_optimizations``; tests/conftest.py's ``fast_compile`` mark)."""
  import jax
  old = jax.config.values["jax_disable_most_optimizations"]
  jax.config.update("jax_disable_most_optimizations", on)
  try:
    yield
  finally:
    jax.config.update("jax_disable_most_optimizations", old)
