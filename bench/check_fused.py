"""The fused Mosaic GPU kernel (``int4_kernel="fused"``, pallas_kernels/gpu/mgpu_mixed.py) on the
GPU against the references, on fresh random inputs; not a test (CI has no GPU).

One check case per process, so a case that hangs the GPU can be killed alone
(``scripts/h200_fused.sh`` runs each under ``timeout -s KILL``, smallest and least novel first):

    python bench/check_fused.py --list [--variants JSON]     # case ids and knobs, in run order
    python bench/check_fused.py --case ID [--knobs JSON] [--log FILE] [--results FILE]
    python bench/check_fused.py [--variants JSON] [--json FILE]   # every case in this process

``--log``: every step (inputs built, compiled, ran, compared) is appended to FILE and flushed
as it happens, and a Python stack dump of every thread goes there a few seconds before
``--deadline`` seconds have passed (faulthandler), so a case killed for hanging still shows how
far it got and where it waited. ``--results``: one JSON line per case appended (``status`` PASS
or FAIL). Exit status 0 when every check of the case passed.

Cases (``CASES``), in order:
* ``tiny_lo``, ``tiny_hi``, ``tiny_mix``, ``tiny_mix8``: the kernel alone
  (``partition_mixed``) at the 0.5B head shape (14 q / 2 KV heads, d64), B = 2, pages of 128:
  INT4 pipeline only, BF16 pipeline only, both (16 softmax columns, as lowered on the CPU
  hosts), both with 8 columns (the production setting, jax 0.11 only); one sequence with an
  empty INT4 partition and one with a single BF16 token, so whole splits have no visible key
  (zero-length splits) and the BF16 V zeroing runs; partials against
  ``partition_mixed_reference``. The smallest launches: run first.
* ``synth_0.5B``, ``synth_4B`` (4B-like: 32 q / 8 KV heads, d128): the poisoned synth cases
  (NaN in invisible BF16 rows and scales, garbage table entries, shuffled pages; ragged lengths,
  an empty BF16 and an empty INT4 partition), the kernel's partials against its reference and
  ``decode_attention_gpu(int4_kernel="fused")`` against the float32 reference (the ragged case
  beside today's path, ``int4_kernel="mosaic"`` + Triton); a traced layer of a 3-layer stack.
* ``big_0.5B``, ``big_4B`` once per knob variant (``--variants``): the bench's size (B = 8, 32K
  keys, the B ~ 0.33 mix) against the float32 reference.

Knobs (``--knobs``, merged over the case's): ``auto_barriers`` (keep Pallas's barriers around
shared-memory loads and stores), ``tile_hi``, ``stages_lo``, ``stages_hi``, ``splits_lo``,
``splits_hi``, ``cols`` (tiny cases: 8 or 16 softmax columns).

Rehearsal without a GPU: ``--dry`` (the kernels' references in their place) and
``CHECK_FUSED_FAKE_HANG=ID`` (case ID sleeps unless run with auto_barriers; ``ID:ab``: always;
``ID:compile``: its last step logged a compile),
through the device script: ``CHECK_ARGS=--dry CHECK_FUSED_FAKE_HANG=tiny_hi STAGE=smoke bash
scripts/h200_fused.sh`` with ``python3`` and ``nvidia-smi`` on the path.
"""
from __future__ import annotations

import argparse
import faulthandler
import functools
import json
import os
import sys
import time
import traceback

SHAPES = {"0.5B": dict(hq=14, hkv=2, d=64), "4B": dict(hq=32, hkv=8, d=128)}
TOL = 6e-3          # bf16 output and one bf16 rounding of P^T per partition: ~2e-3
TOL_PARTIALS = 1e-3  # the kernel against its own reference (same tiles and roundings)
DEFAULT_VARIANTS = '[{}, {"tile_hi": 128}, {"stages_lo": 3, "stages_hi": 3}]'
# (splits_lo, splits_hi, softmax columns): 16 columns is the configuration lowered for CUDA on
# the CPU hosts (jax 0.10); 8 (the production one for <= 8 query heads per KV head) needs the
# register concatenate of jax 0.11, so it is lowered and run on the GPU machine alone.
TINY = {"tiny_lo": (2, 0, 16), "tiny_hi": (0, 2, 16), "tiny_mix": (2, 2, 16),
        "tiny_mix8": (2, 2, 8)}


