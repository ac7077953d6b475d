"""Prefill, the jitted decode step, and the host-side generation loop, for Full KV and PASK.

Data path per step (host <-> device)::

    host: tracker.accept(y_t) -> grammar matcher + adapter -> tag ids z_t, parser-state id s_t;
          fill the bitmask for t+1
    device (one jitted call): controller (Alg. 2) -> actions a_t[G]; cache.begin_step (the token
          leaving the window is materialized); per layer: write K/V of y_t, attention over
          {INT4 pool, BF16 pool, window}; logits for t+1; mask; sample y_{t+1}

Two runners share :func:`generate`: :class:`Runner` over the dense Full-KV cache (the baseline)
and :class:`PaskRunner` over the mixed-precision cache of :mod:`pask_jax.cache`.  Shapes are
static: a step compiles once per (batch, capacity); prefill once per padded prompt length bucket
(multiples of ``PREFILL_BUCKET``), and prompts longer than ``PREFILL_CHUNK`` run as chunks of that
size through one compiled chunk function (the attention scores of a whole 8K prompt at batch 8
would need 69 GB).  Tags, parser states, budgets, temperatures, PRNG keys and grammar bitmasks are
traced inputs; the policy is a traced pytree too (so calibration can vmap a stack of policies).
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import pallas_kernels
from pallas_kernels import int4
from models import decoder
from pask_jax import cache as pcache
from pask_jax import controller, kv_dense, ledger
from pask_jax import mesh as tp
from pask_jax import policy as P
from pask_jax import recycle
from pask_jax.traces import Traces
from pask_jax import tags as T
from pask_jax import actions as Act
from pask_jax.grammar.matcher import Grammar, new_bitmask
from pask_jax.sample import apply_bitmask, how_of, sample
from pask_jax.tracker import FREE_TAG, Tracker, with_positions

PREFILL_BUCKET = 64
PREFILL_CHUNK = 512
# FREE_TAG (tracker.py): a token generated without a grammar adapter; PROMPT_TAG: an unlabeled
# prompt token.
PROMPT_TAG = T.candidates(T.prompt(T.PromptLabel.PROTECTED_CONTENT))


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
  # PASK runs: the request's KV ledger (pask_jax.ledger.summary).  It counts the tokens whose KV
  # entered the cache; the last token of a generation cut at max_tokens never does.
  ledger: dict | None = None
  # Runners with a kernel path (``runner.hbm``): the decode step's HBM bytes over the final
  # cache (:func:`hbm_rows`' fields: hbm_bytes_per_token, hbm_kv_bytes, b_HBM, hbm_granularity).
  hbm: dict | None = dataclasses.field(default=None, compare=False)

  @property
  def tokens_per_s(self) -> float:
    return len(self.tokens) / self.decode_s if self.decode_s > 0 else float("nan")


class Runner:
  """Jitted prefill and decode step for one model over a dense Full-KV cache."""

  def __init__(self, model: nnx.Module, *, batch: int, capacity: int, cache_dtype=None,
               attn_out_dtype=None, mesh: jax.sharding.Mesh | None = None,
               shard_vocab: bool = True):
    """``attn_out_dtype``: round decode-step attention outputs to this dtype (bfloat16, as the
    PASK decode kernels do; prefill stays at full precision in both) — for numerics-matched
    comparisons of the two caches.

    ``mesh``: tensor parallelism over a 1-D ``model`` mesh of more than one device
    (:mod:`pask_jax.mesh`: weights by head / column / row, the cache by KV head, embeddings and
    lm_head by vocabulary unless ``shard_vocab=False``); the model takes the layer layout it
    would take on one device (``models.decoder.prepare``), the unrolled one's fused columns
    ordered for the mesh."""
    self.cfg = model.cfg
    self.tp_mesh = mesh if mesh is not None and mesh.size > 1 else None
    self.attend = kv_dense.attend if attn_out_dtype is None else (
        lambda *a: _round_out(kv_dense.attend(*a), attn_out_dtype))
    if self.tp_mesh is None:
      decoder.prepare(model)   # the layer layout for this backend (in place; see models.decoder)
      self.graphdef, self.params = decoder.split(model)
    else:
      self.graphdef, self.params = tp.prepare_model(model, self.tp_mesh, shard_vocab=shard_vocab)
    self.batch, self.capacity = batch, capacity
    self.param_bytes = param_bytes(self.params)
    self.cache_dtype = cache_dtype or jax.tree.leaves(self.params)[0].dtype
    self.traces = Traces()   # trace (= compile) counts
    if self.tp_mesh is None:
      self.prefill = jax.jit(self._prefill, donate_argnums=(1,))
      self.step = recycle.step_jit(self._step, recycle.logits_like(batch, self.cfg.vocab_size),
                                   donate_argnums=(1,))
      self.select = jax.jit(self._select, static_argnames=("how",))
      return
    m = self.tp_mesh
    ps, cs, rep = jax.tree.map(lambda x: x.sharding, self.params), self.cache_sharding(), \
        tp.replicated(m)
    lg = tp.logits_sharding(m, shard_vocab=shard_vocab)
    self.prefill = jax.jit(self._prefill, donate_argnums=(1,), in_shardings=(ps, cs, rep, rep, rep),
                           out_shardings=(lg, cs))
    self.step = jax.jit(self._step, donate_argnums=(1,), in_shardings=(ps, cs) + (rep,) * 5,
                        out_shardings=(rep, lg, cs), static_argnames=("how",))
    self.select = jax.jit(self._select, in_shardings=(lg,) + (rep,) * 4, out_shardings=rep,
                          static_argnames=("how",))

  def cache_sharding(self) -> kv_dense.DenseCache:
    """The dense cache's shardings (mesh runs): K/V by KV head, lengths replicated."""
    kv = tp.by_kv_head(self.tp_mesh, 5, 3)
    return kv_dense.DenseCache(kv, kv, tp.replicated(self.tp_mesh))

  def new_cache(self, *, batch: int | None = None, capacity: int | None = None,
                dtype=None) -> kv_dense.DenseCache:
    c = self.cfg
    make = lambda: kv_dense.init(c.n_layers, batch or self.batch, capacity or self.capacity,
                                 c.n_kv_heads, c.head_dim, dtype or self.cache_dtype)
    if self.tp_mesh is None:
      return make()
    return jax.jit(make, out_shardings=self.cache_sharding())()   # each device its own heads

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
    for logits, cache in self.prefill_chunks(cache, tokens, lengths):
      pass
    return logits, cache

  def prefill_chunks(self, cache, tokens: np.ndarray, lengths: np.ndarray,
                     chunk: int = PREFILL_CHUNK, ahead: int | None = None):
    """:meth:`prefill_all` one chunk of ``chunk`` tokens at a time (a power of two that divides the
    padded length, or more than it): a generator of (None, cache) after each chunk but the last
    and (last-token logits [B, V], cache) after the last, so a caller can interleave other work
    (the serving engine runs decode steps between the chunks of a long prompt).

    ``ahead``: at most this many chunks unfinished on the device when a chunk is yielded (after
    dispatching a chunk, wait for the one ``ahead`` before it); None: no limit.  The engine
    uses 1: work it puts between two chunks (a short prompt) waits for at most one chunk,
    and the host still launches each chunk while the one before it runs."""
    T = tokens.shape[1]
    chunk = min(T, chunk)
    if T % chunk:
      raise ValueError(f"a prefill chunk of {chunk} tokens does not divide the padded prompt "
                       f"length {T}")
    lengths_d = jnp.asarray(lengths)
    logits = None
    parts = collections.deque()   # the chunks' logits: never donated, so they can be waited on
    for start in range(0, T, chunk):
      part, cache = self.prefill(self.params, cache, jnp.asarray(tokens[:, start:start + chunk]),
                                 jnp.int32(start), lengths_d)
      parts.append(part)
      while ahead is not None and len(parts) > ahead:   # launched this one while that one ran
        jax.block_until_ready(parts.popleft())
      mine = jnp.asarray((lengths - 1 >= start) & (lengths - 1 < start + chunk))[:, None]
      logits = part if logits is None else jnp.where(mine, part, logits)
      yield (logits if start + chunk >= T else None), cache

  def _step(self, params, cache, tokens, bits, key, temperature, top_p, how=None):
    """tokens [B] (the last accepted) -> (next tokens [B], logits [B, V], cache).

    ``how`` (static, by position or keyword; on a mesh by position only): the sampler's
    branches, :func:`pask_jax.sample.how_of` of ``temperature`` and ``top_p``; None: chosen on
    the device by ``lax.cond`` (:func:`pask_jax.sample.sample`), which XLA's GPU runtime runs on
    the host, waiting for the device there."""
    self.traces["step"] += 1
    model = nnx.merge(self.graphdef, params)
    pos = cache.length[:, None]
    cache = cache._replace(length=cache.length + 1)
    logits, cache = model(tokens[:, None], pos, cache, self.attend)
    logits = logits[:, 0]
    with jax.named_scope("sample"):
      nxt = self._select(logits, bits, key, temperature, top_p, how)
    return nxt, logits, cache

  def _select(self, logits, bits, key, temperature, top_p, how=None):
    """Masked sampling of ``logits``; ``how``: :func:`pask_jax.sample.sample`'s (static)."""
    masked = apply_bitmask(logits, bits)
    if self.tp_mesh is not None:   # the mask on each vocabulary shard, then one gather to sample
      masked = jax.lax.with_sharding_constraint(masked, tp.replicated(self.tp_mesh))
    return sample(masked, key, temperature, top_p, how=how)

  # --- the session protocol used by generate() ----------------------------------------------

  def begin(self, tokens: np.ndarray, lengths: np.ndarray, prompt_tags=None):
    return self.prefill_all(self.new_cache(), tokens, lengths)

  def advance(self, state, tokens, tag_ids, state_ids, active, bits, key, temperature, top_p,
              how=None):
    nxt, _, state = self.advance_logits(state, tokens, tag_ids, state_ids, active, bits, key,
                                        temperature, top_p, how)
    return nxt, state

  def advance_logits(self, state, tokens, tag_ids, state_ids, active, bits, key, temperature,
                     top_p, how=None):
    """:meth:`advance` that also returns the step's logits ``[B, V]`` -> (next, logits, state):
    the forced-token path (feed given tokens, score them: W1 of :mod:`calibrate.longctx`).
    On one GPU the logits are valid until the next step (:mod:`pask_jax.recycle`).  ``how``:
    the sampler's static branches, :func:`pask_jax.sample.how_of` of ``temperature`` and
    ``top_p`` (None: chosen on the device, :func:`pask_jax.sample.sample`)."""
    return self.step(self.params, state, tokens, bits, key, temperature, top_p, how)

  def report(self, state) -> list[dict] | None:
    return None

  def hbm(self, state: kv_dense.DenseCache) -> list[dict]:
    """Per sequence the decode step's HBM bytes (:func:`hbm_rows`): the weights' share and the
    whole dense cache (:func:`pask_jax.kv_dense.hbm_bytes`: XLA reads every slot), against
    paged dense BF16 over the tokens the cache holds (default window, pages of 16, at the
    granularity of this host's kernels)."""
    L, B, S, H, D = state.k.shape
    gran = pcache.granularity_of(pallas_kernels.resolve_backend("auto"))
    kv = np.full((B,), kv_dense.hbm_bytes(L, S, H, D, itemsize=state.k.dtype.itemsize))
    dense = pcache.dense_hbm_bytes(np.asarray(state.length), n_layers=L, n_kv_heads=H,
                                   head_dim=D, window=P.DEFAULT_WINDOW, granularity=gran)
    return hbm_rows(kv, dense, self.param_bytes, self.batch, gran)



