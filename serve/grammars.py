"""Grammar compilation off the request path: a gatekeeper process per lane, a bounded cache.

A compile job (a JSON schema, or a tool set with its format and choice) is first compiled in a
**worker process** (spawned, ``nice``d, XGrammar with one thread) under a CPU-time limit
(``timeout_s``): the kernel ends the worker with SIGXCPU when a job passes it, even inside
XGrammar's C++ (which a thread cannot interrupt), and a wall-clock cap of ``WALL_FACTOR`` times
the limit catches a starved worker.  A crash or a memory blow-up takes down a worker, not the
server; it is restarted.  Every check (schema_check, XGrammar's own) runs there too.

A job the worker compiled within its limit is then compiled again in the server process, on its
lane's thread (niced: Linux niceness is per thread; XGrammar releases the GIL), and that result
is served.  Moving the worker's result instead would cost more than compiling twice: serializing
a compiled grammar with 700 properties took 9.3 s and 170 MB of JSON, against 0.9 s to compile.

Choices:

* **Lanes.**  Jobs whose canonical JSON is at most ``SMALL_BYTES`` go to the *small* lane, the
  others to the *large* one; each lane has its own worker, its own compile thread and a bounded
  FIFO queue (``queue_limit``; a full queue is a 429).  Compile time grows super-linearly with
  the schema (measured on this CPU: 1,000 properties / 28 KB 4.0 s, a 20,000-value enum 8.2 s,
  typical tool sets of a few KB 10-40 ms), so a slow schema waits and runs in the large lane
  while the tool sets of ordinary requests keep compiling in the small one.  A small job that
  passes the small lane's limit (``SMALL_TIMEOUT_S``) moves to the large lane.
* **Limit in CPU seconds**, not wall time: the workers are niced below the engine, so under load
  their wall time stretches (a 0.9 s compile took 11 s of wall time beside a decoding engine and
  other work on 2 cores) and a wall-clock limit would refuse ordinary schemas.
* **Cache.**  Results are kept in an LRU keyed by the job's exact JSON text (property order
  matters to the grammar), bounded by entry count and by XGrammar's ``memory_size_bytes``;
  failures (the 400 message, including a time-out) are kept in a larger LRU of messages, so a
  repeated bad schema is refused at once.  Concurrent requests for the same job share one
  compilation, which continues when its first client goes away.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures as cf
import hashlib
import json
import math
import os
import signal
import threading
import time
from typing import Any

SMALL_BYTES = 8192
SMALL_TIMEOUT_S = 2.0
WALL_FACTOR = 6     # a compile may take this many times its CPU limit in wall time (niced)


class CompileError(Exception):
  """A job that cannot be compiled: the message is the client's 400."""


class CompileBusy(Exception):
  """A lane's queue is full (429)."""


def _build(comp, job: dict):
  """Compile one job with the library code paths (the same checks as the CLI)."""
  from pask_jax.grammar import normalize_tools, tool_call_grammar
  if job["kind"] == "json_schema":
    return comp.json_schema(job["schema"], where=job.get("where", "schema"))
  tools = normalize_tools(job["tools"], check=True)   # every tool checked, named or not
  if job.get("only") is not None:
    tools = [t for t in tools if t["name"] == job["only"]]
  return tool_call_grammar(comp, tools, job["fmt"], max_calls=job["max_calls"],
                           indent=job["indent"], choice=job["choice"], check=False)


class _Vocab:
  """The two tokenizer attributes GrammarCompiler reads."""

  def __init__(self, token_bytes, stop_ids):
    self._tb, self.stop_ids = tuple(token_bytes), tuple(stop_ids)

  def token_bytes(self):
    return self._tb


