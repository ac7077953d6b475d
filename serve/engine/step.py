"""The device side of the engine: the cache state and the jitted functions that change it.

Two kinds behind one interface: :class:`PagedStep` over the paged PASK cache (BF16 and INT4
pools, its page bookkeeping in ``pages``) and :class:`DenseStep` over the plain-XLA dense
Full-KV cache (one row of ``context`` slots per sequence, no pools, no ledger: the baseline of
``bench/bench_serving.py``).  Each offers

* a serial step (``serial``): ONE jitted call for the whole batch, the model's step plus per-row
  sampling; inactive slots are masked by ``active`` (neither charged nor written), so it compiles
  once per batch shape;
* an overlapped step: ``forward`` (cache update + logits) and ``pick`` (masked sampling) as two
  calls, so the next forward can be launched fed with the token the pick will produce (a device
  array) before the host has seen it.  Two calls, not one: an executable's outputs are ready
  when all of it has run, so a pick fused with the forward it feeds would hand its tokens to the
  host only after that forward, and the host's half of the next step (the grammar's accept,
  masks, the launch) could no longer run under it.  The forward decides the actions of the
  token fed one step *earlier* (``PaskRunner.deferred_fn``, ``cache.set_pending``): every token
  is decided before it leaves the window, from the same tags in the same order, so outputs,
  actions, balances and ledgers are those of the serial step.

Sampling keys are per request: fold_in(key(seed), token index), so a seeded request samples the
same tokens whatever else shares the batch.  Log-probabilities (of the grammar-masked logits,
before temperature: the chosen token's and the top :data:`TOP_LOGPROBS`) are computed only when
some row asks (``lax.cond``), one compile whatever the per-request count.
"""
from __future__ import annotations

import concurrent.futures
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pask_jax import cache as pcache
from pask_jax import controller, kv_dense, ledger
from pask_jax import mesh as tp
from pask_jax.traces import Traces
from pask_jax import actions as Act
from pask_jax.decode import PaskRunner, prompt_candidates
from pask_jax.launch import Launcher
from pask_jax.recycle import Recycler, logits_like, upload
from pask_jax.sample import apply_bitmask, how_of as sample_how, sample
from serve.engine.pages import NoPages, PagePools
from serve.engine.sizing import bucket, dense_sizing, reachable, size_pools, worst_pages

TOP_LOGPROBS = 20   # alternatives computed per step when a request asks for logprobs


def pick(logits, bits, seeds, steps, temperature, top_p, want_lp, *, gather=None, how=None):
  """Per-row sampling: row b uses key fold_in(key(seeds[b]), steps[b]).  -> (tokens [B],
  (chosen log-prob [B], top ids [B, K], top log-probs [B, K])); the log-probs are of the masked
  logits and are zeros unless some row wants them.  ``gather``: applied to the masked logits
  before sampling (on a mesh: the vocabulary shards gathered, after each applied its mask).

  ``how``: ``(sampled, truncated, log_probs)`` as Python bools (:func:`how_of`): whether some row
  samples, some sampling row has top_p < 1, some row wants log-probs -- the branches chosen when
  tracing, one executable per combination.  None: chosen on the device by ``lax.cond``, which
  XLA's GPU runtime runs on the host: it copies the predicate back and waits for the device
  there, so a pick launched behind a forward would return only once that forward has run."""
  masked = apply_bitmask(logits, bits)
  if gather is not None:
    masked = gather(masked)
  keys = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(seeds, steps)
  tok = sample(masked, keys, temperature, top_p, how=None if how is None else how[:2])
  B, K = logits.shape[0], TOP_LOGPROBS

  def lp():
    ls = jax.nn.log_softmax(masked.astype(jnp.float32), axis=-1)
    top, ids = jax.lax.top_k(ls, K)
    return jnp.take_along_axis(ls, tok[:, None], axis=-1)[:, 0], ids.astype(jnp.int32), top

  none = lambda: (jnp.zeros((B,), jnp.float32), jnp.zeros((B, K), jnp.int32),
                  jnp.zeros((B, K), jnp.float32))
  if how is None:
    return tok, jax.lax.cond(jnp.any(want_lp), lp, none)
  return tok, lp() if how[2] else none()


