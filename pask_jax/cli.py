"""``pask-jax`` command line: generate (and the tools of later stages as they land)."""
from __future__ import annotations

import argparse
import json
import os
import sys


def _pick_platform() -> None:
  """Run on the CPU when this host has no accelerator, unless the user chose a platform.

  The ahead-of-time compile extras install the CUDA plugin and libtpu even on CPU-only hosts,
  where JAX would otherwise try (and loudly fail) to initialize them.
  """
  if "JAX_PLATFORMS" in os.environ:
    return
  has_gpu = os.path.exists("/dev/nvidia0") or os.path.exists("/dev/nvidiactl")
  has_tpu = os.path.exists("/dev/accel0") or os.path.exists("/dev/vfio/0")
  if not (has_gpu or has_tpu):
    os.environ["JAX_PLATFORMS"] = "cpu"


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
  import jax

  from pask_jax.decode import CapacityError, Runner, Sampling, Tracker, capacity_for, generate
  from pask_jax.grammar import (DEFAULT_STYLE, GrammarCompiler, GrammarError, parse_calls,
                                tool_call_grammar, tools_system_prompt)

  _check_policy(args.policy)
  m = _load_model(args.model, args.dtype)
  tok = m.tokenizer
  messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
      {"role": "user", "content": args.prompt}]
  grammar, tools, fmt = None, None, None
  try:
    gc = GrammarCompiler(tok, m.cfg.vocab_size) if (args.json_schema or args.tools) else None
    if args.json_schema:
      grammar = gc.json_schema(_read_json(args.json_schema, "JSON schema"))
    elif args.tools:
      tools = _read_json(args.tools, "tools")
      tools = tools if isinstance(tools, list) else [tools]
      fmt, indent = DEFAULT_STYLE.get(m.cfg.arch, ("json_list", None))
      if args.tool_format and args.tool_format != fmt:
        fmt, indent = args.tool_format, None
      grammar = tool_call_grammar(gc, tools, fmt, indent=indent)
  except GrammarError as e:
    raise SystemExit(f"error: {e}")
  template_takes_tools = tok.chat_template and "tools" in tok.chat_template
  if tools and not template_takes_tools:
    messages.insert(0, {"role": "system", "content": tools_system_prompt(tools, fmt)})
  text = tok.apply_chat_template(messages, tools=tools if template_takes_tools else None) \
      if tok.chat_template and not args.raw else args.prompt
  if not text:
    raise SystemExit("error: --prompt is empty (with --raw nothing else is sent to the model)")
  if args.policy:  # PASK: prompt-span labels for the prefill plan (§3.6)
    from pask_jax.grammar.prompt_spans import label_prompt
    ids, prompt_tags = label_prompt(tok, text)
  else:
    ids, prompt_tags = tok.encode(text), None
  capacity = capacity_for(len(ids), args.max_tokens)
  if capacity > m.cfg.max_position:
    raise SystemExit(f"error: prompt of {len(ids)} tokens + max_tokens {args.max_tokens} exceeds "
                     f"the model's context of {m.cfg.max_position} tokens")
  if args.policy:
    from pask_jax import ledger, policy as pol_mod
    from pask_jax.decode import PaskRunner
    try:
      pol = pol_mod.resolve(args.policy, m.cfg, tokenizer_hash=tok.hash())
    except (FileNotFoundError, ValueError) as e:
      raise SystemExit(f"error: policy {args.policy!r}: {e}")
    runner = PaskRunner(m.model, pol, batch=1, capacity=capacity)
  else:
    runner = Runner(m.model, batch=1, capacity=capacity)
  try:
    tracker = Tracker(grammar)
    if args.policy and tools:  # structural tags of the tool-call output (§3.3)
      from pask_jax import policy as P
      from pask_jax.grammar.fc_adapter import FCAdapter
      tracker = Tracker(grammar, FCAdapter(grammar, tok, vocab=P.state_vocab(pol)))
    res = generate(runner, tok, [ids], trackers=[tracker], prompt_tags=[prompt_tags],
                   sampling=Sampling(max_tokens=args.max_tokens, temperature=args.temperature,
                                     top_p=args.top_p, seed=args.seed))[0]
  except CapacityError as e:
    raise SystemExit(f"error: {e}")
  print(res.text)
  if tools:
    try:
      print("tool calls:", json.dumps(parse_calls(res.text, fmt)))
    except ValueError as e:
      print(f"tool calls: none parsed ({e})")
  if res.ledger is not None:
    print("ledger: " + ledger.format_summary([res.ledger]), file=sys.stderr)
  print(f"[{len(ids)} prompt tokens, {len(res.tokens)} generated, finish={res.finish}, "
        f"prefill {res.prefill_s:.2f}s (incl. compile), decode {res.tokens_per_s:.1f} tokens/s "
        f"(incl. first-step compile), backend={jax.default_backend()}]", file=sys.stderr)
  return 0


