"""``pask-jax calibrate``: Algorithm 1 on a real model and task, with progress bars and resume.

    pask-jax calibrate --model qwen2.5-coder-0.5b-instruct --task bfcl --out runs/cal \
        [--max-cases N] [--categories simple_python multiple] [--rows 1024] \
        [--target-b 0.25 | --targets 0.15 0.20 0.25 0.33] [--windows 8 16 32]
    pask-jax calibrate --task jsonl --data examples/weather_calls.jsonl --out runs/cal [...]

``--task jsonl --data FILE``: a user's task, one case per line (the format is in
:mod:`calibrate.tasks`); its cases are split 1:1 into calibration and development
(:func:`calibrate.tasks.split_jsonl`, seeded by ``--seed``) and Alg. 1 runs as on BFCL.

Writes ``OUT/policy`` (the frozen policy: orbax arrays + policy.json), ``OUT/calibration.json``
(V, D, N̄, ρ, candidates with their nominal and measured costs, the selection, timings) and
``OUT/work/`` (stages saved as they complete, keyed by a fingerprint of model, task, splits and
arguments: rerunning the same command resumes; a different one is refused, naming what differs).
With ``--target-b t`` (one target; the same as ``--targets t``) or ``--targets``, also
``OUT/policy/B<t>/`` per target t (see
:meth:`calibrate.alg1.Calibration.variants`), found by ``pask-jax eval --budget t``; with
``--windows``, the decode candidates compete at each of those recent windows too.

Across processes (several hosts, or one process per accelerator): every process runs the same
command with ``--coordinator HOST:PORT --num-processes N --process-id I`` (I = 0 .. N-1; HOST:PORT
is process 0's address, where it starts the coordinator; ``$JAX_COORDINATOR_ADDRESS`` may stand in
for ``--coordinator``).  The stacked step's policy axis is sharded over the devices of all
processes; process 0 alone reads and writes ``--out`` (see :mod:`calibrate.distributed`)::

    10.0.0.1$ pask-jax calibrate ... --coordinator 10.0.0.1:7777 --num-processes 2 --process-id 0
    other$    pask-jax calibrate ... --coordinator 10.0.0.1:7777 --num-processes 2 --process-id 1
"""
from __future__ import annotations

import json
import math
import os
import time


EPILOG = """\
across processes (several hosts, or one process per GPU): run the same command in every
process, adding
  --coordinator HOST:PORT --num-processes N --process-id I
with I = 0 on the host whose HOST:PORT is given (it starts the coordinator there) and
1 .. N-1 on the others.  E.g. two hosts, the first at 10.0.0.1:
  10.0.0.1$ pask-jax calibrate --task jsonl --data cases.jsonl --out runs/cal
              --coordinator 10.0.0.1:7777 --num-processes 2 --process-id 0
  other$    pask-jax calibrate --task jsonl --data cases.jsonl --out runs/cal
              --coordinator 10.0.0.1:7777 --num-processes 2 --process-id 1
(each one command line).  One process per GPU of a host: give each its GPU with
JAX_LOCAL_DEVICE_IDS=I (or CUDA_VISIBLE_DEVICES=I).  The stacked step's policy rows are
sharded over the devices of all processes (each process drives as many devices); every
process needs the same model, data and arguments (checked).  Process 0 alone reads and
writes --out (saved stages, the policy, calibration.json).  On CPUs the processes'
collectives use gloo.
"""


