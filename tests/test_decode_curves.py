"""bench/decode_curves.py: ablations compared at matched decode budgets from calibration.json."""
import json

import pytest

from bench import decode_curves


def _cal(tmp_path, name, points, ref=0.8):
  d = tmp_path / name
  d.mkdir()
  cands = [{"dev": {"cost": c, "acc": a}, "window": 16} for c, a in points]
  (d / "calibration.json").write_text(json.dumps(
      {"decode_candidates": cands, "dev_reference_accuracy": ref, "n_dev": 100}))
  return str(d)


def test_best_candidate_within_each_budget(tmp_path, capsys):
  a = _cal(tmp_path, "a", [(0.0, 0.5), (0.1, 0.7), (0.3, 0.6), (1.0, 0.8)])
  b = _cal(tmp_path, "b", [(0.2, 0.75), (1.0, 0.8)])
  out = tmp_path / "t.md"
  decode_curves.main([f"full={a}", f"no-x={b}", "--budgets", "0.05", "0.1", "0.25",
                      "--out", str(out)])
  text = out.read_text()
  assert "| full | 16 | 4 | 0.000 | 50.0 | 70.0 | 70.0 | 80.0 |" in text
  assert "| no-x | 16 | 2 | 0.200 | – | – | 75.0 | 80.0 |" in text
  assert "n = 100 development cases" in text and text.strip() in capsys.readouterr().out


def test_bad_arguments_are_one_line_errors(tmp_path):
  with pytest.raises(SystemExit, match="^error: expected NAME=DIR"):
    decode_curves.main([str(tmp_path)])
  with pytest.raises(SystemExit, match="^error: no calibration.json in"):
    decode_curves.main([f"x={tmp_path}"])
