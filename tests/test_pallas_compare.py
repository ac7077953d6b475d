"""compare-kernels end to end on one tiny shape and one TPU generation (CPU: interpret + AOT)."""
import csv
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

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
