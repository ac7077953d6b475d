"""Calibration across processes (calibrate.distributed; issue 28, deliverable 3): two CPU processes
of two host devices each, joined on loopback (jax.distributed, gloo collectives), run one
``pask-jax calibrate`` whose stacked step shards its policy rows over the four devices; the
policy and record they select equal a one-process run's, process 0 alone writes, and bad launch
arguments are one-line errors."""
import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from pask_jax.testing import xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A process of the calibration: the CLI on a tiny random llama over SmolLM2's tokenizer (as
# tests/test_jsonl_task.py's end-to-end run), the model made only once the CLI asks for it, i.e.
# after jax.distributed.initialize.
DRIVER = r"""
import sys
from models.loaders import Loaded
from pask_jax import cli, platform
from pask_jax.testing import smollm2_tokenizer, tiny_llama
tok = smollm2_tokenizer()
def load(*a, **k):
  m = tiny_llama(tok.vocab_size)
  return Loaded(m.cfg, m, tok)
platform.load_model = load
sys.exit(cli.main(["calibrate", "--task", "jsonl", "--rows", "4", "--max-tokens", "6"]
                  + sys.argv[1:]))
"""

YES_NO = {"enum": ["yes", "no"]}
CASES = [{"messages": [{"role": "user", "content": "Is the sky blue?"}], "schema": YES_NO,
          "expected": "yes"},
         {"messages": [{"role": "user", "content": "Is fire cold?"}], "schema": YES_NO,
          "scorer": "json_valid"}]
TIMEOUT = 400      # seconds per process (two cores shared by three processes here)


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def tail(text: str, n: int = 2500) -> str:
  # XLA's fatal errors append C++ stack frames ("    @ 0x..."): keep the messages
  lines = [l for l in text.splitlines() if not l.lstrip().startswith("@ 0x")]
  return "\n".join(lines)[-n:]


def cache_env() -> dict:
  """The session's persistent compilation cache (tests/conftest.py) for a subprocess: process 0
  writes the programs it compiles (jax writes from process 0 only), so the resumed pair loads
  them instead of compiling again.  Nothing when the cache is off."""
  d = os.environ.get("PASK_TEST_CACHE_DIR")
  if not d or d == "off":
    return {}
  return {"JAX_COMPILATION_CACHE_DIR": d, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
          "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1"}


