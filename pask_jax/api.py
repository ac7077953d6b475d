"""The Python API of pask-jax (re-exported by :mod:`pask_jax`; see README, "Python API").

One code path for every front end: ``pask-jax generate`` calls :func:`generate`, and
:func:`submit` prepares engine requests with the same :func:`prepare`.

Choices where nothing else decides:

* ``dtype="auto"`` is float32 on a CPU host and bfloat16 on an accelerator (as the CLI).
* A string prompt is one user turn (after ``system`` when given); a list is the whole
  conversation (OpenAI-style message dicts).  The chat template renders it unless
  ``chat_template=False``; ``chat_template="..."`` replaces the model's template with a file or
  the template itself, resolved and checked as ``pask-jax serve --chat-template`` does
  (:func:`pask_jax.prompt.load_chat_template`); a template that ignores ``tools`` gets them
  described in a system message instead (:func:`pask_jax.grammar.tools_system_prompt`).
* ``max_tokens=None`` (the default) is ``pask-jax serve``'s default for a chat completion:
  :data:`pask_jax.options.DEFAULT_MAX_TOKENS` (256) new tokens, capped by the room the prompt
  leaves in the context (the model's for :func:`generate`, the engine's for :func:`submit`).
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

from pask_jax.options import DEFAULT_MAX_TOKENS, ENGINE, check_engine
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
  # with SamplingParams.logprobs (engine requests): per token (log-prob, [(id, log-prob)] of the
  # top alternatives), as pask-jax serve computes them
  logprobs: list | None = None

  @property
  def tokens_per_s(self) -> float:
    return len(self.tokens) / self.decode_s if self.decode_s > 0 else float("nan")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How one request samples, the fields of ``pask-jax serve``'s requests: ``max_tokens`` new
  tokens (> 0; None: the server's default, :data:`~pask_jax.options.DEFAULT_MAX_TOKENS` capped
  by the room the prompt leaves in the context); ``temperature`` >= 0 (0 is greedy); ``top_p``
  in (0, 1]; ``seed`` (an int); ``stop`` strings (a string or up to 16, matched on the text also
  across token boundaries and cut from it, finish "stop"); ``logprobs`` (None, or 0..20 top
  alternatives per token: engine requests, :func:`submit`); ``n`` answers per prompt (1: as the
  server, n > 1 is refused).  Bad values raise a one-line ``ValueError`` naming the field."""
  max_tokens: int | None = None
  temperature: float = 0.0
  top_p: float = 1.0
  seed: int = 0
  stop: tuple[str, ...] = ()
  logprobs: int | None = None
  n: int = 1

  def __post_init__(self):
    whole = lambda x: isinstance(x, int) and not isinstance(x, bool)
    if self.max_tokens is not None and (not whole(self.max_tokens) or self.max_tokens <= 0):
      raise ValueError(f"max_tokens must be positive (or None: the default), got "
                       f"{self.max_tokens!r}")
    if not (isinstance(self.temperature, (int, float)) and self.temperature >= 0
            and self.temperature != float("inf")):   # NaN fails too
      raise ValueError(f"temperature must be >= 0 (0 is greedy), got {self.temperature!r}")
    if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
    if not whole(self.seed):
      raise ValueError(f"seed must be an int, got {self.seed!r}")
    stop = (self.stop,) if isinstance(self.stop, str) else self.stop
    if stop is None:
      stop = ()
    if not (isinstance(stop, (list, tuple)) and all(isinstance(x, str) and x for x in stop)):
      raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
    if len(stop) > 16:
      raise ValueError(f"stop takes at most 16 strings, got {len(stop)}")
    object.__setattr__(self, "stop", tuple(stop))
    if self.logprobs is not None and not (whole(self.logprobs) and 0 <= self.logprobs <= 20):
      raise ValueError(f"logprobs must be None or an int in [0, 20], got {self.logprobs!r}")
    if not whole(self.n) or self.n < 1:
      raise ValueError(f"n must be a positive int, got {self.n!r}")
    if self.n > 1:
      raise ValueError(f"n={self.n}: one answer per prompt (as pask-jax serve); pass the prompt "
                       f"{self.n} times in a batch, or submit it with different seeds")


