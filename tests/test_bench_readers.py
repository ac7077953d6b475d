"""Readers of committed results (no model, no device): bench/decode_curves.py (ablations at matched
decode budgets from calibration.json), bench/paired_cells.py, bench/sass_opcodes.py."""
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


def _cells(root, name, policy, outcomes):
  d = root / name
  d.mkdir(parents=True)
  (d / "cell.json").write_text(json.dumps({"policy": policy, "method": "pask", "budget": 0.2,
                                          "material": {"settings": {"policy": {
                                              "content": "abcdef0123"}}},
                                          "n": len(outcomes), "measured_B": {
                                              "total_B": 0.2, "prefill_B": 0.19,
                                              "decode_B": 0.1 + 0.01 * len(outcomes)}}))
  (d / "cases.jsonl").write_text("".join(json.dumps({"id": i, "passed": p}) + "\n"
                                         for i, p in outcomes.items()))


def test_paired_cells_compare_on_shared_cases_only(tmp_path):
  from bench import paired_cells
  _cells(tmp_path / "ref", "a", "full", {"x": True, "y": True, "z": False, "w": True})
  _cells(tmp_path / "abl", "b", "no-x", {"x": False, "y": True, "z": True, "v": False})
  out = tmp_path / "t.md"
  paired_cells.main([str(tmp_path / "abl"), "--reference", str(tmp_path / "ref"),
                     "--reference-policy", "full#abcdef01", "--out", str(out)])
  text = out.read_text()
  assert ("| `no-x#abcdef01` | 3 | 66.67 | 66.67 | +0.00 pp | 1 | 1 | 1.000 | "
          "0.200 / 0.190 / 0.140 |") in text
  assert "(measured B total / prefill / decode 0.200 / 0.190 / 0.140)" in text
  # two cells of one policy: their B weighted by their cases
  _cells(tmp_path / "abl", "c", "no-x", {"a": True, "b": True, "c": True, "d": True, "e": True,
                                         "f": True})
  got = paired_cells.budgets(str(tmp_path / "abl"))["no-x#abcdef01"]
  assert abs(got["decode"] - (4 * 0.14 + 6 * 0.16) / 10) < 1e-12 and abs(got["total"] - 0.2) < 1e-12
  assert paired_cells.mcnemar(0, 10) < 0.002 and paired_cells.mcnemar(3, 3) == 1.0
  with pytest.raises(SystemExit, match="^error: no cells of 'other'"):
    paired_cells.main([str(tmp_path / "abl"), "--reference", str(tmp_path / "ref"),
                       "--reference-policy", "other"])


def test_sass_opcodes_counts_by_opcode_without_predicates(tmp_path):
  from bench import sass_opcodes
  p = tmp_path / "s.csv"
  p.write_text('"Kernel Name","k",\n'
               '"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed"\n'
               '"0x1","      LDS.S8 R1, [R2]","3","40"\n'
               '"0x2","      @P0 LDS.S8 R3, [R2+0x4]","1","24"\n'
               '"0x3","      @!UP1 HADD2.BF16_V2 R4, R4, R5","0","16"\n')
  execs, stalls = sass_opcodes.opcode_counts(str(p))
  assert execs == {"LDS.S8": 64, "HADD2.BF16_V2": 16} and stalls["LDS.S8"] == 4
  text = sass_opcodes.table(execs, stalls, per=8, top=5)
  assert "80 warp-instructions executed, 10.00 per unit" in text
  assert "| LDS.S8 | 64 | 8.00 | 100.0% |" in text
