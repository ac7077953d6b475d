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
