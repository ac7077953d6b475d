"""``pask-jax`` command line: generate (and the tools of later stages as they land)."""
from __future__ import annotations

import argparse
import json
import os
import sys

from pask_jax import platform
from pask_jax.options import (DEFAULT_MAX_TOKENS, ENGINE, LO_FORMAT_CHOICES, PREEMPTION,
                              PREFILL_CHUNKS, TOOL_FORMATS, check_engine)


KEY_CENTER_HELP = ("subtract a fixed per-channel mean from the post-RoPE keys (models.center): "
                   "the same attention, far smaller INT4 key error on models whose keys carry a "
                   "channel offset (Qwen2.5)")


# The long-context workloads (calibrate.longctx.TASKS: a test keeps the two equal; the CLI parses
# its arguments without importing calibrate) and the tasks whose tool-call grammar an
# unconstrained run may leave out (calibrate.evaluate.UNCONSTRAINED_TASKS).
LONG_TASKS = ("w1", "w2", "w3", "w3mt")
UNCONSTRAINED_TASKS = ("bfcl", "w3")

def _read_json(path: str, what: str):
  if not os.path.exists(path):
    raise SystemExit(f"error: {what} file not found: {path}")
  try:
    with open(path) as f:
      return json.load(f)
  except json.JSONDecodeError as e:
    raise SystemExit(f"error: {what} file {path} is not valid JSON: {e}")


def _check_policy(name: str | None) -> None:
  """A policy directory's record, checked before the model loads (one-line errors)."""
  from pask_jax import policy as pol_mod
  if name is None or name in pol_mod.BUILTIN:
    return
  try:
    pol_mod.read_record(name)
  except (FileNotFoundError, ValueError) as e:
    raise SystemExit(f"error: policy {name!r}: {e}")


def cmd_generate(args) -> int:
  """``pask-jax generate``: one answer through the Python API (:func:`pask_jax.api.generate`)."""
  import jax

  from pask_jax import api, ledger
  _check_policy(args.policy)
  if args.raw and not args.prompt:
    raise SystemExit("error: --prompt is empty (with --raw nothing else is sent to the model)")
  schema = _read_json(args.json_schema, "JSON schema") if args.json_schema else None
  tools = _read_json(args.tools, "tools") if args.tools else None
  m = platform.load_model_or_exit(args.model, args.dtype,
                                   center_keys=args.key_center == "on")
  try:
    g = api.generate(m, args.prompt, system=args.system or None, tools=tools, json_schema=schema,
                     tool_format=args.tool_format, policy=args.policy,
                     max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                     seed=args.seed, chat_template=not args.raw)
  except (FileNotFoundError, ValueError) as e:
    raise SystemExit(f"error: {e}")
  print(g.text)
  if tools is not None:
    print("tool calls: " + (json.dumps(g.tool_calls) if g.tool_calls is not None else
                            f"none parsed ({g.tool_call_error})"))
  if g.ledger is not None:
    print("ledger: " + ledger.format_summary([g.ledger]), file=sys.stderr)
  print(f"[{api.describe_result(g)}, backend={jax.default_backend()}]", file=sys.stderr)
  return 0


def cmd_serve(args) -> int:
  """``pask-jax serve``: the OpenAI-compatible server (serve/) under uvicorn."""
  import uvicorn

  from serve.app import build
  _check_policy(args.policy)
  try:
    app, engine = build(args.model, args.policy, slots=args.slots, context=args.context,
                        page=args.page, hi_pages=args.hi_pages, lo_pages=args.lo_pages,
                        kv_memory_gb=args.kv_memory,
                        gpu_memory_utilization=args.gpu_memory_utilization,
                        kv_mix=args.kv_mix, preemption=args.preemption,
                        dtype=args.dtype, center_keys=args.key_center == "on",
                        default_max_tokens=args.default_max_tokens,
                        served_model_name=args.served_model_name,
                        max_body_bytes=args.max_body_bytes, max_json_depth=args.max_json_depth,
                        grammar_timeout_s=args.grammar_timeout,
                        prefill_chunk=args.prefill_chunk,
                        prefill_share=args.prefill_share,
                        api_key=args.api_key or ([os.environ["PASK_API_KEY"]]
                                                 if os.environ.get("PASK_API_KEY") else None),
                        chat_template=args.chat_template,
                        tool_call_parser=args.tool_call_parser, lo_format=args.lo_format,
                        lo_page=args.lo_page, tensor_parallel_size=args.tensor_parallel_size)
  except (FileNotFoundError, ValueError) as e:
    raise SystemExit(f"error: {e}")
  print(f"pask-jax serve: http://{args.host}:{args.port}/v1 ({args.slots} slots, max model len "
        f"{args.context}, policy {args.policy})", file=sys.stderr)
  print(f"pask-jax serve: {engine.sizing.describe()}", file=sys.stderr)
  try:
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
  finally:
    engine.stop()
  return 0


def cmd_compare_kernels(args, rest) -> int:
  from pallas_kernels import compare
  return compare.main(rest)


