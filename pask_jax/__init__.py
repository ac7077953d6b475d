"""PASK: Parser-Aware Structural KV Persistence, in JAX.

The Python API (README, "Python API")::

    import pask_jax as pj
    model = pj.load_model()                       # default: SmolLM2-135M-Instruct (GGUF)
    out = pj.generate(model, "What's the weather in Tokyo?", tools=tools, policy="demo")
    out.text, out.tool_calls, pj.read_ledger(out)["measured_B"]

``import pask_jax`` is cheap: JAX, XGrammar and the models load on first use of a function.
"""

__version__ = "0.1.0"

# name -> (module, attribute): resolved on first access (PEP 562), so importing the package
# does not import jax / xgrammar / torch.
_LAZY = {
    "load_model": ("pask_jax.api", "load_model"),
    "load_policy": ("pask_jax.api", "load_policy"),
    "generate": ("pask_jax.api", "generate"),
    "prepare": ("pask_jax.api", "prepare"),
    "read_ledger": ("pask_jax.api", "read_ledger"),
    "start_engine": ("pask_jax.api", "start_engine"),
    "submit": ("pask_jax.api", "submit"),
    "Generation": ("pask_jax.api", "Generation"),
    "Prompt": ("pask_jax.prompt", "Prompt"),
    "SamplingParams": ("pask_jax.api", "SamplingParams"),
    "FrozenPolicy": ("pask_jax.policy", "FrozenPolicy"),
    "Loaded": ("models.loaders", "Loaded"),
    "ChatTemplateError": ("models.tokenizer", "ChatTemplateError"),
    "GrammarError": ("pask_jax.grammar.matcher", "GrammarError"),
    "CapacityError": ("pask_jax.decode", "CapacityError"),
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name):
  if name in _LAZY:
    import importlib
    mod, attr = _LAZY[name]
    value = getattr(importlib.import_module(mod), attr)
    globals()[name] = value
    return value
  raise AttributeError(f"module 'pask_jax' has no attribute {name!r}")


def __dir__():
  return sorted(set(globals()) | set(_LAZY))
