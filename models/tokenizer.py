"""Tokenizer (HF ``tokenizers``) from ``tokenizer.json`` or GGUF metadata, and chat templates.

GGUF files carry the BPE vocabulary, merges, pre-tokenizer name and chat template; we rebuild the
same ``tokenizers`` pipeline that transformers uses for these families (byte-level BPE with the
family's split regex).  Chat templates are rendered as transformers renders them (its sandboxed
jinja2 environment and options, its ``tojson``, ``raise_exception``, ``strftime_now``, the special
tokens in the context, named templates); ``tests/test_tokenizer.py`` checks the output against
transformers' own ``apply_chat_template`` on every template the tests have.
"""
from __future__ import annotations

import dataclasses
import datetime
import functools
import hashlib
import json
import os
from typing import Any, Mapping, Sequence

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


# The named special tokens transformers puts into a chat template's context
# (PreTrainedTokenizerBase.SPECIAL_TOKENS_ATTRIBUTES; extra special tokens are not in it).
SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                 "mask_token")
# GGUF metadata ids of the special tokens, as transformers' GGUF tokenizer converter reads them.
_GGUF_SPECIAL = {"bos_token": "tokenizer.ggml.bos_token_id",
                 "eos_token": "tokenizer.ggml.eos_token_id",
                 "unk_token": "tokenizer.ggml.unknown_token_id",
                 "pad_token": "tokenizer.ggml.padding_token_id"}


class ChatTemplateError(ValueError):
  """A chat template refused the conversation (``raise_exception``) or failed to render."""


