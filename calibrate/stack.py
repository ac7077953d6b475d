"""Generation under a *stack* of policies: the vmapped interventions of Alg. 1 (paper §3.4).

Runtime-V and development selection run the same requests under many frozen policies.  Here a
stack of ``V`` policies (one :class:`~pask_jax.policy.FrozenPolicy` pytree with a leading axis)
is applied to ``V`` copies of ``N`` requests in ONE jitted generation loop: the decode batch is
``V·N`` rows, row ``v·N + n`` is request ``n`` under policy ``v``.  The controller (Alg. 2) and
the prefill plan (§3.6) are ``vmap``-ed over the policy axis; the model, the cache and the
attention kernel see one ordinary batch (so the GPU kernel needs no batching rule), and the
prompt is prefilled once per request and shared by its ``V`` copies.  With several devices the
policy axis is sharded over a 1-D mesh ``rows`` (``jax.shard_map``: each device runs its share of
the policies on its own cache, data parallel); results do not depend on it.

:func:`run_stack` is the driver (chunks of policies and requests of fixed shape so the step
compiles once, host-side grammar tracking, scoring by a task); :func:`run_sequential` is the
plain loop over the same policies, kept for the equivalence test and the speed comparison.
Both generate with :func:`generate_overlapped`: the host's grammar work for token t runs while
the device computes the forward fed with it (the serving engine's overlap, serve/engine/), with
the results of :func:`pask_jax.decode.generate`.
"""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pask_jax import controller
from pask_jax import decode as dec
from pask_jax import ledger
from pask_jax.tracker import with_positions
from pask_jax import policy as P
from pask_jax.launch import Launcher
from pask_jax.recycle import Recycler, logits_like, upload
from pask_jax.sample import how_of
from pask_jax import tags as T

from calibrate.shared import Forest, accept_rows


def stack(policies: Sequence[P.FrozenPolicy]) -> P.FrozenPolicy:
  """Stack policies on a leading axis.  They must share sink, window, groups and cost model;
  reserve tables are padded to one length with each policy's pooled value."""
  p0 = policies[0]
  for p in policies[1:]:
    if (p.sink, p.window, p.n_groups) != (p0.sink, p0.window, p0.n_groups):
      raise ValueError("policies in one stack must share sink, window and layer groups")
    if not np.array_equal(np.asarray(p.cost), np.asarray(p0.cost)):
      raise ValueError("policies in one stack must be bound to the same model (cost model)")
  n = max(1, max(int(p.reserve.shape[0]) for p in policies))
  # The record is static pytree metadata: one shared record keeps the treedefs equal (and the
  # jitted step's cache key stable across stacks); each policy's own record stays with its caller.
  padded = [p.replace(reserve=jnp.concatenate(
      [p.reserve, jnp.full((n - p.reserve.shape[0],), p.pooled, jnp.float32)]),
      record_json='{"stack": true}') for p in policies]
  return jax.tree.map(lambda *xs: jnp.stack(xs), *padded)