def add_parser(sub) -> None:
  import argparse
  c = sub.add_parser("calibrate", help="offline calibration (Alg. 1) of a frozen PASK policy",
                     epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
  c.add_argument("--model", default=None, help="registered name, GGUF file or HF directory")
  c.add_argument("--task", default="bfcl", choices=["bfcl", "jsonl"],
                 help="bfcl: BFCL's calibration and development splits; jsonl: the cases of "
                      "--data FILE (default: bfcl)")
  c.add_argument("--data", default=None, metavar="FILE",
                 help="--task jsonl: the task file, one JSON case per line: messages, tools or "
                      "a JSON schema, and the expected calls / value or a scorer (json_valid); "
                      "see calibrate/tasks.py and examples/weather_calls.jsonl")
  c.add_argument("--out", required=True, help="output directory (resumes if it has work/)")
  c.add_argument("--max-cases", type=int, default=None,
                 help="at most N cases per split and category (calibration and development)")
  c.add_argument("--categories", nargs="+", default=None,
                 help="--task bfcl: BFCL categories (default: simple_python multiple — the "
                      "headline pair)")
  c.add_argument("--seed", type=int, default=0, help="split seed (paper C.1; --task jsonl: "
                                                     "of the 1:1 split)")
  c.add_argument("--rows", type=int, default=256, help="decode rows per stacked chunk (V·N)")
  c.add_argument("--max-tokens", type=int, default=128)
  c.add_argument("--path-points", type=int, default=8,
                 help="candidates evaluated per greedy path (0 = every step)")
  c.add_argument("--min-count", type=int, default=1, metavar="N",
                 help="a tag gets its own calibrated entry only if it occurs at least N times in "
                      "the calibration split's reference prompts and outputs; a rarer tag takes "
                      "its nearest calibrated ancestor's entry (the fallback chain), H where none "
                      "is. Default 1: every tag seen")
  c.add_argument("--alpha-d", type=float, default=0.05)
  c.add_argument("--alpha-p", type=float, default=0.02)
  c.add_argument("--sink", type=int, default=4)
  c.add_argument("--window", type=int, default=32)
  c.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
  c.add_argument("--key-center", choices=["on", "off"], default="on",
                 help="subtract a fixed per-channel mean from the post-RoPE keys (models.center; "
                      "part of the model fingerprint the saved stages are keyed on)")
  c.add_argument("--backend", default="auto", help="attention kernel backend (auto/reference/...)")
  c.add_argument("--target-b", type=float, default=None, metavar="B",
                 help="total-B target in (0, 1]: also write OUT/policy/B<B>/, the most "
                      "dev-accurate composition measured at total B <= B (one target; "
                      "--targets for several)")
  c.add_argument("--targets", type=float, nargs="+", default=(), metavar="B",
                 help="total-B targets in (0, 1]: also write OUT/policy/B<t>/ per target, the "
                      "most dev-accurate composition measured at total B <= t")
  c.add_argument("--keep-within-se", type=float, default=None, metavar="K",
                 help="with targets: among the fits within K binomial standard errors of the "
                      "most dev-accurate one, a composition that releases no prompt token wins "
                      "(default 1; 0: the paper's rule, the most accurate fit). Selection "
                      "only: saved stages resume")
  c.add_argument("--no-decode-keep", action="store_true",
                 help="with targets: compose each target's variant from the calibrated decode "
                      "candidates only, never from the decode stage that keeps every generated "
                      "token at L (for ablation comparisons, where that stage makes variants "
                      "alike). The target stages are keyed by it; the earlier stages resume")
  c.add_argument("--decode-b", type=float, default=None, metavar="B",
                 help="with targets: a matched decode budget in (0, 1] — every target's variant "
                      "composes the decode candidate whose dev-measured decode B is nearest B "
                      "(each decode path also offers its step nearest B), so that ablations "
                      "compare at one decode B. The dev stage onwards is keyed by it")
  c.add_argument("--windows", type=int, nargs="+", default=(), metavar="W",
                 help="also evaluate the decode candidates at these recent windows (e.g. 8 16 32) "
                      "and select over all of them")
  c.add_argument("--ablation", default=None, metavar="NAME",
                 help="calibrate an ablation of the paper's Fig. 5 instead of the full method: "
                      "no-floors, fixed-order (policy components), no-class, no-role, no-state, "
                      "no-layer, no-transition (structural; see calibrate.alg1.ABLATION); "
                      "recorded in the policy and calibration.json")
  c.add_argument("--speedup", type=int, default=0, metavar="K",
                 help="also time K Runtime-V interventions sequentially vs stacked")
  g = c.add_argument_group("across processes (see below)")
  g.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                 help="process 0's address (default: $JAX_COORDINATOR_ADDRESS when "
                      "--num-processes is given)")
  g.add_argument("--num-processes", type=int, default=None, metavar="N",
                 help="processes in the calibration (each runs this same command)")
  g.add_argument("--process-id", type=int, default=None, metavar="I",
                 help="this process's index, 0 .. N-1 (0 writes --out)")
  g.add_argument("--join-timeout", type=int, default=120, metavar="S",
                 help="seconds to wait for the coordinator and the other processes "
                      "(default: 120)")


