"""The engine: continuous batching of requests over one KV cache, on one thread that owns every
device call.  :class:`Engine` builds the parts and is the thread-safe public side (submit,
start/stop, gauges); the iteration itself is :class:`~serve.engine.loop.Loop`'s.
"""
from __future__ import annotations

import collections
import itertools
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from pask_jax.decode import PREFILL_CHUNK, Runner
from pask_jax.launch import default_threaded
# the engine's defaults and choices are serve's and start_engine's
from pask_jax.options import ENGINE, PREEMPTION
from serve.engine.batch import Batch
from serve.engine.loop import Loop
from serve.engine.output import METRIC_KEYS, Output
from serve.engine.request import Request
from serve.engine.scheduler import Scheduler
from serve.engine.sizing import PREFILL_CHUNKS, bucket, kv_bytes_for_utilization
from serve.engine.step import DenseStep, PagedStep
from serve.schedule import PREFILL_SHARE



class Engine(Loop):
  """Over the paged PASK cache; :class:`DenseEngine` over the dense Full-KV one."""
  kind = PagedStep
  paged = True

  def __init__(self, model, tokenizer, policy, *, slots: int = 4, context: int = 1024,
               page: int = 16, hi_pages: int | None = None, lo_pages: int | None = None,
               kv_bytes: int | None = None, gpu_memory_utilization: float | None = None,
               mix: tuple[float, float] | None = None, watermark: float = 0.01,
               preemption: str = "replay", backend: str = "auto",
               prefiller: Runner | None = None, overlap: bool = True,
               prefill_chunk: int = PREFILL_CHUNK, prefill_share: float = PREFILL_SHARE,
               lo_format: str = ENGINE.lo_format, lo_page: int | None = None, mesh=None,
               launch_thread: bool | None = None):
    """``slots``: decode batch (``--max-num-seqs``); ``context``: the most tokens (prompt +
    max_tokens) one request may take (``--max-model-len``); ``kv_bytes`` or
    ``gpu_memory_utilization``: the KV memory budget (:func:`size_pools`); ``hi_pages`` /
    ``lo_pages``: pool sizes in pages (override the budget's); ``mix``: expected (H, L)
    fractions; ``watermark``: the fraction of each pool kept free for running requests' growth
    when admitting; ``preemption``: "recompute" or "replay" (:mod:`serve.engine.loop`);
    ``prefiller``: a batch-1 dense :class:`Runner` to share between engines; ``overlap``:
    overlap the host's work with the device step (:mod:`serve.engine.loop`; off where it does
    not apply); ``prefill_chunk``: tokens per prefill piece (one of :data:`PREFILL_CHUNKS`);
    ``prefill_share``: the most of the engine's time a long prompt's prefill takes while others
    decode; ``lo_format``: the INT4 pool's storage format (:func:`pask_jax.cache.init`): "int4"
    is what the Mosaic GPU kernel reads on Hopper, in pages of a multiple of 64 rows; "auto" (the
    default) picks it there and "bytes" elsewhere (:func:`serve.engine.check_lo_format`);
    ``lo_page``: rows per INT4 page (None: ``page``, or 128 for "int4" on a GPU when ``page`` is
    not a multiple of 64); ``launch_thread``: launch the overlapped forward on a worker thread
    while this one lands the previous tokens (:class:`serve.engine.step.Step`; None: on a GPU,
    where a launch costs milliseconds of host time).

    ``mesh``: tensor parallelism over a 1-D ``model`` mesh (``pask_jax.mesh.serving_mesh``:
    ``--tensor-parallel-size``): weights, the prefill scratch and the pools and windows split
    by KV head, page tables, controller and ledger replicated.  ``kv_bytes`` and
    ``gpu_memory_utilization`` are then each device's budget (the utilization taken of the
    mesh device with the least free memory): a page costs 1/N of its bytes there, so the pools
    get about N times the pages of one device; admission and preemption count pages as on one
    device."""
    if prefill_chunk not in PREFILL_CHUNKS:
      raise ValueError(f"prefill_chunk must be one of {PREFILL_CHUNKS}, got {prefill_chunk!r}")
    self.sched = Scheduler(prefill_chunk, prefill_share)
    if preemption not in PREEMPTION:
      raise ValueError(f"preemption must be one of {PREEMPTION}, got {preemption!r}")
    self.preemption = preemption
    if (policy.record.get("position_bins") if hasattr(policy, "record_json") else None):
      raise ValueError("a no-transition (ablation) policy reads position bins, which the serving "
                       "engine does not emit: evaluate it with pask-jax eval or campaign")
    self.model, self.cfg, self.tok, self.policy = model, model.cfg, tokenizer, policy
    self.slots, self.context, self.page = slots, context, page
    self.window, self.G = int(policy.window), int(policy.n_groups)
    mesh = mesh if mesh is not None and mesh.size > 1 else None
    if prefiller is None:
      prefiller = Runner(model, batch=1, capacity=context, cache_dtype=jnp.bfloat16, mesh=mesh)
    elif prefiller.tp_mesh != mesh:
      raise ValueError("the shared prefiller runs on another mesh than the engine's: make it "
                       "with Runner(..., mesh=) of the engine's mesh")
    self.dense, self.mesh = prefiller, mesh
    if gpu_memory_utilization is not None:
      if kv_bytes is not None:
        raise ValueError("give either a KV memory budget or a memory utilization, not both")
      kv_bytes = kv_bytes_for_utilization(
          gpu_memory_utilization, self.cfg, context,
          devices=None if mesh is None else list(mesh.devices.flat),
          shards=1 if mesh is None else mesh.size)
    self.step = self.kind(model, policy, slots=slots, context=context, page=page,
                          backend=backend, watermark=watermark, kv_bytes=kv_bytes, mix=mix,
                          hi_pages=hi_pages, lo_pages=lo_pages, prefiller=prefiller,
                          lo_format=lo_format, lo_page=lo_page, mesh=mesh)
    self.step.threaded = default_threaded() if launch_thread is None else bool(launch_thread)
    self.pages, self.sizing, self.reach = self.step.pages, self.step.sizing, self.step.reach
    self.hi_total, self.lo_total = self.sizing.hi_pages, self.sizing.lo_pages
    self.runner, self.traces = self.step.runner, self.step.traces
    self.overlap_wanted = bool(overlap)
    self.batch = Batch(slots, self.cfg.vocab_size)
    self.active = self.batch.active
    self.count = np.zeros((slots,), np.int64)   # tokens written per slot
    self.output = Output(tokenizer)
    self.running: list[Request | None] = [None] * slots
    self.waiting: collections.deque[Request] = collections.deque()
    self.inbox: list[Request] = []
    self.cv = threading.Condition()
    self.stopping = False
    self.thread: threading.Thread | None = None
    self.crashed: BaseException | None = None
    self._seq = itertools.count()
    # Metrics, written by the engine thread and read by the app's: every key exists from the
    # start (a dict that grows while another thread iterates it raises).
    self.m = collections.Counter(dict.fromkeys(METRIC_KEYS, 0))
    # Overlap: the last forward launched (logits, the (slot, request) rows it fed), the pick
    # launched after it (tokens, log-probs, rows), and the forwards whose decided actions the
    # host has not read yet (actions, (slot, request, position) rows).
    self.fly_fwd = None
    self.fly_pick = None
    self.fly_acts: collections.deque = collections.deque()

  @property
  def overlap(self) -> bool:
    """Whether iterations overlap the host with the device; read at every iteration, so
    ``preemption`` may be changed while the engine is idle."""
    return self.overlap_wanted and self.preemption == "replay" and self.step.can_overlap

  # --- public, thread-safe ------------------------------------------------------------------

  def worst_case(self, n_prompt: int, max_tokens: int) -> tuple[int, int]:
    """Pages (BF16 pool, INT4 pool) per layer group that one request can need at most."""
    return self.step.worst_case(n_prompt, max_tokens)

  def fits_ever(self, n_prompt: int, max_tokens: int) -> str | None:
    """Why a request can never run here, or None: it is refused only if it could not complete
    even alone (its :meth:`worst_case` exceeds a pool)."""
    if n_prompt < 1:
      return "empty prompt"
    if n_prompt + max_tokens > self.context:
      return (f"prompt of {n_prompt} tokens + max_tokens {max_tokens} exceeds the server's "
              f"context of {self.context} tokens")
    h, l = self.worst_case(n_prompt, max_tokens)
    if h > self.hi_total or l > self.lo_total:
      return ("the request could need more KV pages than the server's pools hold "
              f"({h} BF16 / {l} INT4 pages per layer group at most; the pools have "
              f"{self.hi_total} / {self.lo_total})")
    return None

  def submit(self, req: Request) -> Request:
    why = self.fits_ever(len(req.ids), req.max_tokens)
    if why:
      raise ValueError(why)
    req.t_submit = time.perf_counter()
    with self.cv:
      req.seq = next(self._seq)
      self.inbox.append(req)
      self.cv.notify()
    return req

  def start(self) -> Engine:
    self.thread = threading.Thread(target=self._main, name="pask-engine", daemon=True)
    self.thread.start()
    return self

  def stop(self, timeout: float = 10.0) -> None:
    with self.cv:
      self.stopping = True
      self.cv.notify()
    if self.thread is not None:
      self.thread.join(timeout)
      if not self.thread.is_alive():
        self.step.release_thread()

  @property
  def alive(self) -> bool:
    return self.thread is not None and self.thread.is_alive() and self.crashed is None

  def snapshot(self) -> dict:
    """Gauges for /metrics (racy reads of host counters are fine for monitoring).  Pool gauges
    are per layer group's free list; ``*_free`` is the scarcest group's."""
    hf, lf = self.pages.free_pages()
    return {"queue_depth": len(self.waiting) + len(self.inbox),
            "running": sum(r is not None for r in self.running), "slots": self.slots,
            "hi_free": hf, "hi_total": self.hi_total, "lo_free": lf, "lo_total": self.lo_total,
            **self.m}

  def reset_metrics(self) -> None:
    for k in self.m:   # back to zero, keys kept
      self.m[k] = 0

  def idle(self) -> bool:
    return not (self.inbox or self.waiting or any(x is not None for x in self.running))

  def run_until_idle(self, max_iterations: int | None = None) -> None:
    """Drive the engine on the calling thread (no engine thread: tests, benchmarks)."""
    n = 0
    while not self.idle():
      self._iterate()
      n += 1
      if max_iterations is not None and n >= max_iterations:
        raise RuntimeError(f"engine not idle after {n} iterations")

  def warmup(self, max_prompt: int | None = None, sampling: bool | None = None) -> None:
    """Compile the decode step and every prefill bucket up to ``PREFILL_CHUNK`` tokens (and the
    context) before serving (call before :meth:`start`): one dummy request per bucket, of two
    new tokens.  Otherwise the first prompt of each bucket would compile its prefill pieces,
    plan and insert on the engine thread while every running stream waits.  Longer buckets
    (chunk multiples) compile on first use.  ``max_prompt``: only the buckets that prompts of
    at most that many tokens use (where prompts are known to be short: a faster start; longer
    prompts compile theirs on first use).  ``sampling``: also the picks' sampling variants
    (temperature, top-p, log-probs: each combination is its own program,
    :func:`serve.engine.step.how_of`), one short request each; None: off on a CPU (where a
    compile is short and the tests start many engines), on elsewhere."""
    if max_prompt is not None and (isinstance(max_prompt, bool) or not isinstance(max_prompt, int)
                                   or max_prompt < 1):
      raise ValueError(f"max_prompt must be None or a positive int, got {max_prompt!r}")
    if sampling is None:
      sampling = jax.default_backend() != "cpu"
    tok = self.tok.stop_ids[0] if self.tok.stop_ids else 0
    top = PREFILL_CHUNK if max_prompt is None else min(max_prompt, PREFILL_CHUNK)
    n, sizes = 1, []
    while n + 2 <= self.context and n <= top:   # n: the first length of a bucket
      sizes.append(n)
      n = bucket(n, self.sched.prefill_chunk) + 1   # the first length of the next bucket
    for n in sizes:
      self.submit(Request(ids=[tok] * n, max_tokens=2))
      self.run_until_idle()
    # (temperature, top_p, log-probs) of each remaining combination of the picks' branches
    for t, p, lp in ((0.0, 1.0, 1), (1.0, 1.0, None), (1.0, 1.0, 1), (1.0, 0.9, None),
                     (1.0, 0.9, 1)) if sampling else ():
      self.submit(Request(ids=[tok], max_tokens=3, temperature=t, top_p=p, logprobs=lp))
      self.run_until_idle()
    self.reset_metrics()

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
    except BaseException as e:   # keep the reason for /health, fail requests
      self.crashed = e
      for r in list(self.waiting) + self.inbox + [x for x in self.running if x is not None]:
        r.emit("error", f"engine failure: {e!r}")
      raise


class DenseEngine(Engine):
  """The engine over the plain-XLA dense Full-KV cache (:class:`~serve.engine.step.DenseStep`):
  the baseline of ``bench/bench_serving.py``; the server uses :class:`Engine`."""
  kind = DenseStep
  paged = False
