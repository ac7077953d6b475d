"""bench/profile_step.py reads a trace into per-class device time and host launch calls."""
import gzip
import json

from bench import profile_step


def write_trace(tmp_path):
  ev = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/host:CPU"}}]
  for step in range(2):
    t = step * 1000.0
    ev += [{"ph": "X", "pid": 1, "name": "gemm_fusion", "ts": t, "dur": 100.0, "args": {}},
           {"ph": "X", "pid": 1, "name": "pask_decode_attention", "ts": t + 100, "dur": 50.0,
            "args": {}},
           {"ph": "X", "pid": 2, "name": "cuLaunchKernel", "ts": t, "dur": 4.0},
           {"ph": "X", "pid": 2, "name": "cuLaunchKernel", "ts": t + 5, "dur": 6.0},
           {"ph": "X", "pid": 2, "name": "cuGraphLaunch", "ts": t + 20, "dur": 12.0},
           {"ph": "X", "pid": 2, "name": "python_function", "ts": t, "dur": 500.0}]
  d = tmp_path / "plugins" / "profile" / "run"
  d.mkdir(parents=True)
  with gzip.open(d / "host.perfetto_trace.json.gz", "wt") as f:
    json.dump({"traceEvents": ev}, f)
  return str(tmp_path)


def test_table_per_step(tmp_path):
  t = profile_step.table(write_trace(tmp_path), n_steps=2, wall_s=400e-6)
  assert t["attention"] == 50.0
  assert t["device busy"] == 150.0
  assert t["host gap"] == 250.0
  calls = {name: (c, us) for name, c, us in t["_host_calls"]}
  assert calls == {"cuLaunchKernel": (2.0, 10.0), "cuGraphLaunch": (1.0, 12.0)}
  assert "host calls per step" in profile_step.format_table("x", t)
