"""Whom to admit, when a long prompt's prefill pieces run, and whom to preempt.

Admission is strict FIFO for pages (a large request is never starved): the queue head is
admitted when a slot is free and the pools hold its prompt plan's pages.  A prompt of one piece
(at most ``prefill_chunk`` tokens) is prefilled when admitted, and an iteration admits such
prompts until their prefills took about one decode step.  A longer prompt is prefilled in pieces
between decode steps, paced by :class:`serve.schedule.PrefillPacer`; one is in progress at a
time, and shorter prompts that arrive meanwhile pass it (vLLM's partial-prefill rule).  When the
pools cannot give a step's pages, the youngest running request is preempted, and admission
pauses until a request ends (else the one just preempted would be readmitted and preempted again
at every step).  The scheduler only decides; the engine runs the prefills and steps.
"""
from __future__ import annotations

from serve.schedule import PREFILL_SHARE, PrefillPacer

STARVE_STEPS = 16   # a long prompt in progress gets a piece at least every this many decode steps


class Scheduler:

  def __init__(self, prefill_chunk: int, prefill_share: float = PREFILL_SHARE):
    self.prefill_chunk = int(prefill_chunk)
    self.pacer = PrefillPacer(prefill_share)
    self.prefilling = None   # the long prompt whose prefill is in progress
    # Between two decode steps' completions: prefill seconds spent on the host and the long
    # prompt's pieces run (the pacer charges what the interval cost beyond a decode step).
    self.pre_s = 0.0
    self.pre_pieces = 0
    self.piece_ema = 0.0   # seconds one long-prompt piece adds to an interval (moving average)
    self.since_piece = STARVE_STEPS   # decode steps since a long prompt's pieces last ran
    self.step_ema = 0.0   # seconds per decode step (moving average): the prefill budget
    self.t_land = None    # when the last decode step finished
    self.pressure = False   # a preemption happened: admit nothing until a request ends

  def pace(self, t: float) -> None:
    """A decode step finished at ``t``.  An interval between two such moments without prefill
    work is a decode step (its moving average ``step_ema`` is the short prompts' budget per
    iteration).  What an interval with prefill work took beyond one is charged to the pacer —
    short prompts' prefills too, so all prefill stays near the share while a long prompt is in
    progress (:data:`STARVE_STEPS` bounds the wait) — and, per long-prompt piece less the short
    prompts' host-timed prefills, gives ``piece_ema``.  Measured between completions, not around
    the host's calls: the calls only launch the work, and a piece's device time shows in the
    interval it ran in."""
    if self.t_land is not None:
      dt = t - self.t_land
      if not self.pre_pieces and not self.pre_s:
        self.step_ema = dt if not self.step_ema else 0.8 * self.step_ema + 0.2 * dt
      else:
        extra = max(dt - self.step_ema, 0.0)
        self.pacer.spent(extra)
        if self.pre_pieces:
          per = max(extra - self.pre_s, 0.0) / self.pre_pieces
          self.piece_ema = per if not self.piece_ema else 0.8 * self.piece_ema + 0.2 * per
      self.pacer.step(self.step_ema or dt)
    self.t_land = t
    self.pre_s, self.pre_pieces = 0.0, 0
    self.since_piece += 1

  def room(self, busy: bool, spent: float) -> bool:
    """May this iteration admit another request, ``spent`` seconds of short prefills in?"""
    return not (busy and spent and spent >= self.step_ema)

  def waits(self, r) -> bool:
    """``r`` is a long prompt and another one's prefill is in progress: it waits, and the
    requests behind it may pass."""
    return self.is_long(r) and self.prefilling is not None

  def is_long(self, r) -> bool:
    return len(r.prefill_ids()) > self.prefill_chunk

  def piece_due(self, spent: float, busy: bool) -> bool:
    """Do the long prompt's pieces run now?  While streams decode, when the pacer says — never
    right after a short prompt's prefill (``spent``), whose first decode step would wait for
    them, unless the long prompt starves; with nothing decoding, always."""
    starved = self.since_piece >= STARVE_STEPS
    if (not spent or starved) and (not busy or self.pacer.ready() or starved):
      self.since_piece = 0
      return True
    return False

  def pieces(self, busy: bool) -> int:
    """How many of the long prompt's pieces to launch beside decoding streams: as many as the
    pacer's credit covers, at least one."""
    return max(1, int(self.pacer.credit // self.piece_ema)) if busy and self.piece_ema else 1

  @staticmethod
  def victim(running):
    """Whom to preempt among the ``running`` requests: the youngest (latest arrival)."""
    return max(running, key=lambda r: r.seq)
