"""Tensor-parallel benchmark (issue 29): one run per machine kind, every TP size its devices allow.

Three parts (``--parts``, all by default), each row one JSON line in ``OUT/results.jsonl`` as soon
as it is measured, then ``OUT/summary.json`` and ``OUT/summary.md``:

* ``serving`` — the serving matrix of ``bench/bench_serving.py`` (its prompts, grammar, policies
  and :func:`bench.bench_serving.run_cell`) at one input / output length (``--context``,
  ``--max-tokens``; default 32K in / 1024 out, the Qwen3-4B shape with random weights) for
  ``pask`` (the B ≈ 0.33 bench policy), ``full`` (all-high through the paged engine) and ``xla``
  (plain-XLA dense Full KV) at every concurrency in ``--concurrency`` and every TP size in
  ``--tp`` (default: 1, 2, 4 as far as ``jax.device_count()`` goes): the engine on
  ``pask_jax.mesh.serving_mesh(N)``, the KV budget ``--kv-memory`` per device (so TP = N holds
  about N times the pages; a cell that does not fit is an ``infeasible`` row).  Each TP size gets
  a fresh random model of the same seed (the same weights).  Per row: TPOT median / p90, TTFT,
  throughput (output tokens / wall time), decode tokens/s, measured B, and a digest of every
  request's greedy tokens (``tokens_digest``, the first request's first 32 in ``tokens_first``).
  Summary: per (method, concurrency) the throughput at each TP and the scaling efficiency
  ``tokens/s at TP=N / (N × tokens/s at TP=1)``, and whether the tokens equal TP = 1's (on a
  CPU in float32 they do; in bf16 on GPUs the partial sums add in another order, so a
  difference there is a reduction-order effect, not an error).
  ``--trace N``: trace N engine iterations of every cell once in steady state
  (``bench/profile_step.py``; device events only, so GPU/TPU) and report the collective share:
  the device time of NCCL / all-reduce / all-gather kernels over all device kernel time, summed
  over the devices (``collective_share``; ``profile`` holds the per-class µs per step, summed
  over devices).  Without ``--trace`` the all-reduce time is not measured: the scaling
  efficiency then folds it in with everything else that does not shrink with N (host work,
  launches, the replicated controller, sampling and ledger).
* ``capacity`` — host arithmetic, no device work: the Qwen3-14B shape (``--capacity-shape``: 40
  layers, 40 query / 8 KV heads, d 128) at the same context: the largest concurrency that fits at
  each TP size for ``pask`` / ``full`` / ``xla``, from the engine's own pool sizing
  (:func:`bench.bench_serving.cell_fit`, i.e. ``serve.engine.size_pools`` with ``shards=N``)
  under the per-device budget ``--gpu-memory-utilization`` (0.9) of ``--device-memory``
  (default: an H200's 143771 MiB, wherever the script runs) after the bf16 weights (1/N of them
  per device, norms replicated) and the prefill scratch
  (``serve.engine.kv_bytes_for_utilization``, as ``serve --gpu-memory-utilization`` sizes
  it).  TP sizes the shape's KV heads do not split into are rows with the reason.
* ``calib`` — the stacked calibration step (``calibrate.stack.run_stack``: V policies × N
  requests as V·N rows of one generation loop) with the policy axis sharded over 1, 2, 4 devices
  (``runner_factory(devices=)``, the ``rows`` mesh: data parallel, the model replicated), the
  same ``--calib-rows`` in all (strong scaling) on the synthetic tool-call task, at most
  ``--calib-tokens`` tokens per row: rows per second and row tokens per second of the second of
  two runs (the first compiles), and the token digest (equal across device counts).

Multi-GPU runs keep NVLink multicast off (``NCCL_NVLS_ENABLE=0``,
``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``, ``NVSHMEM_DISABLE_NVLS=1`` set here unless already set).
On a CPU, fake devices: ``XLA_FLAGS=--xla_force_host_platform_device_count=4``.

    XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu \\
      python bench/bench_tp.py --shape tiny --context 256 --max-tokens 8 --concurrency 2 \\
        --calib-rows 8 --calib-tokens 8 --out /tmp/tp
    python bench/bench_tp.py --tokenizer bench/out/tok --out runs/tp     # one GPU host: defaults
    python bench/bench_tp.py --merge runs/tp1 runs/tp2 runs/tp4 --out runs/tp  # calls per TP size
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import json
import math
import os
import sys
import time
import types

from bench import bench_serving as BS

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1"}
QWEN3_14B = dict(arch="qwen3", vocab_size=151936, hidden=5120, intermediate=17408, n_layers=40,
                 n_heads=40, n_kv_heads=8, head_dim=128, rope_theta=1e6, tie_embeddings=False,
                 max_position=40960, name="Qwen3-14B shape (random weights)")
# bench_serving's tiny shape with 4 KV heads (whole GQA groups on 4 devices); the capacity part's
# tiny shape is deeper and untied, as the 14B is.
TINY = dict(BS.TINY, n_heads=8, n_kv_heads=4, head_dim=16, name="tiny qwen3, 4 KV heads")
TINY_CAPACITY = dict(TINY, n_layers=5, tie_embeddings=False, name="tiny qwen3, 5 layers, untied")
PARTS = ("serving", "capacity", "calib")
H200_BYTES = 143771 * 2**20   # one H200's memory as nvidia-smi reports it


def shape_spec(name: str, vocab: int) -> dict:
  """A shape's config fields; the tiny ones take the tokenizer's vocabulary, rounded up to a
  multiple of 128 (so up to 128 devices split it)."""
  from bench.bench_decode import SHAPES
  if name in ("tiny", "tiny-capacity"):
    return dict(TINY if name == "tiny" else TINY_CAPACITY, vocab_size=-(-vocab // 128) * 128)
  if name == "qwen3-14b":
    return dict(QWEN3_14B)
  if name not in SHAPES:
    raise SystemExit(f"error: unknown shape {name!r}; choose tiny, qwen3-14b or one of "
                     f"{', '.join(SHAPES)}")
  return dict(SHAPES[name])


def weight_bytes(cfg, shards: int = 1, itemsize: int = 2) -> int:
  """Bytes of the model's weights on each of ``shards`` devices (``pask_jax.mesh``: attention,
  MLP, embeddings and lm_head split 1/N, the norms replicated)."""
  d, L, f, V = cfg.hidden, cfg.n_layers, cfg.intermediate, cfg.vocab_size
  q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
  split = L * (2 * d * q + 2 * d * kv + 3 * d * f) + V * d * (1 if cfg.tie_embeddings else 2)
  split += L * (q + 2 * kv) if cfg.qkv_bias else 0
  rep = L * 2 * d + d + (L * 2 * cfg.head_dim if cfg.qk_norm else 0)
  return (split // shards + rep) * itemsize


def max_concurrency(cfg, policy, method: str, n_tokens: int, context: int, page: int,
                    kv_bytes: int, mix, shards: int) -> int:
  """The most requests of ``n_tokens`` that an engine with as many slots holds in ``kv_bytes``
  (per device): :func:`bench.bench_serving.cell_fit` searched over the slot count (the slots'
  windows and tables come out of the same budget, so the fit falls as the slots grow)."""
  fit = lambda c: BS.cell_fit(cfg, policy, method, c, n_tokens, context, page, kv_bytes, mix,
                              shards)[0]
  if method == "xla":
    return fit(1)
  if fit(1) < 1:
    return 0
  lo, hi = 1, 2
  while fit(hi) >= hi and hi < 1 << 20:
    lo, hi = hi, 2 * hi
  while hi - lo > 1:
    mid = (lo + hi) // 2
    lo, hi = (mid, hi) if fit(mid) >= mid else (lo, mid)
  return lo


def digest(tokens) -> str:
  return hashlib.sha1(json.dumps(tokens).encode()).hexdigest()[:16]


def collective_share(profile: dict | None) -> float | None:
  """Collective device time over all device kernel time (both summed over the devices)."""
  if not profile:
    return None
  skip = ("device busy", "wall", "host gap")
  total = sum(v for k, v in profile.items() if k not in skip and not k.startswith("_"))
  return profile.get("collective", 0.0) / total if total else None


# ---- parts --------------------------------------------------------------------------------------

def serving(a, cfg, tok, dtype, tps, kv_bytes, emit, deadline) -> None:
  import jax.numpy as jnp
  from models import random_model
  from pask_jax import mesh as tp
  from pask_jax import policy as P
  from pask_jax.decode import Runner
  from pask_jax.grammar import DEFAULT_STYLE, GrammarCompiler, tool_call_grammar
  from serve.engine import DenseEngine, Engine
  n_in, n_out = a.context, a.max_tokens
  ctx = -(-(n_in + n_out) // a.page) * a.page
  fmt, indent = DEFAULT_STYLE.get(cfg.arch, ("json_list", None))
  ids, tags = BS.make_prompt(tok, fmt, n_in)
  grammar = tool_call_grammar(GrammarCompiler(tok, cfg.vocab_size), BS.row_tools(n_out), fmt,
                              max_calls=1, indent=indent, check=False)
  pols = {"pask": BS.bench_policy(cfg), "full": P.all_high(cfg), "xla": P.all_high(cfg)}
  pask_mix = BS.plan_mix(pols["pask"], tags, n_in, n_out)
  for n in tps:
    if time.perf_counter() + a.build_margin > deadline:
      print(f"# time limit: serving at TP={n} and above left out", flush=True)
      return
    mesh = tp.serving_mesh(n, cfg)
    model = random_model(cfg, seed=0, dtype=dtype)   # the same weights at every TP size
    base = Runner(model, batch=1, capacity=ctx, cache_dtype=jnp.bfloat16, mesh=mesh)
    pre = BS.MemoPrefill(base) if a.prefill_memo else base
    for meth in a.methods:
      for c in sorted(a.concurrency):
        mix = pask_mix if meth == "pask" else (1.0, 0.0)
        row = {"part": "serving", "model": cfg.name, "tp": n, "method": meth, "input": n_in,
               "output": n_out, "concurrency": c, "context": ctx, "kv_budget_bytes": kv_bytes,
               "mix": mix, "prefill_memo": a.prefill_memo}
        fit, why = BS.cell_fit(cfg, pols[meth], meth, c, n_in + n_out, ctx, a.page, kv_bytes,
                               mix if meth == "pask" else None, shards=n)
        row["fit_expected"] = fit
        if fit < c:
          emit(dict(row, status="infeasible", reason=why or f"{c} requests of {n_in + n_out} "
                    f"tokens do not fit {kv_bytes / 1e9:.3g} GB per device (about {fit} do)"))
          continue
        t0 = time.perf_counter()
        if t0 + a.build_margin > deadline:
          emit(dict(row, status="skipped", reason="time limit"))
          continue
        if meth == "xla":
          eng = DenseEngine(model, tok, pols[meth], slots=c, context=ctx, page=a.page,
                            kv_bytes=kv_bytes, prefiller=pre, mesh=mesh)
        else:
          eng = Engine(model, tok, pols[meth], slots=c, context=ctx, page=a.page,
                       kv_bytes=kv_bytes, mix=mix, prefiller=pre, mesh=mesh,
                       lo_format=a.lo_format)
        row["build_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        BS.run_cell(eng, tok, grammar, ids, tags, 2, 1, deadline)   # compiles
        row["warmup_s"] = time.perf_counter() - t0
        prof = (os.path.join(a.out, "trace"), f"tp{n}_{meth}_c{c}", a.trace) if a.trace else None
        row.update(BS.run_cell(eng, tok, grammar, ids, tags, n_out, c, deadline, prof,
                               keep_tokens=True))
        toks = row.pop("tokens")
        row.update(tokens_digest=digest(toks), tokens_first=toks[0][:32] if toks else None,
                   sizing=eng.sizing.as_dict(), collective_share=collective_share(
                       row.get("profile")), **BS.device_memory())
        emit(row)
        del eng
        gc.collect()
    del base, pre, model
    gc.collect()


def capacity(a, tok, tps, emit) -> None:
  from models import ModelConfig
  from pask_jax import mesh as tp
  from pask_jax import policy as P
  from pask_jax.grammar import DEFAULT_STYLE
  from serve.engine import kv_bytes_for_utilization
  cfg = ModelConfig(**shape_spec(a.capacity_shape, tok.vocab_size))
  n_in, n_out = a.context, a.max_tokens
  ctx = -(-(n_in + n_out) // a.page) * a.page
  ids, tags = BS.make_prompt(tok, DEFAULT_STYLE.get(cfg.arch, ("json_list", None))[0], n_in)
  pols = {"pask": BS.bench_policy(cfg), "full": P.all_high(cfg), "xla": P.all_high(cfg)}
  mixes = {"pask": BS.plan_mix(pols["pask"], tags, n_in, n_out), "full": None, "xla": None}
  mem, mem_src = ((int(a.device_memory * 1e9), "--device-memory") if a.device_memory is not None
                  else (H200_BYTES, "H200: 143771 MiB (nvidia-smi)"))
  for n in tps:
    row = {"part": "capacity", "model": cfg.name, "tp": n, "input": n_in, "output": n_out,
           "context": ctx, "device_memory_bytes": mem, "device_memory_source": mem_src,
           "gpu_memory_utilization": a.gpu_memory_utilization}
    try:
      tp.check(cfg, n)
    except ValueError as e:
      emit(dict(row, status="skipped", reason=str(e)))
      continue
    w = weight_bytes(cfg, n)
    dev = types.SimpleNamespace(id=0, platform="gpu", memory_stats=lambda w=w: {
        "bytes_limit": mem, "bytes_in_use": w})
    kv = kv_bytes_for_utilization(a.gpu_memory_utilization, cfg, ctx, [dev], shards=n)
    row.update(weights_bytes_per_device=w, kv_bytes_per_device=kv)
    if kv <= 0:
      emit(dict(row, status="infeasible", reason="the weights and prefill scratch fill the "
                "device", max_concurrency={m: 0 for m in pols}))
      continue
    fits = {m: max_concurrency(cfg, pols[m], m, n_in + n_out, ctx, a.page, kv, mixes[m], n)
            for m in pols}
    emit(dict(row, status="ok", max_concurrency=fits, pask_mix=mixes["pask"],
              pask_over_full=fits["pask"] / fits["full"] if fits["full"] else None))


def calibration(a, cfg, tok, dtype, tps, emit, deadline) -> None:
  import jax
  from calibrate import stack as S
  from calibrate import tasks
  from models import random_model
  from pask_jax.grammar import GrammarCompiler
  model = random_model(cfg, seed=0, dtype=dtype)
  N = a.calib_requests
  task = tasks.SyntheticTask(tok, GrammarCompiler(tok, cfg.vocab_size), N, seed=0)
  task.expected = [[{"name": "set_mode", "arguments": {"mode": "eco", "level": "low"}}]] * N
  step = math.lcm(*tps)   # policies a multiple of every device count: the same rows in all
  V = max(step, a.calib_rows // N // step * step)
  pol = BS.bench_policy(cfg)
  cap = -(-(max(len(r.ids) for r in task.requests) + a.calib_tokens + 1) // a.page) * a.page
  for n in tps:
    row = {"part": "calib", "model": cfg.name, "devices": n, "rows": V * N, "policies": V,
           "requests": N, "max_tokens": a.calib_tokens, "capacity": cap}
    if time.perf_counter() + a.build_margin > deadline:
      emit(dict(row, status="skipped", reason="time limit"))
      continue
    rf = S.runner_factory(model, pol, cap, page=a.page, devices=jax.devices()[:n])
    run = lambda: S.run_stack(rf, task, [pol] * V, rows=V * N, max_tokens=a.calib_tokens)
    t0 = time.perf_counter()
    run()                                    # compiles
    t1 = time.perf_counter()
    out = run()
    wall = time.perf_counter() - t1
    toks = [o.tokens for r in out for o in r]
    n_tok = sum(len(t) for t in toks)
    emit(dict(row, status="ok", first_run_s=t1 - t0, wall_s=wall, rows_per_s=V * N / wall,
              row_tokens=n_tok, row_tokens_per_s=n_tok / wall, tokens_digest=digest(toks)))


# ---- summary ------------------------------------------------------------------------------------

def summarize(rows) -> dict:
  """Scaling efficiency and token identity per (method, concurrency); capacity per TP; the
  calibration's rows/s per device count."""
  ok = lambda r: r.get("status") == "ok"
  serve = [r for r in rows if r.get("part") == "serving" and ok(r)]
  out = {"serving": [], "capacity": [], "calib": []}
  for key in dict.fromkeys((r["method"], r["concurrency"]) for r in serve):
    cells = {r["tp"]: r for r in serve if (r["method"], r["concurrency"]) == key}
    one = cells.get(1)
    for n, r in sorted(cells.items()):
      t = r.get("throughput_tok_s")
      out["serving"].append({
          "method": key[0], "concurrency": key[1], "tp": n, "tpot_ms_median": r["tpot_ms_median"],
          "throughput_tok_s": t, "decode_tok_s": r.get("decode_tok_s"),
          "measured_B": r.get("measured_B"),
          "efficiency": t / (n * one["throughput_tok_s"]) if one and t else None,
          "tokens_match_tp1": r["tokens_digest"] == one["tokens_digest"] if one else None,
          "collective_share": r.get("collective_share")})
  for r in rows:
    if r.get("part") == "capacity":
      out["capacity"].append({k: r.get(k) for k in (
          "model", "tp", "status", "kv_bytes_per_device", "max_concurrency", "pask_over_full",
          "reason")})
  cal = [r for r in rows if r.get("part") == "calib" and ok(r)]
  one = next((r for r in cal if r["devices"] == 1), None)
  for r in cal:
    out["calib"].append({
        "devices": r["devices"], "rows": r["rows"], "rows_per_s": r["rows_per_s"],
        "row_tokens_per_s": r["row_tokens_per_s"],
        "efficiency": r["rows_per_s"] / (r["devices"] * one["rows_per_s"]) if one else None,
        "tokens_match_1": r["tokens_digest"] == one["tokens_digest"] if one else None})
  return out