def cmd_serve(args) -> int:
  """``pask-jax serve``: the OpenAI-compatible server (serve/) under uvicorn."""
  import uvicorn

  from serve.app import build
  _check_policy(args.policy)
  try:
    app, engine = build(args.model, args.policy, slots=args.slots, context=args.context,
                        page=args.page, hi_pages=args.hi_pages, lo_pages=args.lo_pages,
                        dtype=args.dtype, default_max_tokens=args.default_max_tokens,
                        served_model_name=args.served_model_name,
                        max_body_bytes=args.max_body_bytes, max_json_depth=args.max_json_depth,
                        grammar_timeout_s=args.grammar_timeout)
  except (FileNotFoundError, ValueError) as e:
    raise SystemExit(f"error: {e}")
  print(f"pask-jax serve: http://{args.host}:{args.port}/v1 ({args.slots} slots, context "
        f"{args.context}, policy {args.policy})", file=sys.stderr)
  try:
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
  finally:
    engine.stop()
  return 0


def cmd_compare_kernels(args, rest) -> int:
  from pallas_kernels import compare
  return compare.main(rest)


def _load_model(name, dtype_name):
  import jax
  import jax.numpy as jnp

  from models import load
  on_cpu = jax.default_backend() == "cpu"
  dtype = {"auto": jnp.float32 if on_cpu else jnp.bfloat16, "float32": jnp.float32,
           "bfloat16": jnp.bfloat16}[dtype_name]
  try:
    m = load(name, dtype=dtype)
  except (FileNotFoundError, ValueError) as e:
    raise SystemExit(f"error: {e}")
  if m.tokenizer is None:
    raise SystemExit("error: this checkpoint has no tokenizer.json; this command needs one")
  return m


def cmd_eval(args) -> int:
  """``pask-jax eval``: one method at one budget on a BFCL split (see pask_jax.evaluate)."""
  from pask_jax import evaluate as E
  rc = E.RunConfig(args.method, args.budget, args.split,
                   tuple(args.categories) if args.categories else None, args.max_cases,
                   args.max_tokens, args.policy,
                   E.read_knobs(args.knobs) if args.knobs else None, args.skip_cases)
  try:
    E.check_config(rc)
  except ValueError as e:
    raise SystemExit(f"error: {e}")
  m = _load_model(args.model, args.dtype)
  try:
    s = E.Session(m, batch=args.batch)
    meta = E.run(s, rc, args.out)
  except ValueError as e:
    raise SystemExit(f"error: {e}")
  c = meta["categories"]
  for k, d in c.items():
    print(f"{k:>18}: n={d['n']:4d} acc={100 * d['accuracy']:6.2f}% per-call="
          f"{100 * d['per_call']:6.2f}% B prefill/decode/total={d['prefill_B']:.3f}/"
          f"{d['decode_B']:.3f}/{d['total_B']:.3f}")
  print(f"wrote {args.out}/cases.jsonl, summary.csv, summary.json ({meta['wall_s']:.1f} s)",
        file=sys.stderr)
  return 0


def cmd_tune(args) -> int:
  """``pask-jax tune``: dev-split knob search for the baselines (paper C.3, Table 8)."""
  from pask_jax import evaluate as E
  m = _load_model(args.model, args.dtype)
  try:
    s = E.Session(m, batch=args.batch)
    res = E.tune(s, args.methods, args.budget, grid=args.grid, split=args.split,
                 max_cases=args.max_cases, max_tokens=args.max_tokens,
                 categories=args.categories, out=args.out)
  except ValueError as e:
    raise SystemExit(f"error: {e}")
  print(json.dumps(res["knobs"], indent=1))
  return 0


def cmd_report(args) -> int:
  """``pask-jax report``: markdown table + accuracy-vs-B plot from eval run directories."""
  from pask_jax import evaluate as E
  try:
    print(E.report(args.runs, args.out), end="")
  except ValueError as e:
    raise SystemExit(f"error: {e}")
  print(f"wrote {args.out}/report.md and {args.out}/accuracy_vs_B.png", file=sys.stderr)
  return 0


def cmd_merge(args) -> int:
  """``pask-jax merge``: one run directory from runs of one configuration over disjoint slices."""
  from pask_jax import evaluate as E
  try:
    meta = E.merge(args.runs, args.out)
  except ValueError as e:
    raise SystemExit(f"error: {e}")
  o = meta["categories"]["overall"]
  print(f"{meta['method']} B={meta['budget']:g}: {o['n']} cases, accuracy "
        f"{100 * o['accuracy']:.2f}%, measured B {o['total_B']:.3f}; wrote {args.out}",
        file=sys.stderr)
  return 0