class StackRunner(dec.PaskRunner):
  """A :class:`~pask_jax.decode.PaskRunner` of batch ``V·N`` whose rows use a policy stack.

  ``template`` fixes what every policy of a stack shares (sink, window, groups, cost model);
  :meth:`use` sets the stack (a traced jit input: changing it does not recompile).
  """

  def __init__(self, model, template: P.FrozenPolicy, *, n_policies: int, n_requests: int,
               capacity: int, page: int = 16, backend: str = "auto", mesh=None):
    self.template = template
    self.V, self.N = n_policies, n_requests
    self.mesh = mesh
    super().__init__(model, template, batch=n_policies * n_requests, capacity=capacity,
                     page=page, backend=backend)
    self.policy = stack([template] * n_policies)
    # The overlapped loop's forward (controller one step late); the cache is donated, and the
    # previous forward's logits (Recycler: one address for them, so XLA does not re-parameterize
    # the step's CUDA graph; the loop's pick has read them by then), but not the ledger: a
    # step's ledger can still be read after the next step ran (generate_overlapped).
    self.forward = Recycler(self._forward, logits_like(n_policies * n_requests,
                                                       model.cfg.vocab_size), donate_argnums=(2,))
    self.local = None
    # The forward is launched on a worker thread while the host accepts the previous tokens
    # (pask_jax.launch; on a GPU).  Not across processes: their collectives keep one thread.
    self.launcher = Launcher()
    # The pick over one mask row per distinct parser state (generate_overlapped, row_masks):
    # rows of a request whose copies share a prefix share their row, so the host writes and
    # uploads a few rows, not B (151,936 bits each at the Qwen vocabulary), and the device
    # gathers them.  Host arrays in (fresh each step: the call's own transfer is the upload); one
    # compile per power-of-two row count that occurs.
    select = self.select
    self.select_rows = jax.jit(
        lambda logits, masks, rows, key, t, p, how=None: select(
            logits, masks[rows], key, t, p, how=how), static_argnames=("how",))
    # Several processes (calibrate.distributed): the mesh holds other processes' devices, so
    # every input of the sharded calls becomes a global array (each process places its own
    # shards) and the sampled tokens come back replicated.
    self.multi = mesh is not None and any(d.process_index != jax.process_index()
                                          for d in mesh.devices.flat)
    if mesh is not None and mesh.size > 1:
      self._shard_over(mesh, model, capacity, page, backend)
    if self.multi:
      self.launcher.threaded = False

  def _shard_over(self, mesh, model, capacity, page, backend):
    """Data parallel over a 1-D mesh ``rows``: device i runs policies [i·V/d, (i+1)·V/d) on its
    own cache (every cache/ledger leaf is the device-major concatenation of the local ones)."""
    d = mesh.size
    if self.V % d:
      raise ValueError(f"{self.V} policies per chunk do not split over {d} devices")
    self.local = StackRunner(model, self.template, n_policies=self.V // d, n_requests=self.N,
                             capacity=capacity, page=page, backend=backend)
    self.local.launcher.close()   # its functions run inside this runner's (and its launcher)
    rows, rep = jax.sharding.PartitionSpec("rows"), jax.sharding.PartitionSpec()
    sm = lambda f, ins: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=ins, out_specs=rows,
                                              check_vma=False))
    self.commit = sm(self.local._commit, (rows, rows, rep, rep, rep, rep))
    local_step = self.local._step

    def step(params, policy, state, tokens, tag_ids, state_ids, active, bits, key, temperature,
             top_p, how=None):   # ``how``: the sampler's branches, static (PaskRunner.step's)
      return jax.shard_map(functools.partial(local_step, how=how), mesh=mesh, out_specs=rows,
                           in_specs=(rep, rows, rows, rows, rows, rows, rows, rows, rep, rows,
                                     rows), check_vma=False)(
          params, policy, state, tokens, tag_ids, state_ids, active, bits, key, temperature,
          top_p)
    self.step = jax.jit(step, static_argnames=("how",))
    self.forward = jax.jit(jax.shard_map(self.local._forward, mesh=mesh,
                                         in_specs=(rep,) + (rows,) * 6, out_specs=rows,
                                         check_vma=False), donate_argnums=(2,))
    self._new_sharded = jax.jit(jax.shard_map(self.local.new_cache, mesh=mesh, in_specs=(),
                                              out_specs=rows, check_vma=False))
    if self.multi:
      self._across_processes(mesh)

  def _across_processes(self, mesh):
    """The sharded calls with global inputs: the parameters replicated once, the policy stack
    per :meth:`use`, host inputs (every process holds them in full, the same) placed shard by
    shard (:func:`calibrate.distributed.to_global`).  The sampler gathers its tokens to every
    process (every process tracks every row's grammar)."""
    from calibrate import distributed as dist
    named = lambda spec: jax.sharding.NamedSharding(mesh, spec)
    rows, rep = named(jax.sharding.PartitionSpec("rows")), named(jax.sharding.PartitionSpec())
    put = lambda tree, s: jax.tree.map(lambda x: dist.to_global(x, s), tree)
    self.params = put(self.params, rep)
    commit, forward = self.commit, self.forward
    self.commit = lambda policy, cache, k, v, cands, lengths: commit(
        policy, cache, *(put(x, rep) for x in (k, v, cands, lengths)))
    self.forward = lambda params, policy, cache, budget, led, tokens, host: forward(
        params, policy, cache, budget, led, put(tokens, rows), put(host, rows))
    # Greedy or sampled, the pick of every row on every process; the key travels as its data.
    select = self.select
    pick = jax.jit(lambda logits, bits, kd, t, p, how=None: select(
        logits, bits, jax.random.wrap_key_data(kd), t, p, how=how), out_shardings=rep,
        static_argnames=("how",))
    self.select = lambda logits, bits, key, t, p, how=None: pick(
        put(logits, rows), put(bits, rows), put(jax.random.key_data(key), rep), put(t, rows),
        put(p, rows), how=how)
    self.select_rows = lambda logits, masks, idx, key, t, p, how=None: self.select(
        logits, masks[idx], key, t, p, how=how)   # every row's mask, expanded on the host

    def local_only(*a, **k):
      raise NotImplementedError("across processes a StackRunner runs generate_overlapped "
                                "(run_stack) only")
    self.step = self.decode_step = local_only
    self.use(self.policy)

  def _forward(self, params, policy, cache, budget, led, tokens, host):
    """:meth:`~pask_jax.decode.PaskRunner.deferred_fn` with its per-row host inputs in one
    int32 array (one transfer per step, not four): ``host [B, N_CAND + 3]`` = the previous
    token's tags, its parser-state id, decide it, feed ``tokens``."""
    n = T.N_CAND
    return self.deferred_fn(params, policy, cache, budget, led, tokens, host[:, :n], host[:, n],
                            host[:, n + 1] > 0, host[:, n + 2] > 0)

  def use(self, policy_stack: P.FrozenPolicy) -> None:
    if policy_stack.action.shape[0] != self.V:
      raise ValueError(f"stack of {policy_stack.action.shape[0]} policies for a runner of {self.V}")
    if self.multi:     # each process places its devices' policies (the stack is the same on all)
      from calibrate import distributed as dist
      s = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec("rows"))
      policy_stack = jax.tree.map(lambda x: dist.to_global(x, s), policy_stack)
    self.policy = policy_stack

  def fetch(self, x) -> np.ndarray:
    """A step output's whole value on this host (gathered from every process's devices when
    the mesh spans several processes)."""
    if self.multi:
      from calibrate import distributed as dist
      return dist.fetch(x)
    return np.asarray(x)

  def new_cache(self):
    from pask_jax import cache as pcache
    if self.local is not None:       # each device builds its own (device-major concatenation)
      return self._new_sharded()
    return pcache.init_for(self.cfg, self.batch, self.template, capacity=self.capacity,
                           page=self.page)

  def _shared(self, policy):
    return self.template

  def _rows(self, x):
    """[V, N, ...] -> [V·N, ...]"""
    return x.reshape((self.V * self.N,) + x.shape[2:])

  def _plan(self, policy, cands, lengths, k, v):
    # cands, lengths, k, v cover the N requests once; every policy plans its own copy.
    plan, _ = jax.vmap(controller.plan_prefill, in_axes=(0, None, None))(policy, cands, lengths)
    budget = jax.vmap(controller.initial_balance)(policy)                 # [V]
    budget = jnp.repeat(budget, self.N)
    tile = lambda x: jnp.tile(x, (1, self.V) + (1,) * (x.ndim - 2))     # batch axis 1
    return self._rows(plan), budget, tile(k), tile(v), jnp.tile(lengths, self.V)

  def _control(self, policy, tag_ids, state_ids, budget, stop):
    V, N = self.V, self.N
    a, b = jax.vmap(controller.control_batch)(
        policy, tag_ids.reshape(V, N, -1), state_ids.reshape(V, N), budget.reshape(V, N),
        stop.reshape(V, N))
    return self._rows(a), self._rows(b)

  def begin(self, tokens: np.ndarray, lengths: np.ndarray, prompt_tags=None):
    # generate() hands us V copies of the N prompts: prefill the first copy only.
    # (commit/_plan tile the N requests' K/V and plans over the V policies).
    N = self.N
    logits, state = super().begin(tokens[:N], lengths[:N], list(prompt_tags or [])[:N])
    return jnp.tile(logits, (self.V, 1)), state

  def report(self, state) -> list[dict]:
    return ledger.summary(state[2], self.template)


