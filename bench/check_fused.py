"""The fused Mosaic GPU kernel (``int4_kernel="fused"``, pallas_kernels/gpu/mgpu_mixed.py) on the
GPU against the references, on fresh random inputs; not a test (CI has no GPU).

    python bench/check_fused.py [--json FILE]     # one line per check; exit 1 if any fails

Per shape (4B-like: 32 q / 8 KV heads, d128; 0.5B: 14 q / 2 KV heads, d64; pages of 128 in both
pools, an int4-format INT4 pool):
* ``synth`` cases (poisoned: NaN in invisible BF16 rows and scales, garbage table entries,
  shuffled pages; ragged lengths, an empty BF16 and an empty INT4 partition): the kernel's
  partials against ``partition_mixed_reference`` (the same tiles and roundings: should agree to
  f32 rounding), and ``decode_attention_gpu(int4_kernel="fused")`` against the float32 reference,
  beside today's path (``int4_kernel="mosaic"`` + Triton) on the same inputs;
* a traced layer of a 3-layer stack;
* every knob variant of the device script at the bench's size (B = 8, 32K keys, the B ~ 0.33
  mix) against the float32 reference.
Every check runs in its own ``try``: a failure prints and the rest go on.
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
import traceback

import jax
import jax.numpy as jnp

from pallas_kernels.gpu import decode_attention_gpu, mgpu_mixed as MX
from pallas_kernels.gpu import mgpu_common
from pallas_kernels.testing import synth

S, C = synth.Shape, synth.Case
SHAPES = {"4B": dict(hq=32, hkv=8, d=128), "0.5B": dict(hq=14, hkv=2, d=64)}
TOL = 6e-3          # bf16 output and one bf16 rounding of P^T per partition: ~2e-3


def cases(hq, hkv, d):
  sh = lambda **kw: S(hq=hq, hkv=hkv, d=d, page=128, **kw)
  return [
      C("ragged", sh(b=4, w=64, lo_cap=2048, hi_cap=512), (2000, 129, 1, 1024),
        (300, 0, 512, 1), (64, 3, 17, 64)),
      C("empty_hi", sh(b=2, w=32, lo_cap=1024, hi_cap=256), (1000, 5), (0, 0), (32, 1)),
      C("empty_lo", sh(b=2, w=32, lo_cap=256, hi_cap=1024), (0, 0), (1000, 129), (5, 32)),
  ]


def rel(a, b) -> float:
  return synth.rel_err(a, b)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("--json", default=None)
  ap.add_argument("--dry", action="store_true",
                  help="CPU dry run of this script: the kernels' references in their place")
  ap.add_argument("--variants", default='[{}, {"tile_hi": 128}]',
                  help="JSON list of fused knob dicts for the bench-size check")
  a = ap.parse_args(argv)
  print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
  kernel = MX.partition_mixed_reference if a.dry else functools.partial(
      MX.partition_mixed, approx_math=True, no_auto_barriers=True)
  dry = dict(interpret=True) if a.dry else {}      # fused -> its reference; Triton interpreted
  rows, bad = [], 0

  def check(name, fn):
    nonlocal bad
    try:
      r = fn()
    except Exception as e:
      traceback.print_exc()
      r = dict(ok=False, error=f"{type(e).__name__}: {str(e)[:400]}")
    r = dict(check=name, **r)
    bad += not r.get("ok", False)
    rows.append(r)
    print(json.dumps(r), flush=True)

  for sname, kw in SHAPES.items():
    g = kw["hq"] // kw["hkv"]
    c = kw["d"] ** -0.5 * mgpu_common.LOG2E
    for case in cases(**kw):
      args = case.make(seed=7, lo_format="int4")

      def partials(args=args, g=g, c=c):
        q, win, hi, lo, maps = args
        b, hq, d = q.shape
        hkv = hq // g
        bh = b * hkv
        page = lo.page
        s_lo, s_hi = MX.plan(bh, maps.lo_pages.shape[1], page, maps.hi_pages.shape[1],
                             hi.k.shape[1], d, 64)
        qp = jnp.pad(q.reshape(b, hkv, g, d), ((0, 0), (0, 0), (0, 16 - g), (0, 0)))
        qp = qp.reshape(bh, 16, d)
        clamp = lambda t, n, pg, s: jnp.pad(
            jnp.where(jnp.arange(t.shape[1])[None] < (n[:, None] + pg - 1) // pg, t, 0),
            ((0, 0), (0, (-t.shape[1]) % s)))
        kargs = (qp, lo.k, lo.scale, lo.v, hi.k, hi.v,
                 clamp(maps.lo_pages, maps.lo_len, page, s_lo),
                 clamp(maps.hi_pages, maps.hi_len, hi.k.shape[1], s_hi),
                 jnp.stack([maps.lo_len, maps.hi_len], 1).astype(jnp.int32),
                 jnp.zeros((2,), jnp.int32))
        kk = dict(splits_lo=s_lo, splits_hi=s_hi, tile_hi=64, qk_scale=c)
        o, ml = kernel(*kargs, **kk)
        ro, rml = MX.partition_mixed_reference(*kargs, **kk)
        out = MX.merge(o, ml, None, g)
        ref = MX.merge(ro, rml, None, g)
        live = rml[:, :, MX.ML_ROWS // 2, :g] > 0
        m_err = float(jnp.max(jnp.where(live, jnp.abs(ml[:, :, 0, :g] - rml[:, :, 0, :g]), 0)))
        e = rel(out, ref)
        return dict(ok=e < 1e-3 and bool(jnp.isfinite(out).all()), rel_err_vs_kernel_ref=e,
                    max_m_err=m_err, splits=[s_lo, s_hi])

      check(f"{sname} {case.name}: kernel partials vs partition_mixed_reference", partials)

      def whole(args=args):
        want = synth.reference_f32(*args)
        out = {}
        for k in ("fused", "mosaic"):
          kn = "mosaic_reference" if dry and k == "mosaic" else k
          got = decode_attention_gpu(*args, int4_kernel=kn, **dry)
          out[k] = rel(got, want)
        return dict(ok=out["fused"] < TOL, rel_err=out["fused"], rel_err_mosaic=out["mosaic"])

      check(f"{sname} {case.name}: decode_attention fused vs float32 reference", whole)

    def stacked(kw=kw):
      args = synth.stack_layers(cases(**kw)[0].make(seed=9, lo_format="int4"))
      f = jax.jit(lambda l, *x: decode_attention_gpu(*x, l, int4_kernel="fused", **dry))
      errs = [rel(f(jnp.int32(i), *args), synth.reference_f32(*synth.layer_of(args, i)))
              for i in range(3)]
      return dict(ok=max(errs) < TOL, rel_err_per_layer=errs)

    check(f"{sname} traced layer of a 3-layer stack", stacked)

  # The bench's size: B = 8, 32K keys, B ~ 0.33 (79.5% INT4, 12.2% BF16 pool, the window).
  from bench.bench_kernels import WIN, build, to_format
  for sname, kw in SHAPES.items():
    ctx = 32768
    lens = (int(ctx * 0.795), int(ctx * 0.122) - WIN, WIN)
    args = to_format(build(jax.random.key(3), 8, kw["hq"], kw["hkv"], kw["d"], *lens,
                           lo_page=128, hi_page=128), "int4")
    want = synth.reference_f32(*args)
    for v in json.loads(a.variants):
      def big(v=v, args=args, want=want):
        e = rel(decode_attention_gpu(*args, int4_kernel="fused", **v, **dry), want)
        return dict(ok=e < TOL, rel_err=e, knobs=v)

      check(f"{sname} b8 32K mix {json.dumps(v)}", big)

  print(f"{len(rows) - bad} of {len(rows)} checks passed", flush=True)
  if a.json:
    with open(a.json, "w") as f:
      json.dump(rows, f, indent=1)
  return int(bad > 0)


if __name__ == "__main__":
  sys.exit(main())
