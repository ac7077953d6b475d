"""bench/bench_tp.py (issue 29) end to end at its tiny configuration on 4 CPU devices, in a
subprocess (the device-count flag must be set before JAX starts): serving rows at TP 1, 2 and 4
with the greedy tokens of every TP equal to TP 1's, the scaling efficiency, the capacity rows and
the stacked calibration step sharded over 1, 2 and 4 devices.  (``full`` is left out to keep the
run short: it is the ``pask`` engine under the all-high policy.)"""
import json
import os
import subprocess
import sys

import pytest

from pask_jax.testing import xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.fast_compile   # the subprocess inherits the level (tests/conftest.py)
def test_tiny_tp_run_on_four_cpu_devices(tmp_path):
  import jax

  from models import registry
  fast = jax.config.values["jax_disable_most_optimizations"]
  env = dict(os.environ, XLA_FLAGS=xla_flags("--xla_force_host_platform_device_count=4"),
             JAX_PLATFORMS="cpu", JAX_DISABLE_MOST_OPTIMIZATIONS=str(int(fast)))
  for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
    env.pop(k, None)
  out = tmp_path / "tp"
  r = subprocess.run(
      [sys.executable, "bench/bench_tp.py", "--shape", "tiny", "--context", "256",
       "--max-tokens", "8", "--concurrency", "2", "--methods", "pask", "xla",
       "--calib-rows", "8", "--calib-requests", "2", "--calib-tokens", "8",
       "--tokenizer", registry.smollm2_path(), "--compile-cache", str(tmp_path / "xla"),
       "--out", str(out)], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  print(r.stdout[-2000:])
  rows = [json.loads(line) for line in open(out / "results.jsonl")]
  s = json.load(open(out / "summary.json"))
  assert s["tp"] == [1, 2, 4] and s["device_count"] == 4
  assert s["multicast_env"] == {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                                "NVSHMEM_DISABLE_NVLS": "1"}
  serving = {(x["method"], x["tp"]): x for x in rows if x["part"] == "serving"}
  assert set(serving) == {(m, n) for m in ("pask", "xla") for n in (1, 2, 4)}
  for x in serving.values():
    assert x["status"] == "ok" and x["completed"] == 2 and x["tokens_out"] == 16, x
    assert x["tpot_ms_median"] > 0 and x["throughput_tok_s"] > 0
    assert x["sizing"]["shards"] == x["tp"]
  for m in ("pask", "xla"):   # float32 on CPU devices: the same greedy tokens at every TP
    assert len({serving[m, n]["tokens_digest"] for n in (1, 2, 4)}) == 1
  assert 0.2 < serving["pask", 4]["measured_B"] < 0.45
  eff = {(x["method"], x["tp"]): x for x in s["serving"]}
  assert all(x["tokens_match_tp1"] is True and x["efficiency"] > 0 for x in eff.values())
  assert eff["pask", 1]["efficiency"] == 1.0
  # capacity: per-device budgets grow with N (the weights split), so the fit grows; PASK > full
  cap = {x["tp"]: x for x in s["capacity"]}
  assert set(cap) == {1, 2, 4} and all(x["status"] == "ok" for x in cap.values())
  fits = [cap[n]["max_concurrency"] for n in (1, 2, 4)]
  assert all(f["pask"] > f["full"] > 0 for f in fits) and cap[1]["pask_over_full"] > 1
  assert fits[0]["pask"] < fits[1]["pask"] < fits[2]["pask"]
  cal = {x["devices"]: x for x in s["calib"]}
  assert set(cal) == {1, 2, 4}
  assert all(x["rows"] == 8 and x["rows_per_s"] > 0 and x["tokens_match_1"] for x in cal.values())
  assert cal[1]["efficiency"] == 1.0
  assert "## serving" in open(out / "summary.md").read()