def _task_cases(args, split: str, skip: int = 0):
  """``--task`` / ``--data`` checked before the model loads (one-line errors): the cases of a
  JSONL task file, already checked against ``--split``, ``--categories`` and ``--max-cases``,
  or None for BFCL (installed: else the install command)."""
  if args.task != "jsonl":
    if args.data is not None:
      raise SystemExit("error: --data applies to --task jsonl")
    long = args.task in LONG_TASKS
    if not long and (args.length is not None or args.tail is not None):
      raise SystemExit(f"error: --length and --tail apply to --task {', '.join(LONG_TASKS)}")
    if args.task == "w1" and args.categories:
      raise SystemExit("error: --task w1 has no categories")
    if args.task in ("bfcl", "w3", "w3mt"):
      from calibrate import bfcl
      bfcl.need()
    if long:
      from calibrate import longctx
      try:
        if args.task in ("w1", "w2"):
          longctx.corpus()
        longctx.suite(args.task, None, None, length=args.length or 8192,
                      tail=args.tail or 1024, seed=args.seed, check_only=True)
      except ValueError as e:
        raise SystemExit(f"error: {e}")
    return None
  if args.data is None:
    raise SystemExit("error: --task jsonl needs --data FILE (one JSON case per line)")
  from calibrate import evaluate as E, tasks
  try:
    cases = tasks.read_jsonl(args.data)
    if not E.JsonlSuite(cases, None, "", None, seed=args.seed).cases(
        split, args.categories, args.max_cases, skip):
      raise ValueError(f"{args.data}: no cases left for split {split!r} after --max-cases / "
                       "--skip-cases")
  except ValueError as e:
    raise SystemExit(f"error: {e}")
  return cases


def _session(m, args, cases):
  """The evaluation session of ``eval`` / ``tune``: BFCL, or the JSONL task's cases."""
  from calibrate import evaluate as E
  if args.task in LONG_TASKS:
    from calibrate import longctx
    from pask_jax.grammar import GrammarCompiler
    gc = GrammarCompiler(m.tokenizer, m.cfg.vocab_size)
    task = longctx.suite(args.task, m, gc, length=args.length or 8192, tail=args.tail or 1024,
                         seed=args.seed)
    return E.Session(m, task, batch=args.batch, compiler=gc)
  if cases is None:
    return E.Session(m, batch=args.batch)
  from pask_jax.grammar import GrammarCompiler
  gc = GrammarCompiler(m.tokenizer, m.cfg.vocab_size)
  task = E.JsonlSuite(cases, m.tokenizer, m.cfg.arch, gc, seed=args.seed,
                      name=f"jsonl:{os.path.basename(args.data)}")
  return E.Session(m, task, batch=args.batch, compiler=gc)


def cmd_eval(args) -> int:
  """``pask-jax eval``: one method at one budget on a BFCL split or a JSONL task file (see
  calibrate.evaluate)."""
  from calibrate import evaluate as E
  budget = args.budget if args.budget is not None or args.method == "pask" else 1.0
  rc = E.RunConfig(args.method, budget, args.split,
                   tuple(args.categories) if args.categories else None, args.max_cases,
                   args.max_tokens, args.policy,
                   E.read_knobs(args.knobs) if args.knobs else None, args.skip_cases,
                   args.temperature, args.top_p, args.sample_seed,
                   constrained=not args.unconstrained)
  try:
    E.check_config(rc)
  except ValueError as e:
    raise SystemExit(f"error: {e}")
  if args.unconstrained and args.task not in UNCONSTRAINED_TASKS:
    raise SystemExit(f"error: --unconstrained leaves out a tool-call grammar: only --task bfcl "
                     f"and w3 have one (got --task {args.task})")
  if args.task == "w1" and args.temperature > 0:
    raise SystemExit("error: --task w1 feeds the document's own tokens (teacher forcing) and "
                     "samples nothing: leave --temperature at 0")
  cases = _task_cases(args, args.split, args.skip_cases)
  m = platform.load_model_or_exit(args.model, args.dtype,
                                   center_keys=args.key_center == "on")
  try:
    s = _session(m, args, cases)
    meta = E.run(s, rc, args.out)
  except ValueError as e:
    raise SystemExit(f"error: {e}")
  c = meta["categories"]
  print(f"{meta['method']}: requested B {E.label(meta['budget'])}, measured B "
        f"{meta['measured_B']:.3f}" + (f" (policy {meta['settings']['policy']})"
                                         if meta["method"] == "pask" else ""))
  for k, d in c.items():
    if "nll" in d:   # W1
      print(f"{k:>18}: n={d['n']:4d} nll={d['nll']:.4f} ppl={d['ppl']:.3f} B prefill/decode/"
            f"total={d['prefill_B']:.3f}/{d['decode_B']:.3f}/{d['total_B']:.3f}")
      continue
    valid = "" if d.get("valid") is None else f" schema-valid={100 * d['valid']:6.2f}%"
    print(f"{k:>18}: n={d['n']:4d} acc={100 * d['accuracy']:6.2f}% per-call="
          f"{100 * d['per_call']:6.2f}%{valid} B prefill/decode/total={d['prefill_B']:.3f}/"
          f"{d['decode_B']:.3f}/{d['total_B']:.3f}")
  print(f"wrote {args.out}/cases.jsonl, summary.csv, summary.json ({meta['wall_s']:.1f} s)",
        file=sys.stderr)
  return 0