def launch(args, devices: int):
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
             XLA_FLAGS=xla_flags(f"--xla_force_host_platform_device_count={devices}"),
             JAX_DISABLE_MOST_OPTIMIZATIONS="1",   # compiles dominate; results are the same
             **cache_env())
  env.pop("JAX_COORDINATOR_ADDRESS", None)
  return subprocess.Popen([sys.executable, "-c", DRIVER] + args, cwd=ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(procs: dict) -> dict:
  """Wait for every process (one deadline for all); on a timeout kill them all.  -> name ->
  (returncode or None when killed, stdout, stderr)."""
  end = time.monotonic() + TIMEOUT
  out = {}
  for name, p in procs.items():
    try:
      so, se = p.communicate(timeout=max(1.0, end - time.monotonic()))
      out[name] = (p.returncode, so, se)
    except subprocess.TimeoutExpired:
      for q in procs.values():
        if q.poll() is None:
          q.kill()
      so, se = p.communicate()
      out[name] = (None, so, se)
  return out


def report(results: dict) -> str:
  return "\n".join(f"--- {name}: exit {rc} (None: killed after {TIMEOUT} s)\nstdout:\n"
                   f"{tail(so, 800)}\nstderr:\n{tail(se)}" for name, (rc, so, se) in
                   results.items())


def one_process(argv, monkeypatch, capsys) -> tuple:
  """The DRIVER's run in this process (one CPU device): the same CLI, model and tokenizer, at
  the same optimization level (the test's fast_compile mark: JAX_DISABLE_MOST_OPTIMIZATIONS
  as the subprocesses).  -> (exit status, stdout, stderr), as ``finish`` gives."""
  from models.loaders import Loaded
  from pask_jax import cli, platform
  from pask_jax.testing import smollm2_tokenizer, tiny_llama
  tok = smollm2_tokenizer()

  def load(*a, **k):
    m = tiny_llama(tok.vocab_size)
    return Loaded(m.cfg, m, tok)
  monkeypatch.setattr(platform, "load_model", load)
  monkeypatch.delenv("JAX_COORDINATOR_ADDRESS", raising=False)
  capsys.readouterr()
  rc = cli.main(["calibrate", "--task", "jsonl", "--rows", "4", "--max-tokens", "6"] + argv)
  so, se = capsys.readouterr()
  return rc, so, se


# The one-process reference runs in this process (no second JAX start-up, model build and
# tokenizer load), at the subprocesses' optimization level; the pair are subprocesses.
@pytest.mark.fast_compile
def test_two_processes_select_the_one_process_policy(tmp_path, monkeypatch, capsys):
  import jax
  from pask_jax import policy as P
  assert len(jax.devices()) == 1     # the reference is a one-device run
  data = tmp_path / "t.jsonl"
  data.write_text("".join(json.dumps(c) + "\n" for c in CASES))
  port = free_port()
  join = ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--join-timeout", "120"]
  t0 = time.monotonic()
  procs = {   # the pair starts first: the one-process reference runs while they join and run
      "process 0": launch(["--data", str(data), "--out", str(tmp_path / "p0")] + join +
                          ["--process-id", "0"], 2),
      "process 1": launch(["--data", str(data), "--out", str(tmp_path / "p1")] + join +
                          ["--process-id", "1"], 2)}
  try:
    ref = {"one process": one_process(["--data", str(data), "--out", str(tmp_path / "one")],
                                      monkeypatch, capsys)}
  except BaseException:
    for p in procs.values():
      p.kill()
      p.communicate()
    raise
  pair = finish(procs)
  assert all(rc == 0 for rc, _, _ in pair.values()), report(pair)
  first = json.load(open(tmp_path / "p0" / "calibration.json"))
  # The same command again resumes from process 0's saved stages, handed to process 1 (which has
  # none): no generation on either.
  join[1] = f"127.0.0.1:{free_port()}"
  again = {f"{k} (resumed)": launch(["--data", str(data), "--out", str(tmp_path / f"p{i}")] +
                                    join + ["--process-id", str(i)], 2)
           for i, k in enumerate(("process 0", "process 1"))}
  res = {**pair, **ref, **finish(again)}
  wall = time.monotonic() - t0
  assert all(rc == 0 for rc, _, _ in res.values()), report(res)
  said = {k: so for k, (_, so, _) in res.items()}
  assert "cpu x4 over 2 processes (this is process 0)" in said["process 0"], report(res)
  assert "cpu x4 over 2 processes (this is process 1)" in said["process 1"], report(res)
  assert "cpu x1" in said["one process"], report(res)
  assert "this process 1 selected the same, checked" in said["process 1"], report(res)
  # Process 0 alone writes (process 1 was given its own --out: untouched).
  assert not (tmp_path / "p1").exists()
  two, one = tmp_path / "p0", tmp_path / "one"
  a, b = P.load(str(two / "policy")), P.load(str(one / "policy"))
  for k in ("action", "floor", "prio", "crit", "reserve", "pooled", "b_d", "b_p"):
    np.testing.assert_array_equal(np.asarray(getattr(a, k)), np.asarray(getattr(b, k)), k)
  assert a.record == b.record
  # The whole record but the clocks: every Runtime-V / Runtime-D value, candidate and pick.
  ra, rb = (json.load(open(d / "calibration.json")) for d in (two, one))
  assert ra.pop("processes") == 2 and "processes" not in rb
  clocks = ("timings_s", "generate_host_s", "wall_s")
  assert {k: v for k, v in ra.items() if k not in clocks} == \
      {k: v for k, v in rb.items() if k not in clocks}
  assert ra["V"] and ra["D"]
  # Resumed: nothing generated (no progress bar), the same selection.
  for k in ("process 0 (resumed)", "process 1 (resumed)"):
    assert "Runtime-V" not in res[k][2] and "reference (cal)" not in res[k][2], report(res)
  assert "this process 1 selected the same, checked" in res["process 1 (resumed)"][1]
  assert not (tmp_path / "p1").exists()
  resumed = json.load(open(two / "calibration.json"))
  assert {k: v for k, v in resumed.items() if k not in clocks} == \
      {k: v for k, v in first.items() if k not in clocks}
  print(f"two joined processes, then resumed, beside one alone: {wall:.0f} s")


# The helpers of calibrate.distributed in two processes, without a model: global arrays from
# host values, gathers, process 0's bytes to all, errors handed on, digests compared.
HELPERS = r"""
import sys
import numpy as np
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from calibrate import distributed as D
pid, port = int(sys.argv[1]), sys.argv[2]
D.initialize(D.Launch(f"127.0.0.1:{port}", 2, pid), timeout=60)
assert (jax.process_count(), jax.process_index(), len(jax.devices())) == (2, pid, 4)
assert D.is_main() == (pid == 0)
mesh = Mesh(np.asarray(jax.devices()), ("rows",))
x = np.arange(12, dtype=np.int32).reshape(4, 3)
g = D.to_global(x, NamedSharding(mesh, P("rows")))
assert not g.is_fully_addressable and [s.data.shape for s in g.addressable_shards] == [(1, 3)] * 2
assert D.to_global(g, NamedSharding(mesh, P())) is g              # already global: as is
f = jax.jit(jax.shard_map(lambda a: a + jax.lax.psum(a.sum(), "rows"), mesh=mesh,
                          in_specs=P("rows"), out_specs=P("rows")))
np.testing.assert_array_equal(D.fetch(f(g)), x + x.sum())          # a collective across both
assert D.broadcast_bytes(b"stage bytes" if pid == 0 else None) == b"stage bytes"
assert D.broadcast_bytes(None) is None and D.broadcast_bytes(b"" if pid == 0 else b"x") == b""
assert D.from_main(lambda: b"\x00\xff" * 3) == b"\x00\xff" * 3
assert D.from_main(lambda: None) is None
def boom():
  raise ValueError("no such stage")
try:
  D.from_main(boom)
except (ValueError, D.DistributedError) as e:
  assert type(e) is (ValueError if pid == 0 else D.DistributedError), type(e)
  assert str(e) == ("no such stage" if pid == 0 else "process 0: no such stage"), str(e)
else:
  raise AssertionError("from_main did not raise")
D.check_same("the same", {"a": np.arange(5), "b": np.float32(1.5)})
try:
  D.check_same("the seed", np.int64(pid))
except D.DistributedError as e:
  assert str(e).startswith("the seed differs between process 0 and process(es) [1]"), str(e)
else:
  raise AssertionError("check_same did not raise")
print("HELPERS-OK", pid)
"""


def test_distributed_helpers_in_two_processes():
  port = free_port()
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=xla_flags("--xla_force_host_platform_device_count=2"))
  procs = {f"process {i}": subprocess.Popen([sys.executable, "-c", HELPERS, str(i), str(port)],
                                            cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                            stderr=subprocess.PIPE, text=True) for i in (0, 1)}
  res = finish(procs)
  assert all(rc == 0 for rc, _, _ in res.values()), report(res)
  for i in (0, 1):
    assert f"HELPERS-OK {i}" in res[f"process {i}"][1], report(res)