class Recorder(dec.Tracker):
  """A tracker that keeps every accepted token's tag candidates and parser-state id."""

  def __init__(self, grammar, adapter):
    super().__init__(grammar, adapter)
    self.tags: list[np.ndarray] = []
    self.states: list[int] = []

  def accept(self, token: int):
    t, s = super().accept(token)
    self.tags.append(np.asarray(t, np.int32))
    self.states.append(int(s))
    return t, s

  def fork(self) -> "Recorder":
    new = super().fork()
    new.tags, new.states = list(self.tags), list(self.states)
    return new


@dataclasses.dataclass
class Outcome:
  """One (policy, request) generation: scored, with its ledger and structural trace."""
  case: int            # index into the request list
  tokens: list[int]
  text: str
  finish: str
  passed: bool
  per_call: float
  ledger: dict
  tags: np.ndarray     # int32[n_accepted, N_CAND] (includes the stop token's row, if any)
  states: np.ndarray   # int32[n_accepted]
  prompt_len: int


def row_masks(trackers, running: np.ndarray, words: int) -> tuple[np.ndarray, np.ndarray]:
  """The next-token bitmasks as ``(masks [U, words] int32, rows [B] int32)``, row b's mask being
  ``masks[rows[b]]``: one mask per distinct ``mask_key`` of the running rows' trackers (rows of
  one parser-state node share theirs: :class:`calibrate.shared.SharedTracker`), every token
  allowed for unconstrained and finished rows (as :func:`pask_jax.decode.generate`).  U is
  padded to a power of two (at most B; padding rows allow every token, unread), so the pick
  compiles for a few sizes only."""
  B = len(trackers)
  rows = np.empty(B, np.int32)
  first: dict[Any, int] = {}
  fill: list[tuple[int, Any]] = []    # (mask row, a tracker that writes it)
  for b in range(B):
    key = getattr(trackers[b], "mask_key", trackers[b]) if running[b] else None
    u = first.get(key)
    if u is None:
      u = first[key] = len(first)
      if key is not None:
        fill.append((u, trackers[b]))
    rows[b] = u
  size = min(B, 1 << max(3, (len(first) - 1).bit_length()))
  masks = np.full((size, words), -1, np.int32)
  for u, tr in fill:
    tr.fill(masks, u)
  return masks, rows