class PaskRunner:
  """Prefill and the jitted PASK decode step over the mixed-precision cache.

  ``decode_step(params, policy, cache, budget, led, tokens[B], tag_ids[B, 4], state_ids[B],
  active[B]) -> (logits[B, V], cache, budget, led, actions[B, G])`` is docs/DESIGN.md's step plus
  the policy (a traced pytree), the ledger and an ``active`` mask (finished sequences are neither
  charged nor written).  ``budget`` is the balance R_t of Alg. 2 *including* the current token's
  allowance (R_1 = b).  Prefill runs at full precision over a dense scratch cache, then the
  prefill plan (§3.6, B.4) retains H, quantizes L and releases R (B.4: "prefill first uses
  all-BF16 scratch storage").
  """

  def __init__(self, model: nnx.Module, policy, *, batch: int, capacity: int, page: int = 16,
               backend: str = "auto", lo_page: int | None = None, lo_format: str = "bytes",
               mesh: jax.sharding.Mesh | None = None, shard_vocab: bool = True,
               kernel_knobs: dict | None = None):
    """``mesh``: tensor parallelism over a 1-D ``model`` mesh of more than one device (as
    :class:`Runner`; the pools and the window by KV head, page tables, controller and ledger
    replicated).  The reference attention runs under the SPMD partitioner; a Pallas backend
    ("gpu", "tpu") runs per shard (``shard_map``: each device its own KV heads and their query
    heads, :func:`pask_jax.mesh.attention_per_shard`).

    ``kernel_knobs``: keyword arguments for ``pallas_kernels.decode_attention`` (tuning knobs,
    ``interpret=True`` to run a Pallas backend on the CPU)."""
    self.cfg = model.cfg
    self.policy = policy
    self.tp_mesh = mesh if mesh is not None and mesh.size > 1 else None
    self.kernel_knobs = dict(kernel_knobs or {})
    if self.tp_mesh is None:
      decoder.prepare(model)
    self.batch, self.capacity, self.page, self.backend = batch, capacity, page, backend
    self.lo_page = lo_page      # INT4 pages (None: ``page``); 64 or 128 for the Mosaic GPU kernel
    self.lo_format = int4.check_format(lo_format)   # the INT4 pool's storage (pask_jax.cache)
    self.traces = Traces()
    self._dense = Runner(model, batch=batch, capacity=capacity, cache_dtype=jnp.bfloat16,
                         mesh=self.tp_mesh, shard_vocab=shard_vocab)
    if self.tp_mesh is None:
      self.graphdef, self.params = decoder.split(model)
      self._dense.params = self.params
      self.commit = jax.jit(self._commit)
      self.decode_step = jax.jit(self.decode_fn, donate_argnums=(2,))
      self.step = recycle.step_jit(self._step, recycle.logits_like(batch, self.cfg.vocab_size),
                                   donate_argnums=(2,))
    else:
      self.graphdef, self.params = self._dense.graphdef, self._dense.params
      ps, cs = jax.tree.map(lambda x: x.sharding, self.params), self.cache_sharding()
      rep, dense = tp.replicated(self.tp_mesh), self._dense.cache_sharding()
      lg = tp.logits_sharding(self.tp_mesh, shard_vocab=shard_vocab)
      self.commit = jax.jit(self._commit, in_shardings=(rep, cs, dense.k, dense.v, rep, rep),
                            out_shardings=(cs, rep, rep))
      self.decode_step = jax.jit(self.decode_fn, donate_argnums=(2,),
                                 in_shardings=(ps, rep, cs) + (rep,) * 6,
                                 out_shardings=(lg, cs, rep, rep, rep))
      self.step = jax.jit(self._step, donate_argnums=(2,),
                          in_shardings=(ps, rep, (cs, rep, rep)) + (rep,) * 8,
                          out_shardings=(rep, lg, (cs, rep, rep)), static_argnames=("how",))
    self.select = self._dense.select
    self.param_bytes = self._dense.param_bytes

  def cache_sharding(self, shapes: pcache.Cache | None = None) -> pcache.Cache:
    """The cache's shardings (mesh runs): every K/V pool and the window by KV head, the page
    tables, lengths and positions replicated.  ``shapes``: of another cache of this runner's
    layout (the engine's paged one; default: :meth:`new_cache`'s)."""
    shapes = jax.eval_shape(self._new_cache) if shapes is None else shapes
    return tp.pask_cache_sharding(self.tp_mesh, shapes, lo_format=self.lo_format)

  def _new_cache(self) -> pcache.Cache:
    return pcache.init_for(self.cfg, self.batch, self.policy, capacity=self.capacity,
                           page=self.page, lo_page=self.lo_page, lo_format=self.lo_format)

  def new_cache(self) -> pcache.Cache:
    if self.tp_mesh is None:
      return self._new_cache()
    return jax.jit(self._new_cache, out_shardings=self.cache_sharding())()

  def _commit(self, policy, cache, k, v, cands, lengths):
    """Dense prefill K/V [L, B, T, Hkv, D] -> plan, materialized cache, ledger, R_1."""
    self.traces["commit"] += 1
    plan, budget, k, v, lengths = self._plan(policy, cands, lengths, k, v)
    cache = pcache.materialize_prefill(cache, k, v, plan, lengths)
    cache = cache.replace(count=lengths.astype(jnp.int32))
    tmpl = self._shared(policy)
    led = ledger.record_prefill(ledger.init(self.batch, tmpl.n_groups), plan, lengths,
                                sink=tmpl.sink)
    return cache, budget, ledger.record_live(led, cache, tmpl.cost, tmpl.c_full)

  # Policy hooks: one policy for the whole batch here; calibrate.stack overrides them to apply a
  # stack of policies, each to its own copy of the requests.
  def _plan(self, policy, cands, lengths, k, v):
    """-> (prefill plan [B, T, G], R_1 [B], K, V, lengths) for the batch's rows."""
    plan, _ = controller.plan_prefill(policy, cands, lengths)
    budget = jnp.full((self.batch,), controller.initial_balance(policy), jnp.float32)
    return plan, budget, k, v, lengths

  def _shared(self, policy):
    """The policy whose sink, groups and cost model the ledger uses (a stack shares them)."""
    return policy

  def _control(self, policy, tag_ids, state_ids, budget, stop):
    return controller.control_batch(policy, tag_ids, state_ids, budget, stop)

  def _attend(self, carry, layer, q, k, v, positions):
    # The kernel reads layer ``layer`` of the stacked pools in place and the update scatters only
    # the new rows: slicing a layer out and writing it back copied every layer's pools per step.
    cache, plan = carry
    g = pcache.group_array(cache)[layer]
    with jax.named_scope("cache_write"):
      cache = pcache.write_step(cache, plan, layer, k[:, 0], v[:, 0], evict=False)
    window, hi, lo, maps = pcache.kernel_inputs(cache.layers, cache, g)
    with jax.named_scope("attention"):
      attn = functools.partial(pallas_kernels.decode_attention, backend=self.backend,
                               **self.kernel_knobs)
      if self.tp_mesh is not None and pallas_kernels.resolve_backend(self.backend) != "reference":
        attn = tp.attention_per_shard(attn, self.tp_mesh)   # a Pallas kernel per device
      out = attn(q[:, 0], window, hi, lo, maps, layer=layer)
    return out[:, None].astype(q.dtype), (cache, plan)

  def _write_and_attend(self, params, cache, tokens, pending, active):
    """Write ``tokens`` [B] at each sequence's next position with pending actions ``pending
    [B, G]`` (the token leaving the window is materialized) and run the model over the cache.
    -> (logits [B, V], cache)."""
    model = nnx.merge(self.graphdef, params)
    pos = cache.count                                  # the new token's absolute position
    with jax.named_scope("cache_write"):
      cache, plan = pcache.begin_step(cache, pending, active)
      cache = pcache.evict_step(cache, plan)     # every layer's evicted row at once
    logits, (cache, _) = model(tokens[:, None], pos[:, None], (cache, plan), self._attend)
    return logits[:, 0], cache

  def decode_fn(self, params, policy, cache, budget, led, tokens, tag_ids, state_ids, active):
    self.traces["step"] += 1
    tmpl = self._shared(policy)
    with jax.named_scope("controller"):
      actions, budget = self._control(policy, tag_ids, state_ids, budget, ~active)
    with jax.named_scope("ledger"):
      led = ledger.record_decode(led, actions, active, cache.count, sink=tmpl.sink)
    logits, cache = self._write_and_attend(params, cache, tokens, actions, active)
    with jax.named_scope("ledger"):
      led = ledger.record_live(led, cache, tmpl.cost, tmpl.c_full)
    return logits, cache, budget, led, actions

  def deferred_fn(self, params, policy, cache, budget, led, tokens, prev_tags, prev_state_ids,
                  decide, active):
    """:meth:`decode_fn` with the controller one step late (the overlapping engine in
    serve/engine.py): first the token fed by the previous step gets its actions, from its tags
    ``prev_tags [B, 4]`` / ``prev_state_ids [B]``, where ``decide [B]``; then ``tokens`` are fed
    with a placeholder that the next step replaces (``cache.set_pending``).  Per sequence the
    controller sees the same tags in the same order and every token is decided before it leaves
    the window, so caches, balances, ledgers and logits equal :meth:`decode_fn`'s; the
    returned actions are those of the previous tokens."""
    self.traces["fwd"] += 1
    tmpl = self._shared(policy)
    with jax.named_scope("controller"):
      actions, budget = self._control(policy, prev_tags, prev_state_ids, budget, ~decide)
    with jax.named_scope("cache_write"):
      cache = pcache.set_pending(cache, actions, decide)
    with jax.named_scope("ledger"):
      led = ledger.record_decode(led, actions, decide, cache.count - 1, sink=tmpl.sink)
    logits, cache = self._write_and_attend(params, cache, tokens, jnp.full_like(actions, Act.H),
                                           active)
    with jax.named_scope("ledger"):
      led = ledger.record_live(led, cache, tmpl.cost, tmpl.c_full)
    return logits, cache, budget, led, actions

  def _step(self, params, policy, state, tokens, tag_ids, state_ids, active, bits, key,
            temperature, top_p, how=None):
    """:meth:`decode_fn`, then the sampler (``how``, static: :meth:`Runner._step`'s) -> (next
    tokens [B], logits [B, V], (cache, budget, ledger))."""
    cache, budget, led = state
    logits, cache, budget, led, _ = self.decode_fn(params, policy, cache, budget, led, tokens,
                                                   tag_ids, state_ids, active)
    with jax.named_scope("sample"):
      nxt = self._dense._select(logits, bits, key, temperature, top_p, how)
    return nxt, logits, (cache, budget, led)

  # --- the session protocol used by generate() ----------------------------------------------

  def begin(self, tokens: np.ndarray, lengths: np.ndarray, prompt_tags=None):
    B, Tn = tokens.shape
    dense = self._dense.new_cache(batch=B, capacity=Tn)
    logits, dense = self._dense.prefill_all(dense, tokens, lengths)
    cands = prompt_candidates(prompt_tags, lengths, Tn)
    state = self.commit(P.lean(self.policy), self.new_cache(), dense.k, dense.v,
                        jnp.asarray(cands), jnp.asarray(lengths))
    return logits, state

  def advance(self, state, tokens, tag_ids, state_ids, active, bits, key, temperature, top_p,
              how=None):
    nxt, _, state = self.advance_logits(state, tokens, tag_ids, state_ids, active, bits, key,
                                        temperature, top_p, how)
    return nxt, state

  def advance_logits(self, state, tokens, tag_ids, state_ids, active, bits, key, temperature,
                     top_p, how=None):
    """:meth:`advance` that also returns the step's logits ``[B, V]`` -> (next, logits, state):
    the forced-token path (feed given tokens, score them: W1 of :mod:`calibrate.longctx`).
    On one GPU the logits are valid until the next step (:mod:`pask_jax.recycle`).  ``how``:
    the sampler's static branches, :func:`pask_jax.sample.how_of` of ``temperature`` and
    ``top_p`` (None: chosen on the device, :func:`pask_jax.sample.sample`)."""
    return self.step(self.params, P.lean(self.policy), state, tokens, tag_ids, state_ids, active,
                     bits, key, temperature, top_p, how)

  def report(self, state) -> list[dict]:
    return ledger.summary(state[2], self.policy)

  def hbm(self, state) -> list[dict]:
    """Per sequence the decode step's HBM bytes over the cache as it stands
    (:func:`pask_jax.cache.hbm_bytes`: window, BF16 pool, INT4 pool with its scales, tables;
    the weights shared by the batch) and b_HBM against paged dense BF16 over the same tokens
    (:func:`hbm_rows`), at this runner's kernels' granularity."""
    cache = state[0]
    gran = pcache.granularity_of(pallas_kernels.resolve_backend(self.backend))
    return hbm_rows(pcache.hbm_bytes(cache, granularity=gran),
                    pcache.dense_hbm_bytes_of(cache, granularity=gran), self.param_bytes,
                    self.batch, gran)


