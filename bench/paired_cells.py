"""Paired comparison of campaign cells: each policy of one results folder against a reference
policy on the very cases both ran (discordant pairs and an exact McNemar p), so a partial run of
an ablation plan is compared with the full method on the same cases instead of on n alone.

  python bench/paired_cells.py results/campaign/qwen15-bfcl-ablations \\
      --reference results/campaign/qwen15-bfcl \\
      --reference-policy policies/qwen2.5-coder-1.5b-instruct-bfcl/B0.20
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os


def outcomes(folder: str) -> dict[str, dict[str, bool]]:
  """``{name: {case id: passed}}`` over a campaign results folder, the name a cell's policy
  directory and the first 8 hex digits of its content digest (cells of an older policy saved at
  the same path stay apart), or ``method@budget`` for a method without a policy."""
  out: dict[str, dict[str, bool]] = {}
  for path in sorted(glob.glob(os.path.join(folder, "*", "cell.json"))):
    with open(path) as f:
      cell = json.load(f)
    pol = ((cell.get("material") or {}).get("settings") or {}).get("policy") or {}
    name = (f"{cell['policy']}#{pol.get('content', '?')[:8]}" if cell.get("policy")
            else f"{cell['method']}@{cell['budget']}")
    with open(os.path.join(os.path.dirname(path), "cases.jsonl")) as f:
      for line in f:
        row = json.loads(line)
        out.setdefault(name, {})[row["id"]] = bool(row["passed"])
  return out


def budgets(folder: str) -> dict[str, dict[str, float]]:
  """``{name: {"total", "prefill", "decode"}}``: each policy's measured B over all its cells in
  ``folder`` (named as :func:`outcomes` names them), the cells' ratios averaged with their case
  counts as weights.  A comparison of retention policies is only as fair as their budgets are
  equal, the decode one included (a variant that spends less decode B loses accuracy for that
  alone), so the table shows them beside the accuracies."""
  sums: dict[str, dict[str, float]] = {}
  for path in sorted(glob.glob(os.path.join(folder, "*", "cell.json"))):
    with open(path) as f:
      cell = json.load(f)
    b, n = cell.get("measured_B"), cell.get("n")
    if not isinstance(b, dict) or not n:
      continue
    pol = ((cell.get("material") or {}).get("settings") or {}).get("policy") or {}
    name = (f"{cell['policy']}#{pol.get('content', '?')[:8]}" if cell.get("policy")
            else f"{cell['method']}@{cell['budget']}")
    acc = sums.setdefault(name, {"n": 0.0, "total": 0.0, "prefill": 0.0, "decode": 0.0})
    acc["n"] += n
    for k in ("total", "prefill", "decode"):
      acc[k] += n * float(b.get(f"{k}_B", float("nan")))
  return {k: {x: v[x] / v["n"] for x in ("total", "prefill", "decode")} for k, v in sums.items()}


def _b(b: dict | None) -> str:
  return "–" if not b else f"{b['total']:.3f} / {b['prefill']:.3f} / {b['decode']:.3f}"


def mcnemar(b: int, c: int) -> float:
  """Exact two-sided McNemar p for ``b`` and ``c`` discordant pairs."""
  n = b + c
  if n == 0:
    return 1.0
  tail = sum(math.comb(n, i) for i in range(min(b, c) + 1)) / 2 ** n
  return min(1.0, 2 * tail)


def table(runs: dict, ref: dict[str, bool], ref_name: str, spent: dict | None = None,
          ref_spent: dict | None = None) -> str:
  """The paired table; ``spent``: :func:`budgets` of ``runs``, ``ref_spent`` the reference's
  (measured B total / prefill / decode over all of each policy's cells)."""
  spent = spent or {}
  rows = [f"Reference: `{ref_name}` (measured B total / prefill / decode {_b(ref_spent)}).", "",
          "| policy | n (shared cases) | accuracy | reference | difference | only this | "
          "only reference | McNemar p | measured B total / prefill / decode |",
          "|---|---|---|---|---|---|---|---|---|"]
  for name, res in sorted(runs.items()):
    ids = [i for i in res if i in ref]
    if not ids:
      continue
    a, r = sum(res[i] for i in ids), sum(ref[i] for i in ids)
    b = sum(res[i] and not ref[i] for i in ids)
    c = sum(ref[i] and not res[i] for i in ids)
    rows.append(f"| `{name}` | {len(ids)} | {100 * a / len(ids):.2f} | {100 * r / len(ids):.2f} | "
                f"{100 * (a - r) / len(ids):+.2f} pp | {b} | {c} | {mcnemar(b, c):.3f} | "
                f"{_b(spent.get(name))} |")
  return "\n".join(rows)


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("results", help="a campaign results folder (cells to compare)")
  ap.add_argument("--reference", required=True, help="the results folder of the reference cells")
  ap.add_argument("--reference-policy", required=True,
                  help="the reference cells' policy directory (its cells of the policy as it is "
                       "now, by content digest), or METHOD@BUDGET for a baseline")
  ap.add_argument("--out", default=None, help="also write the table (markdown) here")
  a = ap.parse_args(argv)
  refs = outcomes(a.reference)
  ref_name = a.reference_policy
  if os.path.isfile(os.path.join(ref_name, "policy.json")):
    from pask_jax import policy as P
    ref_name = f"{os.path.normpath(ref_name)}#{P.digest(ref_name)[:8]}"
  if ref_name not in refs:
    raise SystemExit(f"error: no cells of {ref_name!r} in {a.reference} "
                     f"(it has {len(refs)} policies or methods)")
  text = table(outcomes(a.results), refs[ref_name], ref_name, budgets(a.results),
               budgets(a.reference).get(ref_name))
  print(text)
  if a.out:
    with open(a.out, "w") as f:
      f.write(text + "\n")


if __name__ == "__main__":
  main()
