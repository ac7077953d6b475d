"""Model configuration, read from an HF ``config.json`` or from GGUF metadata.

One config covers the three decoder families we support; they differ only in a few switches:

=========  ==========  =========  ===========================
family     q/k/v bias  q/k norm   RoPE
=========  ==========  =========  ===========================
qwen2      yes         no         rotate-half, theta from ckpt
qwen3      no          yes        rotate-half
llama      no          no         rotate-half (+ llama3 scaling)
=========  ==========  =========  ===========================

HF ``model_type: mistral`` is the llama family (same blocks, no biases); its sliding window is
exact full attention for every context up to the window, so a finite ``sliding_window`` smaller
than ``max_position_embeddings`` becomes the model's context limit (``max_position``) rather than
being refused (Qwen2 with ``use_sliding_window: true`` alike).  Variants this decoder does not
implement (llama ``attention_bias`` / ``mlp_bias``, another ``hidden_act``) are refused by name
instead of loading into a silently different model.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

ARCHS = ("llama", "qwen2", "qwen3")

# HF ``model_type`` / ``architectures`` spellings -> our family name.
_HF_TYPES = {
    "llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "llama",
    "LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
    "MistralForCausalLM": "llama",
}


class UnknownArchitectureError(ValueError):
  """The checkpoint's architecture is not one of :data:`ARCHS`."""


class UnsupportedConfigError(ValueError):
  """A known architecture with a setting this decoder does not implement."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  arch: str
  vocab_size: int
  hidden: int
  intermediate: int
  n_layers: int
  n_heads: int
  n_kv_heads: int
  head_dim: int
  rope_theta: float = 10000.0
  # None, or (as a dict or sorted item tuple) rope_type "llama3" and factor / low_freq_factor /
  # high_freq_factor /
  # original_max_position_embeddings (HF's keys).
  rope_scaling: Any = None
  rms_eps: float = 1e-6
  tie_embeddings: bool = False
  max_position: int = 32768
  name: str = "model"

  def __post_init__(self):
    # Frozen and hashable: NNX keeps the config as static graph data.
    if isinstance(self.rope_scaling, dict):
      object.__setattr__(self, "rope_scaling", tuple(sorted(self.rope_scaling.items())))
    if self.arch not in ARCHS:
      raise UnknownArchitectureError(
          f"unknown model architecture {self.arch!r}; supported: {', '.join(ARCHS)}")
    if self.n_heads % self.n_kv_heads:
      raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")

  @property
  def qkv_bias(self) -> bool:
    return self.arch == "qwen2"

  @property
  def qk_norm(self) -> bool:
    return self.arch == "qwen3"

  @property
  def group(self) -> int:
    """Query heads per KV head (GQA group size)."""
    return self.n_heads // self.n_kv_heads

  def identity(self) -> dict[str, Any]:
    """The fields a calibrated policy depends on (tokenizer hash is added by the loader)."""
    return {"arch": self.arch, "n_layers": self.n_layers, "n_kv_heads": self.n_kv_heads,
            "head_dim": self.head_dim, "vocab_size": self.vocab_size}

  def to_json(self) -> str:
    return json.dumps(dataclasses.asdict(self), sort_keys=True)

  # --- constructors -------------------------------------------------------------------------

  @classmethod
  def from_hf(cls, cfg: dict | str | os.PathLike) -> "ModelConfig":
    """From an HF ``config.json`` (path, directory or parsed dict)."""
    where = "config.json"
    if not isinstance(cfg, dict):
      path = os.fspath(cfg)
      if os.path.isdir(path):
        path = os.path.join(path, "config.json")
      if not os.path.exists(path):
        raise FileNotFoundError(f"model config not found: {path}")
      try:
        with open(path) as f:
          cfg = json.load(f)
      except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
      where = path
    kind = cfg.get("model_type") or next(iter(cfg.get("architectures") or []), None)
    arch = _HF_TYPES.get(kind) or next(
        (_HF_TYPES[a] for a in cfg.get("architectures") or [] if a in _HF_TYPES), None)
    if arch is None:
      raise UnknownArchitectureError(
          f"unknown model architecture {kind!r} (model_type/architectures in config.json); "
          f"supported: {', '.join(ARCHS)} (and mistral, as llama)")

    def need(key):
      if cfg.get(key) is None:
        raise ValueError(f"{where} has no {key!r} (needed for a {kind} model)")
      return cfg[key]

    if arch in ("llama", "qwen3"):
      for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key):
          raise UnsupportedConfigError(f"{where}: {key}=true is not supported for {kind} models "
                                       "(this decoder has no such biases)")
    act = cfg.get("hidden_act", cfg.get("hidden_activation", "silu"))
    if act != "silu":
      raise UnsupportedConfigError(f"{where}: hidden_act={act!r} is not supported (only silu)")
    heads = need("num_attention_heads")
    # transformers >= 5 writes `rope_parameters` (with rope_theta inside); older: `rope_scaling`.
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or (params if params.get("rope_type") else None)
    theta = cfg.get("rope_theta", params.get("rope_theta", 10000.0))
    if scaling is not None:
      scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}
      rtype = scaling.get("rope_type", scaling.get("type"))
      if rtype in (None, "default"):
        scaling = None
      elif rtype != "llama3":
        raise UnsupportedConfigError(f"unsupported rope_scaling type {rtype!r} (supported: llama3)")
    max_pos = int(cfg.get("max_position_embeddings", 32768))
    window = cfg.get("sliding_window")
    windowed = kind == "mistral" or (arch == "qwen2" and cfg.get("use_sliding_window"))
    if windowed and window is not None and int(window) < max_pos:
      max_pos = int(window)   # full attention == sliding-window attention up to the window
    return cls(
        arch=arch, vocab_size=need("vocab_size"), hidden=need("hidden_size"),
        intermediate=need("intermediate_size"), n_layers=need("num_hidden_layers"),
        n_heads=heads, n_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or need("hidden_size") // heads,
        rope_theta=float(theta), rope_scaling=scaling,
        rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position=max_pos,
        name=cfg.get("_name_or_path") or kind or arch)

  @classmethod
  def from_gguf_fields(cls, meta: dict[str, Any], tensor_names: set[str]) -> "ModelConfig":
    """From GGUF metadata (already decoded to Python values) and the file's tensor names."""
    arch = meta.get("general.architecture")
    if arch not in ARCHS:
      raise UnknownArchitectureError(
          f"unknown model architecture {arch!r} in GGUF metadata; supported: {', '.join(ARCHS)}")
    g = lambda k, d=None: meta.get(f"{arch}.{k}", d)
    hidden, heads = int(g("embedding_length")), int(g("attention.head_count"))
    vocab = g("vocab_size") or len(meta["tokenizer.ggml.tokens"])
    return cls(
        arch=arch, vocab_size=int(vocab), hidden=hidden,
        intermediate=int(g("feed_forward_length")), n_layers=int(g("block_count")),
        n_heads=heads, n_kv_heads=int(g("attention.head_count_kv", heads)),
        head_dim=int(g("attention.key_length", hidden // heads)),
        rope_theta=float(g("rope.freq_base", 10000.0)),
        # llama3 scaling travels as the precomputed `rope_freqs.weight` tensor in GGUF.
        rope_scaling=None,
        rms_eps=float(g("attention.layer_norm_rms_epsilon", 1e-6)),
        tie_embeddings="output.weight" not in tensor_names,
        max_position=int(g("context_length", 32768)),
        name=str(meta.get("general.name", arch)))
