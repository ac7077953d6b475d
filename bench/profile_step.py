"""Device profile of a jitted step, reduced to a per-op-class table (issue 12, deliverable 1).

``profile(fn, n_steps, out_dir, name)`` runs ``fn()`` (one whole step, blocking) ``n_steps``
times under ``jax.profiler.trace`` (a perfetto trace), then :func:`table` reads the trace and sums
device time per class of op:

* the class is the named scope the op was traced under (``models.decoder`` and the runners
  label ``qkv``, ``out_proj``, ``mlp``, ``lm_head``, ``norm``, ``rope``, ``attention``,
  ``cache_write``, ``controller``, ``ledger``, ``sample``), found in the event's arguments (XLA
  puts the HLO op's ``op_name`` metadata there); otherwise a guess from the kernel name
  (gemm / scatter / the Pallas kernels / copy / other); a collective (NCCL kernel, XLA
  all-reduce / all-gather / …: tensor parallelism) is ``collective`` whatever its scope;
* ``host gap`` = wall time per step minus device busy time per step (launch gaps, host work,
  transfers the device waits for).

``python bench/profile_step.py TRACE_DIR`` prints the table of a trace made elsewhere.
"""
from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import sys
import time

SCOPES = ("qkv", "out_proj", "mlp", "lm_head", "norm", "rope", "attention", "cache_write",
          "controller", "ledger", "sample")
_NAME_RULES = (
    ("attention", re.compile(r"pask_decode_attention|decode_attention|paged_attention", re.I)),
    ("matmul (unscoped)", re.compile(r"gemm|cublas|cutlass|xmma|gemv|sm90|dot", re.I)),
    ("cache_write", re.compile(r"scatter|dynamic.update", re.I)),
    ("copy / slice", re.compile(r"copy|dynamic.slice|transpose|concatenate", re.I)),
    ("memset / memcpy", re.compile(r"memset|memcpy|MemcpyH|MemcpyD", re.I)),
)


def scopes_from_hlo(hlo_text: str) -> dict[str, str]:
  """Kernel name (HLO instruction name, '.' -> '_') -> its op_name metadata (named scopes)."""
  out = {}
  for m in re.finditer(r"^\s*(?:ROOT )?%?([\w.\-]+) = .*?op_name=\"([^\"]*)\"", hlo_text, re.M):
    out[m.group(1).replace(".", "_").replace("-", "_")] = m.group(2)
  return out


# Cross-device collectives (tensor parallelism: NCCL's kernels, XLA's collective ops), a class of
# their own whatever named scope they were inserted under (the SPMD partitioner gives an
# all-reduce the op_name of the matmul whose partial sums it adds).
COLLECTIVE = re.compile(r"nccl|all[-_]?reduce|all[-_]?gather|reduce[-_]?scatter|"
                        r"collective[-_]?permute|all[-_]?to[-_]?all", re.I)


def classify(name: str, args: dict, op_names: dict | None = None) -> str:
  if COLLECTIVE.search(name):
    return "collective"
  text = " ".join(str(v) for v in args.values()) if args else ""
  if op_names:
    text += " " + op_names.get(name, op_names.get(re.sub(r"_\d+$", "", name), ""))
  for scope in SCOPES:   # the innermost scope wins: attention/cache_write before attend
    if re.search(rf"(^|/){scope}(/|$|\b)", text):
      return scope
  for cls, rx in _NAME_RULES:
    if rx.search(name):
      return cls
  return "other"


def _device_pids(meta: list[dict]) -> set:
  pids = set()
  for e in meta:
    if e.get("name") == "process_name":
      n = str(e.get("args", {}).get("name", ""))
      if re.search(r"/device:(GPU|TPU)|GPU:\d|TPU:\d", n):
        pids.add(e["pid"])
  return pids


