"""Flax NNX decoders (Qwen2/2.5, Qwen3, Llama-3/SmolLM2), their configs, loaders and tokenizers."""
from models.config import ARCHS, ModelConfig, UnknownArchitectureError, UnsupportedConfigError
from models.decoder import Decoder
from models.loaders import Loaded, fingerprint, load, load_gguf, load_hf, random_model
from models.registry import DEFAULT, NAMES
from models.tokenizer import Tokenizer

__all__ = ["ARCHS", "ModelConfig", "UnknownArchitectureError", "UnsupportedConfigError", "Decoder",
           "Loaded", "fingerprint", "load", "load_gguf", "load_hf", "random_model", "DEFAULT",
           "NAMES", "Tokenizer"]
