"""``pask-jax compare-kernels``: the GPU and TPU kernels side by side on a shape grid.

For every shape it reports, per backend: relative error norm against the jnp reference (native
run where that accelerator is present, Pallas interpret mode otherwise), whether the kernel
compiles (TPU: libtpu AOT per generation; GPU: PTX for sm_90a + ptxas, within its register and
shared-memory limits), the compiler's resource report (TPU: memory analysis; GPU: registers,
shared memory, spills; spilled bytes also as their own column: they cost speed, they do not
fail the comparison), the measured time and
effective bandwidth of a kernel on its own accelerator when present (``time_us``), the measured
wall time of a kernel in Pallas interpret mode otherwise (``interp_us``), the jnp reference
(XLA) on this host (``host_ref_us``), and per TPU generation a roofline ESTIMATE (K/V bytes / that
chip's HBM bandwidth; CSV and table only).  Writes ``compare_kernels.csv`` and ``.png`` to --out;
the picture shows only what was measured on the host it ran on, labelled with that host.

Shapes: ``B:Hq:Hkv:D:CTX`` separated by commas, e.g. ``--shapes 2:32:8:128:2048,1:14:2:64:4096``.
Each context is split as the B ~ 0.33 mix of the benchmark: 79.5% INT4, 12% BF16 pool incl. a
64-slot window, the rest released.
"""
from __future__ import annotations

import argparse
import csv
import os
import statistics
import time
import traceback

DEFAULT_SHAPES = "2:32:8:128:1024,2:14:2:64:1024,1:16:2:128:512"
PAGE, WIN = 16, 64


def _parse(spec: str):
  out = []
  for item in spec.split(","):
    try:
      b, hq, hkv, d, ctx = (int(x) for x in item.strip().split(":"))
    except ValueError:
      raise SystemExit(f"error: bad shape {item!r}: want B:Hq:Hkv:D:CTX, five integers") from None
    if min(b, hq, hkv, d, ctx) <= 0:
      raise SystemExit(f"error: bad shape {item!r}: every field must be positive")
    if hq % hkv or d % 2:
      raise SystemExit(f"bad shape {item!r}: Hq must be a multiple of Hkv and D even")
    out.append((b, hq, hkv, d, ctx))
  return out


def _lengths(ctx):
  win = min(WIN, ctx)
  lo = int(ctx * 0.795)
  hi = max(0, min(int(ctx * 0.122), ctx - lo - win))
  return lo, hi, win


def _kv_bytes(b, hkv, d, lo, hi, win):
  return b * hkv * (4 * d * (hi + win) + (d + 4) * lo)


def _time(fn, args, reps=20):
  import jax
  fn(*args).block_until_ready()
  ts = []
  for _ in range(reps):
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    ts.append(time.perf_counter() - t)
  return statistics.median(ts)