def _forward(runner: StackRunner, cache, budget, led, pick, host):
  """The overlapped forward (on the launch thread): its host input goes up from there too."""
  return runner.forward(runner.params, runner.policy, cache, budget, led, pick, upload(host))


def generate_overlapped(runner: StackRunner, tokenizer, prompts: Sequence[Sequence[int]], *,
                        trackers: Sequence, prompt_tags: Sequence[Any] | None = None,
                        sampling: dec.Sampling = dec.Sampling(),
                        timers: dict | None = None) -> list[dec.Result]:
  """:func:`pask_jax.decode.generate` for a :class:`StackRunner` with the host's work under the
  device step: the same tokens, tracker records and ledgers.

  As the serving engine's overlapped loop (serve/engine/): the step is split into the forward
  (``runner.forward``: :meth:`~pask_jax.decode.PaskRunner.deferred_fn`, the controller one step
  late) and the pick (``runner.select_rows`` over the masks of :func:`row_masks`), and forward
  t+1 is launched fed with pick t's tokens still on the device.  Only then does the host read
  token t (pick t is done; forward t+1 runs meanwhile), accept it in the trackers (tags, parser
  states, stop checks) and build the masks of pick t+1.  The forward decides the token fed one
  step earlier, from its tags.

  A row whose next token will be its last by length is not fed; a stop token (or the token that
  completes the grammar) cannot be known ahead: it is fed and never decided, and the row's live
  payload (``live_bits``, ``peak_live_bits``) is taken from the ledger before that feed, so the
  ledger is the synchronous loop's.  ``timers`` (optional) accumulates host seconds:
  ``launch_s`` (inside the forward / pick calls, and joining a forward launched on the launch
  thread), ``wait_s`` (waiting for a pick's tokens), ``host_s`` (trackers and masks), and
  ``steps``.  With ``runner.launcher`` threaded (on a GPU) the forward is launched on the launch
  thread while the host accepts and fills (:mod:`pask_jax.launch`).
  """
  B, vocab = runner.batch, runner.cfg.vocab_size
  n, mt = len(prompts), sampling.max_tokens
  if not 0 < n <= B:
    raise ValueError(f"got {n} prompts for a runner of batch {B}")
  for i, p in enumerate(prompts):
    if len(p) + mt > runner.capacity:
      raise dec.CapacityError(
          f"prompt {i} has {len(p)} tokens; with max_tokens={mt} it needs {len(p) + mt} > "
          f"capacity {runner.capacity}")
  if len(trackers) != n:
    raise ValueError(f"got {len(trackers)} trackers for {n} prompts")
  trackers = list(trackers) + [dec.Tracker() for _ in range(B - n)]
  tm = timers if timers is not None else {}
  for k in ("launch_s", "wait_s", "host_s", "steps"):
    tm.setdefault(k, 0)
  clock = time.perf_counter
  stops = np.asarray(sorted(tokenizer.stop_ids), np.int64)
  temp = jnp.full((B,), sampling.temperature, jnp.float32)
  top_p = jnp.full((B,), sampling.top_p, jnp.float32)
  key = jax.random.key(sampling.seed)
  words = dec.new_bitmask(1, vocab).shape[1]
  sampled = sampling.temperature > 0    # greedy picks ignore the key: no split per step
  # the pick's branches, static: a device-side conditional would make each pick's launch wait
  # for the forward before it (pask_jax.sample.sample)
  how = how_of(sampling.temperature, sampling.top_p)

  t0 = clock()
  tokens, lengths = dec.pad_prompts(prompts, B, runner.capacity)
  logits, (cache, budget, led) = runner.begin(tokens, lengths, prompt_tags)
  running = np.arange(B) < n
  masks, rows = row_masks(trackers, running, words)
  key, sub = jax.random.split(key)
  pick = runner.select_rows(logits, masks, rows, sub, temp, top_p, how=how)
  t1 = None
  out = np.zeros((B, mt), np.int64)     # row b's output tokens: out[b, :n_out[b]]
  n_out = np.zeros((B,), np.int64)
  finish = ["length"] * n
  tag_ids = np.broadcast_to(dec.FREE_TAG, (B, T.N_CAND)).copy()
  state_ids = np.full((B,), -1, np.int32)
  decide = np.zeros((B,), bool)      # rows whose fed token the next forward decides
  count = np.zeros((B,), np.int64)   # accepted tokens per row
  live_from: dict[int, tuple] = {}   # row -> (live_bits, peak_live_bits) before its stop's feed
  for _ in range(mt):
    # Forward: feed the pick's tokens (device) to every running row but those whose token is
    # their last by length; decide the tokens fed by the previous forward.
    feed = running & (count + 1 < mt)
    before = (led.live_bits, led.peak_live_bits)
    ta = clock()
    fwd = None
    if feed.any() or decide.any():
      host = np.concatenate([tag_ids, state_ids[:, None], decide[:, None], feed[:, None]],
                            axis=1, dtype=np.int32)   # a fresh array: the thread may read it late
      fwd = runner.launcher.submit(_forward, runner, cache, budget, led, pick, host)
      tm["steps"] += 1
    tb = clock()
    y = np.asarray(pick)    # waits for the pick only: the forward just launched runs meanwhile
    tc = clock()
    t1 = t1 or tc
    decide = np.zeros((B,), bool)
    idx = np.flatnonzero(running)
    tok = y[idx]
    tag_ids[idx], state_ids[idx], ended = accept_rows([trackers[b] for b in idx], tok)
    count[idx] += 1
    stop = np.isin(tok, stops)
    ended |= stop
    emit = idx[~stop]       # a stop token is not output; the token completing the grammar is
    out[emit, n_out[emit]] = tok[~stop]
    n_out[emit] += 1
    for b in idx[ended]:
      finish[b] = "stop"
      if feed[b]:
        live_from[b] = before
    running[idx[ended]] = False
    more = idx[~ended]
    last = count[more] >= mt
    running[more[last]] = False
    decide[more[~last]] = True
    if not running.any():
      th = clock()
      if fwd is not None:
        logits, cache, budget, led, _ = fwd.result()
      tm["launch_s"] += (tb - ta) + (clock() - th)
      tm["wait_s"] += tc - tb
      tm["host_s"] += th - tc
      break
    masks, rows = row_masks(trackers, running, words)
    if sampled:
      key, sub = jax.random.split(key)
    td = clock()
    if fwd is not None:
      logits, cache, budget, led, _ = fwd.result()
    pick = runner.select_rows(logits, masks, rows, sub, temp, top_p, how=how)
    te = clock()
    tm["launch_s"] += (tb - ta) + (te - td)
    tm["wait_s"] += tc - tb
    tm["host_s"] += td - tc
  t2 = clock()
  t1 = t1 or t2
  led = jax.tree.map(runner.fetch, led)
  if live_from:
    live, peak = led.live_bits.copy(), led.peak_live_bits.copy()
    fetched: dict[int, tuple] = {}
    for b, src in live_from.items():
      lv, pk = fetched.setdefault(id(src), tuple(runner.fetch(x) for x in src))
      live[b], peak[b] = lv[b], pk[b]
    led = led.replace(live_bits=live, peak_live_bits=peak)
  reports = runner.report((cache, budget, led))
  outs = [out[b, :n_out[b]].tolist() for b in range(n)]
  return [dec.Result(outs[b], tokenizer.decode(outs[b]), len(prompts[b]), finish[b], t1 - t0,
                     t2 - t1, reports[b]) for b in range(n)]


