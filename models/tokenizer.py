"""Tokenizer (HF ``tokenizers``) from ``tokenizer.json`` or GGUF metadata, and chat templates.

GGUF files carry the BPE vocabulary, merges, pre-tokenizer name and chat template; we rebuild the
same ``tokenizers`` pipeline that transformers uses for these families (byte-level BPE with the
family's split regex), and render the template with a sandboxed jinja2 environment configured like
transformers' (``trim_blocks``, ``lstrip_blocks``, ``tojson``, ``raise_exception``).
"""
from __future__ import annotations

import datetime
import hashlib
import json
import os
from typing import Any, Sequence

from tokenizers import AddedToken, Regex, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

# Split regexes of the byte-level BPE families we load from GGUF (llama.cpp's pre-tokenizer names).
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _pre_tokenizer(pre: str):
  if pre in ("qwen2", "deepseek-llm"):
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_QWEN2), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  if pre in ("llama-bpe", "llama3", "smaug-bpe"):
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_LLAMA3), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  if pre in ("smollm", "starcoder", "refact", "gpt2", "default"):
    # GPT-2's regex (ByteLevel's own) with digits split one by one (SmolLM/StarCoder).
    seq = [pre_tokenizers.Digits(individual_digits=True)] if pre != "gpt2" else []
    return pre_tokenizers.Sequence(seq + [pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                   use_regex=True)])
  raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r}")


class Tokenizer:
  """Encode/decode, special tokens, stop ids and the chat template of one model."""

  def __init__(self, tok: HFTokenizer, *, chat_template: str | None, stop_ids: Sequence[int],
               bos_id: int | None = None, add_bos: bool = False, vocab_size: int | None = None):
    self.tok = tok
    self.chat_template = chat_template
    self.stop_ids = tuple(sorted(set(int(i) for i in stop_ids)))
    self.bos_id, self.add_bos = bos_id, add_bos
    self.vocab_size = vocab_size or tok.get_vocab_size(with_added_tokens=True)

  # --- construction ---------------------------------------------------------------------------

  @classmethod
  def from_gguf_metadata(cls, meta: dict[str, Any]) -> "Tokenizer":
    if meta.get("tokenizer.ggml.model") != "gpt2":
      raise ValueError(f"unsupported GGUF tokenizer model {meta.get('tokenizer.ggml.model')!r} "
                       "(only byte-level BPE, 'gpt2', is supported)")
    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type", [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"))
    tok.decoder = decoders.ByteLevel()
    # CONTROL (3) tokens are special; USER_DEFINED (4) are added tokens matched in text too.
    special = [AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(types)
               if t == 3]
    user = [AddedToken(tokens[i], special=False, normalized=False) for i, t in enumerate(types)
            if t == 4]
    tok.add_special_tokens(special)
    if user:
      tok.add_tokens(user)
    eos = meta.get("tokenizer.ggml.eos_token_id")
    stops = {i for i in (eos, meta.get("tokenizer.ggml.eot_token_id")) if i is not None}
    stops |= {vocab[t] for t in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>")
              if t in vocab}
    return cls(tok, chat_template=meta.get("tokenizer.chat_template"), stop_ids=sorted(stops),
               bos_id=meta.get("tokenizer.ggml.bos_token_id"),
               add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
               vocab_size=len(tokens))

  @classmethod
  def from_hf_dir(cls, path: str | os.PathLike) -> "Tokenizer":
    path = os.fspath(path)
    tj = os.path.join(path, "tokenizer.json")
    if not os.path.exists(tj):
      raise FileNotFoundError(f"tokenizer.json not found in {path}")
    tok = HFTokenizer.from_file(tj)
    cfg: dict[str, Any] = {}
    if os.path.exists(os.path.join(path, "tokenizer_config.json")):
      with open(os.path.join(path, "tokenizer_config.json")) as f:
        cfg = json.load(f)
    template = cfg.get("chat_template")
    if template is None and os.path.exists(os.path.join(path, "chat_template.jinja")):
      with open(os.path.join(path, "chat_template.jinja")) as f:
        template = f.read()
    name = lambda t: t.get("content") if isinstance(t, dict) else t
    stops = set()
    for t in (name(cfg.get("eos_token")), "<|im_end|>", "<|endoftext|>", "<|eot_id|>"):
      if t is not None and tok.token_to_id(t) is not None:
        stops.add(tok.token_to_id(t))
    gen = os.path.join(path, "generation_config.json")
    if os.path.exists(gen):
      with open(gen) as f:
        eos = json.load(f).get("eos_token_id")
      stops |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    bos = name(cfg.get("bos_token"))
    return cls(tok, chat_template=template, stop_ids=sorted(stops),
               bos_id=tok.token_to_id(bos) if bos else None,
               add_bos=bool(cfg.get("add_bos_token", False)))

  # --- use --------------------------------------------------------------------------------------

  def encode(self, text: str) -> list[int]:
    ids = self.tok.encode(text, add_special_tokens=False).ids
    return ([self.bos_id] + ids) if (self.add_bos and self.bos_id is not None) else ids

  def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
    return self.tok.decode([int(i) for i in ids], skip_special_tokens=skip_special)

  def token_bytes(self) -> tuple[bytes, ...]:
    """Raw bytes of every token id (for the grammar engine and tag adapters; computed once).

    Control tokens map to b"" (no grammar can match them); added tokens to their text."""
    if getattr(self, "_token_bytes", None) is None:
      self._token_bytes = tuple(self._compute_token_bytes())
    return self._token_bytes   # an immutable tuple: no copy per caller (trackers are many)

  def _compute_token_bytes(self) -> list[bytes]:
    vocab = self.tok.get_vocab(with_added_tokens=True)
    out = [b""] * max(self.vocab_size, max(vocab.values()) + 1)
    byte_dec = _byte_decoder()
    added = {t.content: t.special for t in self.tok.get_added_tokens_decoder().values()}
    for t, i in vocab.items():
      if t in added:  # control tokens have no text a grammar could match; added ones do
        out[i] = b"" if added[t] else t.encode()
      else:
        out[i] = bytes(byte_dec.get(c, ord(c) & 0xFF) for c in t)
    return out

  def hash(self) -> str:
    """A stable fingerprint of the vocabulary (policies are refused for another tokenizer)."""
    vocab = sorted(self.tok.get_vocab(with_added_tokens=True).items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(vocab).encode()).hexdigest()[:16]

  def apply_chat_template(self, messages: list[dict], *, tools: list[dict] | None = None,
                          add_generation_prompt: bool = True, **extra) -> str:
    if not self.chat_template:
      raise ValueError("this tokenizer has no chat template")
    return _render(self.chat_template, messages=messages, tools=tools,
                   add_generation_prompt=add_generation_prompt, **extra)


def _byte_decoder() -> dict[str, int]:
  """GPT-2's byte <-> unicode table, inverted."""
  bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
      range(ord("®"), ord("ÿ") + 1))
  cs = bs[:]
  n = 0
  for b in range(256):
    if b not in bs:
      bs.append(b)
      cs.append(256 + n)
      n += 1
  return {chr(c): b for b, c in zip(bs, cs)}


_ENV = None


def _render(template: str, **kw) -> str:
  global _ENV
  if _ENV is None:
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
      return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                        sort_keys=sort_keys)

    def raise_exception(msg):
      raise ValueError(f"chat template error: {msg}")

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    _ENV = env
  return _ENV.from_string(template).render(**kw)