@pytest.mark.parametrize("argv, msg", [
    (["--num-processes", "2", "--process-id", "2", "--coordinator", "127.0.0.1:1234"],
     "error: --process-id 2 out of range for --num-processes 2 (0 .. 1)"),
    (["--num-processes", "2", "--coordinator", "127.0.0.1:1234"],
     "error: calibration across processes needs --process-id I"),
    (["--num-processes", "2", "--process-id", "0"],
     "error: calibration across processes needs --coordinator HOST:PORT"),
    (["--num-processes", "2", "--process-id", "0", "--coordinator", "localhost"],
     "error: --coordinator 'localhost': expected HOST:PORT"),
    (["--num-processes", "0", "--process-id", "0", "--coordinator", "127.0.0.1:1234"],
     "error: --num-processes 0: must be at least 1"),
    (["--join-timeout", "0"], "error: --join-timeout must be at least 1 second"),
])
def test_bad_launch_arguments_are_one_line_errors_before_loading(tmp_path, monkeypatch, argv,
                                                                 msg):
  from pask_jax import cli, platform
  monkeypatch.delenv("JAX_COORDINATOR_ADDRESS", raising=False)
  monkeypatch.setattr(platform, "load_model",
                      lambda *a, **k: pytest.fail("model loaded before the check"))
  with pytest.raises(SystemExit) as e:
    cli.main(["calibrate", "--out", str(tmp_path / "o")] + argv)
  assert str(e.value.code).startswith(msg) and "\n" not in str(e.value.code), e.value.code


