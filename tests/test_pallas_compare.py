"""compare-kernels end to end on one tiny shape and one TPU generation (CPU: interpret + AOT)."""
import csv
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from pallas_kernels import compare  # noqa: E402


def test_compare_kernels_writes_table_csv_and_png(tmp_path, capsys):
  rc = compare.main(["--shapes", "1:4:2:64:160", "--out", str(tmp_path), "--tpu-gens", "v5e"])
  assert rc == 0
  rows = list(csv.DictReader(open(tmp_path / "compare_kernels.csv")))
  assert [r["backend"] for r in rows] == ["gpu (pallas triton)", "tpu v5e (pallas mosaic)"]
  for r in rows:
    assert r["compiled"] == "True" and 0 < float(r["rel_err"]) < 1e-2
  assert "regs=" in rows[0]["resources"] and "temp" in rows[1]["resources"]
  assert float(rows[1]["estimate_us"]) > 0
  assert (tmp_path / "compare_kernels.png").stat().st_size > 1000
  assert "roofline estimate" in capsys.readouterr().out