def main(argv: list[str] | None = None) -> int:
  _pick_platform()
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
  g.add_argument("--tool-format", choices=["fenced_json", "tool_call_tags", "json_list"],
                 help="tool-call format (default: per model family, see pask_jax.grammar)")
  g.add_argument("--max-tokens", type=int, default=64)
  g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
  g.add_argument("--top-p", type=float, default=1.0)
  g.add_argument("--seed", type=int, default=0)
  g.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto")
  g.add_argument("--raw", action="store_true", help="do not apply the chat template")
  g.add_argument("--policy", default=None,
                 help="decode under PASK with this policy: all-high, demo, or a policy directory "
                      "(default: Full KV)")
  s = sub.add_parser("serve", help="OpenAI-compatible server with continuous batching (PASK)")
  s.add_argument("--model", default=None, help="as for generate (default: smollm2-135m-instruct)")
  s.add_argument("--policy", default="all-high", help="all-high (default), demo, or a policy dir")
  s.add_argument("--host", default="127.0.0.1")
  s.add_argument("--port", type=int, default=8000)
  s.add_argument("--slots", type=int, default=4, help="decode batch size")
  s.add_argument("--context", type=int, default=2048,
                 help="most tokens (prompt + max_tokens) per request")
  s.add_argument("--page", type=int, default=16, help="tokens per KV page")
  s.add_argument("--hi-pages", type=int, default=None,
                 help="BF16 pool size in pages (default: every slot at full context)")
  s.add_argument("--lo-pages", type=int, default=None,
                 help="INT4 pool size in pages (default: as --hi-pages if the policy emits L)")
  s.add_argument("--default-max-tokens", type=int, default=256)
  s.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto")
  s.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                 help="model name(s) requests must use (default: --model, or "
                      "smollm2-135m-instruct); responses carry the first")
  s.add_argument("--max-body-bytes", type=int, default=2 << 20,
                 help="largest request body (bytes); larger ones get a 413")
  s.add_argument("--max-json-depth", type=int, default=64,
                 help="deepest JSON nesting of a request body; deeper ones get a 400")
  s.add_argument("--grammar-timeout", type=float, default=10.0,
                 help="CPU seconds one grammar (schema or tool set) may take to compile")
  s.add_argument("--log-level", default="info",
                 choices=["critical", "error", "warning", "info", "debug", "trace"])
  sub.add_parser("compare-kernels", help="compare the GPU and TPU attention kernels", add_help=False)
  from pask_jax.baselines import METHODS
  e = sub.add_parser("eval", help="accuracy and measured KV budget of one method on BFCL")
  e.add_argument("--model", default=None, help="as for generate (default: smollm2-135m-instruct)")
  e.add_argument("--task", choices=["bfcl"], default="bfcl")
  e.add_argument("--split", choices=["cal", "dev", "test"], default="test")
  e.add_argument("--method", required=True, help="one of " + ", ".join(METHODS))
  e.add_argument("--budget", type=float, default=1.0, help="target measured B in (0, 1]")
  e.add_argument("--policy", default=None, help="PASK policy directory (--method pask)")
  e.add_argument("--knobs", default=None, help="knobs.json from pask-jax tune (dev-tuned)")
  e.add_argument("--max-cases", type=int, default=None, help="at most N cases per category")
  e.add_argument("--skip-cases", type=int, default=0,
                 help="leave out the first N cases per category (run a later slice; pool the "
                      "slices with pask-jax merge)")
  e.add_argument("--categories", nargs="+", default=None,
                 help="BFCL categories (default: the four non-live ones)")
  e.add_argument("--max-tokens", type=int, default=128)
  e.add_argument("--batch", type=int, default=64, help="sequences per generation batch")
  e.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto")
  e.add_argument("--out", required=True, help="output directory")
  t = sub.add_parser("tune", help="tune baseline knobs on the development split (paper C.3)")
  t.add_argument("--model", default=None)
  t.add_argument("--task", choices=["bfcl"], default="bfcl")
  t.add_argument("--methods", nargs="+", default=["h2o", "snapkv", "mikv"])
  t.add_argument("--budget", type=float, default=0.33, help="target B the knobs are tuned at")
  t.add_argument("--grid", choices=["small", "paper"], default="small")
  t.add_argument("--split", choices=["cal", "dev"], default="dev")
  t.add_argument("--max-cases", type=int, default=None, help="at most N cases per category")
  t.add_argument("--categories", nargs="+", default=None)
  t.add_argument("--max-tokens", type=int, default=128)
  t.add_argument("--batch", type=int, default=64)
  t.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto")
  t.add_argument("--out", required=True, help="output directory (knobs.json, tune.csv)")
  from calibrate import cli as calibrate_cli
  calibrate_cli.add_parser(sub)
  mg = sub.add_parser("merge", help="pool eval runs of one configuration over disjoint slices")
  mg.add_argument("runs", nargs="+", help="eval output directories (same method, budget, split)")
  mg.add_argument("--out", required=True)
  r = sub.add_parser("report", help="markdown table + accuracy-vs-B plot of eval runs")
  r.add_argument("runs", nargs="+", help="eval output directories")
  r.add_argument("--out", required=True)
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
    return cmd_serve(args)
  if args.cmd == "report":
    return cmd_report(args)
  if args.cmd == "merge":
    return cmd_merge(args)
  if args.cmd == "calibrate":
    return calibrate_cli.run(args)
  if args.cmd in ("eval", "tune"):
    if args.max_tokens <= 0:
      ap.error("--max-tokens must be positive")
    if args.batch <= 0:
      ap.error("--batch must be positive")
    if args.cmd == "tune":
      return cmd_tune(args)
    return cmd_eval(args)
  if args.max_tokens <= 0:
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
