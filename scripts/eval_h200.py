"""Issue #6 experiment in one process: every method at every budget on the BFCL non-live test split.

Steps (one model load; runners and compilations shared by all runs):

1. tune — on the development split only (``--tune-cases`` per category): a Full-KV run measures
   the expected generated length ĝ, then each of H2O, SnapKV, MiKV (and StreamingLLM, one point)
   tries the ``--grid`` at B = ``--tune-budget`` and keeps the knobs with the best dev accuracy
   and that point's own mean generated length (frozen from here on).  Skipped with
   ``--knobs FILE``.  StreamingLLM and SnapKV fix their capacity before decoding from ĝ; if a test
   run misses the target by more than ``--tolerance`` it is rerun once with the observed mean.
2. full — Full KV on the test split, once.
3. for each B in ``--budgets``: pask (policy ``--policy``, see below), streaming, h2o, snapkv,
   mikv; int4 once (fixed profile, B ≈ 0.27 + sinks).
4. report — ``OUT/report.md`` (table), ``OUT/accuracy_vs_B.png`` (Fig. 3 style),
   ``OUT/all_summary.csv`` (every run's summary rows), ``OUT/timing.json``.

``--policy DIR``: a directory holding one policy per budget as ``DIR/B0.33``, or one policy
(a built-in name or ``DIR/policy.json``) that runs only at its own target budget
(``evaluate.pick_policy``).  A budget without a policy made for it skips PASK there (logged).
Example (H200)::

    python scripts/eval_h200.py --model qwen2.5-coder-0.5b-instruct --policy policies/qwen05 \\
        --out runs/h200_bfcl

and on a CPU with a handful of cases::

    JAX_PLATFORMS=cpu python scripts/eval_h200.py --model smollm2-135m-instruct --policy demo \\
        --max-cases 2 --tune-cases 1 --budgets 0.5 --batch 8 --max-tokens 48 --out /tmp/h200_smoke
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import sys
import time

from pask_jax import platform


def policy_for(where: str | None, b: float) -> str | None:
  """The policy for budget ``b`` under ``where`` (see module doc); None if there is none that is
  made for ``b`` (``evaluate.pick_policy``: a run is never labelled with a budget its policy was
  not made for)."""
  if not where:
    return None
  from calibrate import evaluate as E
  try:
    return E.pick_policy(where, b)[0]
  except ValueError:
    return None


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct",
                  help="registered name or GGUF path (default: the Qwen 0.5B GGUF)")
  ap.add_argument("--policy", default=None, help="PASK policy dir (or per-budget dirs inside)")
  ap.add_argument("--out", required=True)
  ap.add_argument("--budgets", type=float, nargs="+", default=[0.33, 0.40, 0.50, 0.60])
  ap.add_argument("--methods", nargs="+",
                  default=["pask", "streaming", "h2o", "snapkv", "mikv", "int4"])
  ap.add_argument("--max-cases", type=int, default=None, help="test cases per category (all)")
  ap.add_argument("--skip-cases", type=int, default=0,
                  help="leave out the first N test cases per category (a later slice; pool the "
                       "slices' run directories with `pask-jax merge`)")
  ap.add_argument("--tune-cases", type=int, default=20, help="dev cases per category for tuning")
  ap.add_argument("--tune-budget", type=float, default=0.33)
  ap.add_argument("--grid", choices=["small", "paper"], default="small")
  ap.add_argument("--knobs", default=None, help="use these frozen knobs instead of tuning")
  ap.add_argument("--categories", nargs="+", default=None)
  ap.add_argument("--batch", type=int, default=120)
  ap.add_argument("--max-tokens", type=int, default=128)
  ap.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto")
  ap.add_argument("--tolerance", type=float, default=0.01,
                  help="rerun streaming/snapkv once when measured B misses the target by more")
  ap.add_argument("--no-progress", action="store_true")
  a = ap.parse_args(argv)
  platform.pick()
  for b in a.budgets + [a.tune_budget]:
    if not 0 < b <= 1:
      ap.error(f"budgets must be in (0, 1], got {b}")
  if "pask" in a.methods and not a.policy:
    ap.error("--policy is required when pask is among --methods")

  from calibrate import evaluate as E
  t_all = time.perf_counter()
  timing: dict[str, float] = {}
  m = platform.load_model_or_exit(a.model, a.dtype)
  s = E.Session(m, batch=a.batch)
  os.makedirs(a.out, exist_ok=True)
  prog = not a.no_progress
  cats = tuple(a.categories) if a.categories else None

  t = time.perf_counter()
  if a.knobs:
    knobs = E.read_knobs(a.knobs)
  else:
    tunable = [x for x in ("streaming", "h2o", "snapkv", "mikv") if x in a.methods]
    knobs = E.tune(s, tunable, a.tune_budget, grid=a.grid, split="dev", max_cases=a.tune_cases,
                   max_tokens=a.max_tokens, categories=cats, out=os.path.join(a.out, "tune"),
                   progress=prog)["knobs"]
  timing["tune"] = time.perf_counter() - t
  print("frozen knobs:", json.dumps(knobs), flush=True)

  test = s.task.cases("test", cats, a.max_cases, skip=a.skip_cases)
  dirs = []

  def one(method, budget, policy=None):
    name = method if method in ("full", "int4") else f"{method}_B{budget:.2f}"
    out = os.path.join(a.out, name)
    t = time.perf_counter()
    rc = E.RunConfig(method, budget, "test", cats, a.max_cases, a.max_tokens, policy, knobs,
                     a.skip_cases)
    meta = E.run(s, rc, out, progress=prog, cases=test)
    o = meta["categories"]["overall"]
    if method in ("streaming", "snapkv") and abs(o["total_B"] - budget) > a.tolerance:
      # Their capacity is fixed before decoding from ĝ; when this method's generated length on
      # test differs from its dev estimate, re-solve with the observed mean and run once more.
      kn = json.loads(json.dumps(knobs))
      kn.setdefault(method, {})["gen"] = o["gen_len"]
      print(f"{name}: B {o['total_B']:.3f} off target; rerun with gen={o['gen_len']:.1f}",
            flush=True)
      rc = dataclasses.replace(rc, knobs=kn)
      meta = E.run(s, rc, out, progress=prog, cases=test)
      o = meta["categories"]["overall"]
    timing[name] = time.perf_counter() - t
    h = meta["categories"].get("simple+multiple", o)
    print(f"{name}: headline {100 * h['accuracy']:.2f}% overall {100 * o['accuracy']:.2f}% "
          f"B {o['total_B']:.3f} ({timing[name]:.1f} s)", flush=True)
    dirs.append(out)

  one("full", 1.0)
  if "int4" in a.methods:
    one("int4", min(a.budgets))
  for b in a.budgets:
    for meth in a.methods:
      if meth == "int4":
        continue
      if meth == "pask":
        pol = policy_for(a.policy, b)
        if pol is None:
          print(f"no PASK policy for B={b:.2f} under {a.policy}: skipped", flush=True)
          continue
        one("pask", b, pol)
      else:
        one(meth, b)

  print(E.report(dirs, a.out))
  with open(os.path.join(a.out, "all_summary.csv"), "w", newline="") as f:
    w = csv.writer(f)
    for i, d in enumerate(dirs):
      with open(os.path.join(d, "summary.csv")) as g:
        rows = list(csv.reader(g))
      w.writerows(rows if i == 0 else rows[1:])
  timing["total"] = time.perf_counter() - t_all
  with open(os.path.join(a.out, "timing.json"), "w") as f:
    json.dump(timing, f, indent=1)
  print(f"total {timing['total']:.1f} s; wrote {a.out}", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
