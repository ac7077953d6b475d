"""Executed warp-instructions by SASS opcode, from Nsight Compute's per-instruction source page.

  ncu ... -o rep python bench/profile_mgpu_int4.py --pool
  ncu --import rep.ncu-rep --page source --print-source sass --csv | gzip > sass.csv.gz
  python bench/sass_opcodes.py sass.csv.gz --per 2097152     # B x Hkv x keys: per (key, head)

Prints one markdown row per opcode (predicate and modifiers after the first dot kept, as
``HGMMA.64x16x16.F32.BF16``): executed warp-instructions, per ``--per`` unit, share of the
warp-stall samples.
"""
from __future__ import annotations

import argparse
import collections
import csv
import gzip
import re


def opcode_counts(path: str) -> tuple[collections.Counter, collections.Counter]:
  opener = gzip.open if path.endswith(".gz") else open
  with opener(path, "rt") as f:
    rows = list(csv.reader(f))
  head = next(i for i, r in enumerate(rows) if "Source" in r and "Instructions Executed" in r)
  cols = rows[head]
  i_src, i_exe = cols.index("Source"), cols.index("Instructions Executed")
  i_stall = cols.index("Warp Stall Sampling (All Samples)")
  execs, stalls = collections.Counter(), collections.Counter()
  for r in rows[head + 1:]:
    if len(r) <= max(i_src, i_exe, i_stall) or not r[i_exe].strip().isdigit():
      continue
    op = re.sub(r"^@!?U?P\w+\s+", "", r[i_src].strip()).split(" ")[0]
    execs[op] += int(r[i_exe])
    stalls[op] += int(r[i_stall] or 0)
  return execs, stalls


def table(execs, stalls, per: float, top: int) -> str:
  total, samples = sum(execs.values()), max(sum(stalls.values()), 1)
  out = [f"{total} warp-instructions executed, {total / per:.2f} per unit", "",
         "| opcode | executed | per unit | stall samples |", "|---|---|---|---|"]
  for op, n in execs.most_common(top):
    out.append(f"| {op} | {n} | {n / per:.2f} | {100 * stalls[op] / samples:.1f}% |")
  return "\n".join(out)


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("csv", help="ncu --page source --print-source sass --csv output (.gz or not)")
  ap.add_argument("--per", type=float, default=1.0, help="divide counts by this (e.g. B*Hkv*N)")
  ap.add_argument("--top", type=int, default=30)
  a = ap.parse_args(argv)
  print(table(*opcode_counts(a.csv), a.per, a.top))


if __name__ == "__main__":
  main()