def write_summary(rows, out: str, meta: dict) -> dict:
  s = dict(summarize(rows), **meta)
  with open(os.path.join(out, "summary.json"), "w") as f:
    json.dump(s, f, indent=1)
  f4 = lambda v: f"{v:.4g}" if isinstance(v, float) else "" if v is None else str(v)
  md = [f"# bench_tp: {meta['device']} × {meta['device_count']}", ""]
  for part, cols in (("serving", ("method", "concurrency", "tp", "tpot_ms_median",
                                  "throughput_tok_s", "efficiency", "tokens_match_tp1",
                                  "collective_share")),
                     ("capacity", ("model", "tp", "status", "kv_bytes_per_device",
                                   "max_concurrency", "pask_over_full")),
                     ("calib", ("devices", "rows", "rows_per_s", "row_tokens_per_s",
                                "efficiency", "tokens_match_1"))):
    md += [f"## {part}", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    md += ["| " + " | ".join(f4(r.get(c)) for c in cols) + " |" for r in s[part]]
    md.append("")
  with open(os.path.join(out, "summary.md"), "w") as f:
    f.write("\n".join(md))
  return s


def merge(dirs, out: str) -> int:
  rows, meta = [], None
  for d in dirs:
    rows += [json.loads(line) for line in open(os.path.join(d, "results.jsonl"))]
    if meta is None and os.path.exists(os.path.join(d, "summary.json")):
      meta = {k: v for k, v in json.load(open(os.path.join(d, "summary.json"))).items()
              if k not in ("serving", "capacity", "calib")}
  meta = dict(meta or {"device": "?", "device_count": "?"}, merged=list(dirs))
  # a row measured in several runs: the last run's
  key = lambda r: json.dumps({k: r.get(k) for k in ("part", "model", "tp", "devices", "method",
                                                    "concurrency")})
  rows = list({key(r): r for r in rows}.values())
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, "results.jsonl"), "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)
  write_summary(rows, out, meta)
  print(f"# merged {len(rows)} rows of {len(dirs)} runs into {out}", flush=True)
  return 0