def cmd_tune(args) -> int:
  """``pask-jax tune``: dev-split knob search for the baselines (paper C.3, Table 8)."""
  from calibrate import evaluate as E
  from pask_jax.baselines import budget as BU
  if args.task == "w1":
    raise SystemExit("error: tune picks knobs by accuracy; --task w1 scores NLL (tune on w2, "
                     "w3 or bfcl)")
  try:   # bad methods or budgets fail here, before the model loads and minutes are spent
    E.check_tunable(args.methods, args.grid)
    for b in args.budget:
      BU.check_target(b)
  except ValueError as e:
    raise SystemExit(f"error: {e}")
  cases = _task_cases(args, args.split)
  m = platform.load_model_or_exit(args.model, args.dtype,
                                   center_keys=args.key_center == "on")
  try:
    s = _session(m, args, cases)
    res = E.tune(s, args.methods, args.budget[0] if len(args.budget) == 1 else args.budget,
                 grid=args.grid, split=args.split, max_cases=args.max_cases,
                 max_tokens=args.max_tokens, categories=args.categories, out=args.out,
                 resume=not args.fresh)
  except ValueError as e:
    raise SystemExit(f"error: {e}")
  for r in res if isinstance(res, list) else [res]:
    print(json.dumps({"budget": r["budget"], "knobs": r["knobs"]}, indent=1))
  return 0


def cmd_report(args) -> int:
  """``pask-jax report``: markdown tables + accuracy-vs-B plots from eval run directories and
  campaign cells (see calibrate.campaign.report)."""
  from calibrate import campaign as C
  try:
    md, files = C.report(args.runs, args.out, results=args.results)
  except ValueError as e:
    raise SystemExit(f"error: {e}")
  print(md, end="")
  print(f"wrote {', '.join(files)}", file=sys.stderr)
  return 0


def cmd_campaign(args) -> int:
  """``pask-jax campaign``: the plan's cells not yet done, as many as fit in --time-limit."""
  from calibrate import campaign as C
  try:
    plan = C.load_plan(args.plan, args.results)
    C.check_task_data(plan)   # the BFCL install, the W1/W2 corpus: before any model loads
    if args.dry_run:
      print(C.describe(plan, C.cells(plan)))
      return 0
    out = C.run(plan, time_limit=args.time_limit, progress=not args.no_progress,
                copy_to=args.copy_to)
  except (FileNotFoundError, ValueError) as e:
    raise SystemExit(f"error: {e}")
  for cell, msg in out.failed:
    print(f"failed: {cell.label} ({cell.key}): {msg}", file=sys.stderr)
  print(f"campaign {plan.name}: ran {len(out.ran)}, done before {len(out.done_before)}, left "
        f"{len(out.left)} (not in the time limit), failed {len(out.failed)}; results in "
        f"{plan.folder}", file=sys.stderr)
  return 1 if out.failed else 0


def cmd_merge(args) -> int:
  """``pask-jax merge``: one run directory from runs of one configuration over disjoint slices."""
  from calibrate import evaluate as E
  try:
    meta = E.merge(args.runs, args.out)
  except ValueError as e:
    raise SystemExit(f"error: {e}")
  o = meta["categories"]["overall"]
  q = f"nll {o['nll']:.4f}" if "nll" in o else f"accuracy {100 * o['accuracy']:.2f}%"
  print(f"{meta['method']} B={E.label(meta['budget'])}: {o['n']} cases, {q}, measured B "
        f"{o['total_B']:.3f}; wrote {args.out}", file=sys.stderr)
  return 0


def _transfer(args) -> int:
  """``pask-jax policy transfer``: POLICY_DIR and each of its ``B<b>`` variants bound, tables
  unchanged, to --model, written under --out (the same layout)."""
  import glob
  from pask_jax import policy as P
  src = os.path.normpath(args.policy_dir)
  dirs = [src] + sorted(d for d in glob.glob(os.path.join(src, "B*"))
                        if os.path.isfile(os.path.join(d, "policy.json")))
  try:
    pols = [(d, P.load(d)) for d in dirs]     # every source read before the model loads
  except (FileNotFoundError, ValueError) as e:
    raise SystemExit(f"error: {e}")
  if os.path.exists(os.path.join(args.out, "policy.json")):
    raise SystemExit(f"error: {args.out} already holds a policy; give another --out")
  m = platform.load_model_or_exit(args.model, "bfloat16")
  for d, pol in pols:
    try:
      moved = P.transfer(pol, m.cfg, m.tokenizer.hash())
    except ValueError as e:
      raise SystemExit(f"error: {d}: {e}")
    dst = os.path.normpath(os.path.join(args.out, os.path.relpath(d, src)))
    P.save(moved, dst)
    print(f"{dst}: {d}'s tables bound to {m.cfg.arch} {m.cfg.n_layers} layers "
          f"(groups {moved.record['layer_boundaries']}), C_full {float(moved.c_full):.0f} bits")
  return 0