def run(args) -> int:
  import jax
  from tqdm import tqdm

  from calibrate import alg1, bfcl, tasks
  from pask_jax.decode import capacity_for
  from pask_jax.grammar import GrammarCompiler

  if args.task == "jsonl":
    if args.data is None:
      raise SystemExit("error: --task jsonl needs --data FILE (one JSON case per line)")
    if args.categories is not None:
      raise SystemExit("error: --categories applies to --task bfcl (a JSONL case names its "
                       "own category)")
  elif args.data is not None:
    raise SystemExit("error: --data applies to --task jsonl")
  categories = args.categories or ["simple_python", "multiple"]
  unknown = [c for c in categories if c not in bfcl.NONLIVE + bfcl.LIVE]
  if unknown:
    raise SystemExit(f"error: unknown BFCL categories {unknown}; choose from "
                     f"{', '.join(bfcl.NONLIVE + bfcl.LIVE)}")
  if args.max_cases is not None and args.max_cases < 2:
    raise SystemExit("error: --max-cases must be at least 2 "
                     "(calibration and development need cases)")
  if args.rows < 1 or args.max_tokens < 1:
    raise SystemExit("error: --rows and --max-tokens must be positive")
  if args.min_count < 1:
    raise SystemExit(f"error: --min-count must be at least 1, got {args.min_count}")
  targets = targets_of(args)
  keep_se = keep_se_of(args, targets)
  if args.no_decode_keep and not targets:
    raise SystemExit("error: --no-decode-keep chooses among target variants: give --targets")
  if args.decode_b is not None:
    if not targets:
      raise SystemExit("error: --decode-b matches the target variants' decode stage: give "
                       "--targets")
    if not 0.0 < args.decode_b <= 1.0:
      raise SystemExit(f"error: --decode-b must be in (0, 1], got {args.decode_b:g}")
  try:
    windows = alg1.check_windows(args.windows)
  except ValueError as e:
    raise SystemExit(f"error: --windows: {e}")
  ablation = ablation_of(args)
  launch = launch_of(args)
  from pask_jax import platform
  if args.task == "jsonl":      # read and checked before the model loads
    try:
      cal_cases, dev_cases = tasks.split_jsonl(tasks.read_jsonl(args.data), args.seed,
                                               args.max_cases)
    except ValueError as e:
      raise SystemExit(f"error: {e}")
  else:
    bfcl.need()
  from calibrate import distributed
  if launch is not None:         # before anything touches a device
    try:
      distributed.initialize(launch, timeout=args.join_timeout)
    except distributed.DistributedError as e:
      raise SystemExit(f"error: {e}")
  m = platform.load_model_or_exit(args.model, args.dtype, center_keys=args.key_center == "on")
  tok = m.tokenizer
  t0 = time.perf_counter()

  def pick(split):
    cases = bfcl.load(categories, split=split, seed=args.seed)
    if args.max_cases:
      by: dict[str, list] = {}
      for c in cases:
        by.setdefault(c.category, []).append(c)
      cases = [c for v in by.values() for c in v[:args.max_cases]]
    return cases

  comp = GrammarCompiler(tok, m.cfg.vocab_size)
  if args.task == "jsonl":
    try:
      cal = tasks.JsonlTask(cal_cases, tok, arch=m.cfg.arch, compiler=comp)
      dev = tasks.JsonlTask(dev_cases, tok, arch=m.cfg.arch, compiler=comp, vocab=cal.vocab)
    except ValueError as e:   # a schema XGrammar cannot compile, a template that refuses
      raise SystemExit(f"error: {e}")
    what = args.data
  else:
    cal_cases, dev_cases = pick("calibration"), pick("development")
    cal = tasks.BFCLTask(cal_cases, tok, arch=m.cfg.arch, compiler=comp)
    dev = tasks.BFCLTask(dev_cases, tok, arch=m.cfg.arch, compiler=comp, vocab=cal.vocab)
    what = ", ".join(categories)
  longest = max(len(r.ids) for r in cal.requests + dev.requests)
  cap = capacity_for(longest, args.max_tokens)
  print(f"calibration {len(cal.requests)} cases, development {len(dev.requests)} "
        f"({what}); longest prompt {longest}, capacity {cap}; "
        f"{jax.devices()[0].platform} x{len(jax.devices())}" +
        (f" over {jax.process_count()} processes (this is process {jax.process_index()})"
         if jax.process_count() > 1 else ""), flush=True)
  cfg = alg1.Config(alpha_d=args.alpha_d, alpha_p=args.alpha_p, path_points=args.path_points,
                    min_count=args.min_count,
                    rows=args.rows, max_tokens=args.max_tokens, sink=args.sink,
                    window=args.window, targets=targets, windows=windows, ablation=ablation,
                    keep_se=keep_se, decode_keep=not args.no_decode_keep,
                    decode_b=args.decode_b)
  bar = lambda label, total: tqdm(total=total, desc=label, unit="gen", mininterval=2.0)
  from calibrate.stages import StageMismatch
  main = distributed.is_main()
  try:
    # Across processes the policy rows are sharded over every process's devices.
    C = alg1.Calibration(m.model, tok.hash(), cal, dev, args.out, cfg, capacity=cap,
                         backend=args.backend, progress=bar,
                         log=lambda s: print(s, flush=True),
                         devices=jax.devices() if distributed.count() > 1 else None)
  except (StageMismatch, distributed.DistributedError) as e:
    # resuming another model's / task's / arguments' stages; processes that disagree
    raise SystemExit(f"error: {e}")
  sp = None
  if args.speedup:       # measured first (needs only the reference and the buckets)
    C.reference()
    C.buckets()
    sp = speedup(C, args.speedup)
    print(f"speedup: {json.dumps(sp)}", flush=True)
    if main:
      with open(os.path.join(args.out, "speedup.json"), "w") as f:
        json.dump(sp, f, indent=1)
  try:
    rec = C.run()
  except (StageMismatch, distributed.DistributedError) as e:
    raise SystemExit(f"error: {e}")
  if sp is not None:
    rec["speedup"] = sp
  rec["wall_s"] = time.perf_counter() - t0
  if main:
    with open(os.path.join(args.out, "calibration.json"), "w") as f:
      json.dump(rec, f, indent=1, sort_keys=True, default=float)
  comp_ = rec["composed"]
  print((f"ablation {ablation}; " if ablation else "") +
        ("policy: " + (os.path.join(args.out, "policy") if main else
                       f"written by process 0 (this process {jax.process_index()} selected the "
                       "same, checked)") + "\n") +
        f"dev accuracy {comp_['dev_accuracy']:.3f} "
        f"(all-high {comp_['dev_reference_accuracy']:.3f}),"
        f" measured B total {comp_['measured_B_total']:.3f} (prefill "
        f"{comp_['measured_B_prefill']:.3f}, decode {comp_['measured_B_decode']:.3f}); "
        f"B_D {comp_['b_d']:.3f}, B_P {comp_['b_p']:.3f}, W {comp_['window']}; "
        f"wall {rec['wall_s']:.0f} s")
  for v in rec.get("variants", []):
    if v["reached"]:
      print(f"variant {v['policy']}: dev accuracy {v['dev_accuracy']:.3f}, measured B total "
            f"{v['measured_B_total']:.3f} (prefill {v['measured_B_prefill']:.3f}, decode "
            f"{v['measured_B_decode']:.3f})" + ("; floors relaxed" if v["floors_relaxed"] else ""))
    else:
      print(f"target B {v['target']:.2f}: not reached on dev (lowest measured total B "
            f"{v['lowest_measured_B_total']:.3f}); no variant")
  if "speedup" in rec:
    s = rec["speedup"]
    print(f"vmapped vs sequential ({s['interventions']} interventions x {s['requests']} requests): "
          f"{s['stacked_s']:.1f} s vs {s['sequential_s']:.1f} s = {s['ratio']:.2f}x; "
          f"same outcomes: {s['same_outcomes']}")
  return 0


