"""Fixtures for tests and benchmarks (not used by the method; ``import pask_jax.testing``).

* :mod:`~pask_jax.testing.fixtures` — tiny random model configs, the embedded SmolLM2 model and
  tokenizer, tokenizers and grammar compilers made once per process, grammar helpers,
  teacher-forced log-probs, exported tokenizer files.
* :mod:`~pask_jax.testing.cache` — whole-step and per-layer cache updates and host-side
  inspection, written over the public :mod:`pask_jax.cache` API (a slower, simpler form of the
  decode step's in-place updates, to compare against).
* :mod:`~pask_jax.testing.parity` — reference log-probs from transformers (torch; opt-in).

Kernel inputs and quantizer stress rows are in :mod:`pallas_kernels.testing`.
"""
from pask_jax.testing.fixtures import (TINY, accepts_text, export_tokenizer, fast_compile,
                                       full_logprobs, grammar_compiler, load_tokenizer, relerr,
                                       smollm2,
                                       smollm2_grammars, smollm2_tokenizer, stored_tokenizer,
                                       tiny_llama, tiny_qwen, xla_flags)

__all__ = ["TINY", "accepts_text", "export_tokenizer", "fast_compile", "full_logprobs",
           "grammar_compiler",
           "load_tokenizer", "relerr", "smollm2", "smollm2_grammars", "smollm2_tokenizer",
           "stored_tokenizer", "tiny_llama", "tiny_qwen", "xla_flags"]
