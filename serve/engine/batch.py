"""Host mirrors of the decode step's per-slot inputs, packed into one transfer per array."""
from __future__ import annotations

import numpy as np

from pask_jax import tags as T
from pask_jax.tracker import FREE_TAG
from pask_jax.grammar.matcher import new_bitmask


class Batch:

  def __init__(self, slots: int, vocab: int):
    B = slots
    self.tokens = np.zeros((B,), np.int32)             # the token each slot feeds next
    self.tag_ids = np.broadcast_to(FREE_TAG, (B, T.N_CAND)).copy()   # ... its tags
    self.state_ids = np.full((B,), -1, np.int32)       # ... its parser state
    self.active = np.zeros((B,), bool)
    self.seeds = np.zeros((B,), np.uint32)
    self.temp = np.zeros((B,), np.float32)
    self.top_p = np.ones((B,), np.float32)
    self.want_lp = np.zeros((B,), bool)
    self.bits = new_bitmask(B, vocab)
    self.bits1 = new_bitmask(1, vocab)
    # Overlap: the next token to feed is the pick's output (on the device); per slot the token
    # fed but not decided yet (its tags and state id).
    self.on_device = np.zeros((B,), bool)
    self.pend = np.zeros((B,), bool)
    self.pend_tags = self.tag_ids.copy()
    self.pend_sids = self.state_ids.copy()

  def feed(self, b: int, tok: int, tag, sid: int) -> None:
    self.tokens[b], self.tag_ids[b], self.state_ids[b] = tok, tag, sid

  def sampling(self, b: int, r) -> None:
    self.seeds[b], self.temp[b], self.top_p[b] = r.seed, r.temperature, r.top_p

  def replay(self, r, i: int) -> None:
    """The next step feeds ``r``'s generated token ``i`` with the tags it was fed with; the last
    one ends the replay (its step samples the next new token)."""
    tag, sid = r.fed[i]
    self.feed(r.slot, r.out[i], tag, sid)
    r.replay = None if i == len(r.out) - 1 else i

  def defer(self, b: int) -> None:
    """Slot ``b``'s token was fed: it is decided at the next forward, from these tags."""
    self.pend[b] = True
    self.pend_tags[b], self.pend_sids[b] = self.tag_ids[b], self.state_ids[b]

  def clear(self, b: int) -> None:
    self.active[b] = False
    self.pend[b] = self.on_device[b] = False
    # an empty slot asks for no sampling branch of the pick (``step.how_of``)
    self.temp[b], self.top_p[b], self.want_lp[b] = 0.0, 1.0, False

  def mask(self, rows, running) -> None:
    """The grammar masks of ``rows`` (a replayed token's sample is not used: no mask)."""
    self.bits[:] = -1
    for b in rows:
      if running[b].replay is None:
        running[b].tracker.fill(self.bits, b)

  def mask1(self, r) -> np.ndarray:
    self.bits1[:] = -1
    r.tracker.fill(self.bits1, 0)
    return self.bits1

  def packed(self, steps) -> np.ndarray:
    """The pick's per-row inputs in one int32 array [B, words + 5]: the bitmask words, then
    seed (uint32 bits), step, wants log-probs, temperature and top_p (float32 bits)."""
    nw = self.bits.shape[1]
    packed = np.zeros((len(self.tokens), nw + 5), np.int32)
    packed[:, :nw] = self.bits
    packed[:, nw] = self.seeds.view(np.int32)
    packed[:, nw + 1] = steps
    packed[:, nw + 2] = self.want_lp & self.active
    packed[:, nw + 3] = self.temp.view(np.int32)
    packed[:, nw + 4] = self.top_p.view(np.int32)
    return packed

  def host(self, decide: np.ndarray) -> np.ndarray:
    """The overlapped forward's per-row inputs, int32 [B, 9] (one transfer): token, use it
    instead of the pick's, the previous token's 4 tags, its state id, decide it, active."""
    host = np.zeros((len(self.tokens), 9), np.int32)
    host[:, 0] = self.tokens
    host[:, 1] = ~self.on_device
    host[:, 2:6] = self.pend_tags
    host[:, 6] = self.pend_sids
    host[:, 7] = decide
    host[:, 8] = self.active
    return host