def _edit(args) -> int:
  from pask_jax import policy as P
  if os.path.exists(os.path.join(args.out, "policy.json")):
    raise SystemExit(f"error: {args.out} already holds a policy; give another --out")
  try:
    pol = P.edit(P.load(args.policy_dir), all_high=args.all_high, no_release=args.no_release)
  except (FileNotFoundError, ValueError) as e:
    raise SystemExit(f"error: {e}")
  P.save(pol, args.out)
  print(f"{args.out}: {pol.record['extra']['name']}; B_P {float(pol.b_p):.4f}, "
        f"B_D {float(pol.b_d):.4f}")
  return 0


def cmd_policy(args) -> int:
  """``pask-jax policy derive``: a total-B variant from what calibration measured, no model
  loaded (:func:`calibrate.variant.derive`); ``edit``: one stage all-high or releasing nothing
  (:func:`pask_jax.policy.edit`); ``transfer``: the tables bound to another model
  (:func:`pask_jax.policy.transfer`); ``pask-jax policy convert``: an old policy directory
  rewritten with its tables in ``arrays/`` only (:func:`pask_jax.policy.convert`)."""
  if args.policy_cmd == "transfer":
    return _transfer(args)
  if args.policy_cmd == "edit":
    return _edit(args)
  if args.policy_cmd == "convert":
    from pask_jax import policy as P
    for d in args.policy_dirs:
      try:
        print(P.convert(d))
      except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"error: {e}")
    return 0
  from calibrate import variant
  try:
    v = variant.derive(args.policy_dir, args.target_b, out=args.out,
                       calibration=args.calibration)
  except (FileNotFoundError, ValueError) as e:
    raise SystemExit(f"error: {e}")
  m = v["base_measured"]
  source = os.path.normpath(os.path.join(v["out"], v["source_policy"]))
  run = (f"--policy {source} --budget {v['requested_B']:g}"
         if os.path.dirname(os.path.abspath(v["out"])) == os.path.abspath(source) else
         f"--policy {v['out']}")
  print(f"variant {v['out']}: B_P {v['b_p']:.4f}, B_D {v['b_d']:.4f}; predicted total B "
        f"{v['predicted_B_total']:.3f} for {v['requested_B']:g} (rule {v['rule']}, base "
        f"{v['base']}, measured at total B {m['B_total']:.3f}); not measured: "
        f"pask-jax eval --method pask {run} measures it")
  return 0


def _arg(cast, ok, what: str):
  """An argparse ``type`` that casts and checks, with a one-line message naming the rule."""
  def parse(text: str):
    try:
      v = cast(text)
    except ValueError:
      v = None
    if v is None or not ok(v):
      raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return v
  return parse


_positive = _arg(int, lambda v: v >= 1, "a positive integer")
_positive_float = _arg(float, lambda v: v > 0, "a positive number")
_fraction = _arg(float, lambda v: 0 <= v <= 1, "a fraction in [0, 1]")
_share = _arg(float, lambda v: 0 < v < 1, "a fraction in (0, 1)")
_utilization = _arg(float, lambda v: 0 < v <= 1, "a fraction in (0, 1]")


def _task_args(p) -> None:
  """--task / --data / --seed, as eval and tune take them."""
  p.add_argument("--task", choices=["bfcl", "jsonl", *LONG_TASKS], default="bfcl",
                 help="bfcl: BFCL's splits; jsonl: the cases of --data FILE, the format "
                      "calibrate --task jsonl reads (split test: every case of the file; cal / "
                      "dev: calibration's 1:1 split of it by --seed); w1 / w2 / w3: the "
                      "long-context workloads of docs/SPHERICAL_KV.md §4 (calibrate/longctx.py: "
                      "LM NLL of the last --tail tokens, needle retrieval EM, BFCL padded with "
                      "distractor tools), prompts of --length tokens; w3mt: W3's multi-turn "
                      "BFCL episodes against bfcl-eval's simulated APIs (calibrate/multiturn.py; "
                      "--length: the context an episode may fill) (default: bfcl)")
  p.add_argument("--length", type=_positive, default=None,
                 help="--task w1/w2/w3: document / prompt length in tokens; w3mt: the context "
                      "an episode may fill (default 8192)")
  p.add_argument("--tail", type=_positive, default=None,
                 help="--task w1: tokens scored at the end of each document (default 1024)")
  p.add_argument("--data", default=None, metavar="FILE",
                 help="--task jsonl: the task file (see calibrate/tasks.py)")
  p.add_argument("--seed", type=int, default=0,
                 help="--task jsonl: the seed of the cal/dev split (as calibrate's --seed)")