def _sampling(sampling: SamplingParams | None, **given) -> SamplingParams:
  given = {k: v for k, v in given.items() if v is not None}
  if sampling is None:
    return SamplingParams(**given)
  if not isinstance(sampling, SamplingParams):
    raise TypeError(f"sampling must be a SamplingParams, not {type(sampling).__name__}")
  if given:
    raise ValueError(f"give sampling= or {', '.join(given)}, not both")
  return sampling


# --- models and policies -----------------------------------------------------------------------

def load_model(name_or_path: str | None = None, *, dtype: Any = "auto", center_keys: bool = True):
  """A registered name (default ``smollm2-135m-instruct``; ``qwen2.5-coder-0.5b-instruct``), a
  GGUF file or an HF checkpoint directory -> :class:`models.Loaded` ``(cfg, model, tokenizer)``.

  Raises ``FileNotFoundError`` / ``ValueError`` with a one-line message naming what is wrong
  (missing files, including tokenizer.json, are found before any weight loads).

  ``center_keys`` (default on): subtract a fixed per-channel mean from the post-RoPE keys
  (:mod:`models.center`): the same attention, far smaller INT4 key error on models whose keys
  carry a channel offset (Qwen2.5)."""
  from pask_jax import platform
  return platform.load_model(name_or_path, dtype_name=dtype, center_keys=center_keys)


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
            tool_format: str | None = None, chat_template: bool | str = True,
            labels: bool = False, max_tokens: int = 0) -> Prompt:
  """Messages -> chat-template text -> ids (``labels``: with the prompt-span labels of the PASK
  prefill plan), plus the grammar for ``json_schema`` or ``tools``.  ``chat_template``: True
  (the model's), False (a string prompt as it is), or a template file's path or the template
  itself, in place of the model's (:func:`pask_jax.prompt.load_chat_template`, as ``pask-jax
  serve --chat-template``).  ``max_tokens``: refuse a prompt that cannot fit the model's context
  with that many new tokens."""
  from pask_jax import prompt as P
  from pask_jax.grammar import tool_call_grammar
  cfg, tok = model.cfg, model.tokenizer
  if tools is not None and json_schema is not None:
    raise ValueError("give tools or a JSON schema, not both")
  renders = tok   # the model's tokenizer, or a copy of it with the caller's template
  if isinstance(chat_template, str):
    renders = P.with_chat_template(tok, P.load_chat_template(chat_template, "chat_template"),
                                   "chat_template")
  elif not isinstance(chat_template, bool):
    raise ValueError(f"chat_template must be True, False, or a template (a file path or the "
                     f"template itself), got {chat_template!r}")
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
  if chat_template is not False and renders.chat_template:
    text = P.render(renders, messages, tools=tools, fmt=fmt)
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


def _runner(model, pol, capacity: int, batch: int = 1):
  """A cached Runner (Full KV) or PaskRunner (its policy set per call: a traced input) of
  ``batch`` rows."""
  from pask_jax.decode import PaskRunner, Runner
  key = ("full" if pol is None else "pask", capacity) + ((batch,) if batch > 1 else ())
  with _lock:
    cache = _runners.setdefault(model.model, {})
    r = cache.get(key)
    if r is None:
      r = (Runner(model.model, batch=batch, capacity=capacity) if pol is None else
           PaskRunner(model.model, pol, batch=batch, capacity=capacity))
      cache[key] = r
  if pol is not None:
    r.policy = pol
  return r


# --- generation --------------------------------------------------------------------------------

class _StopText:
  """A request's tracker that also ends the row once its text holds a stop string (matched on
  the decoded text, so across token boundaries)."""

  def __init__(self, inner, tokenizer, stop: tuple[str, ...]):
    self.inner, self.tok, self.stop = inner, tokenizer, stop
    self.ends, self.out, self.hit = set(tokenizer.stop_ids), [], False

  def fill(self, bits, row):
    self.inner.fill(bits, row)

  def accept(self, token: int):
    out = self.inner.accept(token)
    if token not in self.ends:
      self.out.append(token)
      text = self.tok.decode(self.out)
      self.hit = any(x in text for x in self.stop)
    return out

  @property
  def terminated(self) -> bool:
    return self.hit or self.inner.terminated

  def __getattr__(self, name):   # matcher, adapter, ... of the wrapped tracker
    return getattr(self.inner, name)


