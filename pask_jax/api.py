"""The Python API of pask-jax (re-exported by :mod:`pask_jax`; see README, "Python API").

One code path for every front end: ``pask-jax generate`` calls :func:`generate`, and
:func:`submit` prepares engine requests with the same :func:`prepare`.

Choices where nothing else decides:

* ``dtype="auto"`` is float32 on a CPU host and bfloat16 on an accelerator (as the CLI).
* A string prompt is one user turn (after ``system`` when given); a list is the whole
  conversation (OpenAI-style message dicts).  The chat template renders it unless
  ``chat_template=False``; a template that ignores ``tools`` gets them described in a system
  message instead (:func:`pask_jax.grammar.tools_system_prompt`).
* A JSON schema is checked against its meta-schema (``jsonschema``) before XGrammar compiles it,
  so a schema that is not a schema is refused by name, not compiled into something else.
* Runners (the jitted prefill and decode step) are cached per model, kind and cache capacity
  (capacities are rounded up to multiples of 256), so repeated calls do not recompile.
* ``policy=None`` decodes with Full KV (the dense cache); a policy (a name, a directory or a
  :class:`~pask_jax.policy.FrozenPolicy`) decodes under PASK and the result carries the ledger.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import threading
import weakref
from typing import Any, Sequence

from pask_jax.prompt import Prompt

_lock = threading.Lock()
_runners: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


# --- results ---------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Generation:
  """One generated answer."""
  text: str
  tokens: list[int]
  finish: str                      # "stop" (stop token / grammar complete) or "length"
  prompt_tokens: int
  tool_calls: list[dict] | None = None   # with tools: the parsed calls ({"name", "arguments"})
  tool_call_error: str | None = None     # with tools: why no call parsed (e.g. cut at length)
  ledger: dict | None = None       # under a PASK policy: the KV ledger (see read_ledger)
  prefill_s: float = 0.0           # includes compilation on a first call
  decode_s: float = 0.0

  @property
  def tokens_per_s(self) -> float:
    return len(self.tokens) / self.decode_s if self.decode_s > 0 else float("nan")


# --- models and policies -----------------------------------------------------------------------

def load_model(name_or_path: str | None = None, *, dtype: Any = "auto"):
  """A registered name (default ``smollm2-135m-instruct``; ``qwen2.5-coder-0.5b-instruct``), a
  GGUF file or an HF checkpoint directory -> :class:`models.Loaded` ``(cfg, model, tokenizer)``.

  Raises ``FileNotFoundError`` / ``ValueError`` with a one-line message naming what is wrong
  (missing files, including tokenizer.json, are found before any weight loads)."""
  from pask_jax import platform
  return platform.load_model(name_or_path, dtype_name=dtype)


def load_policy(policy: Any, model):
  """``"all-high"``, ``"demo"``, a calibrated policy directory, or a FrozenPolicy -> the policy,
  checked against ``model`` (architecture, layers, KV heads, tokenizer): another model's policy is
  refused with a ``ValueError`` naming the field that differs."""
  from pask_jax import policy as P
  if isinstance(policy, P.FrozenPolicy):
    return P.bind(policy, model.cfg, model.tokenizer.hash())
  if not isinstance(policy, str):
    raise TypeError(f"policy must be a name, a directory or a FrozenPolicy, not "
                    f"{type(policy).__name__}")
  try:
    return P.resolve(policy, model.cfg, tokenizer_hash=model.tokenizer.hash())
  except FileNotFoundError as e:
    raise FileNotFoundError(f"policy {policy!r}: {e}") from None
  except ValueError as e:
    raise ValueError(f"policy {policy!r}: {e}") from None


def read_ledger(result) -> dict:
  """The KV ledger of a PASK generation (a :class:`Generation`, or an engine result dict):
  ``measured_B`` = (prefill + decode payload) / Full-KV payload, ``prefill_B``, ``decode_B``,
  payload bits, live bits, per-group R/L/H counts, plus ``actions`` (R/L/H totals over groups)
  and ``summary`` (the one-line text the CLI prints)."""
  from pask_jax import ledger as L
  row = result.ledger if hasattr(result, "ledger") else (result or {}).get("ledger")
  if row is None:
    raise ValueError("no ledger: this answer was not generated under a PASK policy "
                     "(pass policy=... to generate)")
  total = {a: sum(g[a] for part in ("prefill_counts", "decode_counts")
                  for g in row[part].values()) for a in ("R", "L", "H")}
  return {**row, "actions": total, "summary": L.format_summary([row])[4:]}


# --- prompts -----------------------------------------------------------------------------------

@functools.lru_cache(maxsize=4)
def _compiler(tokenizer, vocab_size: int):
  from pask_jax.grammar import GrammarCompiler
  return GrammarCompiler(tokenizer, vocab_size)


def check_schema(schema: Any) -> None:
  """Refuse a JSON schema that its meta-schema rejects (one-line ``ValueError``)."""
  import jsonschema
  if not isinstance(schema, (dict, bool)):
    raise ValueError(f"a JSON schema must be an object, got {type(schema).__name__}")
  try:
    jsonschema.validators.validator_for(schema).check_schema(schema)
  except jsonschema.SchemaError as e:
    raise ValueError(f"invalid JSON schema: {str(e).splitlines()[0]}") from None


def prepare(model, prompt: str | Sequence[dict], *, system: str | None = None,
            tools: Sequence[dict] | dict | None = None, json_schema: dict | None = None,
            tool_format: str | None = None, chat_template: bool = True,
            labels: bool = False, max_tokens: int = 0) -> Prompt:
  """Messages -> chat-template text -> ids (``labels``: with the prompt-span labels of the PASK
  prefill plan), plus the grammar for ``json_schema`` or ``tools``.  ``max_tokens``: refuse a
  prompt that cannot fit the model's context with that many new tokens."""
  from pask_jax import prompt as P
  from pask_jax.grammar import tool_call_grammar
  cfg, tok = model.cfg, model.tokenizer
  if tools is not None and json_schema is not None:
    raise ValueError("give tools or a JSON schema, not both")
  if isinstance(prompt, str):
    messages = [{"role": "user", "content": prompt}]
  elif isinstance(prompt, Sequence) and prompt and all(isinstance(m, dict) for m in prompt):
    messages = [dict(m) for m in prompt]
  else:
    raise ValueError("prompt must be a string or a non-empty list of message dicts")
  if system is not None:
    messages.insert(0, {"role": "system", "content": system})
  grammar, fmt = None, None
  if json_schema is not None:
    check_schema(json_schema)
    with _lock:
      grammar = _compiler(tok, cfg.vocab_size).json_schema(json_schema)
  elif tools is not None:
    tools = [tools] if isinstance(tools, dict) else list(tools)
    fmt, indent = P.style(cfg.arch, tool_format)
    with _lock:
      grammar = tool_call_grammar(_compiler(tok, cfg.vocab_size), tools, fmt, indent=indent)
  if chat_template and tok.chat_template:
    text = P.render(tok, messages, tools=tools, fmt=fmt)
  elif isinstance(prompt, str):
    text = prompt
  else:
    raise ValueError("a list of messages needs a chat template (the tokenizer has none, or "
                     "chat_template=False)")
  ids, tags = P.encode(tok, text, labels)
  if max_tokens and len(ids) + max_tokens > cfg.max_position:
    raise ValueError(f"prompt of {len(ids)} tokens + max_tokens {max_tokens} exceeds the model's "
                     f"context of {cfg.max_position} tokens")
  return Prompt(text, ids, tags, grammar, tools, fmt)


