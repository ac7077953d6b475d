"""pask_jax.launch: calls run in order on the launch thread (or at once when not threaded), their
errors come back through the future, and the default follows the backend and the environment."""
import threading
import time

import pytest

from pask_jax import launch


def test_threaded_calls_run_in_order_on_the_launch_thread():
  lz = launch.Launcher(threaded=True)
  seen = []

  def work(i):
    time.sleep(0.01 * (3 - i))   # the first is slowest: order is kept anyway
    seen.append((i, threading.current_thread().name))
    return i * i
  fs = [lz.submit(work, i) for i in range(3)]
  assert [f.result() for f in fs] == [0, 1, 4]
  assert [i for i, _ in seen] == [0, 1, 2]
  assert all(n.startswith("pask-launch") for _, n in seen)

  def broken():
    raise ValueError("no such step")
  with pytest.raises(ValueError, match="no such step"):
    lz.submit(broken).result()
  lz.close()
  assert not lz.threaded


def test_inline_calls_run_here():
  lz = launch.Launcher(threaded=False)
  f = lz.submit(lambda: threading.current_thread().name)
  assert f.done() and f.result() == threading.current_thread().name


def test_default_follows_the_backend_and_the_environment(monkeypatch):
  monkeypatch.delenv(launch.ENV, raising=False)
  assert launch.default_threaded() is False   # CI runs on a CPU
  monkeypatch.setenv(launch.ENV, "1")
  assert launch.default_threaded() is True and launch.Launcher().threaded
  monkeypatch.setenv(launch.ENV, "yes")
  with pytest.raises(ValueError, match=r"^\$PASK_JAX_LAUNCH_THREAD must be 0 or 1, got 'yes'$"):
    launch.default_threaded()