def _cut(text: str, stop: tuple[str, ...]) -> tuple[str, bool]:
  at = [i for i in (text.find(x) for x in stop) if i >= 0]
  return (text[:min(at)], True) if at else (text, False)


def _check_stop(sp: SamplingParams, tools, json_schema) -> None:
  if sp.stop and (tools is not None or json_schema is not None):
    raise ValueError("stop cannot be used with tools or json_schema: their grammar constrains "
                     "the whole answer, and a cut would break it (as pask-jax serve refuses)")


def is_batch(prompt: Any) -> bool:
  """A list of prompts (strings or message lists), as opposed to one prompt (a string or one
  conversation: a list of message dicts)."""
  return (isinstance(prompt, (list, tuple)) and bool(prompt)
          and all(isinstance(q, (str, list, tuple)) for q in prompt))


def generate(model, prompt: str | Sequence[dict] | Sequence[str | Sequence[dict]], *,
             system: str | None = None, tools: Sequence[dict] | dict | None = None,
             json_schema: dict | None = None, tool_format: str | None = None,
             policy: Any = None, max_tokens: int | None = None,
             temperature: float | None = None, top_p: float | None = None,
             seed: int | None = None, stop: str | Sequence[str] | None = None,
             logprobs: int | None = None, n: int | None = None,
             sampling: SamplingParams | None = None,
             chat_template: bool | str = True) -> Generation | list[Generation]:
  """Generate one answer; with ``tools`` it is a tool call in the model's format (parsed into
  ``tool_calls``), with ``json_schema`` a JSON document valid for the schema.

  ``prompt``: a string (one user turn), a conversation (a list of message dicts), or a batch: a
  list of those, generated together as one ragged batch through the same runner (one compile
  per batch size, rounded up to a power of two) and returned as a list of Generations in order;
  every prompt of a batch shares ``system``, ``tools``, ``json_schema``, ``policy`` and the
  sampling, and a sampled (temperature > 0) batch is seeded as a whole (the same batch and seed
  give the same answers).
  ``tool_format``: the tool-call format (``hermes``, vLLM's name, = ``tool_call_tags``:
  ``<tool_call>`` blocks; ``fenced_json``; ``json_list``; None: the model family's measured
  one), the names ``serve --tool-call-parser`` takes.
  ``policy``: None (Full KV), ``"all-high"``, ``"demo"``, a calibrated policy directory or a
  FrozenPolicy: decode under PASK and report the ledger.  Sampling: ``sampling=``
  :class:`SamplingParams`, or its fields as keywords (default: greedy, seed 0, and
  :data:`~pask_jax.options.DEFAULT_MAX_TOKENS` new tokens capped by the room the longest prompt
  leaves in the model's context, as the server's default); ``temperature`` 0 is greedy;
  sampling is seeded; ``logprobs`` are computed by the engine only (:func:`submit`).
  ``chat_template``: True (the model's), False, or a template file or text (:func:`prepare`).
  Bad input raises ``ValueError`` / ``FileNotFoundError`` with a one-line message."""
  from pask_jax.decode import Sampling, capacity_for, generate as run
  sp = _sampling(sampling, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                 seed=seed, stop=stop, logprobs=logprobs, n=n)
  if sp.logprobs is not None:
    raise ValueError("logprobs: pask_jax.generate does not compute log-probs; the engine does "
                     "(pask_jax.submit, pask-jax serve)")
  _check_stop(sp, tools, json_schema)
  prompts = list(prompt) if is_batch(prompt) else [prompt]
  pol = load_policy(policy, model) if policy is not None else None
  ps = [prepare(model, q, system=system, tools=tools, json_schema=json_schema,
                tool_format=tool_format, chat_template=chat_template, labels=pol is not None,
                max_tokens=sp.max_tokens or 1) for q in prompts]
  longest = max(len(p.ids) for p in ps)
  new = sp.max_tokens or min(DEFAULT_MAX_TOKENS, model.cfg.max_position - longest)
  rows = 1 << (len(ps) - 1).bit_length()   # batch sizes compile once each: powers of two
  runner = _runner(model, pol, capacity_for(longest, new), rows)
  trackers = [_tracker(model, p, pol) for p in ps]
  if sp.stop:
    trackers = [_StopText(t, model.tokenizer, sp.stop) for t in trackers]
  res = run(runner, model.tokenizer, [p.ids for p in ps], trackers=trackers,
            prompt_tags=[p.tags for p in ps],
            sampling=Sampling(max_tokens=new, temperature=sp.temperature,
                              top_p=sp.top_p, seed=sp.seed))
  out = []
  for r, p in zip(res, ps):
    text, cut = _cut(r.text, sp.stop)
    calls, why = _parse(text, p)
    out.append(Generation(text, list(r.tokens), "stop" if cut else r.finish, len(p.ids), calls,
                          why, r.ledger, r.prefill_s, r.decode_s))
  return out if is_batch(prompt) else out[0]


