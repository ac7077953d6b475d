"""Prefill, the jitted decode step, and the host-side generation loop (Full KV).

Data path per step (host <-> device)::

    host: matcher.accept(y_t) -> fill bitmask for t+1
    device (one jitted call): KV of y_t into the cache, logits for t+1, mask, sample y_{t+1}

Shapes are static: the step compiles once per (batch, capacity); prefill once per padded prompt
length bucket (multiples of ``PREFILL_BUCKET``), and prompts longer than ``PREFILL_CHUNK`` run as
chunks of that size through one compiled chunk function (the attention scores of a whole 8K
prompt at batch 8 would need 69 GB).  Temperature, top-p, PRNG keys and grammar
bitmasks are traced inputs.
"""
from __future__ import annotations

import collections
import dataclasses
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pask_jax import kv_dense
from pask_jax.grammar.matcher import Grammar, new_bitmask
from pask_jax.sample import apply_bitmask, sample

PREFILL_BUCKET = 64
PREFILL_CHUNK = 512


class CapacityError(ValueError):
  """The prompt (plus the requested new tokens) does not fit the cache capacity."""


@dataclasses.dataclass(frozen=True)
class Sampling:
  max_tokens: int = 64
  temperature: float = 0.0  # <= 0: greedy
  top_p: float = 1.0
  seed: int = 0


@dataclasses.dataclass
class Result:
  tokens: list[int]
  text: str
  prompt_len: int
  finish: str            # "stop" (stop token / grammar complete) or "length"
  prefill_s: float
  decode_s: float

  @property
  def tokens_per_s(self) -> float:
    return len(self.tokens) / self.decode_s if self.decode_s > 0 else float("nan")


class Runner:
  """Jitted prefill and decode step for one model over a dense Full-KV cache."""

  def __init__(self, model: nnx.Module, *, batch: int, capacity: int, cache_dtype=None):
    self.cfg = model.cfg
    self.graphdef, self.params = nnx.split(model)
    self.batch, self.capacity = batch, capacity
    self.cache_dtype = cache_dtype or jax.tree.leaves(self.params)[0].dtype
    self.traces: collections.Counter = collections.Counter()  # trace (= compile) counts
    self.prefill = jax.jit(self._prefill, donate_argnums=(1,))
    self.step = jax.jit(self._step, donate_argnums=(1,))
    self.select = jax.jit(self._select)

  def new_cache(self) -> kv_dense.DenseCache:
    c = self.cfg
    return kv_dense.init(c.n_layers, self.batch, self.capacity, c.n_kv_heads, c.head_dim,
                         self.cache_dtype)

  def _prefill(self, params, cache, tokens, start, lengths):
    """One prompt chunk: tokens [B, Tc] at positions start + [0, Tc) (right-padded prompts of
    ``lengths`` [B]) -> (logits at each sequence's last prompt token, clipped into this chunk
    [B, V], cache)."""
    self.traces["prefill"] += 1
    model = nnx.merge(self.graphdef, params)
    B, T = tokens.shape
    positions = jnp.broadcast_to(start + jnp.arange(T, dtype=jnp.int32), (B, T))
    cache = cache._replace(length=lengths.astype(jnp.int32))
    last = jnp.clip(lengths - 1 - start, 0, T - 1)
    logits, cache = model(tokens, positions, cache, kv_dense.attend, last_only=last)
    return logits[:, 0], cache

  def prefill_all(self, cache, tokens: np.ndarray, lengths: np.ndarray):
    """Whole (padded) prompts, chunk by chunk -> (last-token logits [B, V], cache)."""
    T = tokens.shape[1]
    chunk = min(T, PREFILL_CHUNK)
    lengths_d = jnp.asarray(lengths)
    logits = None
    for start in range(0, T, chunk):
      part, cache = self.prefill(self.params, cache, jnp.asarray(tokens[:, start:start + chunk]),
                                 jnp.int32(start), lengths_d)
      mine = jnp.asarray((lengths - 1 >= start) & (lengths - 1 < start + chunk))[:, None]
      logits = part if logits is None else jnp.where(mine, part, logits)
    return logits, cache

  def _step(self, params, cache, tokens, bits, key, temperature, top_p):
    """tokens [B] (the last accepted) -> (next tokens [B], logits [B, V], cache)."""
    self.traces["step"] += 1
    model = nnx.merge(self.graphdef, params)
    pos = cache.length[:, None]
    cache = cache._replace(length=cache.length + 1)
    logits, cache = model(tokens[:, None], pos, cache, kv_dense.attend)
    logits = logits[:, 0]
    return sample(apply_bitmask(logits, bits), key, temperature, top_p), logits, cache

  def _select(self, logits, bits, key, temperature, top_p):
    return sample(apply_bitmask(logits, bits), key, temperature, top_p)


