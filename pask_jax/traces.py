"""Trace counters: how often each of an object's jitted functions was traced, i.e. compiled.

Runners and engines keep one :class:`Traces` (``runner.traces["step"]``) so tests and benchmarks
can check that a decode step compiles once whatever the tokens, budgets or lengths.  A count is
of the programs jax holds now: :func:`clear_caches` drops every compiled program and zeroes every
live counter, so the next trace counts as the first again.
"""
from __future__ import annotations

import collections
import weakref

_live: weakref.WeakValueDictionary = weakref.WeakValueDictionary()   # by id: a Counter has no hash


class Traces(collections.Counter):
  """A :class:`collections.Counter` of traces by function name, zeroed by :func:`clear_caches`."""

  def __init__(self, *args, **kw):
    super().__init__(*args, **kw)
    _live[id(self)] = self


def clear_caches() -> None:
  """``jax.clear_caches()`` (every compiled program is dropped: each jitted function compiles
  again on its next call), and every live :class:`Traces` zeroed to match."""
  import jax
  jax.clear_caches()
  for t in list(_live.values()):
    t.clear()
