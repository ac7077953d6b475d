"""compare-kernels end to end on one tiny shape and one TPU generation (CPU: interpret + AOT)."""
import csv
import dataclasses
import os
import subprocess
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest

from pallas_kernels import compare


def test_compare_kernels_writes_table_csv_and_png(tmp_path, capsys):
  rc = compare.main(["--shapes", "1:4:2:64:160", "--out", str(tmp_path), "--tpu-gens", "v5e"])
  assert rc == 0
  rows = list(csv.DictReader(open(tmp_path / "compare_kernels.csv")))
  assert [r["backend"] for r in rows] == ["gpu (pallas triton)", "tpu v5e (pallas mosaic)"]
  for r in rows:
    assert r["compiled"] == "True" and 0 < float(r["rel_err"]) < 1e-2
    # on this CPU host: measured interpret-mode and XLA-reference wall times, no native time
    assert r["host"].startswith("cpu") and r["time_us"] == ""
    assert float(r["interp_us"]) > 0 and float(r["host_ref_us"]) > 0
  assert "regs=" in rows[0]["resources"] and "temp" in rows[1]["resources"]
  assert float(rows[1]["estimate_us"]) > 0
  assert (tmp_path / "compare_kernels.png").stat().st_size > 1000
  assert "roofline estimate" in capsys.readouterr().out      # the estimate: table and CSV only


def test_picture_shows_what_this_host_measured():
  base = {"shape": "s", "host": "cpu (cpu)", "host_ref_us": 50.0, "kv_bytes": 1}
  rows = [dict(base, backend="gpu (pallas triton)", interp_us=900.0),
          dict(base, backend="tpu v5e (pallas mosaic)", interp_us=700.0, estimate_us=0.01),
          dict(base, backend="tpu v6e (pallas mosaic)", interp_us=700.0, estimate_us=0.005)]
  import tempfile
  with tempfile.TemporaryDirectory() as d:
    series = compare.plot(rows, os.path.join(d, "p.png"))
  assert series == {"gpu kernel (pallas triton), Pallas interpret mode on cpu (cpu)": [900.0],
                    "jnp reference (XLA) on cpu (cpu)": [50.0],
                    "tpu kernel (pallas mosaic), Pallas interpret mode on cpu (cpu)": [700.0]}
  # on an accelerator host the native measurement is drawn, still no estimates
  gpu = [dict(base, host="gpu (NVIDIA H200)", backend="gpu (pallas triton)", time_us=300.0),
         dict(base, host="gpu (NVIDIA H200)", backend="tpu v5e (pallas mosaic)",
              interp_us=9000.0, estimate_us=200.0)]
  with tempfile.TemporaryDirectory() as d:
    series = compare.plot(gpu, os.path.join(d, "p.png"))
  assert "gpu kernel (pallas triton), native on gpu (NVIDIA H200)" in series
  assert not any("estimate" in k for k in series)


def test_cpu_host_says_what_it_can_and_cannot_compare(tmp_path, capsys, monkeypatch):
  """ptxas spills are a column, not a failure; the output states what a CPU host compares."""
  from pallas_kernels.gpu import aot as gpu_aot
  real = gpu_aot.report

  def spilling(*a, **k):   # the Qwen 0.5B head shape spilled 8 bytes on sm_90a
    return [dataclasses.replace(r, spill_stores=4, spill_loads=4) for r in real(*a, **k)]

  monkeypatch.setattr(gpu_aot, "report", spilling)
  rc = compare.main(["--shapes", "1:14:2:64:96", "--out", str(tmp_path), "--tpu-gens", "v5e"])
  out = capsys.readouterr().out
  assert rc == 0 and "FAILED" not in out
  gpu = next(csv.DictReader(open(tmp_path / "compare_kernels.csv")))
  assert gpu["compiled"] == "True" and int(gpu["spills"]) == 8 * len(gpu["resources"].split(";"))
  assert f"compiled yes spills {gpu['spills']}B" in out   # 8 bytes per compiled kernel
  assert compare.CPU_HOST_NOTE in out and "cannot compare kernel speeds" in out


def test_a_kernel_over_the_register_limit_does_not_compile():
  from pallas_kernels.gpu import aot as gpu_aot
  ok = gpu_aot.GpuReport("k", smem_bytes=1024, registers=80, spill_stores=8, spill_loads=8)
  assert compare.fits(ok)
  assert not compare.fits(dataclasses.replace(ok, registers=gpu_aot.SM90_MAX_REGS + 1))
  assert not compare.fits(dataclasses.replace(ok, smem_bytes=gpu_aot.SM90_MAX_SMEM + 1))
  assert not compare.fits(dataclasses.replace(ok, registers=None))    # ptxas gave no report


