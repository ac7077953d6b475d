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
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pask_jax import controller
from pask_jax import decode as dec
from pask_jax import ledger
from pask_jax import policy as P
from pask_jax import tags as T


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
    self.local = None
    if mesh is not None and mesh.size > 1:
      self._shard_over(mesh, model, capacity, page, backend)

  def _shard_over(self, mesh, model, capacity, page, backend):
    """Data parallel over a 1-D mesh ``rows``: device i runs policies [i·V/d, (i+1)·V/d) on its
    own cache (every cache/ledger leaf is the device-major concatenation of the local ones)."""
    d = mesh.size
    if self.V % d:
      raise ValueError(f"{self.V} policies per chunk do not split over {d} devices")
    self.local = StackRunner(model, self.template, n_policies=self.V // d, n_requests=self.N,
                             capacity=capacity, page=page, backend=backend)
    rows, rep = jax.sharding.PartitionSpec("rows"), jax.sharding.PartitionSpec()
    sm = lambda f, ins: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=ins, out_specs=rows,
                                              check_vma=False))
    self.commit = sm(self.local._commit, (rows, rows, rep, rep, rep, rep))
    self.step = sm(self.local._step, (rep, rows, rows, rows, rows, rows, rows, rows, rep, rows,
                                      rows))

  def use(self, policy_stack: P.FrozenPolicy) -> None:
    if policy_stack.action.shape[0] != self.V:
      raise ValueError(f"stack of {policy_stack.action.shape[0]} policies for a runner of {self.V}")
    self.policy = policy_stack

  def new_cache(self):
    from pask_jax import cache as pcache
    if self.local is not None:
      c = self.local.new_cache()
      return jax.tree.map(lambda x: jnp.concatenate([x] * self.mesh.size, 0), c)
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


def _chunks(n: int, size: int) -> list[range]:
  return [range(s, min(s + size, n)) for s in range(0, n, size)]


def run_stack(runner_for: Callable[[int, int], StackRunner], task, policies: Sequence,
              *, rows: int = 256, max_tokens: int = 128, progress=None, share: bool = True,
              on_chunk: Callable[[list[int], list[list[Outcome]]], None] | None = None
              ) -> list[list[Outcome]]:
  """Generate every request of ``task`` under every policy -> ``out[policy][request]``.

  ``runner_for(V, N)`` returns a (cached) :class:`StackRunner`; chunks have fixed ``(V, N)`` with
  ``V·N <= rows`` (the last chunk is padded by repeating its last policy / request, whose rows
  are dropped), so the step compiles once.  ``task``: see :mod:`calibrate.tasks` (``requests``,
  ``tracker(i)``, ``score(i, text, complete)``).  ``on_chunk(policy_indices, outcomes)`` is called
  as each chunk of policies completes (resumable calibration saves there).  ``share``: rows of
  one request with the same prefix share one parser (:mod:`calibrate.shared`; same results).
  """
  from calibrate.shared import Forest
  reqs = task.requests
  n_req, n_pol = len(reqs), len(policies)
  N = min(n_req, rows)
  V = max(1, min(n_pol, rows // N))
  runner = runner_for(V, N)
  V = runner.V                                    # the factory may round it (devices)
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
      prompts = [reqs[i].ids for _ in pidx for i in ridx]
      ptags = [reqs[i].prompt_tags for _ in pidx for i in ridx]
      res = dec.generate(runner, task.tokenizer, prompts, trackers=trackers, prompt_tags=ptags,
                         sampling=sampling)
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


def run_sequential(runner_for: Callable[[int, int], StackRunner], task, policies: Sequence,
                   *, rows: int = 256, max_tokens: int = 128, progress=None):
  """The same as :func:`run_stack`, one policy at a time (``V = 1``, a parser per row): the
  baseline loop."""
  out = []
  for p in policies:
    out += run_stack(runner_for, task, [p], rows=rows, max_tokens=max_tokens, progress=progress,
                     share=False)
  return out


def runner_factory(model, template: P.FrozenPolicy, capacity: int, *, page: int = 16,
                   backend: str = "auto", devices: Sequence | None = None):
  """A ``runner_for(V, N)`` that builds each shape's :class:`StackRunner` once.

  ``devices``: shard the policy axis over these devices (a 1-D mesh named ``rows``); the
  policies per chunk are rounded down to a multiple of their number.
  """
  cache: dict[tuple[int, int], StackRunner] = {}
  mesh = None
  if devices is not None and len(devices) > 1:
    mesh = jax.sharding.Mesh(np.asarray(devices), ("rows",))

  def get(V: int, N: int) -> StackRunner:
    if mesh is not None and V % mesh.size:
      V = max(mesh.size, V - V % mesh.size)
    if (V, N) not in cache:
      cache[(V, N)] = StackRunner(model, template, n_policies=V, n_requests=N, capacity=capacity,
                                  page=page, backend=backend, mesh=mesh)
    return cache[(V, N)]

  return get


def timed(fn, *a, **kw):
  t0 = time.perf_counter()
  r = fn(*a, **kw)
  return r, time.perf_counter() - t0
