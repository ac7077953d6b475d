"""A request: what the client asks for (the constructor's fields; :meth:`Request.of` builds them
from a prepared :class:`pask_jax.prompt.Prompt`) and the engine's bookkeeping of it (written on
the engine thread only; not constructor arguments)."""
from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from typing import Any

import numpy as np

from pask_jax.prompt import Prompt
from pask_jax.tracker import Tracker

_ids = itertools.count(1)


_ENGINE = {"init": False, "repr": False}   # a field the engine owns


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
  slot: int | None = dataclasses.field(default=None, **_ENGINE)
  out: list[int] = dataclasses.field(default_factory=list, **_ENGINE)
  sent: str = dataclasses.field(default="", **_ENGINE)
  # per token: (logprob, [(id, logprob)])
  lps: list = dataclasses.field(default_factory=list, **_ENGINE)
  # text length before the stop sequence that ended it
  cut: int | None = dataclasses.field(default=None, **_ENGINE)
  detok: Any = dataclasses.field(default=None, **_ENGINE)   # serve.detok.Detokenizer of ``out``
  t_submit: float = dataclasses.field(default=0.0, **_ENGINE)
  t_admit: float | None = dataclasses.field(default=None, **_ENGINE)
  t_first: float | None = dataclasses.field(default=None, **_ENGINE)
  t_last: float | None = dataclasses.field(default=None, **_ENGINE)
  seq: int = dataclasses.field(default=0, **_ENGINE)   # arrival order (preemption: the last)
  # int8 [n_prompt, G]: the prefill plan; [n, G]: actions of the positions its next prefill stores
  prompt_plan: np.ndarray | None = dataclasses.field(default=None, **_ENGINE)
  plan: np.ndarray | None = dataclasses.field(default=None, **_ENGINE)
  resume: dict | None = dataclasses.field(default=None, **_ENGINE)   # what a preempted one needs
  replay: int | None = dataclasses.field(default=None, **_ENGINE)   # the generated token re-fed
  # the prefill in progress (pieces left, length, bucket, page rows)
  pre: Any = dataclasses.field(default=None, **_ENGINE)
  # (tag ids, state id) of every out token (what a replay feeds with it)
  fed: list = dataclasses.field(default_factory=list, **_ENGINE)
  preemptions: int = dataclasses.field(default=0, **_ENGINE)

  @classmethod
  def of(cls, prompt: Prompt, max_tokens: int, tracker: Tracker | None = None,
         **fields) -> "Request":
    """The request of a prepared prompt (its ids and prompt-span labels); ``fields``: the other
    client fields (sampling, ``stop``, ``logprobs``, ``emit``)."""
    return cls(ids=list(prompt.ids), tags=prompt.tags, max_tokens=max_tokens,
               tracker=tracker if tracker is not None else Tracker(), **fields)

  def cancel(self) -> None:
    """Thread-safe (a flag the engine polls every iteration)."""
    self.cancelled = True

  def prefill_ids(self) -> list[int]:
    """The tokens its next prefill runs (resumed by recompute: all but the last generated token
    too; the next step feeds that one)."""
    return self.ids + self.out[:-1] if self.resume and "ledger" in self.resume else self.ids