# --- the serving engine --------------------------------------------------------------------------

def start_engine(model, policy: Any = ENGINE.policy, *, slots: int = ENGINE.slots,
                 context: int = ENGINE.context, page: int = ENGINE.page,
                 hi_pages: int | None = None, lo_pages: int | None = None,
                 kv_memory: float | None = None, gpu_memory_utilization: float | None = None,
                 kv_mix: tuple[float, float] | None = None, preemption: str = ENGINE.preemption,
                 prefill_chunk: int = ENGINE.prefill_chunk,
                 prefill_share: float = ENGINE.prefill_share, lo_format: str = ENGINE.lo_format,
                 lo_page: int | None = ENGINE.lo_page,
                 tool_format: str | None = None, warmup: bool | int = True,
                 tensor_parallel_size: int = ENGINE.tensor_parallel_size):
  """A started :class:`serve.engine.Engine`: continuous batching of ``slots`` sequences over one
  paged PASK cache (``context``: most tokens per request).  Send it requests with
  :func:`submit`; stop it with ``engine.stop()``.  ``pask-jax serve`` puts the OpenAI API on it.

  The options are ``pask-jax serve``'s, with its defaults (one source:
  :data:`pask_jax.options.ENGINE`): ``policy`` (``--policy``, "all-high"), ``slots``
  (``--max-num-seqs``, 4), ``context`` (``--max-model-len``, 2048), ``page`` (``--page``, 16);
  the KV memory budget ``kv_memory`` in GB (``--kv-memory``) or ``gpu_memory_utilization`` (a
  fraction in (0, 1] of the device's free memory; give at most one; neither: every slot gets
  its full context), ``kv_mix`` (expected H and L fractions for sizing), ``hi_pages`` /
  ``lo_pages`` (pool sizes overriding the budget's), ``preemption`` ("replay", the default, or
  "recompute"), ``prefill_chunk`` (64, 128, 256 or 512, the default) and ``prefill_share`` (in
  (0, 1), default 1/3), ``lo_format`` (``--lo-format``: the INT4 pool's storage, "bytes", the
  default, "int4": head-major int4 pages for the Mosaic GPU kernel on Hopper, pages a multiple
  of 64 there, or "auto": "int4" where that kernel runs and takes the model, else "bytes"),
  ``lo_page`` (``--lo-page``: rows per INT4 page; None: ``page``, or 128 for "int4" on a GPU
  when ``page`` is not a multiple of 64).  ``tool_format`` (``--tool-call-parser``): the
  tool-call format of every request that names none (``hermes``, vLLM's name, = ``tool_call_tags``;
  ``fenced_json``; ``json_list``; None: the model family's).  ``warmup``: compile before
  serving the decode step and every prompt bucket (True, as the server does), only the buckets
  of prompts up to that many tokens (an int: a faster start where prompts are short; longer
  ones compile on first use), or nothing (False).  ``tensor_parallel_size``
  (``--tensor-parallel-size``): serve on the first that many local devices, the weights, pools
  and windows split by head (:mod:`pask_jax.mesh`); ``kv_memory`` / ``gpu_memory_utilization``
  are then each device's budget.  Bad values: one-line ``ValueError``."""
  from pask_jax import mesh as tp
  from serve.engine import Engine, check_lo_format
  check_engine(slots=slots, context=context, page=page, hi_pages=hi_pages, lo_pages=lo_pages,
               kv_memory=kv_memory, gpu_memory_utilization=gpu_memory_utilization,
               kv_mix=kv_mix, preemption=preemption, prefill_chunk=prefill_chunk,
               prefill_share=prefill_share, lo_format=lo_format, lo_page=lo_page,
               tensor_parallel_size=tensor_parallel_size, tool_format=tool_format)
  if not isinstance(warmup, bool) and not (isinstance(warmup, int) and warmup > 0):
    raise ValueError(f"warmup must be True, False or a positive int (tokens), got {warmup!r}")
  check_lo_format(lo_format, page, "auto", lo_page)
  mesh = tp.serving_mesh(tensor_parallel_size, model.cfg)
  pol = load_policy(policy, model)
  engine = Engine(model.model, model.tokenizer, pol, slots=slots, context=context, page=page,
                  hi_pages=hi_pages, lo_pages=lo_pages,
                  kv_bytes=None if kv_memory is None else int(kv_memory * 1e9),
                  gpu_memory_utilization=gpu_memory_utilization,
                  mix=None if kv_mix is None else tuple(kv_mix), preemption=preemption,
                  prefill_chunk=prefill_chunk, prefill_share=prefill_share,
                  lo_format=lo_format, lo_page=lo_page, mesh=mesh)
  engine.loaded, engine.tool_format = model, tool_format
  if warmup:
    engine.warmup(None if warmup is True else warmup)
  return engine.start()


