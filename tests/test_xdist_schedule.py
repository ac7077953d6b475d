"""The suite's xdist scheduler (pask_jax.testing.schedule) after crashed workers: the run ends,
each crash is one failure, nothing runs twice and every other test runs (the stock scope
scheduler of pytest-xdist 3.8 re-runs the crashing test on each replacement worker, never runs
the rest of its file, and can hang the run with idle workers)."""
import subprocess
import sys

CONFTEST = '''
import pytest

@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
  from pask_jax.testing.schedule import grouped_files
  return grouped_files(config, log, lambda nodeid: nodeid.split("::")[0])
'''


def test_crashed_workers_fail_their_test_once_and_the_rest_runs(tmp_path):
  (tmp_path / "conftest.py").write_text(CONFTEST)
  for i in range(3):
    (tmp_path / f"test_ok{i}.py").write_text("def test_a(): pass\ndef test_b(): pass\n")
  crash = "import os\ndef test_crash(): os._exit(1)\n"
  (tmp_path / "test_c1.py").write_text("def test_x(): pass\n" + crash + "def test_after(): pass\n")
  (tmp_path / "test_c2.py").write_text(crash)
  (tmp_path / "test_c3.py").write_text(crash + "def test_y(): pass\n")
  r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-n", "2", "--dist", "loadfile",
                      "-p", "no:cacheprovider", str(tmp_path)], capture_output=True, text=True,
                     cwd=tmp_path, timeout=120)
  out = r.stdout
  assert r.returncode == 1 and "3 failed, 9 passed" in out, out[-3000:]
  for f in ("test_c1.py", "test_c2.py", "test_c3.py"):
    assert out.count(f"FAILED {f}::test_crash") == 1, out[-3000:]
  for t in ("test_c1.py::test_after", "test_c3.py::test_y", "test_c1.py::test_x"):
    assert f"PASSED {t}" in out, out[-3000:]


def test_a_worker_dead_while_topped_up_keeps_its_unit_for_the_crash_report(monkeypatch):
  """The race the crash test above can hit: a worker crashes in its first unit while the initial
  schedule tops it up, so the send fails (its channel is closed, the crash not yet reported).
  The scheduler does not raise; the unit stays in the dead worker's workload, and the crash
  report (remove_node) names the test it died on and puts the rest back on the queue."""
  import types

  from xdist.scheduler import loadscope

  from pask_jax.testing.schedule import grouped_files
  monkeypatch.setattr(loadscope, "parse_tx_spec_config", lambda config: [0, 1])

  class Node:
    def __init__(self, sends, name):
      self.sends, self.sent, self.shutting_down = sends, [], False
      self.gateway = types.SimpleNamespace(id=name)

    def send_runtest_some(self, indices):
      if len(self.sent) >= self.sends:
        raise OSError("cannot send (already closed?)")
      self.sent.append(list(indices))

    def shutdown(self):
      self.shutting_down = True

  files = {"c1": ["x", "crash", "after"], "c2": ["crash"], "c3": ["crash", "y"], "ok0": ["a", "b"]}
  ids = [f"{f}.py::{t}" for f, ts in files.items() for t in ts]
  config = types.SimpleNamespace(option=types.SimpleNamespace(loadscopereorder=False))
  sched = grouped_files(config, None, lambda nodeid: nodeid.split("::")[0])
  live, dead = Node(99, "gw0"), Node(1, "gw1")   # ``dead`` takes its first unit, then is gone
  for n in (live, dead):
    sched.add_node(n)
    sched.add_node_collection(n, ids)
  sched.schedule()                          # raised OSError before the fix
  assert live.sent == [[0, 1, 2]] and dead.sent == [[3]]
  assert list(sched.assigned_work[dead]) == ["c2.py", "c3.py"]   # c3 kept, never sent
  assert sched.remove_node(dead) == "c2.py::crash"
  assert list(sched.workqueue) == ["c3.py", "ok0.py"]            # c3 back first, then the rest