def prompt_candidates(prompt_tags, lengths: np.ndarray, Tn: int) -> np.ndarray:
  """Per prompt label candidates ``int32[B, Tn, N_CAND]`` for the prefill plan: each prompt's
  tags (or :data:`PROMPT_TAG` where it has none), ``PAD`` past its length."""
  B = len(lengths)
  cands = np.broadcast_to(PROMPT_TAG, (B, Tn, T.N_CAND)).copy()
  for b, tg in enumerate(list(prompt_tags or [])[:B]):
    if tg is not None:
      cands[b, :len(tg)] = tg
  cands[np.arange(Tn)[None, :] >= np.asarray(lengths)[:, None]] = T.PAD
  return cands


def _round_out(result, dtype):
  out, cache = result
  return out.astype(dtype).astype(out.dtype), cache


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


def param_bytes(params) -> int:
  """Bytes of every array in ``params`` (an nnx state or any pytree): b_HBM's weights term, read
  once per decode step for the whole batch."""
  return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params)))


def hbm_rows(kv, dense, weights: float, batch: int, granularity: str) -> list[dict]:
  """Per sequence the b_HBM fields (docs/SPHERICAL_KV.md §4) from the KV bytes a decode step
  reads ``kv [B]``, those of paged dense BF16 over the same tokens ``dense [B]``
  (:func:`pask_jax.cache.dense_hbm_bytes`), the weights' bytes and the batch they are shared by:
  ``hbm_bytes_per_token = weights / batch + kv``, ``hbm_kv_bytes = kv``, ``b_HBM`` = the first
  over ``weights / batch + dense`` (NaN when that is 0), and the ``hbm_granularity`` counted."""
  w = weights / batch
  ratio = lambda x, y: float(x / y) if y else float("nan")
  return [{"hbm_bytes_per_token": float(w + k), "hbm_kv_bytes": float(k),
           "b_HBM": ratio(w + k, w + d), "hbm_granularity": granularity}
          for k, d in zip(np.asarray(kv, np.float64), np.asarray(dense, np.float64))]