class Tokenizer:
  """Encode/decode, special tokens, stop ids and the chat template(s) of one model.

  ``special_tokens`` maps the names of :data:`SPECIAL_NAMES` to token strings; they are in every
  chat template's context, as in transformers.  ``chat_template`` is the default template (a
  string, or None); ``chat_templates`` every named template (``"default"``, ``"tool_use"``, …).
  """

  def __init__(self, tok: HFTokenizer, *, chat_template: str | dict | None,
               stop_ids: Sequence[int], bos_id: int | None = None, add_bos: bool = False,
               vocab_size: int | None = None, special_tokens: dict[str, str] | None = None):
    self.tok = tok
    if isinstance(chat_template, list):   # tokenizer_config.json: [{"name", "template"}, ...]
      chat_template = {t["name"]: t["template"] for t in chat_template}
    if isinstance(chat_template, dict):
      self.chat_templates = dict(chat_template)
      self.chat_template = chat_template.get("default")
    else:
      self.chat_templates = {"default": chat_template} if chat_template else {}
      self.chat_template = chat_template or None
    self.stop_ids = tuple(sorted(set(int(i) for i in stop_ids)))
    self.bos_id, self.add_bos = bos_id, add_bos
    self.vocab_size = vocab_size or tok.get_vocab_size(with_added_tokens=True)
    special = {k: str(v) for k, v in (special_tokens or {}).items() if v is not None}
    unknown = set(special) - set(SPECIAL_NAMES)
    if unknown:
      raise ValueError(f"unknown special token names {sorted(unknown)}; known: {SPECIAL_NAMES}")
    if "bos_token" not in special and bos_id is not None and tok.id_to_token(bos_id) is not None:
      special["bos_token"] = tok.id_to_token(bos_id)
    self.special_tokens = special

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
    named = {k: tokens[meta[key]] for k, key in _GGUF_SPECIAL.items()
             if isinstance(meta.get(key), int) and 0 <= meta[key] < len(tokens)}
    return cls(tok, chat_template=meta.get("tokenizer.chat_template"), stop_ids=sorted(stops),
               bos_id=meta.get("tokenizer.ggml.bos_token_id"),
               add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
               vocab_size=len(tokens), special_tokens=named)

  @classmethod
  def from_hf_dir(cls, path: str | os.PathLike) -> "Tokenizer":
    """``tokenizer.json`` + ``tokenizer_config.json`` (+ ``special_tokens_map.json``,
    ``chat_template.jinja``, ``additional_chat_templates/*.jinja``), read as transformers does:
    template files take priority over the config's ``chat_template``; the legacy special-tokens
    map is used only when the config has no ``added_tokens_decoder``."""
    path = os.fspath(path)
    tj = os.path.join(path, "tokenizer.json")
    if not os.path.exists(tj):
      raise FileNotFoundError(f"tokenizer.json not found in {path}")
    try:
      tok = HFTokenizer.from_file(tj)
    except Exception as e:  # noqa: BLE001 — a truncated or foreign file: say which
      raise ValueError(f"{tj} is not a readable tokenizer.json: {str(e).splitlines()[0]}") from None
    cfg: dict[str, Any] = _read_json(os.path.join(path, "tokenizer_config.json")) or {}
    smap = _read_json(os.path.join(path, "special_tokens_map.json"))
    if smap and "added_tokens_decoder" not in cfg:
      cfg = {**cfg, **smap}
    template: Any = cfg.get("chat_template")
    files: dict[str, str] = {}
    if os.path.exists(os.path.join(path, "chat_template.jinja")):
      with open(os.path.join(path, "chat_template.jinja"), encoding="utf-8") as f:
        files["default"] = f.read()
    extra = os.path.join(path, "additional_chat_templates")
    if os.path.isdir(extra):
      for name in sorted(os.listdir(extra)):
        if name.endswith(".jinja"):
          with open(os.path.join(extra, name), encoding="utf-8") as f:
            files[name[:-len(".jinja")]] = f.read()
    if files:
      template = files["default"] if list(files) == ["default"] else files
    name = lambda t: t.get("content") if isinstance(t, dict) else t
    special = {k: name(cfg.get(k)) for k in SPECIAL_NAMES if name(cfg.get(k))}
    stops = set()
    for t in (special.get("eos_token"), "<|im_end|>", "<|endoftext|>", "<|eot_id|>"):
      if t is not None and tok.token_to_id(t) is not None:
        stops.add(tok.token_to_id(t))
    gen = _read_json(os.path.join(path, "generation_config.json"))
    if gen:
      eos = gen.get("eos_token_id")
      stops |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    bos = special.get("bos_token")
    return cls(tok, chat_template=template, stop_ids=sorted(stops),
               bos_id=tok.token_to_id(bos) if bos else None,
               add_bos=bool(cfg.get("add_bos_token", False)), special_tokens=special)

  # --- use --------------------------------------------------------------------------------------

  def encode(self, text: str) -> list[int]:
    """Token ids; BOS first when the model adds one and the text does not already begin with it
    (a chat template that writes ``{{ bos_token }}``: transformers tokenizes a rendered chat
    without adding special tokens, so the prompt holds exactly one BOS either way)."""
    ids = self.tok.encode(text, add_special_tokens=False).ids
    if self.add_bos and self.bos_id is not None and ids[:1] != [self.bos_id]:
      ids = [self.bos_id] + ids
    return ids

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

  def template(self, name: str | None = None, tools: Any = None) -> str:
    """The template to render: a named one, or transformers' choice (``tool_use`` when tools are
    given and the model has one, else ``default``); a string that is no name is a template."""
    if name is not None:
      return self.chat_templates.get(name, name)
    if tools is not None and "tool_use" in self.chat_templates:
      return self.chat_templates["tool_use"]
    if self.chat_template:
      return self.chat_template
    if self.chat_templates:
      raise ChatTemplateError(f"this tokenizer has several chat templates and no default: pass "
                              f"one of {sorted(self.chat_templates)}")
    raise ChatTemplateError("this tokenizer has no chat template")

  def takes_tools(self, name: str | None = None) -> bool:
    """Whether the template reads ``tools`` (otherwise callers describe tools in a message)."""
    try:
      return "tools" in self.template(name, tools=[])
    except ChatTemplateError:
      return False

  def apply_chat_template(self, messages: Sequence[Any], *, tools: Sequence[dict] | None = None,
                          add_generation_prompt: bool | None = None,
                          continue_final_message: bool | str = False,
                          documents: Sequence[dict] | None = None,
                          chat_template: str | None = None, **kwargs) -> str:
    """The conversation rendered as transformers' ``apply_chat_template(..., tokenize=False)``
    renders it (same jinja2 sandbox, options, filters, globals and context: the special tokens
    of :attr:`special_tokens`, overridden by ``kwargs``; messages with ``None`` fields dropped,
    objects with ``model_dump`` converted; reasoning fields aliased; ``continue_final_message``).

    One difference: ``add_generation_prompt`` defaults to True here (the caller is about to
    generate), unless ``continue_final_message`` is set.  Raises :class:`ChatTemplateError`
    (a ``ValueError``) with a one-line message when the template refuses the conversation."""
    if add_generation_prompt is None:
      add_generation_prompt = not continue_final_message
    if continue_final_message and add_generation_prompt:
      raise ValueError("continue_final_message and add_generation_prompt are not compatible")
    if not messages:
      raise ValueError("cannot apply the chat template to an empty conversation")
    template = self.template(chat_template, tools)
    chat = []
    for m in messages:
      d = _dump(m)
      if not isinstance(d, dict):
        raise ValueError(f"chat messages must be dicts, got {m!r}")
      chat.append(_plain({k: v for k, v in d.items() if v is not None}))
    chat = _alias_reasoning(chat)
    if tools is not None:
      for t in tools:
        if not isinstance(t, dict):
          raise ValueError(f"tools must be JSON-schema dicts, got {type(t).__name__}")
    if documents is not None and not all(isinstance(d, dict) for d in documents):
      raise ValueError("documents must be a list of dicts with 'title' and 'text' keys")
    ctx = _plain({**self.special_tokens, **kwargs})
    tag = "CONTINUE_FINAL_MESSAGE_TAG "
    field = final = None
    if continue_final_message:
      field = continue_final_message if isinstance(continue_final_message, str) else "content"
      final = chat[-1].get(field)
      if final is None:
        raise ValueError(f"continue_final_message: the final message has no {field!r}")
      fields = [field]
      if field in _REASONING:
        fields = [f for f in _REASONING if chat[-1].get(f) == final]
      if not any(f in template for f in fields):
        raise ValueError(f"continue_final_message: the chat template does not read {field!r}")
      if isinstance(final, (list, tuple)):
        for block in reversed(final):
          if "text" in block:
            final, block["text"] = block["text"], block["text"] + tag
            break
        else:
          raise ValueError("continue_final_message: no text to continue in the final message")
      else:
        for f in fields:
          chat[-1][f] = chat[-1][f] + tag
    out = _render(template, messages=chat, tools=_plain(list(tools) if tools is not None else None),
                  documents=_plain(list(documents) if documents is not None else None),
                  add_generation_prompt=add_generation_prompt, **ctx)
    if continue_final_message:
      if final.strip() not in out or tag.strip() not in out:
        raise ValueError("continue_final_message: the chat template deleted part of the final "
                         "message")
      at = out.rindex(tag.strip())
      out = out[:at] if out[at:at + len(tag)] == tag else out[:at].rstrip()
    return out


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


