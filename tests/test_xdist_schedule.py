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