def submit(engine, prompt: str | Sequence[dict], *, system: str | None = None,
           tools: Sequence[dict] | dict | None = None, json_schema: dict | None = None,
           tool_format: str | None = None, max_tokens: int | None = None,
           temperature: float | None = None, top_p: float | None = None,
           seed: int | None = None, stop: str | Sequence[str] | None = None,
           logprobs: int | None = None, n: int | None = None,
           sampling: SamplingParams | None = None,
           chat_template: bool | str = True) -> "concurrent.futures.Future[Generation]":
  """Queue one request on an engine from :func:`start_engine` -> a Future of its Generation
  (prepared exactly as :func:`generate` prepares it; the engine always decodes under its policy,
  so the result carries the ledger).  Sampling as for :func:`generate`, plus ``logprobs``
  (``Generation.logprobs``); ``max_tokens=None`` is capped by the room the prompt leaves in the
  engine's ``context``, as the server caps it.  ``tool_format``: None takes the engine's
  (``start_engine(tool_format=...)``, like ``serve --tool-call-parser``).  Thread-safe."""
  from serve.engine import Request
  model = getattr(engine, "loaded", None)
  if model is None:
    raise ValueError("submit() needs an engine started by pask_jax.start_engine (it keeps the "
                     "model's tokenizer and config for preparing requests)")
  sp = _sampling(sampling, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                 seed=seed, stop=stop, logprobs=logprobs, n=n)
  _check_stop(sp, tools, json_schema)
  if tool_format is None:   # the engine's (start_engine(tool_format=...)), as the server's
    tool_format = getattr(engine, "tool_format", None)
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
                                payload["prompt_tokens"], calls, why, payload["ledger"],
                                logprobs=payload.get("logprobs")
                                if sp.logprobs is not None else None))

  new = sp.max_tokens or max(1, min(DEFAULT_MAX_TOKENS, engine.context - len(p.ids)))
  req = Request.of(p, new, _tracker(model, p, engine.policy),
                   temperature=sp.temperature, top_p=sp.top_p, seed=sp.seed % 2**32,
                   stop=sp.stop, logprobs=sp.logprobs, emit=emit)
  engine.submit(req)   # ValueError when it can never fit (context, pools)
  return fut


def describe_result(g: Generation) -> str:
  """The CLI's one-line footer for a generation."""
  return (f"{g.prompt_tokens} prompt tokens, {len(g.tokens)} generated, finish={g.finish}, "
          f"prefill {g.prefill_s:.2f}s (incl. compile), decode {g.tokens_per_s:.1f} tokens/s "
          f"(incl. first-step compile)")