def how_of(temperature, top_p, want_lp) -> tuple[bool, bool, bool]:
  """:func:`pick`'s static ``how`` from the host's per-row sampling values (every row, as the
  device-side conditions read them): :func:`pask_jax.sample.how_of`'s, then the log-probs'."""
  return sample_how(temperature, top_p) + (bool(np.asarray(want_lp).any()),)


def pick_packed(logits, packed, *, gather=None, how=None):
  """:func:`pick` with its per-row inputs in one int32 array (``Batch.packed``)."""
  nw = packed.shape[1] - 5
  f32 = lambda c: jax.lax.bitcast_convert_type(packed[:, c], jnp.float32)
  return pick(logits, packed[:, :nw], jax.lax.bitcast_convert_type(packed[:, nw], jnp.uint32),
              packed[:, nw + 1], f32(nw + 3), f32(nw + 4), packed[:, nw + 2] > 0, gather=gather,
              how=how)


def how_of_packed(packed: np.ndarray) -> tuple[bool, bool, bool]:
  """:func:`how_of` of a ``Batch.packed`` array."""
  nw = packed.shape[1] - 5
  return how_of(packed[:, nw + 3].view(np.float32), packed[:, nw + 4].view(np.float32),
                packed[:, nw + 2] > 0)


def lp_row(lp, b: int):
  """Row ``b`` of the sampler's log-prob outputs (host arrays), or None."""
  if lp is None:
    return None
  return float(lp[0][b]), np.asarray(lp[1][b]), np.asarray(lp[2][b])


class Step:
  """What both kinds share: the sampler, and the interface the engine calls.

  ``mesh`` (tensor parallelism, :mod:`pask_jax.mesh`): the state's K/V split by KV head, the
  rest replicated; every jitted function names its in/out shardings, so a step's outputs come
  back placed as its inputs were (one compile, no resharding)."""
  can_overlap = True

  def __init__(self, mesh=None):
    self.mesh = mesh
    self._state = None
    self._pending: concurrent.futures.Future | None = None   # a forward being launched
    self._launcher = Launcher(threaded=False)
    self.gather = None if mesh is None else functools.partial(
        jax.lax.with_sharding_constraint, shardings=tp.replicated(mesh))
    # the picks' branches are static (``how``): no device-side conditional, so launching one
    # does not wait for the device; a combination compiles at its first use
    self._first = jax.jit(functools.partial(pick, gather=self.gather), static_argnames=("how",))
    self._pick_rows = jax.jit(functools.partial(pick_packed, gather=self.gather),
                              static_argnames=("how",))

  # --- the launch thread ----------------------------------------------------------------------
  # With ``threaded`` on, the overlapped forward is launched on a worker thread
  # (:mod:`pask_jax.launch`) while the engine thread lands the previous pick's tokens; the engine
  # thread joins it before it launches the pick that reads its logits.  Everything else that
  # touches the state joins first (``state``), so calls reach the device in the order they would
  # without the thread.

  @property
  def state(self):
    """The device state (joins a forward being launched: its output is the state)."""
    if self._pending is not None:
      self._settle()
    return self._state

  @state.setter
  def state(self, value) -> None:
    if self._pending is not None:
      self._settle()
    self._state = value

  def _settle(self) -> None:
    # A failed launch stays pending: every later use of the state raises its error again (the
    # state it would have produced does not exist), so the engine fails rather than carrying on
    # from the state before it.
    self._pending.result()
    self._pending = None

  @property
  def threaded(self) -> bool:
    return self._launcher.threaded

  @threaded.setter
  def threaded(self, on: bool) -> None:
    if self._pending is not None:
      self._settle()
    self._launcher.threaded = on

  def release_thread(self) -> None:
    """End the launch thread (after the last launch); one starts again at the next launch."""
    on = self.threaded
    self._launcher.threaded = False
    self._launcher.threaded = on

  def _launch(self, run) -> concurrent.futures.Future:
    """``run()`` (a launch that returns its outputs and sets ``_state``) on the launch thread,
    or here when not ``threaded`` -> a future of its outputs."""
    f = self._launcher.submit(run)
    if self.threaded:
      self._pending = f
    return f

  def place(self, x):
    """A host value as a device array where the jitted functions keep theirs (on a mesh:
    replicated on it, so the first call traces the types every later call has)."""
    return upload(x, None if self.mesh is None else tp.replicated(self.mesh))

  def _jit(self, fn, donate: int, ins=None, outs=None):
    """``jax.jit`` of a state-carrying function; on a mesh with these in/out shardings."""
    if self.mesh is None:
      return jax.jit(fn, donate_argnums=(donate,))
    return jax.jit(fn, donate_argnums=(donate,), in_shardings=ins, out_shardings=outs)

  def _jit_fwd(self, fn, donate: int, logits: jax.ShapeDtypeStruct, ins=None, outs=None):
    """:meth:`_jit` of the overlapped forward, its logits written into the previous forward's
    logits buffer (:class:`pask_jax.recycle.Recycler`: one address per step, so XLA does not
    re-parameterize the step's CUDA graph).  The loop picks from a forward's logits before it
    launches the next forward, which donates them."""
    if self.mesh is None:
      return Recycler(fn, logits, donate_argnums=(donate,))
    return Recycler(fn, logits, donate_argnums=(donate,), in_shardings=ins, out_shardings=outs)

  def first(self, logits, bits1, r) -> tuple[int, tuple | None]:
    """A new request's first token from its prefill's logits -> (token, log-prob row)."""
    want = r.logprobs is not None
    tok, lp = self._first(logits, upload(bits1), upload(np.array([r.seed], np.uint32)),
                          upload(np.zeros(1, np.int32)),
                          upload(np.array([r.temperature], np.float32)),
                          upload(np.array([r.top_p], np.float32)),
                          upload(np.array([want])), how=how_of(r.temperature, r.top_p, want))
    lp = tuple(np.asarray(x) for x in lp) if r.logprobs is not None else None
    return int(tok[0]), lp_row(lp, 0)

  # False: the pick's branches chosen on the device (lax.cond), as before: for A/B benchmarks
  static_picks = True

  def pick(self, logits, packed: np.ndarray):
    """Launch the overlapped step's sampling -> (tokens [B], log-prob outputs), on the device."""
    how = how_of_packed(packed) if self.static_picks else None
    return self._pick_rows(logits, upload(packed), how=how)