def case_list(variants: str = DEFAULT_VARIANTS) -> list[tuple[str, dict]]:
  """(case id, knobs) in run order: smallest launches and the proven INT4 pipeline first."""
  out = [(name, {}) for name in TINY]
  out += [(f"synth_{s}", {}) for s in SHAPES]
  for s in SHAPES:
    out += [(f"big_{s}", v) for v in json.loads(variants)]
  return out


class Log:
  """Progress lines to stdout and (``path``) appended and flushed to a file at once."""

  def __init__(self, path: str | None, case: str):
    self.f = open(path, "a", buffering=1) if path else None
    self.case, self.t0 = case, time.time()

  def __call__(self, msg: str) -> None:
    line = f"  [{self.case} +{time.time() - self.t0:5.1f}s] {msg}"
    print(line, flush=True)
    if self.f:
      self.f.write(line + "\n")
      self.f.flush()
      os.fsync(self.f.fileno())


def synth_cases(hq, hkv, d):
  from pallas_kernels.testing import synth
  S, C = synth.Shape, synth.Case
  sh = lambda **kw: S(hq=hq, hkv=hkv, d=d, page=128, **kw)
  return [
      C("ragged", sh(b=4, w=64, lo_cap=2048, hi_cap=512), (2000, 129, 1, 1024),
        (300, 0, 512, 1), (64, 3, 17, 64)),
      C("empty_hi", sh(b=2, w=32, lo_cap=1024, hi_cap=256), (1000, 5), (0, 0), (32, 1)),
      C("empty_lo", sh(b=2, w=32, lo_cap=256, hi_cap=1024), (0, 0), (1000, 129), (5, 32)),
  ]


def tiny_case():
  """B = 2 at the 0.5B head shape, pages of 128: 4 INT4 pages and 2 BF16 pages a sequence.
  Sequence 0: 300 INT4 keys (split 1 holds a ragged page and a page past the length), 200 BF16
  keys (a ragged 64-row tile: the V zeroing); sequence 1: no INT4 key (every INT4 split empty)
  and one BF16 key (BF16 split 1 empty)."""
  from pallas_kernels.testing import synth
  return synth.Case("tiny", synth.Shape(b=2, page=128, w=16, lo_cap=512, hi_cap=256,
                                        **SHAPES["0.5B"]), (300, 0), (200, 1), (5, 16))