def _worker_main(fd: int) -> None:
  """The worker process (``python -c``; see :class:`_Worker`): setup, then jobs, over ``fd``."""
  import resource
  from multiprocessing.connection import Connection
  conn = Connection(fd)
  token_bytes, stop_ids, vocab_size, nice = conn.recv()
  try:
    os.nice(nice)
  except OSError:
    pass
  from pask_jax.grammar import GrammarCompiler, GrammarError
  from pask_jax.grammar.errors import xgrammar_message
  comp = GrammarCompiler(_Vocab(token_bytes, stop_ids), vocab_size, threads=1)
  hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
  conn.send(("ready", os.getpid()))
  while True:
    try:
      job, limit = conn.recv()
    except (EOFError, OSError):   # the server went away
      return
    # The limit is CPU time (this process is niced: under load its wall time stretches): the
    # kernel ends the process with SIGXCPU when the job passes it, even inside XGrammar's C++.
    used = sum(resource.getrusage(resource.RUSAGE_SELF)[:2])
    soft = int(math.ceil(used + limit))
    resource.setrlimit(resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY
                                             else min(soft, hard), hard))
    try:
      t0 = sum(resource.getrusage(resource.RUSAGE_SELF)[:2])
      _build(comp, job)
      conn.send(("ok", sum(resource.getrusage(resource.RUSAGE_SELF)[:2]) - t0))
    except GrammarError as e:
      conn.send(("err", str(e)))
    except RecursionError:
      conn.send(("err", "the schema is nested too deeply"))
    except Exception as e:  # noqa: BLE001 — XGrammar's own errors are the client's input too
      conn.send(("err", f"XGrammar cannot compile this: {xgrammar_message(e)}"))


class _Worker:
  """One compile process: ``python -c`` with this repository on its path (not
  multiprocessing's spawn, which re-imports the caller's ``__main__`` and so fails in a script
  without a ``__main__`` guard), talking over a socketpair."""

  def __init__(self, args, name: str):
    self.args, self.name = args, name
    self.proc = None
    self.restarts = -1
    self.start()

  def start(self) -> None:
    import socket
    import subprocess
    import sys
    from multiprocessing.connection import Connection
    mine, theirs = socket.socketpair()
    # Started in the directory that holds this ``serve`` package: ``-c`` puts the working
    # directory first on the child's path, so the child runs the same code as this process.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    self.proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; from serve.grammars import _worker_main; "
         "_worker_main(int(sys.argv[1]))", str(theirs.fileno())],
        pass_fds=(theirs.fileno(),), cwd=root, stdin=subprocess.DEVNULL)
    theirs.close()
    self.conn = Connection(mine.detach())
    self.conn.send(self.args)
    self.ready = False
    self.restarts += 1

  def _wait_ready(self, timeout: float) -> None:
    if not self.ready:
      if not self.conn.poll(timeout):
        raise TimeoutError("grammar worker did not start")
      self.conn.recv()
      self.ready = True

  def run(self, job: dict, limit: float):
    """Blocking (a pool thread): ("ok", ...) / ("err", msg) / ("timeout",); ``limit`` in CPU
    seconds, with a wall-clock cap of WALL_FACTOR times that."""
    t0 = time.monotonic()
    try:
      self._wait_ready(180.0)
      self.conn.send((job, limit))
      if self.conn.poll(WALL_FACTOR * limit + 5):
        return self.conn.recv(), time.monotonic() - t0
    except (EOFError, OSError):   # the worker died: the CPU limit (SIGXCPU), memory, a crash
      try:
        code = self.proc.wait(5)
      except Exception:  # noqa: BLE001
        code = None
      self.kill()
      self.start()
      if code == -signal.SIGXCPU:
        return ("timeout",), time.monotonic() - t0
      return ("err", "the grammar compiler failed on this schema"), time.monotonic() - t0
    self.kill()
    self.start()
    return ("timeout",), time.monotonic() - t0

  def kill(self) -> None:
    if self.proc is not None and self.proc.poll() is None:
      self.proc.kill()
      try:
        self.proc.wait(5)
      except Exception:  # noqa: BLE001
        pass
    try:
      self.conn.close()
    except OSError:
      pass


def _nice_thread(nice: int) -> None:
  """Lower this thread's priority (Linux: niceness is per thread)."""
  try:
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
  except (OSError, AttributeError):
    pass