def _chunks(n: int, size: int) -> list[range]:
  return [range(s, min(s + size, n)) for s in range(0, n, size)]


def run_stack(runner_for: Callable[..., StackRunner], task, policies: Sequence,
              *, rows: int = 256, max_tokens: int = 128, progress=None, share: bool = True,
              on_chunk: Callable[[list[int], list[list[Outcome]]], None] | None = None,
              timers: dict | None = None) -> list[list[Outcome]]:
  """Generate every request of ``task`` under every policy -> ``out[policy][request]``.

  ``runner_for(V, N, most=rows // N)`` returns a (cached) :class:`StackRunner` of ``V`` policies
  or more (:func:`runner_factory`: an already compiled one of at most ``min(2·V, most)``);
  chunks have that runner's fixed ``(V, N)`` with ``V·N <= rows`` (the last chunk is padded by
  repeating its last policy / request, whose rows are dropped), so the step compiles once.
  ``task``: see :mod:`calibrate.tasks` (``requests``, ``tracker(i)``, ``score(i, text,
  complete)``).  ``on_chunk(policy_indices, outcomes)`` is called as each chunk of policies
  completes (resumable calibration saves there).  ``share``: rows of
  one request with the same prefix share one parser (:mod:`calibrate.shared`; same results).
  ``timers``: host seconds per kind, summed over chunks (see :func:`generate_overlapped`).
  """
  reqs = task.requests
  n_req, n_pol = len(reqs), len(policies)
  N = min(n_req, rows)
  V = max(1, min(n_pol, rows // N))
  runner = runner_for(V, N, most=max(1, rows // N))
  V = runner.V                      # the factory may round it (devices) or give a larger one
  out: list[list[Outcome | None]] = [[None] * n_req for _ in range(n_pol)]
  order = sorted(range(n_req), key=lambda i: len(reqs[i].ids))     # similar lengths together
  sampling = dec.Sampling(max_tokens=max_tokens)
  for pc in _chunks(n_pol, V):
    pidx = list(pc) + [pc[-1]] * (V - len(pc))
    runner.use(stack([policies[i] for i in pidx]))
    for rc in _chunks(n_req, N):
      ridx = [order[i] for i in rc]
      ridx = ridx + [ridx[-1]] * (N - len(ridx))
      if share:
        forest = Forest(task.tracker)
        trackers = [forest.row(i) for _ in pidx for i in ridx]
      else:
        trackers = [task.tracker(i) for _ in pidx for i in ridx]
      # Rows of a no-transition policy (ablation) see position bins, not the parser's tags.
      bins = [P.position_bins(policies[p]) for p in pidx]
      trackers = [with_positions([t], bins[j // N])[0] for j, t in enumerate(trackers)]
      prompts = [reqs[i].ids for _ in pidx for i in ridx]
      ptags = [reqs[i].tags for _ in pidx for i in ridx]
      res = generate_overlapped(runner, task.tokenizer, prompts, trackers=trackers,
                                prompt_tags=ptags, sampling=sampling, timers=timers)
      for vi, p in enumerate(pidx[:len(pc)]):
        for ni, r in enumerate(ridx[:len(rc)]):
          j = vi * N + ni
          rr, tr = res[j], trackers[j]
          passed, per_call = task.score(r, rr.text, rr.finish == "stop")
          out[p][r] = Outcome(r, rr.tokens, rr.text, rr.finish, passed, per_call, rr.ledger,
                              np.asarray(tr.tags, np.int32).reshape(-1, T.N_CAND),
                              np.asarray(tr.states, np.int32), rr.prompt_len)
      if progress is not None:
        progress(len(pc) * len(rc))
    if on_chunk is not None:
      on_chunk(list(pc), [out[i] for i in pc])
  return out


def run_sequential(runner_for: Callable[..., StackRunner], task, policies: Sequence,
                   *, rows: int = 256, max_tokens: int = 128, progress=None):
  """The same as :func:`run_stack`, one policy at a time (``V = 1`` exactly: no larger runner
  stands in; a parser per row): the baseline loop."""
  one = lambda V, N, most=None: runner_for(V, N)
  out = []
  for p in policies:
    out += run_stack(one, task, [p], rows=rows, max_tokens=max_tokens, progress=progress,
                     share=False)
  return out


def runner_factory(model, template: P.FrozenPolicy, capacity: int, *, page: int = 16,
                   backend: str = "auto", devices: Sequence | None = None):
  """A ``runner_for(V, N, most=None)`` that builds each shape's :class:`StackRunner` once.

  A runner of ``V' > V`` policies (and ``N`` requests) built already serves a call for ``V`` when
  ``V' <= min(2·V, most)``, the smallest such: its extra rows repeat the chunk's last policy
  (:func:`run_stack`'s padding; the same outcomes), at most twice a chunk's rows per step in
  place of a compile of another shape (~6 s of CPU for SmolLM2's stack on a CPU host, where a
  step costs milliseconds).  A calibration's stages ask for 1, then ``rows // N``, then fewer
  policies (the README's: 1, 8, 7): two compiles instead of three.  ``most=None``: ``V`` exactly.

  ``devices``: shard the policy axis over these devices (a 1-D mesh named ``rows``); the
  policies per chunk are rounded down to a multiple of their number.
  """
  cache: dict[tuple[int, int], StackRunner] = {}
  mesh = None
  if devices is not None and len(devices) > 1:
    mesh = jax.sharding.Mesh(np.asarray(devices), ("rows",))

  def get(V: int, N: int, most: int | None = None) -> StackRunner:
    if mesh is not None and V % mesh.size:
      V = max(mesh.size, V - V % mesh.size)
    if (V, N) not in cache and most is not None:
      spare = [v for v, n in cache if n == N and V < v <= min(2 * V, most)]
      if spare:
        return cache[(min(spare), N)]
    if (V, N) not in cache:
      cache[(V, N)] = StackRunner(model, template, n_policies=V, n_requests=N, capacity=capacity,
                                  page=page, backend=backend, mesh=mesh)
    return cache[(V, N)]

  return get


def timed(fn, *a, **kw):
  t0 = time.perf_counter()
  r = fn(*a, **kw)
  return r, time.perf_counter() - t0