def launch_of(args):
  """The checked ``--coordinator/--num-processes/--process-id`` (None: one process); a partial or
  bad set is a one-line SystemExit, before anything loads."""
  from calibrate import distributed
  if args.join_timeout < 1:
    raise SystemExit("error: --join-timeout must be at least 1 second")
  try:
    return distributed.parse(args.coordinator, args.num_processes, args.process_id)
  except distributed.DistributedError as e:
    raise SystemExit(f"error: {e}")


def targets_of(args) -> tuple[float, ...]:
  """The checked total-B targets of ``--target-b B`` (one) or ``--targets B ...``; both together,
  or a bad value, is a one-line SystemExit."""
  from calibrate import alg1
  if args.target_b is not None and args.targets:
    raise SystemExit("error: give --target-b B (one target) or --targets B ... (several), not both")
  flag, given = (("--target-b", (args.target_b,)) if args.target_b is not None else
                 ("--targets", args.targets))
  try:
    return alg1.check_targets(given)
  except ValueError as e:
    raise SystemExit(f"error: {flag}: {e}")


def keep_se_of(args, targets) -> float:
  """The checked tie band K of ``--keep-within-se``: unset, ``alg1.Config.keep_se`` when there
  are targets to choose among and 0 (nothing to choose) without; a bad value, or a band without
  targets, is a one-line SystemExit."""
  from calibrate import alg1
  k = args.keep_within_se
  if k is not None and not (math.isfinite(k) and k >= 0):
    raise SystemExit(f"error: --keep-within-se must be a finite number >= 0, got {k}")
  if k and not targets:
    raise SystemExit("error: --keep-within-se chooses among target variants: give --targets")
  if k is None:
    return float(alg1.Config.keep_se) if targets else 0.0
  return float(k)