def test_bad_arguments_are_one_line_errors(tmp_path):
  for argv, msg in ((["--tpu-gens", "v7"], "unknown TPU generation v7 in --tpu-gens; known: "
                                           "v5e, v6e, tpu7x"),
                    (["--tpu-gens", "v5e,v4"], "unknown TPU generation v4"),
                    (["--tpu-gens", ","], "known: v5e"),
                    (["--shapes", "1:14:2:64"], "bad shape '1:14:2:64': want B:Hq:Hkv:D:CTX"),
                    (["--shapes", "1:14:4:64:96"], "Hq must be a multiple of Hkv"),
                    (["--shapes", "0:14:2:64:96"], "must be positive")):
    with pytest.raises(SystemExit) as e:
      compare.main(argv + ["--out", str(tmp_path)])
    assert msg in str(e.value.code) and "\n" not in str(e.value.code)
  assert not os.listdir(tmp_path)                      # refused before any work
  with pytest.raises(ValueError, match="unknown TPU generation v7; known"):
    compare.run([(1, 4, 2, 64, 96)], str(tmp_path), gens=["v7"])


def test_libtpu_is_quiet_on_a_host_without_a_tpu(monkeypatch):
  # libtpu reads its topology from the environment when the AOT compile first loads it, so the
  # check runs in a fresh process
  env = {k: v for k, v in os.environ.items() if not k.startswith("TPU_")}
  code = ("from pallas_kernels import compare; assert compare.quiet_libtpu(); "
          "from pallas_kernels.tpu import aot; print(aot.device('v6e').device_kind)")
  p = subprocess.run([sys.executable, "-c", code], env=dict(env, JAX_PLATFORMS="cpu"),
                     capture_output=True, text=True, timeout=300)
  assert p.returncode == 0 and "v6" in p.stdout, p.stderr
  assert "TPU_ACCELERATOR_TYPE" not in p.stderr and "worker hostname" not in p.stderr, p.stderr
  import glob
  monkeypatch.setattr(glob, "glob", lambda pat: ["/dev/accel0"] if "accel" in pat else [])
  for k in ("TPU_HOST_BOUNDS", "TPU_WORKER_HOSTNAMES", "TPU_WORKER_ID"):
    monkeypatch.delenv(k, raising=False)
  assert not compare.quiet_libtpu() and "TPU_HOST_BOUNDS" not in os.environ   # a TPU host


def test_an_install_without_the_aot_compilers_checks_numerics_and_exits_0(tmp_path, capsys,
                                                                          monkeypatch):
  """The default CPU install (no `aot` extra: no ptxas, no libtpu): compile rows are "not
  checked" (named, with the install command), not failures; numerics are still compared."""
  import importlib.util

  from pallas_kernels.gpu import aot as gpu_aot
  from pallas_kernels.tpu import aot as tpu_aot

  def no_ptxas():
    raise FileNotFoundError("no ptxas")

  real_spec = importlib.util.find_spec
  monkeypatch.setattr(gpu_aot, "find_ptxas", no_ptxas)
  monkeypatch.setattr(importlib.util, "find_spec",
                      lambda name, *a: None if name == "libtpu" else real_spec(name, *a))
  missing = compare.missing_toolchains()
  assert set(missing) == {"gpu", "tpu"} and "libtpu is not installed" in missing["tpu"]
  assert all("bash scripts/setup.sh --aot" in v for v in missing.values())
  monkeypatch.setattr(gpu_aot, "report", lambda *a, **k: pytest.fail("compiled without ptxas"))
  monkeypatch.setattr(tpu_aot, "compile_for",
                      lambda *a, **k: pytest.fail("compiled without libtpu"))
  rc = compare.main(["--shapes", "1:4:2:64:160", "--out", str(tmp_path), "--tpu-gens", "v6e"])
  out = capsys.readouterr().out
  assert rc == 0 and "FAILED" not in out, out
  assert "not checked: the gpu and tpu compile" in out and "compiled n/a" in out
  rows = list(csv.DictReader(open(tmp_path / "compare_kernels.csv")))
  assert [r["backend"] for r in rows] == ["gpu (pallas triton)", "tpu v6e (pallas mosaic)"]
  for r in rows:
    assert r["compiled"] == "" and r["resources"].startswith("compile not checked")
    assert 0 < float(r["rel_err"]) < 1e-2


def test_a_ptxas_without_jax_cuda_plugin_is_not_checked_not_failed(monkeypatch):
  """A CPU install beside a system CUDA toolkit: ptxas is on PATH but jax's CUDA plugin (which
  carries Triton's compiler) is not installed.  The GPU compile is "not checked" with the install
  command, not a "compiled NO" that fails compare-kernels (seen on a fresh clone of this repo)."""
  import importlib.util

  from pallas_kernels.gpu import aot as gpu_aot
  real_spec = importlib.util.find_spec
  monkeypatch.setattr(gpu_aot, "find_ptxas", lambda: "/usr/local/bin/ptxas")
  monkeypatch.setattr(importlib.util, "find_spec",
                      lambda name, *a: None if name in compare.CUDA_PLUGINS
                      else real_spec(name, *a))
  missing = compare.missing_toolchains()
  assert "CUDA plugin" in missing["gpu"] and "bash scripts/setup.sh --aot" in missing["gpu"]