def padded_len(n: int, bucket: int = PREFILL_BUCKET) -> int:
  """Prompt length after padding: a bucket multiple, or a chunk multiple past one chunk."""
  step = PREFILL_CHUNK if n > PREFILL_CHUNK else bucket
  return -(-n // step) * step


def capacity_for(prompt_len: int, max_tokens: int, round_to: int = 256) -> int:
  """A cache capacity that holds the padded prompt and ``max_tokens`` new tokens."""
  need = max(prompt_len + max_tokens, padded_len(prompt_len))
  return -(-need // round_to) * round_to


def pad_prompts(prompts: Sequence[Sequence[int]], batch: int, capacity: int,
                bucket: int = PREFILL_BUCKET) -> tuple[np.ndarray, np.ndarray]:
  lengths = np.array([len(p) for p in prompts] + [1] * (batch - len(prompts)), np.int32)
  if min(len(p) for p in prompts) == 0:
    raise ValueError("empty prompt")
  T = padded_len(int(lengths.max()), bucket)
  if int(lengths.max()) <= PREFILL_CHUNK:
    T = min(T, capacity)
  elif T > capacity:
    raise CapacityError(f"a prompt of {int(lengths.max())} tokens is prefilled in chunks of "
                        f"{PREFILL_CHUNK} and needs capacity >= {T} (got {capacity}); see "
                        "capacity_for()")
  tokens = np.zeros((batch, T), np.int32)
  for i, p in enumerate(prompts):
    tokens[i, :len(p)] = p
  return tokens, lengths


def generate(runner: Runner, tokenizer, prompts: Sequence[Sequence[int]], *,
             grammars: Sequence[Grammar | None] | None = None,
             sampling: Sampling = Sampling()) -> list[Result]:
  """Generate for up to ``runner.batch`` prompts of different lengths, each under its grammar."""
  B, V = runner.batch, runner.cfg.vocab_size
  n = len(prompts)
  if not 0 < n <= B:
    raise ValueError(f"got {n} prompts for a runner of batch {B}")
  for i, p in enumerate(prompts):
    if len(p) + sampling.max_tokens > runner.capacity:
      raise CapacityError(
          f"prompt {i} has {len(p)} tokens; with max_tokens={sampling.max_tokens} it needs "
          f"{len(p) + sampling.max_tokens} > capacity {runner.capacity}")
  grammars = list(grammars) if grammars is not None else [None] * n
  matchers = [g.matcher() if g is not None else None for g in grammars] + [None] * (B - n)
  stops = set(tokenizer.stop_ids)
  temp = jnp.full((B,), sampling.temperature, jnp.float32)
  top_p = jnp.full((B,), sampling.top_p, jnp.float32)
  key = jax.random.key(sampling.seed)
  bits = new_bitmask(B, V)

  def fill(active):
    bits[:] = -1
    for b in range(n):
      if active[b] and matchers[b] is not None:
        matchers[b].fill(bits, b)

  t0 = time.perf_counter()
  tokens, lengths = pad_prompts(prompts, B, runner.capacity)
  logits, cache = runner.prefill_all(runner.new_cache(), tokens, lengths)
  active = [True] * n + [False] * (B - n)
  fill(active)
  key, sub = jax.random.split(key)
  nxt = np.asarray(runner.select(logits, jnp.asarray(bits), sub, temp, top_p))
  t1 = time.perf_counter()
  out: list[list[int]] = [[] for _ in range(n)]
  finish = ["length"] * n
  for step in range(sampling.max_tokens):
    for b in range(n):
      if not active[b]:
        continue
      tok = int(nxt[b])
      m = matchers[b]
      if m is not None and not m.accept(tok):
        raise RuntimeError(f"grammar rejected token {tok} it allowed (sequence {b})")
      if tok in stops or (m is not None and m.terminated):
        active[b], finish[b] = False, "stop"
        if tok not in stops:
          out[b].append(tok)
        continue
      out[b].append(tok)
      if len(out[b]) >= sampling.max_tokens:
        active[b] = False
    if not any(active) or step == sampling.max_tokens - 1:
      break
    fill(active)
    key, sub = jax.random.split(key)
    nxt_dev, _, cache = runner.step(runner.params, cache, jnp.asarray(nxt), jnp.asarray(bits), sub,
                                    temp, top_p)
    nxt = np.asarray(nxt_dev)
  t2 = time.perf_counter()
  return [Result(out[b], tokenizer.decode(out[b]), len(prompts[b]), finish[b], t1 - t0, t2 - t1)
          for b in range(n)]