HBM_FIELDS = ("hbm_bytes_per_token", "hbm_kv_bytes", "b_HBM", "hbm_granularity")


def runner_hbm(runner, state, reports: Sequence[dict | None]) -> list[dict | None]:
  """Per row the decode step's HBM fields (:func:`hbm_rows`) of a runner with a kernel path:
  taken from its report rows where they carry them (SphRunner's), else ``runner.hbm(state)``;
  None per row for a runner without ``hbm``."""
  if all(r is not None and "b_HBM" in r for r in reports):
    return [{k: r[k] for k in HBM_FIELDS} for r in reports]
  hbm = getattr(runner, "hbm", None)
  return (hbm(state) if hbm is not None else None) or [None] * len(reports)


def generate(runner, tokenizer, prompts: Sequence[Sequence[int]], *,
             grammars: Sequence[Grammar | None] | None = None,
             trackers: Sequence[Tracker] | None = None, prompt_tags: Sequence[Any] | None = None,
             prompt_segments: Sequence[Any] | None = None,
             sampling: Sampling = Sampling()) -> list[Result]:
  """Generate for up to ``runner.batch`` prompts of different lengths.

  Each request has a :class:`Tracker` (its grammar matcher and tag adapter), built from
  ``grammars`` when ``trackers`` is not given.  ``prompt_tags``: optional per-prompt
  ``int32[n, 4]`` prompt-span label candidates for the PASK prefill plan.  ``prompt_segments``:
  optional per-prompt ``bool[n]`` marks of retrieved evidence (a document, a tool output), for a
  runner that prices segments (``reads_segments``: Spherical KV's RDR).  With a
  :class:`PaskRunner` each result carries the request's ledger in ``Result.ledger``.

  The runner's ``select`` and ``advance`` get the sampler's static ``how`` last, by position
  (:func:`pask_jax.sample.how_of` of ``sampling``; every row samples alike): no step carries a
  device-side conditional.
  """
  B, V = runner.batch, runner.cfg.vocab_size
  n = len(prompts)
  if not 0 < n <= B:
    raise ValueError(f"got {n} prompts for a runner of batch {B}")
  for i, p in enumerate(prompts):
    if len(p) + sampling.max_tokens > runner.capacity:
      raise CapacityError(
          f"prompt {i} has {len(p)} tokens; with max_tokens={sampling.max_tokens} it needs "
          f"{len(p) + sampling.max_tokens} > capacity {runner.capacity}")
  if prompt_segments is not None and all(s is None for s in prompt_segments):
    prompt_segments = None   # nothing marked: every runner's begin as before
  if prompt_segments is not None and not getattr(runner, "reads_segments", False):
    raise ValueError(f"prompt_segments given, but {type(runner).__name__} does not read "
                     "segments (only Spherical KV's runner prices retrieved evidence)")
  if trackers is None:
    grammars = list(grammars) if grammars is not None else [None] * n
    trackers = [Tracker(g) for g in grammars]
  trackers = list(trackers) + [Tracker() for _ in range(B - n)]
  # A no-transition policy (ablation) reads position bins, not the parser's tags.
  pol = getattr(runner, "policy", None)
  if pol is not None and hasattr(pol, "record_json"):
    from pask_jax.policy import position_bins
    trackers = with_positions(trackers, position_bins(pol))
  stops = set(tokenizer.stop_ids)
  sampled = sampling.temperature > 0
  # the sampler's branches, static (every row samples alike): no device-side conditional in the
  # step, which XLA's GPU runtime would run on the host, waiting for the device there
  how = how_of(sampling.temperature, sampling.top_p)
  put = recycle.upload   # inputs as transfers, not jnp.asarray's program per input
  temp = jnp.full((B,), sampling.temperature, jnp.float32)
  top_p = jnp.full((B,), sampling.top_p, jnp.float32)
  key = jax.random.key(sampling.seed)
  bits = new_bitmask(B, V)
  tag_ids = np.broadcast_to(FREE_TAG, (B, T.N_CAND)).copy()
  state_ids = np.full((B,), -1, np.int32)

  def fill(active):
    # an active row's tracker writes its whole row; only finished / padding rows are reset
    idle = [b for b in range(B) if b >= n or not active[b]]
    if idle:
      bits[idle] = -1
    for b in range(n):
      if active[b]:
        trackers[b].fill(bits, b)

  t0 = time.perf_counter()
  tokens, lengths = pad_prompts(prompts, B, runner.capacity)
  segments = {} if prompt_segments is None else {"segments": prompt_segments}
  logits, state = runner.begin(tokens, lengths, prompt_tags, **segments)
  active = [True] * n + [False] * (B - n)
  fill(active)
  key, sub = jax.random.split(key)
  nxt = np.asarray(runner.select(logits, put(bits), sub, temp, top_p, how))
  t1 = time.perf_counter()
  out: list[list[int]] = [[] for _ in range(n)]
  finish = ["length"] * n
  for step in range(sampling.max_tokens):
    for b in range(n):
      if not active[b]:
        continue
      tok = int(nxt[b])
      tag_ids[b], state_ids[b] = trackers[b].accept(tok)
      if tok in stops or trackers[b].terminated:
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
    if sampled:   # greedy picks ignore the key: no split (one more launch) per step
      key, sub = jax.random.split(key)
    nxt_dev, state = runner.advance(state, put(nxt), put(tag_ids), put(state_ids),
                                    put(np.asarray(active, bool)), put(bits), sub, temp, top_p,
                                    how)
    nxt = np.asarray(nxt_dev)
  t2 = time.perf_counter()
  reports = runner.report(state) or [None] * n
  hbms = runner_hbm(runner, state, reports)
  return [Result(out[b], tokenizer.decode(out[b]), len(prompts[b]), finish[b], t1 - t0, t2 - t1,
                 reports[b], hbms[b]) for b in range(n)]