def _parse(text: str, prompt: Prompt) -> tuple[list[dict] | None, str | None]:
  if not prompt.tools:
    return None, None
  from pask_jax.grammar import parse_calls
  try:
    return parse_calls(text, prompt.fmt), None
  except ValueError as e:
    return None, str(e)


def _tracker(model, prompt: Prompt, pol):
  from pask_jax.tracker import Tracker
  if pol is not None and prompt.tools:   # structural tags of the tool-call output (§3.3)
    from pask_jax import policy as P
    from pask_jax.grammar.fc_adapter import FCAdapter
    return Tracker(prompt.grammar, FCAdapter(prompt.grammar, model.tokenizer,
                                             vocab=P.state_vocab(pol)))
  return Tracker(prompt.grammar)


def _runner(model, pol, capacity: int):
  """A cached Runner (Full KV) or PaskRunner (its policy set per call: a traced input)."""
  from pask_jax.decode import PaskRunner, Runner
  key = ("full" if pol is None else "pask", capacity)
  with _lock:
    cache = _runners.setdefault(model.model, {})
    r = cache.get(key)
    if r is None:
      r = (Runner(model.model, batch=1, capacity=capacity) if pol is None else
           PaskRunner(model.model, pol, batch=1, capacity=capacity))
      cache[key] = r
  if pol is not None:
    r.policy = pol
  return r


# --- generation --------------------------------------------------------------------------------

