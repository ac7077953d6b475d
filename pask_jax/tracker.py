"""One request's grammar state on the host: the matcher and the structural-tag adapter.

Light on purpose (numpy; xgrammar only through a grammar's matcher, no JAX): the server's request
threads and the Python API hold one per request without importing the decode step.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from pask_jax import tags as T
from pask_jax.grammar.matcher import Grammar

# Tag of a token generated without a grammar adapter (free text).
FREE_TAG = T.candidates(T.fc(T.Cls.FREE_GENERATION))


class Tracker:
  """One request's grammar matcher and structural-tag adapter on the host.

  ``accept(token) -> (tag ids int32[4], parser-state id)``.  Without an adapter every token gets
  :data:`FREE_TAG` and the unseen state id -1 (pooled reserve).
  """

  def __init__(self, grammar: Grammar | None = None, adapter: Any = None):
    self.matcher = grammar.matcher() if grammar is not None else None
    self.adapter = adapter

  def fill(self, bits: np.ndarray, row: int) -> None:
    """Write row ``row`` of the next-token bitmask (every word: all ones when unconstrained)."""
    if self.matcher is not None:
      self.matcher.fill(bits, row)
    else:
      bits[row] = -1

  def fork(self) -> "Tracker":
    """An independent tracker in the same parser and adapter state."""
    new = object.__new__(type(self))
    new.__dict__.update(self.__dict__)
    new.matcher = self.matcher.fork() if self.matcher is not None else None
    new.adapter = self.adapter.fork() if self.adapter is not None else None
    return new

  def accept(self, token: int) -> tuple[np.ndarray, int]:
    if self.adapter is not None:
      return self.adapter.accept(self.matcher, token)
    if self.matcher is not None and not self.matcher.accept(token):
      raise RuntimeError(f"grammar rejected token {token} it allowed")
    return FREE_TAG, -1

  @property
  def terminated(self) -> bool:
    return self.matcher is not None and self.matcher.terminated

  @property
  def mask_key(self):
    """Rows of equal keys have equal next-token bitmasks: None when unconstrained (every token
    allowed), else this tracker (its own)."""
    return None if self.matcher is None else self


class PositionTracker:
  """The no-transition ablation (paper C.5) over any tracker: the grammar still constrains the
  tokens, but each accepted token's tag is its request-local position bin
  (:func:`pask_jax.tags.position_id` of :func:`pask_jax.tags.position_bin`) and its parser
  state the unseen -1 (pooled reserve); a stop token keeps its ``STOP`` candidate.  Keeps
  ``tags`` / ``states`` of what it returned, like calibration's recorders."""

  def __init__(self, inner, edges):
    self.inner, self.edges, self.n = inner, tuple(int(x) for x in edges), 0
    self.tags: list[np.ndarray] = []
    self.states: list[int] = []

  def fill(self, bits: np.ndarray, row: int) -> None:
    self.inner.fill(bits, row)

  def fork(self) -> "PositionTracker":
    new = object.__new__(type(self))
    new.__dict__.update(self.__dict__)
    new.inner = self.inner.fork()
    new.tags, new.states = list(self.tags), list(self.states)
    return new

  def accept(self, token: int) -> tuple[np.ndarray, int]:
    tags, _ = self.inner.accept(token)
    if np.any(np.asarray(tags) == T.STOP):
      out = np.asarray(tags, np.int32)
    else:
      out = T.candidates(T.position_id(T.position_bin(self.n, self.edges)))
    self.n += 1
    self.tags.append(out)
    self.states.append(-1)
    return out, -1

  @property
  def terminated(self) -> bool:
    return self.inner.terminated

  @property
  def mask_key(self):
    """The inner tracker's (positions do not change the grammar's bitmask)."""
    return getattr(self.inner, "mask_key", self.inner)


def with_positions(trackers, edges):
  """``trackers`` as :class:`PositionTracker` over ``edges`` (None: unchanged)."""
  if edges is None:
    return list(trackers)
  return [t if isinstance(t, PositionTracker) else PositionTracker(t, edges) for t in trackers]
