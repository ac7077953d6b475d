"""Launching a jitted step on a worker thread, so the host's Python work runs meanwhile.

Why (issue 24): on a GPU host a decode step's forward is one CUDA graph of a few hundred
nodes, and the call returns only once the graph is launched -- about 2 ms of host time for the
Qwen 0.5B step on an H100 host, during which JAX holds no Python lock.  The loops that drive it
(the serving engine, calibration's overlapped generate) meanwhile have Python work of their own
that does not depend on the launch (the grammar's accept of the previous tokens, tags, masks).
On one thread the two add up; with the launch on a worker thread they overlap.

A :class:`Launcher` runs each submitted call on its one worker thread in submission order (or at
once on the caller's thread when not ``threaded``) and returns a future; the caller joins it
(``result()``) before anything that needs the call's outputs or the buffers it donates.  One
worker keeps the device's calls in the order they were submitted.
"""
from __future__ import annotations

import concurrent.futures
import os
import weakref
from typing import Callable


ENV = "PASK_JAX_LAUNCH_THREAD"   # "1" / "0": force the launch thread on / off everywhere


def default_threaded() -> bool:
  """Whether a launch thread pays here: on a GPU (a launch costs milliseconds of host time);
  on a CPU or TPU a launch returns in tens of microseconds.  ``$PASK_JAX_LAUNCH_THREAD`` (1 or
  0) overrides it."""
  env = os.environ.get(ENV, "").strip()
  if env:
    if env not in ("0", "1"):
      raise ValueError(f"${ENV} must be 0 or 1, got {env!r}")
    return env == "1"
  import jax
  return jax.default_backend() == "gpu"


class Launcher:
  """``submit(fn, *args)`` -> a future of ``fn(*args)``, run on the launch thread (``threaded``)
  or at once here.  An error raised by ``fn`` is raised by the future's ``result()``."""

  def __init__(self, threaded: bool | None = None, name: str = "pask-launch"):
    self.name = name
    self._pool: concurrent.futures.ThreadPoolExecutor | None = None
    self.threaded = default_threaded() if threaded is None else threaded

  @property
  def threaded(self) -> bool:
    return self._pool is not None

  @threaded.setter
  def threaded(self, on: bool) -> None:
    if bool(on) == self.threaded:
      return
    if on:
      self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=self.name)
      weakref.finalize(self, self._pool.shutdown, wait=False)
    else:
      pool, self._pool = self._pool, None
      pool.shutdown(wait=True)   # what was submitted still runs

  def submit(self, fn: Callable, *args) -> concurrent.futures.Future:
    if self._pool is not None:
      return self._pool.submit(fn, *args)
    f = concurrent.futures.Future()
    f.set_result(fn(*args))
    return f

  def close(self) -> None:
    self.threaded = False
