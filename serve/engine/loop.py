"""The engine thread's loop.

Each iteration asks the :class:`~serve.engine.scheduler.Scheduler` whom to admit and when a long
prompt's pieces run, runs the prefills and one decode step through the
:class:`~serve.engine.step.Step` (taking pages from its pools as the tokens leaving the window
need them, preempting whom the scheduler names when a pool is short), and gives each token to
:class:`~serve.engine.output.Output`, which says whether the request goes on.

Overlap (``overlap=True``, the default where it applies): the host's half of a step (launching
the kernels of the unrolled model, the grammar's accept, tags and masks) runs while the device
computes the previous step; the forward is launched fed with the pick's token before the host
has seen it.  A request that ends has had its last token fed speculatively; nothing of it is
charged.  The host knows a token's actions two steps after feeding it, so page growth needs a
window of at least 3; with ``preemption="recompute"`` (which needs every action known when it
preempts) or a smaller window the engine runs the serial step.  On a GPU the forward's launch
(one CUDA graph, milliseconds of host time) runs on the step's launch thread while this thread
lands the previous tokens (:class:`~serve.engine.step.Step`, ``threaded``), and the pick's
sampling branches are chosen here, not on the device, so its launch never waits for the device.

Preemption keeps a request's grammar matcher and adapter, its streamed text, its sampling step
counter and, per position, the actions it was given; its KV is recomputed in one of two ways:
``"replay"`` (default) prefills the prompt again and re-feeds the generated tokens through the
decode step with their tags, so the output continues bit for bit as in an unpreempted run;
``"recompute"`` (vLLM-style) prefills prompt + generated tokens at once with their recorded
actions and restores balance and ledger: decisions continue exactly, but the generated tokens'
K/V come from a full-precision prefill, so a greedy continuation can differ after a near tie.
No request fails for lack of pages (the oldest running one can always finish alone:
:meth:`Engine.worst_case`) and every page comes back.
"""
from __future__ import annotations

import collections
import time

import jax
import jax.numpy as jnp
import numpy as np

from serve.engine.output import count_finish, count_peak
from serve.engine.request import Request
from serve.engine.sizing import bucket
from serve.engine.step import lp_row


