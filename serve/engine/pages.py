"""Host bookkeeping of the KV page pools: free lists, every slot's pages, and the action of
every cached position.

Page ids are per pool and layer group (layer groups own disjoint layers, so a group's demand
never blocks another's); free lists are numpy stacks, so a step's allocation is a few vector
ops.  The host mirrors every slot's per-position actions (the prompt plan, then the actions each
step returns), so it knows W steps ahead what the token leaving the window at the next step
needs: a page is taken exactly when the first entry that needs it is materialized.  Nothing here
touches the device or the requests: the engine asks, and applies the answers.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from pask_jax import actions as Act

HI, LO = 0, 1           # pool index
CODE = (Act.H, Act.L)       # the action stored in each pool


@dataclasses.dataclass(frozen=True)
class Growth:
  """The pages the tokens leaving the window at this step need."""
  rows: np.ndarray      # slots whose token leaves the window
  sel: np.ndarray       # bool [2, G, k]: the leaving entry goes to that pool
  need: np.ndarray      # bool [2, G, k]: ... and opens a new page there
  short: bool           # some free list cannot give them: preempt first

  @property
  def takes(self) -> bool:
    return bool(len(self.rows)) and bool(self.need.any())


NO_GROWTH = Growth(np.zeros((0,), np.int64), np.zeros((2, 0, 0), bool), np.zeros((2, 0, 0), bool),
                   False)


class PagePools:
  """The paged cache's pools (``totals`` pages each, of ``page`` and ``lo_page`` rows) as the
  host sees them."""

  def __init__(self, totals: tuple[int, int], *, slots: int, context: int, page: int,
               window: int, sink: int, n_groups: int, watermark: float,
               lo_page: int | None = None):
    B, G = slots, n_groups
    self.totals, self.window, self.sink, self.G = totals, window, sink, G
    self.pages = np.array([page, page if lo_page is None else lo_page], np.int64)   # rows
    self.watermark = float(watermark)
    self.n_pages = tuple(int(-(-context // pg)) for pg in self.pages)   # table length per pool
    self.acts = np.zeros((B, context, G), np.int8)     # the action of every cached position
    self.lens = np.zeros((2, G, B), np.int64)          # entries per (pool, group, slot)
    self.npg = np.zeros((2, G, B), np.int64)           # pages per (pool, group, slot)
    self.tbl = [np.zeros((G, B, n), np.int32) for n in self.n_pages]   # every slot's pages
    self.free = [np.tile(np.arange(n, dtype=np.int32)[::-1], (G, 1)) for n in totals]
    self.top = np.array([[n] * G for n in totals], np.int64)   # free pages [pool, group]

  def free_pages(self) -> tuple[int, int]:
    """Free pages of each pool in its scarcest layer group."""
    return int(self.top[HI].min()), int(self.top[LO].min())

  def used(self) -> tuple[int, int]:
    """Pages in use of each pool in its busiest layer group."""
    used = np.array(self.totals)[:, None] - self.top
    return int(used[HI].max()), int(used[LO].max())

  def held(self, b: int) -> list[int]:
    """Pages slot ``b`` holds per pool (its busiest group): its peak, as pools are append-only."""
    return [int(self.npg[HI, :, b].max()), int(self.npg[LO, :, b].max())]

  def need(self, plan: np.ndarray) -> np.ndarray:
    """Pages [pool, group] for the entries of ``plan`` that have left the window."""
    done = plan[:max(0, len(plan) - self.window)]
    counts = np.stack([(done == c).sum(0) for c in CODE])           # [2, G]
    return -(-counts // self.pages[:, None])

  def fits(self, need: np.ndarray, busy: bool) -> bool:
    """The pools can give ``need`` now (while others run: plus the watermark's headroom for
    their decode growth, as vLLM's 1 %)."""
    if not busy:
      return bool((need <= self.top).all())
    wm = np.ceil(self.watermark * np.array(self.totals, np.float64))[:, None]
    used = np.array(self.totals)[:, None] > 1       # an unused 1-page pool has no headroom
    return bool((need + np.where(used, wm, 0) <= self.top).all())

  def _pop(self, X: int, g: int, k: int) -> np.ndarray:
    t = self.top[X, g]
    assert k <= t, "page free list underflow"
    self.top[X, g] = t - k
    return self.free[X][g, t - k:t]

  def take(self, b: int, need: np.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Give slot ``b`` its prompt pages ``need [2, G]`` -> device page rows [G, n_pages] of
    each pool."""
    rows = []
    for X in (HI, LO):
      tbl = np.full((self.G, self.n_pages[X]), self.totals[X], np.int32)
      for g in range(self.G):
        k = int(need[X, g])
        if k:
          ids = self._pop(X, g, k)
          tbl[g, :k] = ids
          self.tbl[X][g, b, :k] = ids
        self.npg[X, g, b] = k
      rows.append(jnp.asarray(tbl))
    return rows[0], rows[1]

  def give_back(self, b: int) -> None:
    """Every page of slot ``b`` back to the free lists; its mirror emptied."""
    for X in (HI, LO):
      for g in range(self.G):
        k = int(self.npg[X, g, b])
        if k:
          t = self.top[X, g]
          self.free[X][g, t:t + k] = self.tbl[X][g, b, :k]
          self.top[X, g] = t + k
    self.npg[:, :, b] = 0
    self.lens[:, :, b] = 0

  def growth(self, active: np.ndarray, count: np.ndarray) -> Growth:
    """What the next step needs for the active slots (``count``: tokens written per slot)."""
    W = self.window
    rows = np.flatnonzero(active)
    p = count[rows]
    er = rows[p >= W]
    a = self.acts[er, p[p >= W] - W].T                             # [G, k] evicted actions
    sel = np.stack([a == c for c in CODE])                         # [2, G, k]
    need = sel & (self.lens[:, :, er] % self.pages[:, None, None] == 0)
    return Growth(er, sel, need, bool((need.sum(-1) > self.top).any()))

  def grow(self, g: Growth) -> tuple[np.ndarray, np.ndarray]:
    """Take the pages of ``g`` (which fits) -> new page ids [G, B] per pool (-1: none)."""
    er, sel, need = g.rows, g.sel, g.need
    new = np.full((2, self.G, self.acts.shape[0]), -1, np.int32)
    for X, grp in zip(*np.nonzero(need.any(-1))):
      rs = er[need[X, grp]]
      ids = self._pop(X, grp, len(rs))
      new[X, grp, rs] = ids
      self.tbl[X][grp, rs, self.lens[X, grp, rs] // self.pages[X]] = ids
      self.npg[X, grp, rs] += 1
    if len(er):
      self.lens[:, :, er] += sel
    return new[HI], new[LO]

  def store_plan(self, b: int, plan: np.ndarray, n: int) -> None:
    """Slot ``b`` was filled with ``n`` positions of actions ``plan``."""
    self.acts[b, :n] = plan
    done = plan[:max(0, n - self.window)]
    for X, code in enumerate(CODE):
      self.lens[X, :, b] = (done == code).sum(0)

  def record(self, rows: np.ndarray, p: np.ndarray, actions: np.ndarray) -> None:
    """The actions [k, G] of the tokens just written at positions ``p`` of slots ``rows`` (sinks
    are H), for later evictions."""
    a = actions.astype(np.int8)
    self.acts[rows, p] = np.where((p < self.sink)[:, None], np.int8(Act.H), a)

  def record_late(self, acts, rows) -> None:
    """A deferred forward's decided actions (device [B, G]) for ``rows``: (slot, position)."""
    a = np.asarray(acts).astype(np.int8)
    for b, p in rows:
      self.acts[b, p] = Act.H if p < self.sink else a[b]

  def actions(self, b: int, n: int) -> np.ndarray:
    """The actions of slot ``b``'s first ``n`` positions (a copy)."""
    return self.acts[b, :n].copy()


class NoPages:
  """The dense cache's stand-in for :class:`PagePools`: admission by free slot only."""
  totals = (0, 0)

  def free_pages(self) -> tuple[int, int]:
    return 0, 0

  def used(self) -> tuple[int, int]:
    return 0, 0

  def held(self, b: int) -> list[int]:
    return [0, 0]

  def need(self, plan) -> None:
    return None

  def fits(self, need, busy: bool) -> bool:
    return True

  def take(self, b: int, need) -> None:
    return None

  def give_back(self, b: int) -> None:
    pass

  def growth(self, active, count) -> Growth:
    return NO_GROWTH

  def grow(self, g: Growth) -> None:
    return None

  def store_plan(self, b: int, plan, n: int) -> None:
    pass

  def record(self, rows, p, actions) -> None:
    pass

  def record_late(self, acts, rows) -> None:
    pass

  def actions(self, b: int, n: int) -> None:
    return None
