"""A request: what the client asks for (the constructor's fields) and the engine's bookkeeping
of it (written on the engine thread only; not constructor arguments)."""
from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Callable

import numpy as np

from pask_jax.decode import Tracker

_ids = itertools.count(1)


def _engine(default=None, factory=None):
  """A field the engine owns: not a constructor argument, not in the repr."""
  if factory is not None:
    return dataclasses.field(default_factory=factory, init=False, repr=False)
  return dataclasses.field(default=default, init=False, repr=False)


@dataclasses.dataclass(eq=False)
class Request:
  """Events go back to the client through ``emit(kind, payload)``, called on the engine thread:
  ``"delta"`` (text), ``"done"`` (result dict; None for a request cancelled in the queue),
  ``"error"`` (message)."""
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
  # The engine's bookkeeping.
  slot: int | None = _engine()
  out: list[int] = _engine(factory=list)
  sent: str = _engine("")
  lps: list = _engine(factory=list)   # per token: (logprob, [(id, logprob)])
  cut: int | None = _engine()         # text length before the stop sequence that ended it
  detok: Any = _engine()              # serve.detok.Detokenizer of ``out``
  t_submit: float = _engine(0.0)
  t_admit: float | None = _engine()
  t_first: float | None = _engine()
  t_last: float | None = _engine()
  seq: int = _engine(0)               # arrival order (preemption takes the largest)
  prompt_plan: np.ndarray | None = _engine()   # int8 [n_prompt, G] prefill plan
  plan: np.ndarray | None = _engine()   # int8 [n, G] actions of the positions its next prefill stores
  resume: dict | None = _engine()     # what a preempted request needs to continue
  replay: int | None = _engine()      # replay: index of the generated token being re-fed
  pre: Any = _engine()                # the prefill in progress (pieces left, length, bucket, rows)
  fed: list = _engine(factory=list)   # (tag ids, state id) of every out token
  preemptions: int = _engine(0)

  def cancel(self) -> None:
    """Thread-safe (a flag the engine polls every iteration)."""
    self.cancelled = True

  def prefill_ids(self) -> list[int]:
    """The tokens its next prefill runs (resumed by recompute: all but the last generated token
    too; the next step feeds that one)."""
    return self.ids + self.out[:-1] if self.resume and "ledger" in self.resume else self.ids