def test_coordinator_from_the_environment(monkeypatch):
  from calibrate import distributed
  env = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:7777"}
  assert distributed.parse(None, 2, 1, env) == distributed.Launch("10.0.0.1:7777", 2, 1)
  assert distributed.parse(None, None, None, env) is None      # the variable alone: one process
  assert distributed.parse(None, None, None, {}) is None


def test_unreachable_coordinator_is_a_one_line_error_within_the_timeout(tmp_path, monkeypatch):
  from pask_jax import cli, platform
  monkeypatch.setattr(platform, "load_model",
                      lambda *a, **k: pytest.fail("model loaded before joining"))
  data = tmp_path / "t.jsonl"
  data.write_text("".join(json.dumps(c) + "\n" for c in CASES))
  port = free_port()     # nobody listens there
  t0 = time.monotonic()
  with pytest.raises(SystemExit) as e:
    cli.main(["calibrate", "--task", "jsonl", "--data", str(data), "--out", str(tmp_path / "o"),
              "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", "1",
              "--join-timeout", "2"])
  assert time.monotonic() - t0 < 30
  msg = str(e.value.code)
  assert msg.startswith(f"error: coordinator 127.0.0.1:{port} unreachable within 2 s") and \
      "\n" not in msg, msg


def test_a_process_left_alone_exits_in_one_line_at_the_join_timeout(tmp_path):
  """Process 0 of two, the other never started: one line and status 1 at --join-timeout (XLA
  would abort the process with a stack dump)."""
  data = tmp_path / "t.jsonl"
  data.write_text("".join(json.dumps(c) + "\n" for c in CASES))
  port = free_port()
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("JAX_COORDINATOR_ADDRESS", None)
  t0 = time.monotonic()
  r = subprocess.run([sys.executable, "-m", "pask_jax.cli", "calibrate", "--task", "jsonl",
                      "--data", str(data), "--out", str(tmp_path / "o"), "--coordinator",
                      f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", "0",
                      "--join-timeout", "3"], cwd=ROOT, env=env, capture_output=True, text=True,
                     timeout=120)
  assert r.returncode == 1, tail(r.stderr)
  line = (f"error: not all 2 processes joined 127.0.0.1:{port} within 3 s (this is process 0; "
          "is every process started with the same --coordinator and --num-processes?)")
  assert r.stderr.rstrip().endswith(line), tail(r.stderr)
  assert "Check failure" not in r.stderr and not (tmp_path / "o").exists()
  assert time.monotonic() - t0 < 90
