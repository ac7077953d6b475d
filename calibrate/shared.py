"""Parser sharing across the copies of one request in a policy stack.

In a stack, the V copies of a request usually emit the same tokens for a long stretch (an
intervention changes the output only once compressed entries matter, if at all).  Rows of one
request that have produced the same token prefix are in the same grammar and adapter state, so
one parser serves them all: the host work per step (XGrammar accept + structural tags + frontier
key ≈ 80 µs per row, and the bitmask fill) is paid once per *distinct* prefix, not once per row.

A :class:`Forest` holds, per request, a prefix tree whose live nodes are the prefixes some row is
at now.  Each node caches what a row needs there — the accepted token's (tag candidates,
parser-state id), ``terminated`` and the next-token bitmask row — and owns one tracker positioned
after its prefix.  When rows at a node accept different tokens, each new child gets a
:meth:`~pask_jax.tracker.Tracker.fork` of the node's tracker (XGrammar copies the parser state; the
adapter copies its scan state) and the last row to leave takes the tracker itself, so a
divergence costs one fork, never a replay of the prefix.  A node that every row has left is
dropped (its mask and children), so memory follows the live rows, not the tree.  Results are
identical to one tracker per row (tested), only cheaper.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np


class _Node:
  __slots__ = ("tracker", "children", "result", "terminated", "mask", "rows")

  def __init__(self, tracker, result=None, terminated=False):
    self.tracker = tracker          # positioned exactly after this node's prefix
    self.children: dict[int, _Node] = {}
    self.result = result            # (tags, state) of the prefix's last token
    self.terminated = terminated
    self.mask = None                # cached bitmask row for the next token
    self.rows = 0                   # rows at this node now


class Forest:
  """Prefix trees of trackers, one per request.  ``make(i)`` builds a fresh tracker (it must
  support ``fork()``)."""

  def __init__(self, make: Callable[[int], Any]):
    self.make = make
    self.roots: dict[int, _Node] = {}
    self.accepts = 0     # distinct (prefix, token) accepts
    self.forks = 0

  def row(self, i: int) -> "SharedTracker":
    if i not in self.roots:
      self.roots[i] = _Node(self.make(i))
    node = self.roots[i]
    node.rows += 1
    return SharedTracker(self, node)


class SharedTracker:
  """The tracker protocol of :func:`pask_jax.decode.generate` over a shared prefix tree; keeps
  the row's own tag/state record (``tags``, ``states``) like :class:`calibrate.stack.Recorder`."""

  def __init__(self, forest: Forest, node: _Node):
    self.forest, self.node = forest, node
    self.tags: list[np.ndarray] = []
    self.states: list[int] = []

  def fill(self, bits: np.ndarray, row: int) -> None:
    n = self.node
    if n.mask is None:
      n.tracker.fill(bits, row)
      n.mask = bits[row].copy()
    else:
      bits[row] = n.mask

  def accept(self, token: int):
    n = self.node
    token = int(token)
    n.rows -= 1
    child = n.children.get(token)
    if child is None:
      if n.rows > 0:              # rows still here may need this state: branch off a copy
        tr = n.tracker.fork()
        self.forest.forks += 1
      else:                       # the last row to leave takes the tracker along
        tr, n.tracker = n.tracker, None
      res = tr.accept(token)
      self.forest.accepts += 1
      child = n.children[token] = _Node(tr, res, tr.terminated)
    if n.rows == 0:               # no row will come back here: free the node's state
      n.tracker, n.mask, n.children = None, None, {}
    child.rows += 1
    self.node = child
    t, s = child.result
    self.tags.append(np.asarray(t, np.int32))
    self.states.append(int(s))
    return child.result

  @property
  def terminated(self) -> bool:
    return self.node.terminated

  @property
  def mask_key(self) -> _Node:
    """Rows with the same key have the same next-token bitmask (the prefix's node): the
    overlapped loop uploads one mask row per key (:func:`calibrate.stack.generate_overlapped`)."""
    return self.node