def run(shapes, out_dir, *, gens=None, log=print):
  import jax

  from pallas_kernels.testing import synth
  from pallas_kernels.gpu import aot as gpu_aot
  from pallas_kernels.gpu import decode_attention_gpu
  from pallas_kernels.tpu import aot as tpu_aot
  from pallas_kernels.tpu import decode_attention_tpu

  import functools

  from pallas_kernels import decode_attention

  gens = gens or sorted(tpu_aot.TOPOLOGIES)
  missing = missing_toolchains()
  if unknown := [g for g in gens if g not in tpu_aot.TOPOLOGIES]:
    raise ValueError(f"unknown TPU generation {', '.join(unknown)}; known: "
                     f"{', '.join(sorted(tpu_aot.TOPOLOGIES))}")
  plat = jax.default_backend()
  kind = jax.devices()[0].device_kind
  host = plat if kind.lower() == plat else f"{plat} ({kind})"
  xla_ref = jax.jit(functools.partial(decode_attention, backend="reference"))
  rows = []
  for b, hq, hkv, d, ctx in shapes:
    lo, hi, win = _lengths(ctx)
    shape = synth.Shape(b=b, hq=hq, hkv=hkv, d=d, page=PAGE, w=win,
                        lo_cap=-(-lo // PAGE) * PAGE, hi_cap=max(PAGE, -(-hi // PAGE) * PAGE))
    args = synth.make(shape, lo, hi, win, seed=b * 7 + d + ctx)
    nbytes = _kv_bytes(b, hkv, d, lo, hi, win)
    name = f"B{b} {hq}q/{hkv}kv d{d} ctx{ctx}"
    ref = synth.reference_f32(*args)
    base = dict(shape=name, kv_bytes=nbytes, host=host,
                host_ref_us=_time(xla_ref, args, reps=5) * 1e6)

    # GPU.
    row = dict(base, backend="gpu (pallas triton)")
    try:
      native = plat == "gpu"
      out = decode_attention_gpu(*args, interpret=not native)
      row["rel_err"] = synth.rel_err(out, ref)
      row["numerics"] = "native" if native else "interpret"
      if native:
        t = _time(decode_attention_gpu, args)
        row.update(time_us=t * 1e6, tbps=nbytes / t / 1e12)
      else:
        interp = functools.partial(decode_attention_gpu, interpret=True)
        row["interp_us"] = _time(interp, args, reps=5) * 1e6
    except Exception as e:
      row["rel_err"] = None
      row["error"] = f"{type(e).__name__}: {e}"[:200]
    if "gpu" in missing:
      row["compiled"] = None
      row["resources"] = f"compile not checked: {missing['gpu']}"
    else:
      try:
        reps = gpu_aot.report(decode_attention_gpu, *args)
        # Compiles = within sm_90a's register and shared-memory limits; spills (local-memory
        # traffic ptxas reports) cost speed, not correctness: a column, not a failure.
        row["compiled"] = all(fits(r) for r in reps)
        row["spills"] = sum((r.spill_stores or 0) + (r.spill_loads or 0) for r in reps)
        row["resources"] = "; ".join(f"sm_90a {r.summary()}" for r in reps)
      except Exception as e:
        row["compiled"] = False
        row["resources"] = f"compile failed: {type(e).__name__}: {e}"[:200]
    rows.append(row)
    log(_fmt(row))

    # TPU: numerics once (native or interpret), AOT compile and roofline estimate per generation.
    timed: dict = {}
    try:
      native = plat == "tpu"
      out = decode_attention_tpu(*args, interpret=not native)
      tpu_err, tpu_num = synth.rel_err(out, ref), "native" if native else "interpret"
      if native:
        t = _time(decode_attention_tpu, args)
        timed = dict(time_us=t * 1e6, tbps=nbytes / t / 1e12)
      else:
        interp = functools.partial(decode_attention_tpu, interpret=True)
        timed = dict(interp_us=_time(interp, args, reps=5) * 1e6)
    except Exception as e:
      tpu_err, tpu_num = None, f"failed: {type(e).__name__}"
    for gen in gens:
      row = dict(base, backend=f"tpu {gen} (pallas mosaic)", rel_err=tpu_err, numerics=tpu_num,
                 estimate_us=nbytes / tpu_aot.HBM_BW[gen] * 1e6, **timed)
      if "tpu" in missing:
        row["compiled"] = None
        row["resources"] = f"compile not checked: {missing['tpu']}"
        rows.append(row)
        log(_fmt(row))
        continue
      try:
        comp = tpu_aot.compile_for(gen, decode_attention_tpu, *args)
        mem = tpu_aot.memory_report(comp)
        row["compiled"] = True
        row["resources"] = (f"args {mem['argument_bytes']}B out {mem['output_bytes']}B "
                            f"temp {mem['temp_bytes']}B code {mem['code_bytes']}B")
      except Exception as e:
        row["compiled"] = False
        row["resources"] = f"compile failed: {type(e).__name__}: {e}"[:200]
      rows.append(row)
      log(_fmt(row))

  os.makedirs(out_dir, exist_ok=True)
  cols = ["shape", "backend", "numerics", "rel_err", "compiled", "spills", "resources",
          "time_us", "tbps",
          "interp_us", "host_ref_us", "host", "estimate_us", "kv_bytes", "error"]
  with open(os.path.join(out_dir, "compare_kernels.csv"), "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=cols)
    w.writeheader()
    for r in rows:
      w.writerow({c: r.get(c, "") for c in cols})
  plot(rows, os.path.join(out_dir, "compare_kernels.png"))
  return rows


AOT_HINT = "install the ahead-of-time compile extras: bash scripts/setup.sh --aot"


# jax's CUDA plugin registers the Triton compiler (Triton IR -> PTX) that the GPU compile check
# runs before ptxas; without it the check would fail with "Platform CUDA does not have a Triton
# compilation handler", which says nothing about the kernel.
CUDA_PLUGINS = ("jax_cuda13_plugin", "jax_cuda12_plugin")


def missing_toolchains() -> dict[str, str]:
  """What the compile checks need and this install lacks, by backend (``gpu``: jax's CUDA plugin,
  which carries Triton's compiler, and ptxas from CUDA >= 13; ``tpu``: libtpu): ``{backend:
  reason}``, empty when all are there.  The default CPU install has neither plugin nor libtpu
  (the ``aot`` extra adds them; a system CUDA toolkit may still put a ptxas on PATH): its rows
  say "not checked", not failed."""
  import importlib.util

  from pallas_kernels.gpu import aot as gpu_aot
  out = {}
  if not any(importlib.util.find_spec(n) is not None for n in CUDA_PLUGINS):
    out["gpu"] = f"jax's CUDA plugin (Triton's compiler) is not installed ({AOT_HINT})"
  else:
    try:
      gpu_aot.find_ptxas()
    except FileNotFoundError:
      out["gpu"] = f"no ptxas from CUDA >= 13 ({AOT_HINT})"
  if importlib.util.find_spec("libtpu") is None:
    out["tpu"] = f"libtpu is not installed ({AOT_HINT})"
  return out


def fits(rep) -> bool:
  """A Triton kernel's ptxas report is within sm_90a's register and shared-memory limits (what
  "compiled" means here; spills are reported, not failed)."""
  from pallas_kernels.gpu import aot as gpu_aot
  return (rep.registers is not None and rep.registers <= gpu_aot.SM90_MAX_REGS
          and rep.smem_bytes <= gpu_aot.SM90_MAX_SMEM)


def _fmt(r):
  err = "-" if r.get("rel_err") is None else f"{r['rel_err']:.1e}"
  t = (f"{r['time_us']:.1f}us {r['tbps']:.2f}TB/s" if "time_us" in r else
       f"{r['interp_us']:.0f}us interpret on {r['host']}" if "interp_us" in r else "-")
  est = f"~{r['estimate_us']:.2f}us (roofline estimate)" if "estimate_us" in r else "-"
  spills = f" spills {r['spills']}B" if r.get("spills") is not None else ""
  comp = {True: "yes", False: "NO", None: "n/a"}[r.get("compiled")]
  return (f"{r['shape']:28s} {r['backend']:24s} err {err:>8s} ({r.get('numerics', '-')}) "
          f"compiled {comp:3s}{spills} | {t} | {est} | "
          f"{r.get('resources', '')}")


def plot(rows, path):
  """Bars of what was MEASURED on this host, per shape: each kernel natively on its own
  accelerator, or its wall time in Pallas interpret mode (on a CPU host: an emulation, not
  kernel speed), and the jnp reference under XLA.  Roofline estimates for other chips are not
  drawn (they stay in the CSV and the table).  Returns the series drawn: {label: [µs per shape]}."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  shapes = list(dict.fromkeys(r["shape"] for r in rows))
  host = rows[0].get("host", "this host") if rows else "this host"
  series: dict[str, list] = {}

  def put(label, i, v):
    series.setdefault(label, [None] * len(shapes))
    if series[label][i] is None:
      series[label][i] = v

  for r in rows:
    i = shapes.index(r["shape"])
    kernel = ("tpu kernel (pallas mosaic)" if r["backend"].startswith("tpu") else
              f"{r['backend'].split(' (')[0]} kernel ({r['backend'].split(' (')[-1]}")
    if r.get("time_us"):
      put(f"{kernel}, native on {host}", i, r["time_us"])
    elif r.get("interp_us"):
      put(f"{kernel}, Pallas interpret mode on {host}", i, r["interp_us"])
    if r.get("host_ref_us"):
      put(f"jnp reference (XLA) on {host}", i, r["host_ref_us"])
  fig, ax = plt.subplots(figsize=(max(6, 2.2 * len(shapes)), 4.2))
  width = 0.8 / max(1, len(series))
  for j, (label, ys) in enumerate(series.items()):
    xs = [i + j * width for i, y in enumerate(ys) if y]
    ax.bar(xs, [y for y in ys if y], width, label=label,
           hatch="//" if "interpret" in label else None)
  ax.set_xticks([i + 0.4 - width / 2 for i in range(len(shapes))])
  ax.set_xticklabels(shapes, fontsize=7)
  ax.set_ylabel("measured microseconds per call (log)")
  ax.set_yscale("log")
  ax.set_title(f"decode attention, measured on {host}"
               + (" (interpret mode: CPU emulation, not kernel speed)"
                  if any("interpret" in k for k in series) else ""), fontsize=9)
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return series


# The TPU generations the AOT compile knows (pallas_kernels.tpu.aot.TOPOLOGIES; kept here too so
# that --tpu-gens is checked before JAX and libtpu load).
TPU_GENS = ("v5e", "v6e", "tpu7x")

CPU_HOST_NOTE = (
    "this host is a CPU: what it compares is each kernel's numerics (rel_err against the jnp "
    "reference, run in Pallas interpret mode) and whether it compiles for sm_90a and each TPU "
    "generation (resources, spills); it cannot compare kernel speeds: interp_us and host_ref_us "
    "are emulation and XLA-on-CPU wall times, estimate_us a roofline estimate; run on a GPU or "
    "TPU for time_us")


def gens_of(text: str | None) -> list[str] | None:
  """``--tpu-gens``: a comma list of known generations (None: all); one-line error otherwise."""
  if text is None:
    return None
  gens = [g.strip() for g in text.split(",") if g.strip()]
  bad = [g for g in gens if g not in TPU_GENS]
  if bad or not gens:
    raise SystemExit(f"error: unknown TPU generation {', '.join(bad) or repr(text)} in "
                     f"--tpu-gens; known: {', '.join(TPU_GENS)}")
  return list(dict.fromkeys(gens))


def quiet_libtpu() -> bool:
  """On a host without a TPU, give libtpu the single-host topology it would otherwise look up
  (and warn about, on stderr) when the AOT compile loads it, and let it load beside another
  process that holds it (here it only compiles: no chip to share); must run before libtpu
  loads.  A TPU host keeps its own environment.  Returns whether it set anything."""
  import glob
  if glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"):
    return False
  for k, v in (("TPU_HOST_BOUNDS", "1,1,1"), ("TPU_WORKER_HOSTNAMES", "localhost"),
               ("TPU_WORKER_ID", "0"), ("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")):
    os.environ.setdefault(k, v)
  return True


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(prog="pask-jax compare-kernels",
                               description=__doc__.split("\n\n")[0])
  ap.add_argument("--shapes", default=DEFAULT_SHAPES,
                  help=f"B:Hq:Hkv:D:CTX[,...] (default: {DEFAULT_SHAPES})")
  ap.add_argument("--out", default="compare_kernels_out",
                  help="folder for the CSV and PNG (default: compare_kernels_out)")
  ap.add_argument("--tpu-gens", default=None,
                  help=f"comma list among {','.join(TPU_GENS)} (default all)")
  a = ap.parse_args(argv)
  gens, shapes = gens_of(a.tpu_gens), _parse(a.shapes)
  quiet_libtpu()
  import jax
  cpu = jax.default_backend() == "cpu"
  if cpu:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    print(CPU_HOST_NOTE)
  try:
    rows = run(shapes, a.out, gens=gens)
  except Exception:
    traceback.print_exc()
    return 1
  print(f"wrote {os.path.join(a.out, 'compare_kernels.csv')} and .png")
  if cpu:
    print(CPU_HOST_NOTE)
  unchecked = sorted({r["backend"].split(" (")[0].split()[0] for r in rows
                      if r.get("compiled") is None})
  if unchecked:
    print(f"not checked: the {' and '.join(unchecked)} compile (this install lacks its "
          f"compiler; {AOT_HINT}); numerics were compared")
  bad = [r for r in rows
         if r.get("rel_err") is None or r["rel_err"] > 1e-2 or r.get("compiled") is False]
  for r in bad:
    why = "did not compile" if r.get("compiled") is False else \
        "failed to run" if r.get("rel_err") is None else f"rel_err {r['rel_err']:.1e} > 1e-2"
    print(f"FAILED: {r['backend']} on {r['shape']}: {why}")
  return 1 if bad else 0


if __name__ == "__main__":
  raise SystemExit(main())