def generate(model, prompt: str | Sequence[dict], *, system: str | None = None,
             tools: Sequence[dict] | dict | None = None, json_schema: dict | None = None,
             tool_format: str | None = None, policy: Any = None, max_tokens: int = 64,
             temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
             chat_template: bool = True) -> Generation:
  """Generate one answer; with ``tools`` it is a tool call in the model's format (parsed into
  ``tool_calls``), with ``json_schema`` a JSON document valid for the schema.

  ``policy``: None (Full KV), ``"all-high"``, ``"demo"``, a calibrated policy directory or a
  FrozenPolicy: decode under PASK and report the ledger.  ``temperature`` 0 is greedy; sampling
  is seeded.  Bad input raises ``ValueError`` / ``FileNotFoundError`` with a one-line message."""
  from pask_jax.decode import Sampling, capacity_for, generate as run
  if max_tokens <= 0:
    raise ValueError(f"max_tokens must be positive, got {max_tokens}")
  if not temperature >= 0:   # also NaN
    raise ValueError(f"temperature must be >= 0 (0 is greedy), got {temperature}")
  if not 0 < top_p <= 1:
    raise ValueError(f"top_p must be in (0, 1], got {top_p}")
  if not isinstance(seed, int):
    raise ValueError(f"seed must be an int, got {seed!r}")
  pol = load_policy(policy, model) if policy is not None else None
  p = prepare(model, prompt, system=system, tools=tools, json_schema=json_schema,
              tool_format=tool_format, chat_template=chat_template, labels=pol is not None,
              max_tokens=max_tokens)
  runner = _runner(model, pol, capacity_for(len(p.ids), max_tokens))
  res = run(runner, model.tokenizer, [p.ids], trackers=[_tracker(model, p, pol)],
            prompt_tags=[p.tags], sampling=Sampling(max_tokens=max_tokens,
                                                    temperature=temperature, top_p=top_p,
                                                    seed=seed))[0]
  calls, why = _parse(res.text, p)
  return Generation(res.text, list(res.tokens), res.finish, len(p.ids), calls, why, res.ledger,
                    res.prefill_s, res.decode_s)


# --- the serving engine --------------------------------------------------------------------------

def start_engine(model, policy: Any = "all-high", *, slots: int = 4, context: int = 1024,
                 page: int = 16, hi_pages: int | None = None, lo_pages: int | None = None,
                 warmup: bool = True):
  """A started :class:`serve.engine.Engine`: continuous batching of ``slots`` sequences over one
  paged PASK cache (``context``: most tokens per request).  Send it requests with
  :func:`submit`; stop it with ``engine.stop()``.  ``pask-jax serve`` puts the OpenAI API on it."""
  from serve.engine import Engine
  pol = load_policy(policy, model)
  engine = Engine(model.model, model.tokenizer, pol, slots=slots, context=context, page=page,
                  hi_pages=hi_pages, lo_pages=lo_pages)
  engine.loaded = model
  if warmup:
    engine.warmup()
  return engine.start()


def submit(engine, prompt: str | Sequence[dict], *, system: str | None = None,
           tools: Sequence[dict] | dict | None = None, json_schema: dict | None = None,
           tool_format: str | None = None, max_tokens: int = 64, temperature: float = 0.0,
           top_p: float = 1.0, seed: int = 0,
           chat_template: bool = True) -> "concurrent.futures.Future[Generation]":
  """Queue one request on an engine from :func:`start_engine` -> a Future of its Generation
  (prepared exactly as :func:`generate` prepares it; the engine always decodes under its policy,
  so the result carries the ledger).  Thread-safe."""
  from serve.engine import Request
  model = getattr(engine, "loaded", None)
  if model is None:
    raise ValueError("submit() needs an engine started by pask_jax.start_engine (it keeps the "
                     "model's tokenizer and config for preparing requests)")
  if max_tokens <= 0:
    raise ValueError(f"max_tokens must be positive, got {max_tokens}")
  p = prepare(model, prompt, system=system, tools=tools, json_schema=json_schema,
              tool_format=tool_format, chat_template=chat_template, labels=True)
  fut: concurrent.futures.Future = concurrent.futures.Future()

  def emit(kind, payload):
    if fut.done():
      return
    if kind == "error":
      fut.set_exception(RuntimeError(payload))
    elif kind == "done":
      if payload is None:
        fut.cancel()
        return
      calls, why = _parse(payload["text"], p)
      fut.set_result(Generation(payload["text"], list(payload["tokens"]), payload["finish"],
                                payload["prompt_tokens"], calls, why, payload["ledger"]))

  req = Request.of(p, max_tokens, _tracker(model, p, engine.policy), temperature=temperature,
                   top_p=top_p, seed=seed % 2**32, emit=emit)
  engine.submit(req)   # ValueError when it can never fit (context, pools)
  return fut


def describe_result(g: Generation) -> str:
  """The CLI's one-line footer for a generation."""
  return (f"{g.prompt_tokens} prompt tokens, {len(g.tokens)} generated, finish={g.finish}, "
          f"prefill {g.prefill_s:.2f}s (incl. compile), decode {g.tokens_per_s:.1f} tokens/s "
          f"(incl. first-step compile)")