def ablation_of(args) -> str | None:
  """The checked ``--ablation`` (None: the full method); an unknown name is a one-line
  SystemExit, before anything loads."""
  from pask_jax import tags
  try:
    return tags.check_ablation(getattr(args, "ablation", None))
  except ValueError as e:
    raise SystemExit(f"error: --ablation: {e}")


def speedup(C, k: int) -> dict:
  """Time the first ``k`` Runtime-V interventions on the calibration split, stacked (one loop)
  vs sequential (one loop per intervention), after compiling both shapes; compare outcomes."""
  from calibrate import stack
  keys = C.interventions()[:k]
  pols = [C.intervention_policy(*key) for key in keys]
  rows, mt = C.cfg.rows, C.cfg.max_tokens
  # Warm up (compile) both shapes on one request.
  one = C.cal.subset([0])
  stack.run_stack(C.runner_for, one, pols[:1], rows=rows, max_tokens=4)
  stack.run_stack(C.runner_for, C.cal, pols[:1], rows=rows, max_tokens=4)
  stack.run_stack(C.runner_for, C.cal, pols, rows=rows, max_tokens=4)
  t0 = time.perf_counter()
  a = stack.run_stack(C.runner_for, C.cal, pols, rows=rows, max_tokens=mt)
  t1 = time.perf_counter()
  c = stack.run_stack(C.runner_for, C.cal, pols, rows=rows, max_tokens=mt, share=False)
  t2 = time.perf_counter()
  b = stack.run_sequential(C.runner_for, C.cal, pols, rows=rows, max_tokens=mt)
  t3 = time.perf_counter()
  same = all(x.tokens == y.tokens for ra, rb in zip(a, b) for x, y in zip(ra, rb))
  same_c = all(x.tokens == y.tokens for ra, rb in zip(c, b) for x, y in zip(ra, rb))
  return {"interventions": len(pols), "requests": len(C.cal.requests), "stacked_s": t1 - t0,
          "stacked_unshared_s": t2 - t1, "sequential_s": t3 - t2, "ratio": (t3 - t2) / (t1 - t0),
          "ratio_unshared": (t3 - t2) / (t2 - t1), "same_outcomes": same and same_c}
