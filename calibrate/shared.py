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

from typing import Any, Callable, Sequence

import numpy as np

from pask_jax import tags as T


class _Node:
  __slots__ = ("tracker", "children", "result", "terminated", "mask", "rows")

  def __init__(self, tracker, result=None, terminated=False):
    self.tracker = tracker          # positioned exactly after this node's prefix
    self.children: dict[int, _Node] = {}
    self.result = result            # (tags int32[N_CAND], state) of the prefix's last token
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

  def move(self, node: _Node, token: int, k: int) -> _Node:
    """``k`` rows at ``node`` accept ``token``: the child node they move to (made on first use).
    The tracker is forked only while rows stay behind at ``node`` (another token, or not
    accepting now); the last rows to leave take it along, and the node is freed."""
    node.rows -= k
    child = node.children.get(token)
    if child is None:
      if node.rows > 0:
        tr = node.tracker.fork()
        self.forks += 1
      else:
        tr, node.tracker = node.tracker, None
      t, s = tr.accept(token)
      self.accepts += 1
      child = node.children[token] = _Node(tr, (np.asarray(t, np.int32), int(s)), tr.terminated)
    if node.rows == 0:            # no row will come back here: free the node's state
      node.tracker, node.mask, node.children = None, None, {}
    child.rows += k
    return child

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
    child = self.forest.move(self.node, int(token), 1)
    self.arrive(child)
    return child.result

  def arrive(self, child: _Node) -> None:
    """Stand at ``child`` (the node :meth:`Forest.move` gave) and record its token's result."""
    self.node = child
    t, s = child.result
    self.tags.append(t)
    self.states.append(s)

  @property
  def terminated(self) -> bool:
    return self.node.terminated

  @property
  def mask_key(self) -> _Node:
    """Rows with the same key have the same next-token bitmask (the prefix's node): the
    overlapped loop uploads one mask row per key (:func:`calibrate.stack.generate_overlapped`)."""
    return self.node


def accept_rows(trackers: Sequence, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray,
                                                                  np.ndarray]:
  """Tracker ``r`` accepts ``tokens[r]``, for every r: ``(tags int32[R, N_CAND], states
  int32[R], terminated bool[R])``, what each tracker's own ``accept`` returns, with each row's
  records kept as its ``accept`` keeps them.

  The :class:`SharedTracker` rows at one node that accept one token move together
  (:meth:`Forest.move`: one parser accept per (node, token), one fork only while rows stay
  behind) and their results are written per group, so the host's cost per step follows the
  distinct parser states, not the rows; any other tracker accepts on its own."""
  R = len(trackers)
  tags = np.empty((R, T.N_CAND), np.int32)
  states = np.empty(R, np.int32)
  done = np.empty(R, bool)
  groups: dict[tuple[_Node, int], list[int]] = {}
  for r, (tr, tok) in enumerate(zip(trackers, np.asarray(tokens).tolist())):
    if type(tr) is SharedTracker:
      groups.setdefault((tr.node, tok), []).append(r)
    else:
      tags[r], states[r] = tr.accept(tok)
      done[r] = tr.terminated
  for (node, tok), rows in groups.items():
    child = trackers[rows[0]].forest.move(node, tok, len(rows))
    for r in rows:
      trackers[r].arrive(child)
    tags[rows], states[rows], done[rows] = *child.result, child.terminated
  return tags, states, done
