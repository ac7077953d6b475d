"""The serving engine: continuous batching of requests over one paged PASK cache.

One engine thread owns every device call.  The decode batch has ``slots`` sequence slots that
share one :class:`pask_jax.cache.Cache` (built by ``cache.init_paged``: the BF16 and INT4 pools
are sized for the server, not ``slots × context``).  Choices, in the order a request meets them:

* **Admission (B.4).**  A request reserves, per pool, the pages its persistent demand can reach
  in the worst case: ``ceil(max(0, prompt + max_tokens - W) / page)`` (tokens still in the
  recent window of W slots never reach a pool).  The INT4 pool is reserved only when the policy
  can emit L (some floor below H); otherwise every stored token is H and the INT4 pool is one
  unused page.  Requests wait in a strict FIFO queue until a slot is free and both free lists
  hold their reservation (no overtaking, so a large request is never starved).  The prefill
  scratch (a dense BF16 cache of the padded prompt) is transient and prefills run one at a time,
  so it is a fixed cost of the engine, not part of a reservation.
* **Prefill** runs at full precision for one request (batch 1, padded to a power-of-two bucket
  >= 64, so a handful of shapes compile), then ``cache.insert_slot`` materializes its prefill plan
  (prompt-span labels → R/L/H) into the request's slot and pages — one jitted function with the
  slot index and page rows as traced inputs, compiled once per bucket.
* **Interleaving**: each engine iteration admits requests into free slots, then runs one decode
  step for all running slots.  While other requests are decoding, admission stops once this
  iteration's prefills took about one decode step (a moving average; at least one prefill), so
  a burst of arrivals stalls running streams by about one step; with nothing running it fills
  every free slot (a step costs the same for one active row as for all).
* **Decode**: ONE jitted step for the whole batch (``PaskRunner._decode_step`` + per-row
  sampling); inactive slots are masked by ``active`` (neither charged nor written), so it
  compiles once per batch shape.  Sampling keys are per request: fold_in(key(seed), token
  index), so a seeded request samples the same tokens whatever else shares the batch.
* **Per request**: its own grammar matcher + adapter (:class:`pask_jax.decode.Tracker`, with
  ``FCAdapter`` for tools) and its ledger row (reset on insert, read at completion).
* **Stop sequences** (``Request.stop``) are matched on the decoded text after every accepted
  token, so a sequence split across tokens is found; the text is cut before it (the tokens stay
  counted) and the request finishes "stop".  Streamed text holds back the longest tail that could
  still begin a stop sequence.
* **Log-probabilities** (``Request.logprobs``: None, or how many alternatives): inside the jitted
  sampling function, the log-softmax of the grammar-masked logits (before temperature) gives the
  chosen token's log-prob and the top :data:`TOP_LOGPROBS`; computed only when some row asks
  (``lax.cond``), one compile whatever the per-request count.
* **Release**: on completion, cancellation (client disconnect) and error the slot is emptied
  (``cache.release_slot``: its page tables point nowhere) and its pages go back to the free
  lists.

Events go back to the caller through ``Request.emit(kind, payload)``, called on the engine
thread (the app forwards them to its event loop).  kinds: ``"delta"`` (text), ``"done"``
(result dict), ``"error"`` (message).
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import math
import threading
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from pask_jax import cache as pcache
from pask_jax import controller, kv_dense, ledger
from pask_jax import tags as T
from pask_jax.decode import FREE_TAG, PREFILL_CHUNK, PaskRunner, Runner, Tracker, prompt_candidates
from pask_jax.grammar.matcher import new_bitmask
from pask_jax.sample import _nucleus, apply_bitmask

_ids = itertools.count(1)
TOP_LOGPROBS = 20   # alternatives computed per step when a request asks for logprobs
METRIC_KEYS = ("queue_wait_s", "prefill_s", "prefills", "decode_steps", "decode_step_s",
               "decode_rows", "requests_stop", "requests_length", "requests_cancelled",
               "requests_error", "prompt_tokens", "completion_tokens", "tpot_s_sum", "tpot_count",
               "overflow", "payload_bits", "full_kv_bits", "actions_R", "actions_L", "actions_H",
               "admission_blocked_pages")


@dataclasses.dataclass(eq=False)
class Request:
  ids: list[int]
  max_tokens: int
  tracker: Tracker = dataclasses.field(default_factory=Tracker)
  tags: np.ndarray | None = None    # prompt-span label candidates int32[n, 4]
  temperature: float = 0.0
  top_p: float = 1.0
  seed: int = 0
  stop: tuple[str, ...] = ()        # stop sequences (text), matched across token boundaries
  logprobs: int | None = None       # None, or the number of top alternatives to return (<= 20)
  emit: Callable[[str, Any], None] = lambda kind, payload: None
  rid: int = dataclasses.field(default_factory=lambda: next(_ids))
  cancelled: bool = False
  # engine-side state
  slot: int | None = None
  hi: list[int] = dataclasses.field(default_factory=list)
  lo: list[int] = dataclasses.field(default_factory=list)
  out: list[int] = dataclasses.field(default_factory=list)
  sent: str = ""
  lps: list = dataclasses.field(default_factory=list)   # per token: (logprob, [(id, logprob)])
  cut: int | None = None            # text length before the stop sequence that ended it
  t_submit: float = 0.0
  t_admit: float | None = None
  t_first: float | None = None
  t_last: float | None = None

  def cancel(self) -> None:
    """Thread-safe (a flag the engine polls every iteration)."""
    self.cancelled = True


def bucket(n: int) -> int:
  """Padded prefill length: a power of two >= 64, or a chunk multiple past one chunk."""
  if n > PREFILL_CHUNK:
    return -(-n // PREFILL_CHUNK) * PREFILL_CHUNK
  return max(64, 1 << (n - 1).bit_length())


class Engine:
  def __init__(self, model, tokenizer, policy, *, slots: int = 4, context: int = 1024,
               page: int = 16, hi_pages: int | None = None, lo_pages: int | None = None,
               backend: str = "auto"):
    """``context``: the most tokens (prompt + max_tokens) one request may take.  ``hi_pages`` /
    ``lo_pages``: pool sizes in pages (default: every slot at full context)."""
    self.model, self.cfg, self.tok, self.policy = model, model.cfg, tokenizer, policy
    self.slots, self.context, self.page = slots, context, page
    self.runner = PaskRunner(model, policy, batch=slots, capacity=context, page=page,
                             backend=backend)
    self.dense = Runner(model, batch=1, capacity=context, cache_dtype=jnp.bfloat16)
    self.dense.params = self.runner.params
    self.window = int(policy.window)
    self.n_pages = math.ceil(context / page)
    self.uses_low = bool(np.any(np.asarray(policy.floor) < T.H))
    self.hi_total = hi_pages or slots * self.n_pages
    self.lo_total = lo_pages or (slots * self.n_pages if self.uses_low else 1)
    self.free_hi = collections.deque(range(self.hi_total))
    self.free_lo = collections.deque(range(self.lo_total))
    c = self.cfg
    cache = pcache.init_paged(c.n_layers, slots, c.n_kv_heads, c.head_dim, capacity=context,
                              window=self.window, hi_pool_pages=self.hi_total,
                              lo_pool_pages=self.lo_total, sink=policy.sink,
                              n_groups=policy.n_groups, page=page)
    self.state = (cache, jnp.zeros((slots,), jnp.float32), ledger.init(slots, policy.n_groups))
    self._insert = jax.jit(self._insert_fn, donate_argnums=(1,))
    self._release = jax.jit(self._release_fn, donate_argnums=(0,))
    self._step = jax.jit(self._step_fn, donate_argnums=(2,))
    self._first = jax.jit(self._pick)
    # Host mirrors of the step inputs.
    B, V = slots, c.vocab_size
    self.tokens = np.zeros((B,), np.int32)
    self.tag_ids = np.broadcast_to(FREE_TAG, (B, T.N_CAND)).copy()
    self.state_ids = np.full((B,), -1, np.int32)
    self.active = np.zeros((B,), bool)
    self.seeds = np.zeros((B,), np.uint32)
    self.temp = np.zeros((B,), np.float32)
    self.top_p = np.ones((B,), np.float32)
    self.want_lp = np.zeros((B,), bool)
    self.bits = new_bitmask(B, V)
    self.bits1 = new_bitmask(1, V)
    self.running: list[Request | None] = [None] * B
    self.waiting: collections.deque[Request] = collections.deque()
    self.inbox: list[Request] = []
    self.stops = set(tokenizer.stop_ids)
    self.cv = threading.Condition()
    self.stopping = False
    self.thread: threading.Thread | None = None
    self.crashed: BaseException | None = None
    self.step_ema = 0.0   # seconds per decode step (moving average): the prefill budget
    # Metrics, written by the engine thread and read by the app's: every key exists from the
    # start (a dict that grows while another thread iterates it raises).
    self.m = collections.Counter(dict.fromkeys(METRIC_KEYS, 0))

  # --- jitted pieces ------------------------------------------------------------------------

  def _insert_fn(self, policy, state, k, v, cands, length, slot, hi_row, lo_row):
    """Prefill K/V of one request [L, 1, T, Hkv, D] -> its plan materialized into ``slot``;
    the slot's ledger row and balance are reset."""
    self.runner.traces["insert"] += 1
    cache, budget, led = state
    plan, _ = controller.plan_prefill(policy, cands, length)
    cache = pcache.insert_slot(cache, slot, k, v, plan, length, hi_row, lo_row)
    one = ledger.record_prefill(ledger.init(1, policy.n_groups), plan, length, sink=policy.sink)
    put = lambda full, part: jax.lax.dynamic_update_slice_in_dim(full, part, slot, 0)
    led = jax.tree.map(put, led, one)
    led = ledger.record_live(led, cache, policy.cost, policy.c_full)
    budget = budget.at[slot].set(controller.initial_balance(policy))
    return cache, budget, led

  def _release_fn(self, state, slot):
    cache, budget, led = state
    return pcache.release_slot(cache, slot), budget, led

  def _pick(self, logits, bits, seeds, steps, temperature, top_p, want_lp):
    """Per-row sampling: row b uses key fold_in(key(seeds[b]), steps[b]).  -> (tokens [B],
    (chosen log-prob [B], top ids [B, K], top log-probs [B, K])); the log-probs are of the
    masked logits and are zeros unless some row wants them."""
    masked = apply_bitmask(logits, bits)
    greedy = jnp.argmax(masked, axis=-1).astype(jnp.int32)
    keys = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(seeds, steps)
    row = lambda l, k, t, p, g: _nucleus(l[None], k, t[None], p[None], g[None])[0]
    tok = jax.lax.cond(jnp.any(temperature > 0),
                       lambda: jax.vmap(row)(masked, keys, temperature, top_p, greedy),
                       lambda: greedy)
    B, K = logits.shape[0], TOP_LOGPROBS

    def lp():
      ls = jax.nn.log_softmax(masked.astype(jnp.float32), axis=-1)
      top, ids = jax.lax.top_k(ls, K)
      return jnp.take_along_axis(ls, tok[:, None], axis=-1)[:, 0], ids.astype(jnp.int32), top

    none = lambda: (jnp.zeros((B,), jnp.float32), jnp.zeros((B, K), jnp.int32),
                    jnp.zeros((B, K), jnp.float32))
    return tok, jax.lax.cond(jnp.any(want_lp), lp, none)

  def _step_fn(self, params, policy, state, tokens, tag_ids, state_ids, active, bits, seeds,
               steps, temperature, top_p, want_lp):
    cache, budget, led = state
    logits, cache, budget, led, _ = self.runner._decode_step(
        params, policy, cache, budget, led, tokens, tag_ids, state_ids, active)
    return self._pick(logits, bits, seeds, steps, temperature, top_p, want_lp), \
        (cache, budget, led)

  # --- public, thread-safe ------------------------------------------------------------------

  def demand(self, n_prompt: int, max_tokens: int) -> tuple[int, int]:
    """Pages (BF16 pool, INT4 pool) a request reserves (see the module docstring)."""
    need = math.ceil(max(0, n_prompt + max_tokens - self.window) / self.page)
    return need, (need if self.uses_low else 0)

  def fits_ever(self, n_prompt: int, max_tokens: int) -> str | None:
    """Why a request can never run here, or None."""
    if n_prompt < 1:
      return "empty prompt"
    if n_prompt + max_tokens > self.context:
      return (f"prompt of {n_prompt} tokens + max_tokens {max_tokens} exceeds the server's "
              f"context of {self.context} tokens")
    h, l = self.demand(n_prompt, max_tokens)
    if h > self.hi_total or l > self.lo_total:
      return "the request needs more KV pages than the server's pools hold"
    return None

  def submit(self, req: Request) -> Request:
    why = self.fits_ever(len(req.ids), req.max_tokens)
    if why:
      raise ValueError(why)
    req.t_submit = time.perf_counter()
    with self.cv:
      self.inbox.append(req)
      self.cv.notify()
    return req

  def start(self) -> "Engine":
    self.thread = threading.Thread(target=self._main, name="pask-engine", daemon=True)
    self.thread.start()
    return self

  def stop(self, timeout: float = 10.0) -> None:
    with self.cv:
      self.stopping = True
      self.cv.notify()
    if self.thread is not None:
      self.thread.join(timeout)

  @property
  def alive(self) -> bool:
    return self.thread is not None and self.thread.is_alive() and self.crashed is None

  def snapshot(self) -> dict:
    """Gauges for /metrics (racy reads of host counters are fine for monitoring)."""
    return {"queue_depth": len(self.waiting) + len(self.inbox),
            "running": sum(r is not None for r in self.running), "slots": self.slots,
            "hi_free": len(self.free_hi), "hi_total": self.hi_total,
            "lo_free": len(self.free_lo), "lo_total": self.lo_total, **self.m}

  def warmup(self) -> None:
    """Compile the decode step and the smallest prefill bucket before serving (call before
    :meth:`start`): one dummy request of one prompt token and two new tokens."""
    r = Request(ids=[self.tok.stop_ids[0] if self.tok.stop_ids else 0], max_tokens=2)
    self.submit(r)
    while self.inbox or self.waiting or any(x is not None for x in self.running):
      self._iterate()
    for k in self.m:   # back to zero, keys kept
      self.m[k] = 0

  # --- the engine thread --------------------------------------------------------------------

  def _main(self) -> None:
    try:
      while True:
        with self.cv:
          while not (self.stopping or self.inbox or self.waiting
                     or any(r is not None for r in self.running)):
            self.cv.wait()
          if self.stopping:
            break
        self._iterate()
    except BaseException as e:   # noqa: BLE001 — keep the reason for /health, fail requests
      self.crashed = e
      for r in list(self.waiting) + self.inbox + [x for x in self.running if x is not None]:
        r.emit("error", f"engine failure: {e!r}")
      raise

  def _iterate(self) -> None:
    with self.cv:
      self.waiting.extend(self.inbox)
      self.inbox.clear()
    for b, r in enumerate(self.running):
      if r is not None and r.cancelled:
        self._finish(r, "cancelled")
    self._admit()
    if self.active.any():
      self._decode()

  def _admit(self) -> None:
    if any(r.cancelled for r in self.waiting):   # gone before admission: drop, nothing held
      for r in [r for r in self.waiting if r.cancelled]:
        self.m["requests_cancelled"] += 1
        r.emit("done", None)
      self.waiting = collections.deque(r for r in self.waiting if not r.cancelled)
    busy = bool(self.active.any())
    spent = 0.0
    while self.waiting and None in self.running:
      r = self.waiting[0]
      h, l = self.demand(len(r.ids), r.max_tokens)
      if len(self.free_hi) < h or len(self.free_lo) < l:
        self.m["admission_blocked_pages"] += 1   # a slot is free, the pages are not
        return   # strict FIFO: wait for pages
      self.waiting.popleft()
      r.slot = self.running.index(None)
      r.hi = [self.free_hi.popleft() for _ in range(h)]
      r.lo = [self.free_lo.popleft() for _ in range(l)]
      self.running[r.slot] = r
      r.t_admit = time.perf_counter()
      self.m["queue_wait_s"] += r.t_admit - r.t_submit
      t0 = time.perf_counter()
      try:
        self._prefill(r)
      except Exception as e:  # noqa: BLE001 — a bad request must not take the engine down
        self._finish(r, "error", f"prefill failed: {e}")
      spent += time.perf_counter() - t0
      # Running streams wait while we prefill: stop once this iteration's prefills cost about
      # one decode step (always at least one).  With nothing running, fill every free slot —
      # the step costs the same for 1 active row as for all of them.
      if busy and spent >= self.step_ema:
        return

  def _row(self, pages: list[int], total: int) -> jnp.ndarray:
    return jnp.asarray(pages + [total] * (self.n_pages - len(pages)), jnp.int32)

  def _prefill(self, r: Request) -> None:
    t0 = time.perf_counter()
    n, Tn = len(r.ids), bucket(len(r.ids))
    toks = np.zeros((1, Tn), np.int32)
    toks[0, :n] = r.ids
    c = self.cfg
    dense = kv_dense.init(c.n_layers, 1, Tn, c.n_kv_heads, c.head_dim, jnp.bfloat16)
    logits, dense = self.dense.prefill_all(dense, toks, np.array([n], np.int32))
    cands = prompt_candidates([r.tags], np.array([n]), Tn)
    self.state = self._insert(self.policy, self.state, dense.k, dense.v, jnp.asarray(cands),
                              jnp.asarray([n], jnp.int32), jnp.int32(r.slot),
                              self._row(r.hi, self.hi_total), self._row(r.lo, self.lo_total))
    self.bits1[:] = -1
    r.tracker.fill(self.bits1, 0)
    tok, lp = self._first(logits, jnp.asarray(self.bits1), jnp.asarray([r.seed], jnp.uint32),
                          jnp.asarray([0], jnp.int32),
                          jnp.asarray([r.temperature], jnp.float32),
                          jnp.asarray([r.top_p], jnp.float32),
                          jnp.asarray([r.logprobs is not None]))
    self.m["prefill_s"] += time.perf_counter() - t0
    self.m["prefills"] += 1
    b = r.slot
    self.seeds[b], self.temp[b], self.top_p[b] = r.seed, r.temperature, r.top_p
    lp = tuple(np.asarray(x) for x in lp) if r.logprobs is not None else None
    self._accept(r, int(tok[0]), _row(lp, 0))

  def _decode(self) -> None:
    t0 = time.perf_counter()
    self.bits[:] = -1
    for b, r in enumerate(self.running):
      if r is not None and self.active[b]:
        r.tracker.fill(self.bits, b)
    steps = np.array([len(r.out) if r is not None else 0 for r in self.running], np.int32)
    nxt, self.state = self._step(self.runner.params, self.policy, self.state,
                                 jnp.asarray(self.tokens), jnp.asarray(self.tag_ids),
                                 jnp.asarray(self.state_ids), jnp.asarray(self.active),
                                 jnp.asarray(self.bits), jnp.asarray(self.seeds),
                                 jnp.asarray(steps), jnp.asarray(self.temp),
                                 jnp.asarray(self.top_p), jnp.asarray(self.want_lp & self.active))
    lps = tuple(np.asarray(x) for x in nxt[1]) if (self.want_lp & self.active).any() else None
    nxt = np.asarray(nxt[0])
    dt = time.perf_counter() - t0
    self.m["decode_steps"] += 1
    self.m["decode_step_s"] += dt
    self.step_ema = dt if not self.step_ema else 0.8 * self.step_ema + 0.2 * dt
    self.m["decode_rows"] += int(self.active.sum())
    for b, r in enumerate(self.running):
      if r is not None and self.active[b]:
        self._accept(r, int(nxt[b]), _row(lps, b))

  def _accept(self, r: Request, tok: int, lp=None) -> None:
    """The host half of a step for one request (as in ``decode.generate``), with stop
    sequences and log-probs (module docstring)."""
    b = r.slot
    self.active[b] = False
    self.want_lp[b] = r.logprobs is not None
    now = time.perf_counter()
    r.t_first = r.t_first or now
    r.t_last = now
    try:
      tag, sid = r.tracker.accept(tok)
    except Exception as e:  # noqa: BLE001
      return self._finish(r, "error", f"grammar: {e}")
    stop = tok in self.stops or r.tracker.terminated
    if tok not in self.stops:
      r.out.append(tok)
      if r.logprobs is not None and lp is not None:
        r.lps.append(_logprobs(lp, r.logprobs))
      if r.stop:
        stop = self._stop_text(r) or stop
      self._send(r)
    if stop:
      return self._finish(r, "stop")
    if len(r.out) >= r.max_tokens:
      return self._finish(r, "length")
    self.tokens[b], self.tag_ids[b], self.state_ids[b] = tok, tag, sid
    self.active[b] = True

  def _stop_text(self, r: Request) -> bool:
    """Cut the text at the first stop sequence that the newest token completed."""
    text = self.tok.decode(r.out)
    longest = max(len(x) for x in r.stop)
    lo = max(0, len(r.sent) - longest)
    hits = [i for i in (text.find(x, lo) for x in r.stop) if i >= 0]
    if hits:
      r.cut = min(hits)
      return True
    return False

  def _send(self, r: Request, final: bool = False) -> None:
    text = self.tok.decode(r.out)
    if r.cut is not None:
      text, final = text[:r.cut], True
    elif r.stop and not final:
      # Hold back the longest tail that could still begin a stop sequence.
      hold = max((k for x in r.stop for k in range(min(len(x) - 1, len(text)), 0, -1)
                  if text.endswith(x[:k])), default=0)
      text = text[:len(text) - hold]
    # Hold back an incomplete UTF-8 sequence (decoded as U+FFFD) until its bytes arrive.
    if (final or not text.endswith("\ufffd")) and text.startswith(r.sent) and text != r.sent:
      r.emit("delta", text[len(r.sent):])
      r.sent = text

  def _finish(self, r: Request, finish: str, error: str | None = None) -> None:
    b = r.slot
    result = None
    if finish in ("stop", "length"):
      self._send(r, final=True)
      row = ledger.summary(self.state[2], self.policy)[b]
      overflow = bool(self.state[0].overflow[b])
      n = len(r.out)
      tpot = (r.t_last - r.t_first) / (n - 1) if n > 1 else None
      text = self.tok.decode(r.out)
      result = {"tokens": list(r.out), "text": text if r.cut is None else text[:r.cut],
                "finish": finish, "prompt_tokens": len(r.ids), "ledger": row,
                "overflow": overflow, "tpot_s": tpot, "logprobs": r.lps,
                "ttft_s": (r.t_first - r.t_submit) if r.t_first else None,
                "queue_s": (r.t_admit - r.t_submit) if r.t_admit else None}
      self.m["requests_" + finish] += 1
      self.m["prompt_tokens"] += len(r.ids)
      self.m["completion_tokens"] += n
      if tpot is not None:
        self.m["tpot_s_sum"] += tpot
        self.m["tpot_count"] += 1
      self.m["overflow"] += overflow
      # Aggregate measured B: payload sums, not a mean of ratios.
      self.m["payload_bits"] += row["prefill_bits"] + row["decode_bits"]
      self.m["full_kv_bits"] += row["full_kv_bits"]
      for part in ("prefill_counts", "decode_counts"):
        for g in row[part].values():
          for a, cnt in g.items():
            self.m["actions_" + a] += cnt
    else:
      self.m["requests_" + finish] += 1
    self.active[b] = False
    self.running[b] = None
    self.state = self._release(self.state, jnp.int32(b))
    self.free_hi.extend(r.hi)
    self.free_lo.extend(r.lo)
    r.hi, r.lo, r.slot = [], [], None
    if error is not None:
      r.emit("error", error)
    else:
      r.emit("done", result)


def _row(lp, b: int):
  """Row ``b`` of the sampler's log-prob outputs (host arrays), or None."""
  if lp is None:
    return None
  return float(lp[0][b]), np.asarray(lp[1][b]), np.asarray(lp[2][b])


def _logprobs(lp, k: int) -> tuple:
  """(chosen log-prob, [(id, log-prob)] of the top ``k`` alternatives that the mask allows)."""
  chosen, ids, top = lp
  alts = [(int(i), float(v)) for i, v in zip(ids[:k], top[:k]) if np.isfinite(v)]
  return chosen, alts
