"""Prefill pacing: how much of the engine's time a long prompt's prefill may take while other
requests decode.

A prompt of several prefill pieces (``--prefill-chunk`` tokens each) would stall every
running stream for the whole of its prefill if it ran at once.  The engine runs its pieces
between decode steps instead, and this pacer decides when: every decode step earns the long
prefill ``share / (1 - share)`` of that step's time as credit, a piece runs while the credit is
positive, and its cost is taken off (the credit can go negative: a piece costing more than its
allowance is paid back over the next steps).  Over any stretch of decoding, the long prefill
thus takes at most about ``share`` of the wall time, whatever a piece costs against a step —
on the 2-core CPU a 64-token piece of SmolLM2 costs two decode steps, on the H200 a 512-token
piece of a 4B model about one.  The credit never exceeds one step's allowance, so a long run of
decode steps without a long prompt does not store up a burst.

Prompts of one piece are not paced: they are prefilled when admitted (within the iteration's
budget of about one decode step), and may be admitted while a long prompt is in progress, so a
short request is not queued behind a long one's prefill (vLLM's partial-prefill rule).  Their
prefill time is charged to the credit all the same (``Scheduler.pace``), so a long prompt
gives way while short ones arrive; ``serve.engine.STARVE_STEPS`` bounds how long.
"""
from __future__ import annotations

import dataclasses

PREFILL_SHARE = 1 / 3   # default: a long prefill gets a third of the time (half the decode time)


@dataclasses.dataclass
class PrefillPacer:
  share: float = PREFILL_SHARE
  credit: float = 0.0   # seconds of long-prefill work allowed now (<= one step's allowance)

  def __post_init__(self):
    if not (isinstance(self.share, (int, float)) and 0.0 < self.share < 1.0):
      raise ValueError(f"prefill_share must be a fraction in (0, 1), got {self.share!r}")
    self.ratio = self.share / (1.0 - self.share)   # prefill seconds per decode second

  def step(self, dt: float) -> None:
    """A decode step of ``dt`` seconds (its own time, prefill excluded) has run."""
    cap = self.ratio * dt
    self.credit = min(cap, self.credit + cap)

  def ready(self) -> bool:
    """May a long prompt's next piece run now, beside running decode streams?"""
    return self.credit > 0.0

  def spent(self, dt: float) -> None:
    """A piece took ``dt`` seconds."""
    self.credit -= dt