def _read_json(path: str) -> Any:
  """A JSON file's content, None when absent; a named error when it is not JSON."""
  if not os.path.exists(path):
    return None
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except json.JSONDecodeError as e:
    raise ValueError(f"{path} is not valid JSON: {e}") from None


# --- chat templates: transformers' rendering, reproduced (utils/chat_template_utils.py) ---------

_REASONING = ("reasoning_content", "thinking", "reasoning")


def _dump(m: Any) -> Any:
  """Message objects (pydantic models, e.g. the openai client's) -> dicts, as transformers."""
  if isinstance(m, Mapping):
    return {k: _dump(v) for k, v in m.items()}
  if isinstance(m, list):
    return [_dump(v) for v in m]
  if isinstance(m, tuple):
    return tuple(_dump(v) for v in m)
  if dataclasses.is_dataclass(m) and not isinstance(m, type):
    return {f.name: _dump(getattr(m, f.name)) for f in dataclasses.fields(m)}
  if callable(getattr(m, "model_dump", None)):
    return _dump(m.model_dump())
  return m


def _plain(v: Any) -> Any:
  """What a template may see: plain JSON types (subclasses stripped), anything else a
  placeholder naming its type — transformers' ``_plain_template_data``."""
  if v is None or type(v) in (str, int, float, bool):
    return v
  if isinstance(v, str):
    return str.__str__(v)
  if isinstance(v, int):
    return int.__int__(v)
  if isinstance(v, float):
    return float.__float__(v)
  if isinstance(v, Mapping):
    return {_plain(k): _plain(x) for k, x in v.items()}
  if isinstance(v, list):
    return [_plain(x) for x in v]
  if isinstance(v, tuple):
    return tuple(_plain(x) for x in v)
  try:
    import numpy as np
    if isinstance(v, np.generic):
      return _plain(v.item())
  except ImportError:  # pragma: no cover
    pass
  if dataclasses.is_dataclass(v) and not isinstance(v, type):
    return {f.name: _plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
  if callable(getattr(v, "model_dump", None)):
    return _plain(v.model_dump())
  return f"<{type(v).__name__}>"


def _alias_reasoning(chat: list[dict]) -> list[dict]:
  out = []
  for m in chat:
    r = next((m[k] for k in _REASONING if m.get(k) is not None), None)
    out.append({"thinking": r, **m, "reasoning_content": r} if r is not None else m)
  return out


class _TemplateRaised(Exception):
  pass


@functools.lru_cache(maxsize=64)
def _compile(template: str):
  """The template compiled in an environment configured as transformers' (trim_blocks,
  lstrip_blocks, loopcontrols, a ``{% generation %}`` block that renders its body, ``tojson``
  without HTML escaping, ``raise_exception``, ``strftime_now``, guarded ``dict``/``namespace``)."""
  import jinja2
  import jinja2.ext
  from jinja2.sandbox import ImmutableSandboxedEnvironment

  class Generation(jinja2.ext.Extension):
    tags = {"generation"}

    def parse(self, parser):
      lineno = next(parser.stream).lineno
      body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
      return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
      return caller()

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)

  def raise_exception(message):
    raise _TemplateRaised(message)

  class TemplateDict:
    def __call__(self, *args, **kwargs):
      return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
      return dict.fromkeys(*args, **kwargs)

  class TemplateNamespace(jinja2.utils.Namespace):
    def __init__(*args, **kwargs):  # noqa: N805 — jinja's Namespace signature trick
      self, args = args[0], args[1:]
      attrs = dict(*args, **kwargs)
      for name in attrs:
        TemplateNamespace._check(name)
      jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
      TemplateNamespace._check(name)
      jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
      if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(
            f"chat templates cannot store underscore-prefixed attributes on a namespace: {name!r}")

  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                      extensions=[Generation, jinja2.ext.loopcontrols])
  env.filters["tojson"] = tojson
  env.globals["raise_exception"] = raise_exception
  env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
  env.globals["dict"] = TemplateDict()
  env.globals["namespace"] = TemplateNamespace
  try:
    return env.from_string(template)
  except jinja2.TemplateSyntaxError as e:
    raise ChatTemplateError(f"the chat template does not parse: {e} (line {e.lineno})") from None


def _render(template: str, **kw) -> str:
  compiled = _compile(template)
  try:
    return compiled.render(**kw)
  except _TemplateRaised as e:
    raise ChatTemplateError(f"chat template error: {e}") from None
  except ChatTemplateError:
    raise
  except Exception as e:  # noqa: BLE001 — undefined attributes, None + str, sandbox refusals
    raise ChatTemplateError(f"chat template failed to render: {type(e).__name__}: {e}") from None