class Loop:
  """One iteration of the engine (:meth:`_iterate`) and what it runs; engine thread only.  The
  state it works on (requests, parts, host mirrors) is built by :class:`serve.engine.Engine`."""

  def _iterate(self) -> None:
    """One iteration: cancellations, admission and prefill, one decode step."""
    with self.cv:
      self.waiting.extend(self.inbox)
      self.inbox.clear()
    for r in [x for x in self.running if x is not None and x.cancelled]:
      self._finish(r, "cancelled")
    if self.overlap:
      if self.fly_pick is not None:
        self._land()
      for r in [x for x in self.running if x is not None and x.cancelled]:
        self._finish(r, "cancelled")
      self._admit()
      self._launch()
      return
    self._admit()
    if self.batch.active.any():
      self._decode()
    else:
      self.sched.t_land = None

  # --- admission and prefill ----------------------------------------------------------------

  def _admit(self) -> None:
    """Admit waiting requests into free slots as the scheduler and the pools allow, and run
    the prefills the scheduler says are due."""
    m, s = self.m, self.sched
    if any(r.cancelled for r in self.waiting):   # gone before admission: drop, nothing held
      for r in [r for r in self.waiting if r.cancelled]:
        m["requests_cancelled"] += 1
        r.emit("done", None)
      self.waiting = collections.deque(r for r in self.waiting if not r.cancelled)
    busy = bool(self.batch.active.any())
    running = any(x is not None for x in self.running)
    # Under page pressure nothing new is admitted while a request runs; a prompt already being
    # prefilled in pieces still goes on (it holds its pages), or a batch whose only running
    # request is that prompt would never finish one and never lift the pressure.
    blocked = s.pressure and running
    if blocked:
      if self.waiting and None in self.running:
        m["admission_blocked_pages"] += 1
    else:
      s.pressure = False
    spent, i = 0.0, 0
    while (not blocked and i < len(self.waiting) and None in self.running
           and s.room(busy, spent)):
      r = self.waiting[i]
      if s.waits(r):
        i += 1
        continue
      t0 = time.perf_counter()
      try:
        need, plan_s = self.step.need(r, s.prefill_chunk)
      except Exception as e:  # noqa: BLE001 — a bad request must not take the engine down
        del self.waiting[i]
        m["requests_error"] += 1
        r.emit("error", f"prefill plan failed: {e}")
        continue
      m["plan_s"] += plan_s
      t0 += plan_s   # admission overhead is host bookkeeping only
      running = any(x is not None for x in self.running)
      if not self.pages.fits(need, running):
        m["admit_s"] += time.perf_counter() - t0
        if not running:   # cannot happen after fits_ever; never wait forever on it
          del self.waiting[i]
          m["requests_error"] += 1
          r.emit("error", "the KV pools are too small for this request")
          continue
        m["admission_blocked_pages"] += 1   # a slot is free, the pages are not
        break   # FIFO for pages: nothing behind it goes first
      del self.waiting[i]
      r.slot = b = self.running.index(None)
      self.running[b] = r
      rows = self.pages.take(b, need)
      if rows is not None:
        count_peak(m, self.pages.used())
      m["admit_s"] += time.perf_counter() - t0
      if r.resume is None:
        r.t_admit = time.perf_counter()
        m["queue_wait_s"] += r.t_admit - r.t_submit
      try:
        self._prefill(r, rows)
      except Exception as e:  # noqa: BLE001 — a bad request must not take the engine down
        self._finish(r, "error", f"prefill failed: {e}")
        continue
      if r is not s.prefilling:   # one piece: prefilled now, and it decodes from next step
        spent += self._prefill_some(r, busy=False)
    if s.prefilling is not None:
      busy = bool(self.batch.active.any())
      if s.piece_due(spent, busy):
        self._prefill_some(s.prefilling, busy)

  def _prefill(self, r: Request, rows) -> None:
    """Start ``r``'s prefill (a long prompt becomes the scheduler's ``prefilling``);
    :meth:`_prefill_some` runs it."""
    ids = r.prefill_ids()
    chunk = self.sched.prefill_chunk
    n, Tn = len(ids), bucket(len(ids), chunk)
    toks = np.zeros((1, Tn), np.int32)
    toks[0, :n] = ids
    dense = self.dense.new_cache(batch=1, capacity=Tn, dtype=jnp.bfloat16)   # on a mesh: sharded
    r.pre = (self.dense.prefill_chunks(dense, toks, np.array([n], np.int32), chunk, ahead=1),
             n, Tn, rows)
    if n > chunk:
      self.sched.prefilling = r

  def _prefill_some(self, r: Request, busy: bool) -> float:
    """Run ``r``'s prefill piece by piece and finish it when its last piece is done -> host
    seconds.  One piece: whole.  The long prompt: while others decode, as many pieces as the
    scheduler says; else to its end or until a new request arrives."""
    s = self.sched
    long = r is s.prefilling
    k = s.pieces(busy)
    t0 = time.perf_counter()
    try:
      while True:
        logits, dense = next(r.pre[0])
        s.pre_pieces += long
        k -= 1
        if logits is not None or (busy and k <= 0):
          break
        if not busy and long:   # to its end, but a request that arrives waits for this piece only
          jax.block_until_ready(dense)   # (with the next one queued it waited for two)
          if self.inbox:
            break
      if logits is not None:
        if long:
          s.prefilling = None
        (_, n, Tn, rows), r.pre = r.pre, None
        self._prefill_done(r, logits, dense, n, Tn, rows)
    except Exception as e:  # noqa: BLE001 — a bad request must not take the engine down
      if long:
        s.prefilling = None
      r.pre = None
      self._finish(r, "error", f"prefill failed: {e}")
    dt = time.perf_counter() - t0
    self.m["prefill_s"] += dt
    if not long:
      s.pre_s += dt
    return dt

  def _prefill_done(self, r: Request, logits, dense, n: int, Tn: int, rows) -> None:
    """The prompt's K/V into the slot; a resumed request continues, a new one gets its first
    token from the prefill's logits."""
    resume, b = r.resume, r.slot
    self.step.insert(r, dense, n, Tn, rows)
    self.count[b] = n
    self.pages.store_plan(b, r.plan, n)
    self.batch.sampling(b, r)
    if resume and "ledger" in resume:   # recompute: the next step feeds its last token
      self.batch.feed(b, resume["token"], resume["tag"], resume["state"])
    if resume:
      if "replay" in resume:   # re-feed the generated tokens through the decode step
        r.replay = 0
        self.batch.replay(r, 0)
      self.batch.active[b] = True
      r.resume = None
      self.m["resumed"] += 1
      return
    tok, lp = self.step.first(logits, self.batch.mask1(r), r)
    self.m["prefills"] += 1
    self._accept(r, tok, lp)

  # --- pages and preemption -----------------------------------------------------------------

  def _grow(self):
    """Pages the tokens leaving the window at this step need -> new page ids per pool;
    preempts whom the scheduler names while a pool is short."""
    while True:
      g = self.pages.growth(self.batch.active, self.count)
      if not g.short:
        break
      live = [r for r in self.running if r is not None]
      young = self.sched.victim(live)
      if len(live) == 1:   # alone and still short: the pool cannot hold it (see worst_case)
        self._finish(young, "error", "the KV pools are too small for this request alone "
                     f"(free pages per pool and layer group: {self.pages.top.tolist()})")
      else:
        self._preempt(young)
    new = self.pages.grow(g)
    if g.takes:
      count_peak(self.m, self.pages.used())
    return new

  def _preempt(self, r: Request) -> None:
    """Free ``r``'s slot and pages, keep what it needs to continue (per ``self.preemption``),
    and put it back at the head of the queue."""
    b = r.slot
    if r is self.sched.prefilling:   # nothing generated here yet: back to the queue as it came
      pass
    elif self.preemption == "recompute" and r.replay is None:
      r.resume = {**self.step.saved(b), "token": int(self.batch.tokens[b]),
                  "tag": self.batch.tag_ids[b].copy(), "state": int(self.batch.state_ids[b])}
      r.plan = self.pages.actions(b, self.count[b])
    else:   # replay: only the prompt is prefilled again
      r.resume, r.plan = {"replay": True}, r.prompt_plan
    r.replay = None
    r.preemptions += 1
    self.m["preemptions"] += 1
    self.sched.pressure = True
    self._vacate(b)
    r.slot = None
    self.waiting.appendleft(r)

  def _vacate(self, b: int) -> None:
    s = self.sched
    if s.prefilling is not None and s.prefilling is self.running[b]:
      s.prefilling.pre, s.prefilling = None, None   # dropped mid-prefill
    self.batch.clear(b)
    self.running[b] = None
    self.step.release(b)
    self.pages.give_back(b)
    self.count[b] = 0

  # --- decode -------------------------------------------------------------------------------

  def _decode(self) -> None:
    """One serial step: sample, read back, give every row its token."""
    m, batch = self.m, self.batch
    t0 = time.perf_counter()
    grow = self._grow()
    t1 = time.perf_counter()
    m["alloc_s"] += t1 - t0
    rows = np.flatnonzero(batch.active)
    if not len(rows):
      return
    batch.mask(rows, self.running)
    steps = np.array([len(r.out) if r is not None else 0 for r in self.running], np.int32)
    want = batch.want_lp & batch.active
    t_fill = time.perf_counter()
    out, lp = self.step.serial(batch, steps, want, grow)
    t_disp = time.perf_counter()
    lps = tuple(np.asarray(x) for x in lp) if want.any() else None
    out = np.asarray(out)
    t_wait = time.perf_counter()
    m["fill_s"] += t_fill - t1
    m["dispatch_s"] += t_disp - t_fill
    m["wait_s"] += t_wait - t_disp
    m["decode_steps"] += 1
    m["decode_step_s"] += t_wait - t1
    self.sched.pace(t_wait)
    m["decode_rows"] += len(rows)
    t2 = time.perf_counter()
    p = self.count[rows]
    self.pages.record(rows, p, out[rows, 1:])
    self.count[rows] = p + 1
    t3 = time.perf_counter()
    m["alloc_s"] += t3 - t2
    for b in rows:
      r = self.running[b]
      if r.replay is None:
        self._accept(r, int(out[b, 0]), lp_row(lps, b))
      else:
        m["replay_steps"] += 1
        batch.replay(r, r.replay + 1)
    m["accept_s"] += time.perf_counter() - t3

  def _land(self) -> None:
    """Overlap: wait for the last pick's tokens (the device meanwhile runs the forward fed with
    them) and give them to their requests."""
    tok, lp, rows = self.fly_pick
    self.fly_pick = None
    t0 = time.perf_counter()
    tok = np.asarray(tok)
    lps = tuple(np.asarray(x) for x in lp) if any(r.logprobs is not None for _, r in rows) \
        else None
    t1 = time.perf_counter()
    self.m["wait_s"] += t1 - t0
    if self.sched.t_land is not None:   # a step = the time between two landings
      self.m["decode_step_s"] += t1 - self.sched.t_land
    self.sched.pace(t1)
    while len(self.fly_acts) > 1:   # every forward before the one in flight has finished
      fwd, dec = self.fly_acts.popleft()
      if dec:
        self.pages.record_late(fwd.result()[1],
                               [(b, p) for b, r, p in dec if self.running[b] is r])
    for b, r in rows:
      if self.running[b] is r:
        self._accept(r, int(tok[b]), lp_row(lps, b))
        if self.running[b] is r:   # continues: its token was fed already, decide it next
          self.batch.defer(b)
    self.m["accept_s"] += time.perf_counter() - t1

  def _launch(self) -> None:
    """Overlap: the pick of the forward in flight, then the next forward (fed with the pick's
    output)."""
    m, batch = self.m, self.batch
    t0 = time.perf_counter()
    tok_dev = None
    batch.on_device[:] = False
    if self.fly_fwd is not None:
      fwd, fed = self.fly_fwd
      self.fly_fwd = None
      live = [(b, r) for b, r in fed if self.running[b] is r]
      if live:
        batch.mask([b for b, _ in live], self.running)
        picked = [(b, r) for b, r in live if r.replay is None]   # a replayed token's is ignored
        packed = batch.packed([len(r.out) if r is not None else 0 for r in self.running])
        t1 = time.perf_counter()
        m["fill_s"] += t1 - t0
        logits = fwd.result()[0]   # the forward's launch (on the launch thread) has ended
        t2 = time.perf_counter()
        m["join_s"] += t2 - t1
        tok_dev, lp = self.step.pick(logits, packed)
        m["dispatch_s"] += time.perf_counter() - t2
        for b, r in picked:
          batch.on_device[b] = True
        self.fly_pick = (tok_dev, lp, picked)
        for b, r in live:
          if r.replay is not None:   # the next replayed token, from the host
            m["replay_steps"] += 1
            batch.replay(r, r.replay + 1)
    rows_run = [b for b, r in enumerate(self.running) if r is not None and r.pre is None]
    if not rows_run:
      self.fly_acts.clear()
      self.sched.t_land = None
      return
    t2 = time.perf_counter()
    # A request whose pick gives its last token (max_tokens) is not fed again; its previous
    # token is still decided.  (A stop token cannot be known ahead: it is fed, never decided.)
    batch.active[:] = False
    for b in rows_run:
      r = self.running[b]
      batch.active[b] = not (batch.on_device[b] and len(r.out) + 1 >= r.max_tokens)
    grow = self._grow()   # may preempt (replay): rows leave
    m["alloc_s"] += time.perf_counter() - t2
    rows = np.flatnonzero(batch.active)
    decide = batch.pend & np.array([r is not None for r in self.running])
    if not len(rows) and not decide.any():
      return
    host = batch.host(decide)
    dec = [(b, self.running[b], int(self.count[b]) - 1) for b in np.flatnonzero(decide)]
    if tok_dev is None:
      tok_dev = self.step.place(np.zeros((self.slots,), np.int32))
    t3 = time.perf_counter()
    fwd = self.step.forward(tok_dev, host, grow)
    m["dispatch_s"] += time.perf_counter() - t3
    self.fly_acts.append((fwd, dec))
    self.fly_fwd = (fwd, [(b, self.running[b]) for b in rows])
    m["decode_steps"] += 1
    m["decode_rows"] += len(rows)
    self.count[rows] += 1
    batch.pend[decide] = False
    # The tokens fed from the host (first tokens, replays) have known tags: decided next step.
    # A token fed from the pick gets its tags when it lands.
    for b in rows:
      if not batch.on_device[b]:
        batch.defer(b)
      else:
        batch.pend[b] = False

  # --- output -------------------------------------------------------------------------------

  def _accept(self, r: Request, tok: int, lp=None) -> None:
    """Give ``r`` its token; it ends, or its slot feeds the token at the next step."""
    b = r.slot
    self.batch.active[b] = False
    self.batch.want_lp[b] = r.logprobs is not None
    v = self.output.accept(r, tok, lp)
    if v.finish is not None:
      return self._finish(r, v.finish, v.error)
    r.fed.append((np.array(v.tag, np.int32), int(v.sid)))   # what a replay feeds with it
    self.batch.feed(b, tok, v.tag, v.sid)
    self.batch.active[b] = True

  def _finish(self, r: Request, finish: str, error: str | None = None) -> None:
    """``r`` ends (completed, cancelled or failed): its result, its slot and pages freed."""
    b = r.slot
    result = None
    if finish in ("stop", "length"):
      row, overflow = self.step.ledger_row(b)
      result = self.output.result(r, finish, row, overflow, self.pages.held(b))
    count_finish(self.m, finish, result)
    self._vacate(b)
    self.sched.pressure = False   # pages came back: admission may resume
    r.slot = None
    if error is not None:
      r.emit("error", error)
    else:
      r.emit("done", result)
