"""Parser sharing across the copies of one request in a policy stack.

In a stack, the V copies of a request usually emit the same tokens for a long stretch (an
intervention changes the output only once compressed entries matter, if at all).  Rows of one
request that have produced the same token prefix are in the same grammar and adapter state, so
one parser serves them all: the host work per step (XGrammar accept + structural tags + frontier
key ≈ 80 µs per row, and the bitmask fill) is paid once per *distinct* prefix, not once per row.

A :class:`Forest` holds, per request, a prefix tree.  Each node caches what a row needs there —
the accepted token's (tag candidates, parser-state id), ``terminated`` and the next-token bitmask
row.  The live tracker object moves down the tree with the first row that extends a node; a row
that diverges later gets a fresh tracker replayed along its prefix (once per divergence).
Results are identical to one tracker per row (tested), only cheaper.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np


class _Node:
  __slots__ = ("prefix", "tracker", "children", "result", "terminated", "mask")

  def __init__(self, prefix: tuple, tracker=None):
    self.prefix = prefix
    self.tracker = tracker          # a tracker positioned exactly after ``prefix`` (or None)
    self.children: dict[int, _Node] = {}
    self.result = None              # (tags, state) of the prefix's last token
    self.terminated = False
    self.mask = None                # cached bitmask row for the next token


class Forest:
  """Prefix trees of trackers, one per request.  ``make(i)`` builds a fresh tracker."""

  def __init__(self, make: Callable[[int], Any]):
    self.make = make
    self.roots: dict[int, _Node] = {}
    self.replays = 0
    self.accepts = 0

  def row(self, i: int) -> "SharedTracker":
    if i not in self.roots:
      self.roots[i] = _Node((), self.make(i))
    return SharedTracker(self, i, self.roots[i])

  def _tracker_at(self, i: int, node: _Node):
    """A tracker positioned after ``node.prefix`` (taken from the node, or replayed)."""
    if node.tracker is not None:
      tr, node.tracker = node.tracker, None
      return tr
    tr = self.make(i)
    for t in node.prefix:
      tr.accept(t)
    self.replays += 1
    return tr


class SharedTracker:
  """The tracker protocol of :func:`pask_jax.decode.generate` over a shared prefix tree; keeps
  the row's own tag/state record (``tags``, ``states``) like :class:`calibrate.stack.Recorder`."""

  def __init__(self, forest: Forest, i: int, node: _Node):
    self.forest, self.i, self.node = forest, i, node
    self.tags: list[np.ndarray] = []
    self.states: list[int] = []

  def fill(self, bits: np.ndarray, row: int) -> None:
    n = self.node
    if n.mask is None:
      tr = n.tracker
      if tr is None:
        n.tracker = tr = self.forest._tracker_at(self.i, n)
      tr.fill(bits, row)
      n.mask = bits[row].copy()
    else:
      bits[row] = n.mask

  def accept(self, token: int):
    n = self.node
    token = int(token)
    child = n.children.get(token)
    if child is None:
      tr = self.forest._tracker_at(self.i, n)
      res = tr.accept(token)
      self.forest.accepts += 1
      child = _Node(n.prefix + (token,), tr)
      child.result, child.terminated = res, tr.terminated
      n.children[token] = child
    self.node = child
    t, s = child.result
    self.tags.append(np.asarray(t, np.int32))
    self.states.append(int(s))
    return child.result

  @property
  def terminated(self) -> bool:
    return self.node.terminated
