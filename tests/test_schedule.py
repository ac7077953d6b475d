"""serve/schedule.py: the prefill pacer keeps a long prompt's prefill at its share of the time."""
import numpy as np
import pytest

from serve.schedule import PREFILL_SHARE, PrefillPacer


def simulate(pacer, steps, piece):
  """A decode loop that runs a long prompt's pieces whenever the pacer allows.  steps: seconds
  of each decode step; piece: seconds of a piece -> the prefill's share of the wall time."""
  pre = 0.0
  for dt in steps:
    pacer.step(dt)
    while pacer.ready():
      pacer.spent(piece)
      pre += piece
  return pre / (pre + float(np.sum(steps)))


@pytest.mark.parametrize("share", [0.1, PREFILL_SHARE, 0.5, 0.8])
@pytest.mark.parametrize("piece_per_step", [0.05, 0.7, 2.0, 9.0])
def test_the_long_prefill_takes_its_share_of_the_time(share, piece_per_step):
  """Whatever a piece costs against a step (20 pieces a step to one piece per 9 steps), and with
  decode steps that vary, the prefill's share of the time converges to ``share``."""
  rng = np.random.default_rng(0)
  steps = rng.uniform(0.05, 0.15, 4000)
  got = simulate(PrefillPacer(share), steps, piece_per_step * 0.1)
  # one piece beyond the allowance at most: a bound that shrinks with the run's length
  slack = piece_per_step * 0.1 / steps.sum() + 1e-9
  assert share - 0.02 - slack <= got <= share + slack, got


def test_no_burst_after_a_long_stretch_without_long_prompts():
  p = PrefillPacer(0.5)
  for _ in range(1000):
    p.step(0.1)
  assert p.credit == pytest.approx(0.1)   # one step's allowance, not a thousand
  p.spent(0.25)
  assert not p.ready()
  p.step(0.1)
  assert not p.ready()   # -0.05
  p.step(0.1)
  assert p.ready()


@pytest.mark.parametrize("share", [0, 1, -0.5, 1.5, "0.3", None])
def test_a_share_outside_0_1_is_refused(share):
  with pytest.raises(ValueError, match="prefill_share must be a fraction in \\(0, 1\\)"):
    PrefillPacer(share)