class Gate:
  """A lane's idle workers, handed to waiters first come first served, across event loops.

  A pool may be shared by apps that run on different event loops (``create_app(grammars=)``;
  each uvicorn server has its own): an ``asyncio.Semaphore`` binds to the first loop that waits
  on it and then fails every other loop's wait ("bound to a different event loop"), which
  turned one slow compile into 500s for the other app.  Here a waiter is a future of its own
  loop, resolved through that loop's ``call_soon_threadsafe``."""

  def __init__(self, workers):
    self._lock = threading.Lock()
    self._idle = collections.deque(workers)
    self._waiters: collections.deque = collections.deque()   # (loop, future)

  async def take(self):
    loop = asyncio.get_running_loop()
    with self._lock:
      if self._idle and not self._waiters:
        return self._idle.popleft()
      fut = loop.create_future()
      self._waiters.append((loop, fut))
    try:
      return await fut
    except asyncio.CancelledError:
      with self._lock:
        if (loop, fut) in self._waiters:
          self._waiters.remove((loop, fut))
      if fut.done() and not fut.cancelled():   # handed a worker as it was cancelled
        self.give(fut.result())
      raise

  def give(self, w) -> None:
    with self._lock:
      while self._waiters:
        loop, fut = self._waiters.popleft()
        try:
          loop.call_soon_threadsafe(self._hand, fut, w)
          return
        except RuntimeError:   # that loop is closed: the next waiter
          continue
      self._idle.append(w)

  def _hand(self, fut, w) -> None:   # on the waiter's loop
    if fut.done():   # cancelled meanwhile
      self.give(w)
    else:
      fut.set_result(w)


class _Lane:
  def __init__(self, name, workers, timeout):
    self.name, self.workers, self.timeout = name, list(workers), timeout
    self.gate = Gate(self.workers)
    self.waiting = 0