def kernel_args(args, g: int, s_lo: int, s_hi: int):
  """``decode_attention``'s inputs -> ``partition_mixed``'s (as ``mixed_attention`` builds
  them: q padded, tables clamped past the length and padded to the splits, one-page stand-ins
  for a pool without splits)."""
  import jax.numpy as jnp
  from pallas_kernels.gpu import mgpu_common
  q, _, hi, lo, maps = args
  b, hq, d = q.shape
  hkv = hq // g
  page_lo, page_hi = lo.page, hi.k.shape[1]
  qp = jnp.pad(q.reshape(b, hkv, g, d), ((0, 0), (0, 0), (0, mgpu_common.N_PAD - g), (0, 0)))
  qp = qp.reshape(b * hkv, mgpu_common.N_PAD, d).astype(jnp.bfloat16)
  # Entries past a sequence's pages (garbage, out of range included) -> page 0; padded with
  # page 0 to a multiple of the splits (a BF16 page's tiles then divide into them too).
  table = lambda t, n, pg, s: jnp.pad(
      jnp.where(jnp.arange(t.shape[1])[None] < (n[:, None] + pg - 1) // pg, t, 0),
      ((0, 0), (0, (-t.shape[1]) % s))).astype(jnp.int32)
  if s_lo:
    lo_k, lo_s, lo_v = lo.k, lo.scale, lo.v
    lo_tbl = table(maps.lo_pages, maps.lo_len, page_lo, s_lo)
  else:
    lo_k, lo_v = jnp.zeros((1, hkv, 64, d), jnp.int4), jnp.zeros((1, hkv, d, 64), jnp.int4)
    lo_s, lo_tbl = jnp.zeros((1, hkv, 2, 64), jnp.float16), jnp.zeros((b, 1), jnp.int32)
  if s_hi:
    hi_k, hi_v = hi.k, hi.v
    hi_tbl = table(maps.hi_pages, maps.hi_len, page_hi, s_hi)
  else:
    hi_k = hi_v = jnp.zeros((1, 64, hkv, d), jnp.bfloat16)
    hi_tbl = jnp.zeros((b, 1), jnp.int32)
  lens = jnp.stack([maps.lo_len, maps.hi_len], 1).astype(jnp.int32)
  return (qp, lo_k, lo_s, lo_v, hi_k, hi_v, lo_tbl, hi_tbl, lens, jnp.zeros((2,), jnp.int32))


def compile_run(log, what: str, fn, *args):
  """jit + lower + compile (Mosaic GPU compiles the kernel here) then one run, each step
  logged before it starts: a hang shows as the last line."""
  import jax
  log(f"{what}: compiling")
  t = time.time()
  exe = jax.jit(fn).lower(*args).compile()
  log(f"{what}: compiled in {time.time() - t:.1f}s; running")
  t = time.time()
  out = jax.block_until_ready(exe(*args))
  log(f"{what}: ran in {time.time() - t:.2f}s")
  return out


def check_partials(log, args, g, s_lo, s_hi, knobs, dry, cols=None):
  """The kernel's partials against ``partition_mixed_reference`` (same tiles, splits and
  roundings: f32 rounding apart)."""
  import jax.numpy as jnp
  from pallas_kernels.gpu import mgpu_common, mgpu_mixed as MX
  from pallas_kernels.testing import synth
  q = args[0]
  d = q.shape[-1]
  tile_hi = knobs.get("tile_hi", 64)
  kargs = kernel_args(args, g, s_lo, s_hi)
  kk = dict(splits_lo=s_lo, splits_hi=s_hi, tile_hi=tile_hi,
            qk_scale=d ** -0.5 * mgpu_common.LOG2E)
  cols = knobs.get("cols", cols or (8 if g <= 8 and mgpu_common.HAS_CONCAT else
                                    mgpu_common.N_PAD))
  kernel = MX.partition_mixed_reference if dry else functools.partial(
      MX.partition_mixed, approx_math=True, no_auto_barriers=not knobs.get("auto_barriers"),
      stages_lo=knobs.get("stages_lo", 2), stages_hi=knobs.get("stages_hi", 2), cols=cols)
  o, ml = compile_run(log, f"partition_mixed splits {s_lo}+{s_hi}",
                      functools.partial(kernel, **kk), *kargs)
  ro, rml = MX.partition_mixed_reference(*kargs, **kk)
  out, ref = MX.merge(o, ml, None, g), MX.merge(ro, rml, None, g)
  live = rml[:, :, MX.ML_ROWS // 2, :g] > 0
  m_err = float(jnp.max(jnp.where(live, jnp.abs(ml[:, :, 0, :g] - rml[:, :, 0, :g]), 0)))
  dead_l = float(jnp.max(jnp.where(live, 0, jnp.abs(ml[:, :, MX.ML_ROWS // 2, :g]))))
  e = synth.rel_err(out, ref)
  return dict(ok=e < TOL_PARTIALS and dead_l == 0 and bool(jnp.isfinite(out).all()),
              rel_err_vs_kernel_ref=e, max_m_err=m_err, max_l_of_empty_splits=dead_l,
              splits=[s_lo, s_hi], cols=cols)


def check_whole(log, args, knobs, dry, mosaic_too=True):
  """``decode_attention_gpu(int4_kernel="fused")`` against the float32 reference (and today's
  Mosaic INT4 + Triton path on the same inputs, for scale)."""
  from pallas_kernels.gpu import decode_attention_gpu
  from pallas_kernels.testing import synth
  want = synth.reference_f32(*args)
  extra = dict(interpret=True) if dry else {}
  fused = {k: v for k, v in knobs.items() if k != "cols"}
  got = compile_run(log, f"decode_attention fused {json.dumps(fused)}",
                    lambda *a: decode_attention_gpu(*a, int4_kernel="fused", **fused, **extra),
                    *args)
  r = dict(ok=synth.rel_err(got, want) < TOL, rel_err=synth.rel_err(got, want), knobs=fused)
  if mosaic_too:
    kn = "mosaic_reference" if dry else "mosaic"
    got = compile_run(log, f"decode_attention {kn}",
                      lambda *a: decode_attention_gpu(*a, int4_kernel=kn, **extra), *args)
    r["rel_err_mosaic"] = synth.rel_err(got, want)
  return r


def run_case(case: str, knobs: dict, log, dry: bool = False) -> list[dict]:
  """One case's checks -> result rows (each ``ok`` or not; an exception is a failed row)."""
  import jax
  from pallas_kernels.gpu import decode_attention_gpu
  from pallas_kernels.testing import synth
  rows = []
  fake = os.environ.get("CHECK_FUSED_FAKE_HANG", "")     # rehearsal of the device script's
  if fake.split(":")[0] == case and (":ab" in fake or not knobs.get("auto_barriers")):
    log("CHECK_FUSED_FAKE_HANG: sleeping as a hung kernel would")   # HANG path (CPU, --dry)
    if ":compile" in fake:
      log("fake: compiling")            # the device script's TIMEOUT_COMPILING path
    time.sleep(1e6)

  def check(name, fn):
    log(f"check {name}")
    t = time.time()
    try:
      r = fn()
    except Exception as e:      # a failure prints and the case's other checks go on
      traceback.print_exc()
      r = dict(ok=False, error=f"{type(e).__name__}: {str(e)[:400]}")
    r = dict(check=name, seconds=round(time.time() - t, 1), **r)
    log(("ok   " if r.get("ok") else "FAIL ") + json.dumps(r)[:300])
    rows.append(r)

  if case in TINY:
    s_lo, s_hi, cols = TINY[case]
    s_lo, s_hi = knobs.get("splits_lo", s_lo), knobs.get("splits_hi", s_hi)
    args = tiny_case().make(seed=int(time.time()) % 10000, lo_format="int4")
    log("inputs built")
    g = SHAPES["0.5B"]["hq"] // SHAPES["0.5B"]["hkv"]
    check(f"{case}: kernel partials vs partition_mixed_reference",
          lambda: check_partials(log, args, g, s_lo, s_hi, knobs, dry, cols))
    return rows

  kind, sname = case.split("_", 1)
  kw = SHAPES[sname]
  g = kw["hq"] // kw["hkv"]
  if kind == "synth":
    from pallas_kernels.gpu import mgpu_mixed as MX
    for c in synth_cases(**kw):
      args = c.make(seed=7 + int(time.time()) % 1000, lo_format="int4")
      q, _, hi, lo, maps = args
      tile_hi = knobs.get("tile_hi", 64)
      s_lo, s_hi = MX.plan(q.shape[0] * kw["hkv"], maps.lo_pages.shape[1], lo.page,
                           maps.hi_pages.shape[1], hi.k.shape[1], kw["d"], tile_hi)
      check(f"{case} {c.name}: kernel partials vs partition_mixed_reference",
            lambda: check_partials(log, args, g, s_lo, s_hi, knobs, dry))
      check(f"{case} {c.name}: decode_attention fused vs float32 reference",
            lambda: check_whole(log, args, knobs, dry, mosaic_too=c.name == "ragged"))

    def stacked():
      args = synth.stack_layers(synth_cases(**kw)[0].make(seed=9, lo_format="int4"))
      fused = {k: v for k, v in knobs.items() if k != "cols"}
      extra = dict(interpret=True) if dry else {}
      f = jax.jit(lambda l, *x: decode_attention_gpu(*x, l, int4_kernel="fused", **fused,
                                                     **extra))
      errs = [synth.rel_err(f(jax.numpy.int32(i), *args),
                            synth.reference_f32(*synth.layer_of(args, i))) for i in range(3)]
      return dict(ok=max(errs) < TOL, rel_err_per_layer=errs)

    check(f"{case}: traced layer of a 3-layer stack", stacked)
    return rows

  if kind == "big":     # the bench's size: B = 8, 32K keys, B ~ 0.33 (79.5% INT4, 12.2% BF16)
    from bench.bench_kernels import WIN, build, to_format
    ctx = 32768
    lens = (int(ctx * 0.795), int(ctx * 0.122) - WIN, WIN)
    args = to_format(build(jax.random.key(int(time.time()) % 1000), 8, kw["hq"], kw["hkv"],
                           kw["d"], *lens, lo_page=128, hi_page=128), "int4")
    log("inputs built")
    check(f"{case} b8 32K mix {json.dumps(knobs)}",
          lambda: check_whole(log, args, knobs, dry, mosaic_too=False))
    return rows
  raise ValueError(f"unknown case {case!r}: one of {[c for c, _ in case_list()]}")


def main(argv=None) -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("--list", action="store_true", help="print 'ID<TAB>KNOBS' per case, in order")
  ap.add_argument("--case", default=None, help="run this case alone")
  ap.add_argument("--knobs", default="{}", help="JSON dict of knobs over the case's")
  ap.add_argument("--variants", default=DEFAULT_VARIANTS,
                  help="JSON list of fused knob dicts for the bench-size cases")
  ap.add_argument("--log", default=None, help="append progress lines to this file")
  ap.add_argument("--results", default=None, help="append one JSON line per case to this file")
  ap.add_argument("--json", default=None, help="(all cases) write every result row here")
  ap.add_argument("--deadline", type=float, default=0,
                  help="seconds: dump every thread's stack to --log this long after the start "
                       "(a few seconds before the caller's kill)")
  ap.add_argument("--dry", action="store_true",
                  help="CPU dry run of this script: the kernels' references in their place")
  a = ap.parse_args(argv)
  if a.list:
    for cid, kn in case_list(a.variants):
      print(f"{cid}\t{json.dumps(kn)}")
    return 0
  todo = [(a.case, json.loads(a.knobs))] if a.case else [
      (c, {**kn, **json.loads(a.knobs)}) for c, kn in case_list(a.variants)]
  bad, every = 0, []
  for cid, knobs in todo:
    log = Log(a.log, cid + (f" {json.dumps(knobs)}" if knobs else ""))
    if a.deadline > 0 and log.f:
      faulthandler.dump_traceback_later(a.deadline, exit=False, file=log.f)
    import jax
    log(f"start: jax {jax.__version__} on {jax.devices()[0].device_kind}")
    t = time.time()
    rows = run_case(cid, knobs, log, a.dry)
    faulthandler.cancel_dump_traceback_later()
    ok = bool(rows) and all(r.get("ok") for r in rows)
    bad += not ok
    every += rows
    res = dict(case=cid, knobs=knobs, status="PASS" if ok else "FAIL",
               seconds=round(time.time() - t, 1), checks=rows)
    log(f"{res['status']} in {res['seconds']}s")
    if a.results:
      with open(a.results, "a") as f:
        f.write(json.dumps(res) + "\n")
  if a.json:
    with open(a.json, "w") as f:
      json.dump(every, f, indent=1)
  print(f"{len(todo) - bad} of {len(todo)} cases passed", flush=True)
  return int(bad > 0)


if __name__ == "__main__":
  rc = main()
  sys.stdout.flush()
  sys.stderr.flush()
  # Results are written and flushed: skip the interpreter's and the GPU client's teardown, which
  # a sick GPU can stall (the device script would then kill a finished case as hung).
  os._exit(rc)