def main(argv: list[str] | None = None) -> int:
  platform.pick()
  ap = argparse.ArgumentParser(prog="pask-jax", description="PASK structured-generation KV tools")
  sub = ap.add_subparsers(dest="cmd", required=True)
  g = sub.add_parser("generate", help="generate text (optionally under a JSON schema or tools)")
  g.add_argument("--model", default=None,
                 help="GGUF file, HF checkpoint dir, or a registered name "
                      "(default: smollm2-135m-instruct; also qwen2.5-coder-0.5b-instruct)")
  g.add_argument("--prompt", required=True)
  g.add_argument("--system", default=None, help="optional system message")
  x = g.add_mutually_exclusive_group()
  x.add_argument("--json-schema", metavar="FILE", help="constrain the output to this JSON schema")
  x.add_argument("--tools", metavar="FILE", help="JSON list of tools (OpenAI format)")
  g.add_argument("--tool-format", choices=list(TOOL_FORMATS),
                 help="tool-call format; hermes (vLLM's name) = tool_call_tags (default: per "
                      "model family, see pask_jax.grammar)")
  g.add_argument("--max-tokens", type=int, default=None,
                 help=f"new tokens (default: {DEFAULT_MAX_TOKENS}, capped by the room the prompt "
                      "leaves in the model's context, as serve's --default-max-tokens)")
  g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
  g.add_argument("--top-p", type=float, default=1.0)
  g.add_argument("--seed", type=int, default=0)
  g.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto")
  g.add_argument("--key-center", choices=["on", "off"], default="on",
                 help=KEY_CENTER_HELP)
  g.add_argument("--raw", action="store_true", help="do not apply the chat template")
  g.add_argument("--policy", default=None,
                 help="decode under PASK with this policy: all-high, demo, or a policy directory "
                      "(default: Full KV)")
  class ServeHelp(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" unless the help already says what the default is."""

    def _get_help_string(self, action):
      if "(default" in (action.help or "") or action.default in (None, False):
        return action.help
      return super()._get_help_string(action)

  s = sub.add_parser("serve", help="OpenAI-compatible server with continuous batching (PASK)",
                     formatter_class=ServeHelp,
                     description="OpenAI-compatible server (vLLM-style flags where they exist).")
  s.add_argument("--model", default=None, help="GGUF file, HF checkpoint dir, or a registered "
                                               "name (default: smollm2-135m-instruct)")
  s.add_argument("--policy", default=ENGINE.policy,
                 help="PASK policy: all-high, demo, or a calibrated policy directory")
  s.add_argument("--host", default="127.0.0.1", help="address to listen on")
  s.add_argument("--port", type=int, default=8000, help="port to listen on")
  s.add_argument("--api-key", nargs="+", default=None, metavar="KEY",
                 help="require 'Authorization: Bearer KEY' (one of the keys) on every route "
                      "but /health and /metrics; a wrong or missing key is a 401 (default: "
                      "$PASK_API_KEY if set, else no key is required)")
  s.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                 help="Jinja chat template replacing the model's: a file path, or the template "
                      "itself (a value with '{', '}' or a newline) (default: the model's)")
  s.add_argument("--tool-call-parser", default=None, choices=list(TOOL_FORMATS),
                 help="the format tool calls are generated (grammar) and parsed in: hermes = "
                      "<tool_call>{\"name\": ..., \"arguments\": ...}</tool_call> blocks "
                      "(Qwen2.5, Hermes; vLLM's hermes; tool_call_tags is the same format), "
                      "fenced_json = ```json blocks, "
                      "json_list = a JSON list of calls (default: per model family: qwen2 "
                      "fenced_json, qwen3 hermes, others json_list)")
  s.add_argument("--enable-auto-tool-choice", action="store_true",
                 help="accepted so that vLLM command lines run; tool_choice 'auto' works "
                      "with or without it (default: off)")
  s.add_argument("--max-num-seqs", "--slots", dest="slots", type=_positive,
                 default=ENGINE.slots,
                 metavar="N",
                 help="decode batch: requests decoded together (alias --slots)")
  s.add_argument("--max-model-len", "--context", dest="context", type=_positive,
                 default=ENGINE.context,
                 metavar="N",
                 help="most tokens (prompt + max_tokens) per request (alias --context)")
  s.add_argument("--page", type=_positive, default=ENGINE.page, help="tokens per KV page")
  s.add_argument("--tensor-parallel-size", "-tp", type=_positive,
                 default=ENGINE.tensor_parallel_size, metavar="N",
                 help="serve on the first N local GPUs or TPU chips, like vLLM: attention by KV "
                      "head, the MLP by columns/rows, embeddings and lm_head by vocabulary, the "
                      "KV pools and windows by KV head; --kv-memory and "
                      "--gpu-memory-utilization are then per device (default: 1)")
  s.add_argument("--lo-format", choices=list(LO_FORMAT_CHOICES), default=ENGINE.lo_format,
                 help="storage of the INT4 pool: bytes (half-split nibbles: the Triton and TPU "
                      "kernels), int4 (head-major int4 pages: the Mosaic GPU kernel on Hopper, "
                      "~2x the INT4 read rate, in pages of 64 or 128 there) or auto, the default "
                      "(int4 where the Mosaic GPU kernel runs and takes the model, else bytes)")
  s.add_argument("--lo-page", type=_positive, default=ENGINE.lo_page, metavar="N",
                 help="tokens per INT4-pool page (default: --page, or 128 for the int4 format "
                      "on a GPU when --page is not a multiple of 64)")
  mem = s.add_mutually_exclusive_group()
  mem.add_argument("--kv-memory", type=_positive_float, default=None, metavar="GB",
                   help="KV cache memory budget in GB: both pools sized from it and the "
                        "policy's expected H/L mix (default: every slot at full context)")
  mem.add_argument("--gpu-memory-utilization", type=_utilization, default=None,
                   metavar="FRACTION", help="KV budget as this fraction of the device's free "
                                            "memory after loading the weights, like vLLM (with "
                                            "-tp: of the device with the least) (default: "
                                            "every slot at full context)")
  s.add_argument("--kv-mix", type=_fraction, nargs=2, default=None, metavar=("H", "L"),
                 help="expected fractions of window-leaving entries stored H and L, for "
                      "sizing (default: from the policy; e.g. from pask_actions_total)")
  s.add_argument("--hi-pages", type=_positive, default=None,
                 help="BF16 pool size in pages, overriding the budget's (default: sized from "
                      "the budget)")
  s.add_argument("--lo-pages", type=_positive, default=None,
                 help="INT4 pool size in pages, overriding the budget's (default: sized from "
                      "the budget)")
  s.add_argument("--preemption", choices=list(PREEMPTION), default=ENGINE.preemption,
                 help="when a pool runs dry the youngest request is preempted; when readmitted "
                      "its prompt is prefilled again and its generated tokens re-fed through "
                      "the decode step (replay: output continues bit-exactly) or prefilled "
                      "with the prompt (recompute: one prefill, numerically close)")
  s.add_argument("--prefill-chunk", type=int, choices=list(PREFILL_CHUNKS),
                 default=ENGINE.prefill_chunk,
                 help="tokens of a prompt prefilled between two decode steps while other "
                      "requests decode (smaller: less stall for them, more steps for the "
                      "prompt)")
  s.add_argument("--prefill-share", type=_share, default=ENGINE.prefill_share,
                 help="the most of the engine's time a long prompt's prefill (several pieces) "
                      "takes while other requests decode; prompts of one piece are not paced "
                      "and may pass a long one in progress (default: 1/3)")
  s.add_argument("--default-max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                 help="max_tokens of a chat completion that sets none (capped by the room "
                      "left in --max-model-len)")
  s.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                 help="weights and activations (auto: float32 on CPU, else bfloat16)")
  s.add_argument("--key-center", choices=["on", "off"], default="on",
                 help=KEY_CENTER_HELP)
  s.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                 help="model name(s) requests must use; responses carry the first (default: "
                      "--model, or smollm2-135m-instruct)")
  s.add_argument("--max-body-bytes", type=int, default=2 << 20,
                 help="largest request body (bytes); larger ones get a 413")
  s.add_argument("--max-json-depth", type=int, default=64,
                 help="deepest JSON nesting of a request body; deeper ones get a 400")
  s.add_argument("--grammar-timeout", type=float, default=10.0,
                 help="CPU seconds one grammar (schema or tool set) may take to compile")
  s.add_argument("--log-level", default="info",
                 choices=["critical", "error", "warning", "info", "debug", "trace"],
                 help="uvicorn's log level")
  sub.add_parser("compare-kernels", help="compare the GPU and TPU attention kernels",
                 add_help=False)
  from pask_jax.baselines import METHODS
  e = sub.add_parser("eval", help="accuracy and measured KV budget of one method on BFCL or "
                                  "a JSONL task file")
  e.add_argument("--model", default=None, help="as for generate (default: smollm2-135m-instruct)")
  _task_args(e)
  e.add_argument("--split", choices=["cal", "dev", "test"], default="test")
  e.add_argument("--method", required=True, help="one of " + ", ".join(METHODS))
  e.add_argument("--budget", type=float, default=None,
                 help="target measured B in (0, 1] (default 1; --method pask: the policy's own, "
                      "and a directory of B<x> variants runs the one for --budget; a budget the "
                      "policy cannot honour is refused)")
  e.add_argument("--policy", default=None,
                 help="PASK policy directory, or one holding per-budget variants B0.33, ... "
                      "(--method pask)")
  e.add_argument("--knobs", default=None, help="knobs.json from pask-jax tune (dev-tuned)")
  e.add_argument("--max-cases", type=int, default=None, help="at most N cases per category")
  e.add_argument("--skip-cases", type=int, default=0,
                 help="leave out the first N cases per category (run a later slice; pool the "
                      "slices with pask-jax merge)")
  e.add_argument("--categories", nargs="+", default=None,
                 help="BFCL categories (default: the four non-live ones); --task jsonl: "
                      "categories of the file (default: all)")
  e.add_argument("--max-tokens", type=int, default=128)
  e.add_argument("--temperature", type=float, default=0.0,
                 help="> 0: nucleus sampling with --top-p and --sample-seed (default 0: greedy)")
  e.add_argument("--top-p", type=float, default=1.0)
  e.add_argument("--sample-seed", type=int, default=0)
  e.add_argument("--unconstrained", action="store_true",
                 help="bfcl / w3: decode without the tool-call grammar (the answer is still "
                      "scored by the checker, and each row says whether its calls parse and "
                      "validate against the tool schemas: 'valid'); not for methods that read "
                      "the parser's tags (pask, triaxial, pask+ada)")
  e.add_argument("--batch", type=int, default=64,
                 help="most sequences per generation batch (fewer cases: fewer rows, no padding)")
  e.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto")
  e.add_argument("--key-center", choices=["on", "off"], default="on",
                 help=KEY_CENTER_HELP)
  e.add_argument("--out", required=True, help="output directory")
  t = sub.add_parser("tune", help="tune baseline knobs on the development split (paper C.3)")
  t.add_argument("--model", default=None)
  _task_args(t)
  t.add_argument("--methods", nargs="+", default=["h2o", "snapkv", "mikv"])
  t.add_argument("--budget", type=float, nargs="+", default=[0.33],
                 help="target B the knobs are tuned at; several: one Full-KV run for all, each "
                      "budget's knobs in OUT/B<budget>/")
  t.add_argument("--grid", choices=["small", "paper"], default="small")
  t.add_argument("--split", choices=["cal", "dev"], default="dev")
  t.add_argument("--max-cases", type=int, default=None, help="at most N cases per category")
  t.add_argument("--categories", nargs="+", default=None)
  t.add_argument("--max-tokens", type=int, default=128)
  t.add_argument("--batch", type=int, default=64)
  t.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto")
  t.add_argument("--key-center", choices=["on", "off"], default="on",
                 help=KEY_CENTER_HELP)
  t.add_argument("--out", required=True, help="output directory (knobs.json, tune.csv)")
  t.add_argument("--fresh", action="store_true",
                 help="measure every grid point again (default: a rerun into the same --out "
                      "with the same settings measures only the points still missing)")
  from calibrate import cli as calibrate_cli
  calibrate_cli.add_parser(sub)
  po = sub.add_parser("policy", help="work on a calibrated policy directory")
  pos = po.add_subparsers(dest="policy_cmd", required=True,
                          metavar="{derive,edit,convert,transfer}")
  pd = pos.add_parser("derive", help="write the variant at another total B from the dev "
                                     "measurements calibration saved (no model loaded)",
                       description="Writes the variant at total B (--target-b) of a calibrated "
                                   "policy from its dev-measured compositions: B_P re-aimed "
                                   "from the nearest one's prompt share and decode cost (see "
                                   "calibrate/variant.py). The B is predicted, not measured.")
  pd.add_argument("policy_dir", metavar="POLICY_DIR",
                  help="a calibrated policy directory (pask-jax calibrate's OUT/policy)")
  pd.add_argument("--target-b", type=float, required=True, metavar="B",
                  help="total B in (0, 1] the variant is aimed at")
  pd.add_argument("--out", default=None, metavar="DIR",
                  help="where to write it (default POLICY_DIR/B<b>, found by eval --budget b)")
  pd.add_argument("--calibration", default=None, metavar="FILE",
                  help="the calibration.json of POLICY_DIR (default: beside it, as calibrate "
                       "writes it; the B<t> variants' own records are read too)")
  pe = pos.add_parser("edit", help="write a policy with one stage changed: all-high (the "
                                   "prefill-decode decomposition) or no prompt token released",
                      description="Writes POLICY_DIR with one stage changed, the other as "
                                  "calibrated (pask_jax.policy.edit): --all-high decode gives "
                                  "the paper's Table 17 'prefill-only' row, --all-high prefill "
                                  "its 'decode-only' row; --no-release prefill puts every "
                                  "prompt floor at L (Alg. 1's KEEP: B_P above INT4's cost "
                                  "spent on H by the calibrated priorities). No "
                                  "model is loaded; the tables' model binding is kept.")
  pe.add_argument("policy_dir", metavar="POLICY_DIR")
  pe.add_argument("--out", required=True, metavar="DIR")
  pe.add_argument("--all-high", choices=("prefill", "decode"), default=None,
                  help="keep every token of this stage H (its budget 1)")
  pe.add_argument("--no-release", choices=("prefill",), default=None,
                  help="release no prompt token: every prompt floor L (Alg. 1's KEEP)")
  pc = pos.add_parser("convert", help="rewrite an old (pask-policy/1) policy directory: the "
                                      "tables in arrays/ only, policy.json without them",
                      description="Rewrites each POLICY_DIR in place as pask-policy/2: the tables "
                                  "(action, floor, prio, crit, Γ) in arrays/ (orbax) only, "
                                  "policy.json with everything that is not an array. The tables "
                                  "are read from arrays/, or rebuilt from the old policy.json's "
                                  "entries where arrays/ is gone. A pask-policy/2 directory is "
                                  "left as it is.")
  pc.add_argument("policy_dirs", nargs="+", metavar="POLICY_DIR")
  pt = pos.add_parser("transfer", help="bind a policy (and its B<b> variants), tables unchanged, "
                                       "to another model",
                      description="Writes POLICY_DIR and each of its B<b> variants under --out "
                                  "bound to --model: the same tables, budgets and Γ (fractions of "
                                  "C_full), the target's layer groups and cost model; the record "
                                  "keeps the source's identity under transferred_from (the "
                                  "paper's Table 4: a policy calibrated on one model used on "
                                  "another).")
  pt.add_argument("policy_dir", metavar="POLICY_DIR")
  pt.add_argument("--model", required=True, help="registered name, GGUF file or HF directory")
  pt.add_argument("--out", required=True, metavar="DIR")
  mg = sub.add_parser("merge", help="pool eval runs of one configuration over disjoint slices")
  mg.add_argument("runs", nargs="+", help="eval output directories (same method, budget, split)")
  mg.add_argument("--out", required=True)
  r = sub.add_parser("report", help="markdown tables (quality beside measured B, stability vs "
                                     "Full KV) + quality-vs-B plots of eval runs and campaign "
                                     "cells, one per model, task and split")
  r.add_argument("runs", nargs="+",
                 help="eval output directories, campaign cells, folders of them (a plan's "
                      "results folder) or plan files; other folders are skipped")
  r.add_argument("--out", required=True)
  r.add_argument("--results", default=None, help="campaign results root of plan files "
                                                   "(default results/campaign)")
  from calibrate.campaign import parse_duration
  cp = sub.add_parser("campaign", help="run a plan of eval cells, resumably, in a time limit")
  cp.add_argument("plan", help="PLAN.toml (see README, 'Accuracy campaign')")
  cp.add_argument("--time-limit", type=_arg(parse_duration, lambda v: v > 0,
                                            "a duration such as 600, 10m or 1.5h"),
                  default=None, metavar="S",
                  help="start a cell only if it is expected to finish within S seconds of the "
                       "start (also 10m, 1.5h; default: no limit)")
  cp.add_argument("--dry-run", action="store_true", help="list the cells and which are done")
  cp.add_argument("--results", default=None, help="results root (default results/campaign)")
  cp.add_argument("--copy-to", default=None, metavar="DIR",
                  help="also copy each finished cell to DIR/<plan name>/<key>/ as it completes")
  cp.add_argument("--no-progress", action="store_true")
  args, rest = ap.parse_known_args(argv)
  if args.cmd == "compare-kernels":
    return cmd_compare_kernels(args, rest)
  if rest:
    ap.error(f"unrecognized arguments: {' '.join(rest)}")
  if args.cmd == "serve":
    for name in ("slots", "context", "page", "default_max_tokens", "max_body_bytes",
                 "max_json_depth"):
      if getattr(args, name) <= 0:
        ap.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    for name in ("hi_pages", "lo_pages"):
      if getattr(args, name) is not None and getattr(args, name) <= 0:
        ap.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if not 0 <= args.port <= 65535:
      ap.error(f"--port must be in [0, 65535], got {args.port}")
    if not args.grammar_timeout > 0:
      ap.error(f"--grammar-timeout must be positive, got {args.grammar_timeout}")
    try:   # the checks start_engine makes, naming the flags (e.g. --kv-mix summing over 1)
      check_engine(**{k: getattr(args, k) for k in (
          "slots", "context", "page", "hi_pages", "lo_pages", "kv_memory",
          "gpu_memory_utilization", "kv_mix", "preemption", "prefill_chunk", "prefill_share",
          "lo_format", "lo_page", "tensor_parallel_size")}, tool_format=args.tool_call_parser,
          flags=True)
    except ValueError as e:
      ap.error(str(e))
    return cmd_serve(args)
  if args.cmd == "report":
    return cmd_report(args)
  if args.cmd == "campaign":
    return cmd_campaign(args)
  if args.cmd == "merge":
    return cmd_merge(args)
  if args.cmd == "calibrate":
    return calibrate_cli.run(args)
  if args.cmd == "policy":
    return cmd_policy(args)
  if args.cmd in ("eval", "tune"):
    if args.max_tokens <= 0:
      ap.error("--max-tokens must be positive")
    if args.batch <= 0:
      ap.error("--batch must be positive")
    if args.cmd == "tune":
      return cmd_tune(args)
    return cmd_eval(args)
  if args.max_tokens is not None and args.max_tokens <= 0:
    ap.error("--max-tokens must be positive")
  if not 0 <= args.temperature <= 2:   # NaN fails too
    ap.error(f"--temperature must be in [0, 2] (0 = greedy), got {args.temperature}")
  if not 0 < args.top_p <= 1:
    ap.error(f"--top-p must be in (0, 1], got {args.top_p}")
  if args.raw and not args.prompt:
    ap.error("--prompt is empty (with --raw nothing else is sent to the model)")
  return cmd_generate(args)


if __name__ == "__main__":
  sys.exit(main())
