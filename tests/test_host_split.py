"""bench/host_split.py: every function it times exists under its name (a rename would silently
drop a row), the wrappers count and time calls, pass results and errors through, and come off."""
import importlib
import time

import pytest

from bench.host_split import STEPS, TARGETS, Split


def test_every_target_resolves_and_the_steps_are_among_them():
  for mod, cls, fn, label in TARGETS:
    owner = importlib.import_module(mod)
    owner = getattr(owner, cls) if cls else owner
    assert callable(getattr(owner, fn)), label
  assert set(STEPS) <= {t[3] for t in TARGETS}


class _Thing:
  def work(self, x):
    time.sleep(0.002)
    if x < 0:
      raise ValueError("negative")
    return 2 * x


def test_split_times_calls_and_comes_off():
  original = _Thing.__dict__["work"]
  s = Split()
  s.wrap(_Thing, "work", "Thing.work")
  t = _Thing()
  assert [t.work(i) for i in range(3)] == [0, 2, 4]
  with pytest.raises(ValueError, match="negative"):
    t.work(-1)
  assert s.calls["Thing.work"] == 4 and s.seconds["Thing.work"] >= 0.008
  table = s.table(steps=2).splitlines()
  assert table[1].split()[:2] == ["Thing.work", "4"]
  s.remove()
  assert _Thing.__dict__["work"] is original and _Thing().work(5) == 10
