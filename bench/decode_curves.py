"""Dev accuracy of every decode candidate of one or more calibrations, at matched decode budgets.

Alg. 1 measures each decode candidate of the Runtime-D greedy path on the development split with
an all-high prefill (``calibration.json``'s ``decode_candidates``: measured decode B as ``cost``,
dev accuracy); the ablations of the paper's Fig. 5 are compared here at the same decode budget,
each method's best candidate whose measured decode B is at most the budget (its own selection
rule), with the binomial standard error of the reference. No model runs.

  python bench/decode_curves.py --budgets 0.03 0.06 0.10 0.15 0.20 0.27 \\
      full=policies/qwen2.5-coder-1.5b-instruct-bfcl \\
      no-state=policies/qwen2.5-coder-1.5b-instruct-bfcl-ablations/no-state
"""
from __future__ import annotations

import argparse
import json
import math
import os


def curve(path: str) -> dict:
  with open(os.path.join(path, "calibration.json")) as f:
    cal = json.load(f)
  pts = sorted((c["dev"]["cost"], c["dev"]["acc"]) for c in cal["decode_candidates"])
  return {"points": pts, "n_dev": cal.get("n_dev"), "reference": cal["dev_reference_accuracy"],
          "window": cal["decode_candidates"][0].get("window"), "ablation": cal.get("ablation")}


def at_budget(points, budget: float):
  fits = [acc for cost, acc in points if cost <= budget + 1e-9]
  return max(fits) if fits else None


def table(curves: dict, budgets) -> str:
  head = "| calibration | W | candidates | min decode B | " + " | ".join(
      f"B_D ≤ {b:.2f}" for b in budgets) + " | all-high |"
  rows = [head, "|" + "---|" * (5 + len(budgets))]
  for name, c in curves.items():
    cells = [at_budget(c["points"], b) for b in budgets]
    rows.append(f"| {name} | {c['window']} | {len(c['points'])} | {c['points'][0][0]:.3f} | "
                + " | ".join("–" if a is None else f"{100 * a:.1f}" for a in cells)
                + f" | {100 * c['reference']:.1f} |")
  n = next(iter(curves.values()))["n_dev"]
  ref = next(iter(curves.values()))["reference"]
  if n:
    rows.append(f"\nn = {n} development cases per cell; one binomial s.e. at the reference: "
                f"{100 * math.sqrt(ref * (1 - ref) / n):.1f} pp ({100 / n:.2f} pp per case).")
  return "\n".join(rows)


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("calibrations", nargs="+", metavar="NAME=DIR",
                  help="a label and a calibration's policy directory (with calibration.json)")
  ap.add_argument("--budgets", type=float, nargs="+", default=[0.03, 0.06, 0.10, 0.15, 0.20, 0.27])
  ap.add_argument("--out", default=None, help="also write the table (markdown) here")
  a = ap.parse_args(argv)
  curves = {}
  for item in a.calibrations:
    name, sep, path = item.partition("=")
    if not sep or not path:
      raise SystemExit(f"error: expected NAME=DIR, got {item!r}")
    if not os.path.exists(os.path.join(path, "calibration.json")):
      raise SystemExit(f"error: no calibration.json in {path}")
    curves[name] = curve(path)
  text = table(curves, a.budgets)
  print(text)
  if a.out:
    with open(a.out, "w") as f:
      f.write(text + "\n")


if __name__ == "__main__":
  main()