MOSAIC_PAGE = 128     # INT4 rows per page where the Mosaic GPU kernel reads the pool


def check_lo_format(lo_format: str, page: int, backend: str, lo_page: int | None = None,
                    cfg=None) -> tuple[str, int]:
  """The INT4 pool's storage format and rows per page -> ``(format, lo_page)``, or a one-line
  error for a format the step's kernels cannot read.  "bytes" is read everywhere; "int4" by the
  reference (CPU) and, on a GPU, only by the Mosaic GPU kernel: Hopper (sm_90), pages of a
  multiple of 64 rows (an unset ``lo_page`` is then ``page`` if it is such a multiple, else
  :data:`MOSAIC_PAGE`), head dim a multiple of 64, at most 16 query heads per KV head.  "auto":
  "int4" where that kernel runs and takes the model (``cfg``; None: not known yet, the check
  before a model loads), else "bytes" (the Triton kernel reads bytes at about half the Mosaic
  kernel's rate)."""
  from pallas_kernels import int4, resolve_backend
  from pallas_kernels.gpu import mgpu_decode
  if lo_format not in ("auto",) + int4.FORMATS:
    raise ValueError(f"lo_format must be 'auto', 'bytes' or 'int4', got {lo_format!r}")
  which = resolve_backend(backend)
  hopper = which == "gpu" and mgpu_decode.hopper()
  mosaic_page = lambda: page if page % 64 == 0 else MOSAIC_PAGE
  takes = lambda lp: cfg is None or mgpu_decode.supported(lp, cfg.head_dim,
                                                          cfg.n_heads // cfg.n_kv_heads)
  if lo_format == "auto":
    lo_format = "int4" if hopper and takes(lo_page or mosaic_page()) else "bytes"
  if lo_page is None:
    lo_page = mosaic_page() if lo_format == "int4" and which == "gpu" else page
  if lo_format == "int4" and which == "gpu":
    if not hopper:
      raise ValueError("lo_format 'int4' is read on a GPU by the Mosaic GPU kernel only, which "
                       "needs Hopper (sm_90): use 'bytes' or 'auto' here")
    if lo_page % 64:
      raise ValueError(f"lo_format 'int4' on the GPU needs INT4 pages of a multiple of 64 tokens "
                       f"(the Mosaic GPU kernel reads one page per pipeline step), got {lo_page}")
    if not takes(lo_page):
      raise ValueError(f"lo_format 'int4': the Mosaic GPU kernel takes a head dim of a multiple "
                       f"of 64 and at most 16 query heads per KV head, this model has "
                       f"{cfg.head_dim} and {cfg.n_heads // cfg.n_kv_heads}: use 'bytes' or "
                       f"'auto'")
  if lo_format == "int4" and which == "tpu":
    raise ValueError("the TPU kernel reads the 'bytes' INT4 format only, got lo_format 'int4'")
  return lo_format, int(lo_page)


class PagedStep(Step):
  """The paged PASK cache: ``(cache, controller balances, ledger)`` for ``slots`` sequences."""

  def __init__(self, model, policy, *, slots: int, context: int, page: int, backend: str,
               watermark: float, kv_bytes=None, mix=None, hi_pages=None, lo_pages=None,
               lo_format: str = "bytes", lo_page: int | None = None, mesh=None, **_):
    super().__init__(mesh)
    c = model.cfg
    lo_format, lo_page = check_lo_format(lo_format, page, backend, lo_page, cfg=c)
    self.policy, self.window, self.G = policy, int(policy.window), int(policy.n_groups)
    self.page, self.can_overlap = page, self.window >= 3   # page growth needs a window of 3
    self.lo_page, self.lo_format = lo_page, lo_format
    self.sizing = size_pools(c, policy, slots=slots, context=context, page=page,
                             kv_bytes=kv_bytes, mix=mix, hi_pages=hi_pages, lo_pages=lo_pages,
                             shards=1 if mesh is None else mesh.size, lo_page=lo_page)
    self.reach = reachable(policy)
    totals = (self.sizing.hi_pages, self.sizing.lo_pages)
    self.pages = PagePools(totals, slots=slots, context=context, page=page, window=self.window,
                           sink=int(policy.sink), n_groups=self.G, watermark=watermark,
                           lo_page=lo_page)
    self.runner = PaskRunner(model, policy, batch=slots, capacity=context, page=page,
                             backend=backend, lo_page=lo_page, lo_format=lo_format, mesh=mesh)
    self.traces = self.runner.traces
    make = lambda: pcache.init_paged(
        c.n_layers, slots, c.n_kv_heads, c.head_dim, capacity=context, window=self.window,
        hi_pool_pages=totals[0], lo_pool_pages=totals[1], sink=policy.sink, n_groups=self.G,
        page=page, lo_page=lo_page, lo_format=lo_format)
    ss = kv = ps = rep = lg = None
    if mesh is None:
      cache = make()
    else:   # each device makes its own KV heads' pools and windows
      cs = self.runner.cache_sharding(jax.eval_shape(make))
      cache = jax.jit(make, out_shardings=cs)()
      ps, rep, lg = tp.step_shardings(mesh, self.runner.params)
      ss, kv = (cs, rep, rep), tp.by_kv_head(mesh, 5, 3)
    self.state = (cache, self.place(np.zeros((slots,), np.float32)),
                  jax.tree.map(self.place, ledger.init(slots, self.G)))
    self._plan = jax.jit(self._plan_fn)
    self._insert = self._jit(self._insert_fn, 1, (rep, ss, kv, kv) + (rep,) * 5, ss)
    self._restore = self._jit(self._restore_fn, 0, (ss, rep, rep, rep), ss)
    self._release = self._jit(self._release_fn, 0, (ss, rep), ss)
    self._step = self._jit(self._step_fn, 2, (ps, rep, ss) + (rep,) * 12, ((rep, rep), ss))
    self._fwd = self._jit_fwd(self._fwd_fn, 2, logits_like(slots, c.vocab_size, lg),
                              (ps, rep, ss, rep, rep), ((lg, rep), ss))

  # --- jitted pieces ------------------------------------------------------------------------

  def _plan_fn(self, policy, cands, length):
    self.traces["plan"] += 1
    return controller.plan_prefill(policy, cands, length)[0]

  def _insert_fn(self, policy, state, k, v, plan, length, slot, hi_rows, lo_rows):
    """Prefill K/V of one request [L, 1, T, Hkv, D] and its plan [1, T, G] -> materialized
    into ``slot``; the slot's ledger row and balance are reset."""
    self.traces["insert"] += 1
    cache, budget, led = state
    cache = pcache.insert_slot(cache, slot, k, v, plan, length, hi_rows, lo_rows)
    one = ledger.record_prefill(ledger.init(1, policy.n_groups), plan, length, sink=policy.sink)
    put = lambda full, part: jax.lax.dynamic_update_slice_in_dim(full, part, slot, 0)
    led = jax.tree.map(put, led, one)
    led = ledger.record_live(led, cache, policy.cost, policy.c_full)
    budget = budget.at[slot].set(controller.initial_balance(policy))
    return cache, budget, led

  def _restore_fn(self, state, slot, balance, led_row):
    """A resumed request's controller balance and ledger row back into ``slot``."""
    self.traces["restore"] += 1
    cache, budget, led = state
    led = jax.tree.map(lambda full, row: full.at[slot].set(row), led, led_row)
    return cache, budget.at[slot].set(balance), led

  def _release_fn(self, state, slot):
    cache, budget, led = state
    return pcache.release_slot(cache, slot), budget, led

  def _step_fn(self, params, policy, state, tokens, tag_ids, state_ids, active, bits, seeds,
               steps, temperature, top_p, want_lp, new_hi, new_lo):
    """-> ((int32 [B, 1 + G]: next token and the actions decided for the token fed, log-prob
    outputs of the sampler), state)."""
    cache, budget, led = state
    cache = pcache.assign_pages(cache, new_hi, new_lo)
    logits, cache, budget, led, actions = self.runner.decode_fn(
        params, policy, cache, budget, led, tokens, tag_ids, state_ids, active)
    nxt, lps = pick(logits, bits, seeds, steps, temperature, top_p, want_lp, gather=self.gather)
    out = jnp.concatenate([nxt[:, None], actions.astype(jnp.int32)], axis=1)
    return (out, lps), (cache, budget, led)

  def _fwd_fn(self, params, policy, state, dev_tok, inputs):
    """The overlapped forward.  ``dev_tok [B]``: the last pick's tokens (device); ``inputs``
    int32 [B·9 + 2·G·B]: ``host`` [B, 9] (``Batch.host``) and ``pages`` [2, G, B] (new page ids
    per pool), flattened into one transfer.  -> ((logits [B, V], actions [B, G] of the previous
    tokens), state)."""
    B = dev_tok.shape[0]
    host, pages = inputs[:9 * B].reshape(B, 9), inputs[9 * B:].reshape(2, self.G, B)
    cache, budget, led = state
    tokens = jnp.where(host[:, 1] > 0, host[:, 0], dev_tok)
    cache = pcache.assign_pages(cache, pages[0], pages[1])
    logits, cache, budget, led, actions = self.runner.deferred_fn(
        params, policy, cache, budget, led, tokens, host[:, 2:6], host[:, 6], host[:, 7] > 0,
        host[:, 8] > 0)
    return (logits, actions.astype(jnp.int32)), (cache, budget, led)

  # --- the interface ------------------------------------------------------------------------

  def worst_case(self, n_prompt: int, max_tokens: int) -> tuple[int, int]:
    """Pages (BF16 pool, INT4 pool) per layer group that one request can need at most: every
    token beyond the window stored in that pool (0 for a pool the policy never uses)."""
    return worst_pages(self.policy, n_prompt + max_tokens, self.page, self.lo_page)

  def need(self, r, chunk: int) -> tuple[np.ndarray, float]:
    """Pages [pool, group] that ``r``'s next prefill stores -> (pages, seconds spent planning).
    A new request's plan (``r.plan``, ``r.prompt_plan``) is computed first: it depends only on
    the prompt-span labels and the policy (one small jitted call per bucket)."""
    seconds = 0.0
    if r.plan is None:
      t0 = time.perf_counter()
      n, Tn = len(r.ids), bucket(len(r.ids), chunk)
      cands = prompt_candidates([r.tags], np.array([n]), Tn)
      plan = np.asarray(self._plan(self.policy, upload(cands), upload(np.array([n], np.int32))))
      plan = plan[0, :n].copy()
      plan[:self.policy.sink] = Act.H   # the cache forces sinks H
      r.plan = r.prompt_plan = plan
      seconds = time.perf_counter() - t0
    return self.pages.need(r.plan), seconds

  def insert(self, r, dense, n: int, Tn: int, rows) -> None:
    """``r``'s prefill (K/V of ``n`` tokens padded to ``Tn``) materialized by its plan into its
    slot and ``rows`` pages (traced inputs: one compile per bucket); a request resumed by
    recompute gets its balance and ledger row back."""
    plan = np.zeros((1, Tn, self.G), np.int8)
    plan[0, :n] = r.plan
    self.state = self._insert(self.policy, self.state, dense.k, dense.v, upload(plan),
                              upload(np.array([n], np.int32)), jnp.int32(r.slot), *rows)
    if r.resume and "ledger" in r.resume:
      self.state = self._restore(self.state, jnp.int32(r.slot),
                                 upload(r.resume["balance"]),
                                 jax.tree.map(upload, r.resume["ledger"]))

  def saved(self, b: int) -> dict:
    """What slot ``b`` needs to continue after a recompute: its balance and ledger row."""
    _, budget, led = self.state
    return {"balance": np.asarray(budget[b]),
            "ledger": jax.tree.map(lambda x: np.asarray(x[b]), led)}

  def release(self, b: int) -> None:
    self.state = self._release(self.state, jnp.int32(b))

  def serial(self, batch, steps, want, grow):
    """One serial step of the whole batch -> (int32 [B, 1 + G], log-prob outputs), on the
    device."""
    out, self.state = self._step(
        self.runner.params, self.policy, self.state, upload(batch.tokens),
        upload(batch.tag_ids), upload(batch.state_ids), upload(batch.active),
        upload(batch.bits), upload(batch.seeds), upload(steps),
        upload(batch.temp), upload(batch.top_p), upload(want),
        upload(grow[0]), upload(grow[1]))
    return out

  # False: the decided actions are copied to the host when record_late reads them (A/B benchmarks)
  early_actions = True

  def forward(self, tok_dev, host, grow) -> concurrent.futures.Future:
    """Launch the overlapped forward -> a future of (logits, actions decided for the previous
    tokens); on the launch thread when ``threaded``."""
    # one transfer for both host inputs (a fresh array: the loop rewrites its own); joined state
    inputs = np.concatenate([np.asarray(host, np.int32).ravel(),
                             np.stack(grow).astype(np.int32, copy=False).ravel()])
    state = self.state

    def run():
      out, self._state = self._fwd(self.runner.params, self.policy, state, tok_dev,
                                   upload(inputs))
      # The host reads these actions a step later (PagePools.record_late): their copy is
      # queued behind the forward now, so that read finds them on the host, not a transfer.
      if self.early_actions:
        out[1].copy_to_host_async()
      return out
    return self._launch(run)

  def ledger_row(self, b: int) -> tuple[dict | None, bool]:
    """Slot ``b``'s ledger summary and whether its cache overflowed."""
    led = jax.tree.map(lambda x: np.asarray(x[b:b + 1]), self.state[2])
    return ledger.summary(led, self.policy)[0], bool(np.asarray(self.state[0].overflow[b]))


class DenseStep(Step):
  """The plain-XLA dense Full-KV cache (``kv_dense``, ``kv_dense.attend`` in the step):
  admission by free slot only, no pages, no ledger (measured B is 1 by definition)."""

  def __init__(self, model, policy, *, slots: int, context: int, page: int, prefiller,
               kv_bytes=None, mesh=None, **_):
    super().__init__(mesh)
    c = model.cfg
    self.policy, self.G = policy, int(policy.n_groups)
    self.sizing = dense_sizing(c, slots=slots, context=context, page=page,
                               window=int(policy.window), kv_bytes=kv_bytes,
                               shards=1 if mesh is None else mesh.size)
    self.reach = (True, False)
    self.pages = NoPages()
    self.graphdef, _ = nnx.split(model)   # the prefiller's layout
    self.runner = prefiller   # params and traces live on the shared prefill runner
    self.traces = Traces()
    self.state = prefiller.new_cache(batch=slots, capacity=context, dtype=jnp.bfloat16)
    cs = kv = ps = rep = lg = None
    if mesh is not None:
      ps, rep, lg = tp.step_shardings(mesh, prefiller.params)
      cs, kv = prefiller.cache_sharding(), tp.by_kv_head(mesh, 5, 3)
    self._insert = self._jit(self._insert_fn, 0, (cs, kv, kv, rep, rep), cs)
    self._release = self._jit(self._release_fn, 0, (cs, rep), cs)
    self._step = self._jit(self._step_fn, 1, (ps, cs) + (rep,) * 8, ((rep, rep), cs))
    self._fwd = self._jit_fwd(self._fwd_fn, 1, logits_like(slots, c.vocab_size, lg),
                              (ps, cs, rep, rep), ((lg, rep), cs))

  def _forward(self, params, cache, tokens, active):
    """tokens [B] written at each active row's next slot, the model over the dense cache ->
    (logits [B, V], cache)."""
    model = nnx.merge(self.graphdef, params)
    cap = cache.k.shape[2]
    pos = jnp.where(active, cache.length, cap)[:, None]      # inactive rows write nothing
    cache = cache._replace(length=cache.length + active.astype(jnp.int32))
    logits, cache = model(tokens[:, None], pos, cache, kv_dense.attend)
    return logits[:, 0], cache

  def _fwd_fn(self, params, cache, dev_tok, host):
    """The overlapped forward (:meth:`PagedStep._fwd_fn`'s ``host`` layout; no actions)."""
    self.traces["fwd"] += 1
    tokens = jnp.where(host[:, 1] > 0, host[:, 0], dev_tok)
    logits, cache = self._forward(params, cache, tokens, host[:, 8] > 0)
    return (logits, jnp.zeros((tokens.shape[0], self.G), jnp.int32)), cache

  def _insert_fn(self, cache, k, v, length, slot):
    self.traces["insert"] += 1
    Tn = min(k.shape[2], cache.k.shape[2])
    at = (0, slot, 0, 0, 0)
    kc = jax.lax.dynamic_update_slice(cache.k, k[:, :, :Tn].astype(cache.k.dtype), at)
    vc = jax.lax.dynamic_update_slice(cache.v, v[:, :, :Tn].astype(cache.v.dtype), at)
    return kv_dense.DenseCache(kc, vc, cache.length.at[slot].set(length[0]))

  def _release_fn(self, cache, slot):
    return cache._replace(length=cache.length.at[slot].set(0))

  def _step_fn(self, params, cache, tokens, active, bits, seeds, steps, temperature, top_p,
               want_lp):
    self.traces["step"] += 1
    logits, cache = self._forward(params, cache, tokens, active)
    nxt, lps = pick(logits, bits, seeds, steps, temperature, top_p, want_lp, gather=self.gather)
    out = jnp.concatenate([nxt[:, None], jnp.zeros((nxt.shape[0], self.G), jnp.int32)], axis=1)
    return (out, lps), cache

  def worst_case(self, n_prompt: int, max_tokens: int) -> tuple[int, int]:
    return 0, 0

  def need(self, r, chunk: int) -> tuple[None, float]:
    return None, 0.0

  def insert(self, r, dense, n: int, Tn: int, rows) -> None:
    self.state = self._insert(self.state, dense.k, dense.v, upload(np.array([n], np.int32)),
                              jnp.int32(r.slot))

  def saved(self, b: int) -> dict:
    return {"balance": None, "ledger": None}

  def release(self, b: int) -> None:
    self.state = self._release(self.state, jnp.int32(b))

  def serial(self, batch, steps, want, grow):
    out, self.state = self._step(
        self.runner.params, self.state, upload(batch.tokens), upload(batch.active),
        upload(batch.bits), upload(batch.seeds), upload(steps),
        upload(batch.temp), upload(batch.top_p), upload(want))
    return out

  def forward(self, tok_dev, host, grow) -> concurrent.futures.Future:
    host, state = np.array(host), self.state

    def run():
      out, self._state = self._fwd(self.runner.params, state, tok_dev, upload(host))
      return out
    return self._launch(run)

  def ledger_row(self, b: int) -> tuple[None, bool]:
    return None, False
