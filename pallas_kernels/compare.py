"""``pask-jax compare-kernels``: the GPU and TPU kernels side by side on a shape grid.

For every shape it reports, per backend: relative error norm against the jnp reference (native
run where that accelerator is present, Pallas interpret mode otherwise), whether the kernel
compiles (TPU: libtpu AOT per generation; GPU: PTX for sm_90a + ptxas), the compiler's resource
report (TPU: memory analysis; GPU: registers, shared memory, spills), the measured time and
effective bandwidth on a GPU when one is present, and per TPU generation a roofline ESTIMATE
(K/V bytes / that chip's HBM bandwidth).  Writes ``compare_kernels.csv`` and ``.png`` to --out.

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
    b, hq, hkv, d, ctx = (int(x) for x in item.strip().split(":"))
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

  from pallas_kernels import synth
  from pallas_kernels.gpu import aot as gpu_aot
  from pallas_kernels.gpu import decode_attention_gpu
  from pallas_kernels.tpu import aot as tpu_aot
  from pallas_kernels.tpu import decode_attention_tpu

  gens = gens or sorted(tpu_aot.TOPOLOGIES)
  plat = jax.default_backend()
  rows = []
  for b, hq, hkv, d, ctx in shapes:
    lo, hi, win = _lengths(ctx)
    shape = synth.Shape(b=b, hq=hq, hkv=hkv, d=d, page=PAGE, w=win,
                        lo_cap=-(-lo // PAGE) * PAGE, hi_cap=max(PAGE, -(-hi // PAGE) * PAGE))
    args = synth.make(shape, lo, hi, win, seed=b * 7 + d + ctx)
    nbytes = _kv_bytes(b, hkv, d, lo, hi, win)
    name = f"B{b} {hq}q/{hkv}kv d{d} ctx{ctx}"
    ref = synth.reference_f32(*args)
    base = dict(shape=name, kv_bytes=nbytes)

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
    except Exception as e:
      row["rel_err"] = None
      row["error"] = f"{type(e).__name__}: {e}"[:200]
    try:
      reps = gpu_aot.report(decode_attention_gpu, *args)
      row["compiled"] = all(r.ok() for r in reps)
      row["resources"] = "; ".join(f"sm_90a {r.summary()}" for r in reps)
    except Exception as e:
      row["compiled"] = False
      row["resources"] = f"compile failed: {type(e).__name__}: {e}"[:200]
    rows.append(row)
    log(_fmt(row))

    # TPU: numerics once (native or interpret), AOT compile and roofline estimate per generation.
    try:
      native = plat == "tpu"
      out = decode_attention_tpu(*args, interpret=not native)
      tpu_err, tpu_num = synth.rel_err(out, ref), "native" if native else "interpret"
    except Exception as e:
      tpu_err, tpu_num = None, f"failed: {type(e).__name__}"
    for gen in gens:
      row = dict(base, backend=f"tpu {gen} (pallas mosaic)", rel_err=tpu_err, numerics=tpu_num,
                 estimate_us=nbytes / tpu_aot.HBM_BW[gen] * 1e6)
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
  cols = ["shape", "backend", "numerics", "rel_err", "compiled", "resources", "time_us", "tbps",
          "estimate_us", "kv_bytes", "error"]
  with open(os.path.join(out_dir, "compare_kernels.csv"), "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=cols)
    w.writeheader()
    for r in rows:
      w.writerow({c: r.get(c, "") for c in cols})
  _plot(rows, os.path.join(out_dir, "compare_kernels.png"))
  return rows


def _fmt(r):
  err = "-" if r.get("rel_err") is None else f"{r['rel_err']:.1e}"
  t = f"{r['time_us']:.1f}us {r['tbps']:.2f}TB/s" if "time_us" in r else "-"
  est = f"~{r['estimate_us']:.2f}us (roofline estimate)" if "estimate_us" in r else "-"
  return (f"{r['shape']:28s} {r['backend']:24s} err {err:>8s} ({r.get('numerics', '-')}) "
          f"compiled {'yes' if r.get('compiled') else 'NO':3s} | {t} | {est} | "
          f"{r.get('resources', '')}")


def _plot(rows, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  shapes = list(dict.fromkeys(r["shape"] for r in rows))
  backends = list(dict.fromkeys(r["backend"] for r in rows))
  fig, ax = plt.subplots(figsize=(max(6, 2.2 * len(shapes)), 4))
  width = 0.8 / max(1, len(backends))
  for j, be in enumerate(backends):
    xs, ys, hatch = [], [], []
    for i, sh in enumerate(shapes):
      r = next((r for r in rows if r["shape"] == sh and r["backend"] == be), None)
      if r is None:
        continue
      v = r.get("time_us", r.get("estimate_us"))
      if v:
        xs.append(i + j * width)
        ys.append(v)
        hatch.append("time_us" not in r)
    bars = ax.bar(xs, ys, width, label=be + (" (roofline estimate)" if any(hatch) else ""))
    for bar, h in zip(bars, hatch):
      if h:
        bar.set_hatch("//")
  ax.set_xticks([i + 0.4 - width / 2 for i in range(len(shapes))])
  ax.set_xticklabels(shapes, fontsize=7)
  ax.set_ylabel("microseconds per call (log)")
  ax.set_yscale("log")
  ax.set_title("decode attention: measured (solid) vs HBM-roofline estimate (hatched)")
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(prog="pask-jax compare-kernels", description=__doc__.split("\n\n")[0])
  ap.add_argument("--shapes", default=DEFAULT_SHAPES, help="B:Hq:Hkv:D:CTX[,...]")
  ap.add_argument("--out", default="compare_kernels_out", help="folder for the CSV and PNG")
  ap.add_argument("--tpu-gens", default=None, help="comma list among v5e,v6e,tpu7x (default all)")
  a = ap.parse_args(argv)
  import jax
  if jax.default_backend() == "cpu":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
  try:
    rows = run(_parse(a.shapes), a.out, gens=a.tpu_gens.split(",") if a.tpu_gens else None)
  except Exception:
    traceback.print_exc()
    return 1
  print(f"wrote {os.path.join(a.out, 'compare_kernels.csv')} and .png")
  bad = [r for r in rows if r.get("rel_err") is None or r["rel_err"] > 1e-2 or not r.get("compiled")]
  return 1 if bad else 0


if __name__ == "__main__":
  raise SystemExit(main())