# ---- driver -------------------------------------------------------------------------------------

def main(argv=None) -> int:
  for k, v in NO_MULTICAST.items():   # before JAX (and NCCL) start
    os.environ.setdefault(k, v)
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--out", required=True)
  ap.add_argument("--merge", nargs="+", default=None, metavar="DIR",
                  help="no run: the results.jsonl of earlier runs (e.g. one call per TP size) "
                       "into one OUT/results.jsonl and summary")
  ap.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
  ap.add_argument("--tp", type=int, nargs="+", default=None,
                  help="TP sizes / calibration device counts (default: 1 2 4, those the "
                       "devices allow)")
  ap.add_argument("--shape", default="qwen3-4b",
                  help="serving and calibration shape: tiny or a bench_decode shape")
  ap.add_argument("--capacity-shape", default=None,
                  help="the capacity part's shape (default: qwen3-14b; tiny-capacity with "
                       "--shape tiny)")
  ap.add_argument("--context", type=int, default=32768, help="input tokens")
  ap.add_argument("--max-tokens", type=int, default=1024, help="output tokens")
  ap.add_argument("--concurrency", type=int, nargs="+", default=[8, 16, 32])
  ap.add_argument("--methods", nargs="+", default=list(BS.METHODS), choices=BS.METHODS)
  ap.add_argument("--kv-memory", type=float, default=None, metavar="GB",
                  help="serving KV budget per device (default: 64 on a GPU; on a CPU Full KV "
                       "of the largest concurrency, +50%%)")
  ap.add_argument("--device-memory", type=float, default=None, metavar="GB",
                  help="capacity part: memory per device (default: an H200's 143771 MiB; "
                       "0.05 with --shape tiny)")
  ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
  ap.add_argument("--page", type=int, default=16)
  ap.add_argument("--lo-format", default="bytes", choices=["bytes", "int4"])
  ap.add_argument("--no-prefill-memo", dest="prefill_memo", action="store_false",
                  help="prefill every request (default: a prompt's dense prefill once per "
                       "engine, as bench_serving --prefill-memo; TTFT then excludes it)")
  ap.add_argument("--calib-rows", type=int, default=256, help="V·N rows of the stacked step")
  ap.add_argument("--calib-requests", type=int, default=8, help="N")
  ap.add_argument("--calib-tokens", type=int, default=64, help="max tokens per row")
  ap.add_argument("--trace", type=int, default=0, metavar="N",
                  help="trace N engine iterations of every serving cell: collective share")
  ap.add_argument("--tokenizer", default=None, help="as bench_serving's --tokenizer")
  ap.add_argument("--gguf", default=None, help="as bench_serving's --gguf")
  ap.add_argument("--time-limit", type=float, default=None, metavar="S")
  ap.add_argument("--build-margin", type=float, default=60.0, metavar="S",
                  help="with a time limit, start nothing that compiles with fewer S left")
  ap.add_argument("--compile-cache", default=os.path.join(os.path.expanduser("~"), ".cache",
                                                           "pask-jax", "xla"))
  a = ap.parse_args(argv)
  if min(a.concurrency + [a.context, a.max_tokens, a.calib_rows, a.calib_requests,
                          a.calib_tokens]) < 1:
    raise SystemExit("error: sizes must be positive")
  if a.merge:
    return merge(a.merge, a.out)
  t_start = time.perf_counter()
  deadline = t_start + a.time_limit if a.time_limit else float("inf")
  # every program cached (the engines of one TP size share most of theirs: a hit, not a compile)
  jax = BS.start_jax(a.compile_cache, min_compile_s=0)
  import jax.numpy as jnp
  from models import ModelConfig
  ndev = jax.device_count()
  tps = a.tp or [n for n in (1, 2, 4) if n <= ndev]
  if max(tps) > ndev or min(tps) < 1:
    raise SystemExit(f"error: --tp {tps}: this host has {ndev} {jax.default_backend()} devices")
  if a.capacity_shape is None:
    a.capacity_shape = "tiny-capacity" if a.shape == "tiny" else "qwen3-14b"
  if a.device_memory is None and a.shape == "tiny":
    a.device_memory = 0.05
  tok, tok_src = BS.load_tokenizer(a.gguf, a.tokenizer)
  cfg = ModelConfig(**shape_spec(a.shape, tok.vocab_size))
  if cfg.vocab_size < tok.vocab_size:
    raise SystemExit(f"error: the tokenizer ({tok_src}) has {tok.vocab_size} tokens, more than "
                     f"the {a.shape} shape's vocabulary of {cfg.vocab_size}")
  gpu = jax.default_backend() != "cpu"
  dtype = jnp.bfloat16 if gpu else jnp.float32
  from serve.engine import page_bytes
  ctx = -(-(a.context + a.max_tokens) // a.page) * a.page
  kv_gb = a.kv_memory if a.kv_memory is not None else (
      64.0 if gpu else 1.5 * max(a.concurrency) * ctx * page_bytes(cfg, a.page)[0] / a.page / 1e9)
  kv_bytes = int(kv_gb * 1e9)
  os.makedirs(a.out, exist_ok=True)
  out_path = os.path.join(a.out, "results.jsonl")
  open(out_path, "w").close()
  dev = jax.devices()[0]
  meta = {"device": dev.device_kind, "platform": jax.default_backend(), "device_count": ndev,
          "tp": tps, "shape": cfg.name, "context": a.context, "max_tokens": a.max_tokens,
          "kv_budget_bytes_per_device": kv_bytes, "tokenizer": os.path.basename(tok_src),
          "multicast_env": {k: os.environ.get(k) for k in NO_MULTICAST}}
  print(f"# bench_tp: {cfg.name}, {jnp.dtype(dtype).name}, {ndev} x {dev.device_kind}, TP {tps}, "
        f"parts {a.parts}", flush=True)
  rows = []

  def emit(row):
    rows.append(row)
    with open(out_path, "a") as f:
      f.write(json.dumps(row) + "\n")
    keys = ("part", "tp", "devices", "method", "concurrency", "status", "tpot_ms_median",
            "throughput_tok_s", "max_concurrency", "rows_per_s", "reason")
    print(json.dumps({k: row[k] for k in keys if k in row}), flush=True)

  meta["part_s"] = {}
  for part, run in (  # the host arithmetic first: always there, however the rest ends
      ("capacity", lambda: capacity(a, tok, tps, emit)),
      ("serving", lambda: serving(a, cfg, tok, dtype, tps, kv_bytes, emit, deadline)),
      ("calib", lambda: calibration(a, cfg, tok, dtype, tps, emit, deadline))):
    if part in a.parts:
      t0 = time.perf_counter()
      run()
      meta["part_s"][part] = round(time.perf_counter() - t0, 1)
  meta["wall_s"] = time.perf_counter() - t_start
  s = write_summary(rows, a.out, meta)
  for r in s["serving"] + s["calib"]:
    print("# " + json.dumps(r), flush=True)
  print(f"# wrote {out_path} ({len(rows)} rows) and summary.json / summary.md in "
        f"{meta['wall_s']:.0f} s (per part: {meta['part_s']})", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