def table(trace_dir: str, n_steps: int | None = None, wall_s: float | None = None,
          op_names: dict | None = None) -> dict:
  """{class: device µs per step} (+ "device busy", "host gap" when wall time is known)."""
  paths = sorted(glob.glob(os.path.join(trace_dir, "**", "*perfetto_trace.json.gz"),
                           recursive=True))
  if not paths:
    paths = sorted(glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True))
  if not paths:
    raise FileNotFoundError(f"no trace under {trace_dir}")
  d = json.load(gzip.open(paths[-1]))
  ev = d["traceEvents"] if isinstance(d, dict) else d
  dev = _device_pids([e for e in ev if e.get("ph") == "M"])
  per = collections.Counter()
  names = collections.Counter()
  spans = []
  for e in ev:
    if e.get("ph") != "X" or e.get("pid") not in dev:
      continue
    dur = float(e.get("dur", 0.0))
    cls = classify(e.get("name", ""), e.get("args") or {}, op_names)
    per[cls] += dur
    names[(cls, e.get("name", "")[:60])] += dur
    spans.append((float(e["ts"]), float(e["ts"]) + dur))
  # Busy time = union of kernel intervals (streams may overlap).
  busy, end = 0.0, -1.0
  for a, b in sorted(spans):
    if b > end:
      busy += b - max(a, end)
      end = b
  n = n_steps or 1
  out = {k: v / n for k, v in sorted(per.items(), key=lambda kv: -kv[1])}
  out["device busy"] = busy / n
  if wall_s is not None:
    out["wall"] = wall_s * 1e6
    out["host gap"] = max(0.0, wall_s * 1e6 - busy / n)
  out["_top_kernels"] = [(c, nm, round(t / n, 1)) for (c, nm), t in names.most_common(15)]
  out["_host_calls"] = host_calls(ev, dev, n)
  out["_device_pids"] = len(dev)
  return out


# Host-side events that say how a step reaches the device: driver launches (a kernel launched on
# its own vs a CUDA graph launch of a captured command buffer), copies, synchronizations, and
# XLA's thunk annotations.
_HOST_RX = re.compile(r"^(cu[A-Z]\w*|cuda[A-Z]\w*)$|Thunk|CommandBuffer|[Gg]raph", re.I)


def host_calls(ev: list, dev: set, n: int) -> list:
  """[(name, calls per step, host µs per step)] of the host-side launch/copy/sync events and
  thunk annotations, most time first."""
  cnt, dur = collections.Counter(), collections.Counter()
  for e in ev:
    if e.get("ph") != "X" or e.get("pid") in dev:
      continue
    nm = e.get("name", "")
    if _HOST_RX.search(nm):
      key = re.sub(r"[:#]\d+.*$", "", nm)[:60]
      cnt[key] += 1
      dur[key] += float(e.get("dur", 0.0))
  return [(k, round(cnt[k] / n, 1), round(dur[k] / n, 1)) for k, _ in dur.most_common(20)]


def profile(fn, n_steps: int, out_dir: str, name: str, hlo_text: str | None = None) -> dict:
  """Trace ``n_steps`` calls of ``fn`` (already compiled and warm; returns what to block on)
  -> :func:`table`.  ``hlo_text``: the compiled step's HLO, to label kernels by named scope."""
  import jax
  d = os.path.join(out_dir, name)
  os.makedirs(d, exist_ok=True)
  with jax.profiler.trace(d, create_perfetto_trace=True):
    t0 = time.perf_counter()
    out = None
    for _ in range(n_steps):
      out = fn()
    jax.block_until_ready(out)
    wall = (time.perf_counter() - t0) / n_steps
  return table(d, n_steps, wall, scopes_from_hlo(hlo_text) if hlo_text else None)


def format_table(name: str, t: dict) -> str:
  lines = [f"## {name}: device µs per step"]
  for k, v in t.items():
    if not k.startswith("_"):
      lines.append(f"  {k:20s} {v:10.1f}")
  lines.append("  top kernels: " + "; ".join(f"{c}:{n} {us}" for c, n, us in t["_top_kernels"][:8]))
  if t.get("_host_calls"):
    lines.append("  host calls per step (name, calls, µs): " + "; ".join(
        f"{n} {c} {us}" for n, c, us in t["_host_calls"][:12]))
  return "\n".join(lines)


if __name__ == "__main__":
  print(format_table(sys.argv[1], table(sys.argv[1])))