class GrammarPool:
  """Compiles grammars for one tokenizer in worker processes (module docstring)."""

  def __init__(self, tokenizer, vocab_size: int, *, timeout_s: float = 10.0,
               small_workers: int = 1, large_workers: int = 1, queue_limit: int = 16,
               cache_entries: int = 128, cache_bytes: int = 1 << 30, nice: int = 19):
    vocab = list(tokenizer.token_bytes())
    vocab += [b""] * (vocab_size - len(vocab))
    vocab = vocab[:vocab_size]
    stops = list(tokenizer.stop_ids)
    self.timeout_s, self.queue_limit = float(timeout_s), int(queue_limit)
    args = (tuple(vocab), tuple(stops), vocab_size, nice)
    self.lanes = {
        "small": _Lane("small", [_Worker(args, f"small{i}") for i in range(small_workers)],
                       min(SMALL_TIMEOUT_S, self.timeout_s)),
        "large": _Lane("large", [_Worker(args, f"large{i}") for i in range(large_workers)],
                       self.timeout_s)}
    self.threads = cf.ThreadPoolExecutor(small_workers + large_workers + 2,
                                         thread_name_prefix="pask-grammar-wait")
    from pask_jax.grammar import GrammarCompiler
    self.compiler = GrammarCompiler(tokenizer, vocab_size, threads=1)
    for lane in self.lanes.values():
      lane.thread = cf.ThreadPoolExecutor(1, thread_name_prefix=f"pask-grammar-{lane.name}",
                                          initializer=_nice_thread, initargs=(nice,))
    self.cache: collections.OrderedDict[str, Any] = collections.OrderedDict()
    self.cache_entries, self.cache_bytes, self.bytes = cache_entries, cache_bytes, 0
    self.failed: collections.OrderedDict[str, str] = collections.OrderedDict()
    # keyed by (event loop, job): a task belongs to its loop (apps on other loops compile anew)
    self.inflight: dict[tuple, asyncio.Future] = {}
    self.lock = threading.Lock()
    self.stats = collections.Counter(dict.fromkeys(
        ("hits", "misses", "failures", "timeouts", "busy", "compile_s"), 0))

  # --- public -----------------------------------------------------------------------------

  async def get(self, job: dict):
    """The compiled :class:`~pask_jax.grammar.Grammar` of ``job``; CompileError (400) or
    CompileBusy (429)."""
    text = json.dumps(job, ensure_ascii=False)
    key = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
    with self.lock:
      g = self.cache.get(key)
      if g is not None:
        self.cache.move_to_end(key)
        self.stats["hits"] += 1
        return g
      why = self.failed.get(key)
    if why is not None:
      self.stats["hits"] += 1
      raise CompileError(why)
    slot = (asyncio.get_running_loop(), key)
    task = self.inflight.get(slot)
    if task is None:   # one compilation per job, not tied to the request that started it
      task = self.inflight[slot] = asyncio.ensure_future(self._job(slot, job, len(text)))
      task.add_done_callback(lambda t: t.cancelled() or t.exception())
    return await asyncio.shield(task)

  async def _job(self, slot: tuple, job: dict, size: int):
    key = slot[1]
    try:
      g = await self._compile(job, size)
    except CompileError as e:
      with self.lock:
        self.failed[key] = str(e)
        while len(self.failed) > 4 * self.cache_entries:
          self.failed.popitem(last=False)
      raise
    finally:
      self.inflight.pop(slot, None)
    self._put(key, g)
    return g

  def close(self) -> None:
    for lane in self.lanes.values():
      for w in lane.workers:
        w.kill()
      lane.thread.shutdown(wait=False, cancel_futures=True)
    self.threads.shutdown(wait=False, cancel_futures=True)

  def snapshot(self) -> dict:
    return {**self.stats, "cached": len(self.cache), "cached_bytes": self.bytes,
            "compiling": len(self.inflight),
            "queued_small": self.lanes["small"].waiting,
            "queued_large": self.lanes["large"].waiting}

  # --- internals --------------------------------------------------------------------------

  async def _compile(self, job: dict, size: int):
    self.stats["misses"] += 1
    lane = self.lanes["small" if size <= SMALL_BYTES else "large"]
    while True:
      reply, spent = await self._run(lane, job, lane.timeout)
      self.stats["compile_s"] += spent
      if reply[0] == "timeout" and lane.name == "small" and self.timeout_s > lane.timeout:
        lane = self.lanes["large"]   # a slow small schema: the large lane, its full limit
        continue
      break
    if reply[0] == "timeout":
      self.stats["timeouts"] += 1
      raise CompileError(f"the grammar took longer than {self.timeout_s:g} s (CPU) to "
                         "compile (the server's --grammar-timeout); simplify the schema")
    if reply[0] == "err":
      self.stats["failures"] += 1
      raise CompileError(reply[1])
    # Proven to compile within the limit: compile it here, on this lane's (niced) thread.  A
    # compiled grammar is far cheaper to rebuild than to move: serializing one with 700
    # properties took 9.3 s and 170 MB of JSON against 0.9 s to compile.
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(lane.thread, _build, self.compiler, job)

  async def _run(self, lane: _Lane, job: dict, timeout: float):
    if lane.waiting >= self.queue_limit:
      self.stats["busy"] += 1
      raise CompileBusy(f"too many grammars are waiting to compile ({lane.name} lane); "
                        "retry later")
    lane.waiting += 1
    queued = True
    try:
      w = await lane.gate.take()
      lane.waiting -= 1
      queued = False
      try:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.threads, w.run, job, timeout)
      finally:
        lane.gate.give(w)
    finally:
      if queued:   # cancelled while waiting for a worker
        lane.waiting -= 1

  def _put(self, key: str, g) -> None:
    size = int(g.compiled.memory_size_bytes)
    with self.lock:
      self.cache[key] = g
      self.bytes += size
      g._pool_bytes = size
      while self.cache and (len(self.cache) > self.cache_entries or self.bytes > self.cache_bytes):
        _, old = self.cache.popitem(last=False)
        self.bytes -= getattr(old, "_pool_bytes", 0)
