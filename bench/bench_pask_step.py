"""Whole decode step: PASK mix vs all-BF16 PASK vs plain-XLA Full KV, in one process
(issues 11, 12).

Random weights; the PASK cache is filled layer chunk by layer chunk (``cache.prefill_rows`` +
``cache.write_prefill``, random K/V drawn on the device per chunk, so 32K contexts at batch 16 fit)
from a random per-token plan with fractions ``R,L,H`` of released / INT4 / BF16 tokens beyond the
sinks and the window.  Pools are sized to the plan (what a memory-sized server allocates): the
kernel grid follows the stored bytes, not the logical context.  Every row of the output holds, for
one (layout, batch, context, mix): the PASK step, the all-BF16 PASK step (mix 0,0,1: our best
Full KV, same kernel) and the plain-XLA Full-KV step (``pask_jax.decode.Runner``, dense cache),
all timed in the same process, plus the measured live B.

    python bench/bench_pask_step.py --shape qwen3-4b --batch 8 --context 8192 32768 \
        --mixes 0.2,0.65,0.15 0.5,0.4,0.1 --layouts unrolled --json out.jsonl [--profile DIR]

``--lo-page 128``: INT4 pages of 128 rows, so on Hopper ``decode_attention`` reads the INT4
partition with the Mosaic GPU kernel (``int4_kernel="auto"``).
``--layouts stacked unrolled`` times both layer layouts of ``models.decoder`` (the model is
converted in place between them).  ``--profile DIR`` also writes a device trace of each timed step
and its per-op table (``bench/profile_step.py``).  ``--time-limit S`` skips what would start after
S seconds (rows already measured are kept).

Per step, each row also holds the host time inside the jitted call until it returns
(``*_launch_ms``) and the device time (``*_device_ms``): the wall time of a step waited for with
``block_until_ready``, minus its launch (not profiler-based; ``--profile``'s "device busy" is).
The chained ``*_ms`` is the time per step of steps launched back to back.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--shape", default="qwen2.5-0.5b")
  ap.add_argument("--batch", type=int, nargs="+", default=[8])
  ap.add_argument("--context", type=int, nargs="+", default=[8192])
  ap.add_argument("--mixes", nargs="+", default=["0.2,0.65,0.15"], help="R,L,H fractions")
  ap.add_argument("--layouts", nargs="+", default=["auto"], choices=["auto", "stacked", "unrolled"])
  ap.add_argument("--steps", type=int, default=16)
  ap.add_argument("--chunk-layers", type=int, default=4)
  ap.add_argument("--no-full", action="store_true", help="skip the plain-XLA Full-KV step")
  ap.add_argument("--state-params", action="store_true",
                  help="also time the first mix with the weights passed as flax's nnx.State "
                       "(the runners' form before models.decoder.split): the launch's share of "
                       "flattening them, same process")
  ap.add_argument("--profile", default=None)
  ap.add_argument("--donate-state", action="store_true",
                  help="donate the balances and the ledger with the cache (the runner donates "
                       "the cache only), so no per-step output but the logits is a new buffer")
  ap.add_argument("--alternate", action="store_true",
                  help="with --recycle-logits: two copies of the step (two executables, so two "
                       "CUDA graphs) called in turn, so no launch waits on the graph the "
                       "previous step is still running")
  ap.add_argument("--recycle-logits", action="store_true",
                  help="the balances, the ledger and the previous step's logits donated with "
                       "the cache (pask_jax.recycle): the new logits, and the intermediates XLA "
                       "places in their buffer, keep one address, so the step's CUDA graph is "
                       "not re-parameterized per step")
  ap.add_argument("--time-limit", type=float, default=1e9)
  ap.add_argument("--json", default=None)
  ap.add_argument("--kernel-knobs", default="{}",
                  help="JSON dict of decode_attention knobs for the PASK runner (e.g. "
                       "'{\"wgs_lo\": 2}': the warp-specialized INT4 kernel)")
  ap.add_argument("--lo-format", default="bytes", choices=["bytes", "int4"],
                  help="the INT4 pool's storage format (int4: read by the Mosaic GPU kernel)")
  ap.add_argument("--lo-page", type=int, default=None,
                  help="rows per INT4 page (default: the runner's page); 64 or 128 let the "
                       "Mosaic GPU INT4 kernel run on Hopper")
  a = ap.parse_args(argv)
  if "JAX_PLATFORMS" not in os.environ and not os.path.exists("/dev/nvidia0"):
    os.environ["JAX_PLATFORMS"] = "cpu"
  import jax
  import jax.numpy as jnp
  import numpy as np
  from bench.bench_decode import SHAPES
  from models import ModelConfig, random_model
  from models import decoder
  from pask_jax import cache as pc, controller, ledger, policy as P
  from pask_jax.decode import PaskRunner, Runner
  from pask_jax.recycle import Recycler, logits_like
  from pask_jax.sample import how_of
  from pask_jax.tracker import FREE_TAG

  t_start = time.perf_counter()
  over = lambda: time.perf_counter() - t_start > a.time_limit
  cfg = ModelConfig(**SHAPES[a.shape])
  dt = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
  model = random_model(cfg, dtype=dt)
  pol = P.demo(cfg)
  G, W, S = pol.n_groups, pol.window, a.steps
  # timed() runs 2 S + 2 steps: the pools and the Full-KV cache hold every token they add (a
  # pool that overflows drops rows, and the all-BF16 mix evicts every step into the BF16 pool).
  room = (2 * S + 2) * (2 if a.state_params else 1) + 1   # every step timed() runs
  mixes = [tuple(float(x) for x in m.split(",")) for m in a.mixes]
  mixes = [tuple(float(x) / sum(m) for x in m) for m in mixes]
  dev = jax.devices()[0].device_kind
  print(f"# {cfg.name}, {jnp.dtype(dt).name}, {dev}, jax {jax.__version__}", flush=True)

  def timed(step, n):
    """After a warm-up: (mean of n chained steps, mean launch, mean device time), seconds.

    Chained: n steps back to back, then one wait (what a loop that never syncs sees).  Then n
    steps each waited for: launch = host time inside ``step()`` until it returns, device = the
    rest of that step's wall time until ``block_until_ready`` returns (the device's time on the
    step, less whatever of it ran during the launch).  step() returns what to block on."""
    for _ in range(2):   # warm-up: compiles (both executables where --alternate)
      jax.block_until_ready(step())
    t0 = time.perf_counter()
    calls = 0.0
    for _ in range(n):
      t1 = time.perf_counter()
      out = step()
      calls += time.perf_counter() - t1
    jax.block_until_ready(out)
    chained = (time.perf_counter() - t0) / n
    # host time per call while the device is still busy with earlier steps: equal to the launch
    # below if the host runs ahead, up to the whole step if something in the call waits
    print(f"    chained: {calls / n * 1e3:.2f} ms per call returned, {chained * 1e3:.2f} per step",
          flush=True)
    launch = device = 0.0
    for _ in range(n):
      t0 = time.perf_counter()
      out = step()
      t1 = time.perf_counter()
      jax.block_until_ready(out)
      t2 = time.perf_counter()
      launch, device = launch + (t1 - t0), device + (t2 - t1)
    return chained, launch / n, device / n

  def prof(name, step, hlo=None):
    if not a.profile:
      return None
    from bench import profile_step
    t = profile_step.profile(step, 3, a.profile, name, hlo)
    print(profile_step.format_table(name, t), flush=True)
    return {k: v for k, v in t.items() if not k.startswith("_")} | {"top": t["_top_kernels"]}

  def pask_cache(runner, B, C, mix, seed):
    """A filled PASK cache whose pools hold exactly the plan's H / L rows (+ decode headroom)."""
    rng = np.random.default_rng(seed)
    plan = rng.choice(3, size=(B, C, G), p=mix).astype(np.int8)
    past = plan[:, :max(0, C - W)]
    n_h = int((past == 2).sum(axis=1).max()) + pol.sink + room
    n_l = int((past == 1).sum(axis=1).max()) + room
    page = runner.page
    lo_page = a.lo_page or page
    cache = pc.init_for(cfg, B, pol, capacity=C + room, page=page, lo_page=lo_page,
                        lo_format=a.lo_format,
                        hi_capacity=max(page, n_h),
                        lo_capacity=max(lo_page, n_l) if mix[1] else lo_page)
    lengths = jnp.full((B,), C, jnp.int32)
    # donated: a pass-through of the pools is otherwise a copy (2 x 36 GiB all-BF16 at b16 32K).
    cache, rows = jax.jit(pc.prefill_rows, static_argnums=2, donate_argnums=0)(
        cache, jnp.asarray(plan), C, lengths)
    shape = (B, C, cfg.n_kv_heads, cfg.head_dim)

    # rows travel as an argument: closed over, they became a constant of the jitted function.
    write = jax.jit(lambda c, rows, key, start, n: pc.write_prefill(
        c, rows, jax.random.normal(key, (n,) + shape, jnp.bfloat16),
        jax.random.normal(jax.random.fold_in(key, 1), (n,) + shape, jnp.bfloat16), start),
        static_argnums=(3, 4), donate_argnums=(0,))
    for start in range(0, cfg.n_layers, a.chunk_layers):
      n = min(a.chunk_layers, cfg.n_layers - start)
      cache = write(cache, rows, jax.random.key(seed * 1000 + start), start, n)
    del rows
    return cache.replace(count=jnp.full((B,), C, jnp.int32))

  rows_out = []
  for layout in a.layouts:
    decoder.prepare(model, layout)
    for B in a.batch:
      for C in a.context:
        if over():
          print(f"# time limit: skipping {layout} batch {B} context {C}", flush=True)
          continue
        tags = jnp.broadcast_to(jnp.asarray(FREE_TAG), (B, 4))
        sid, act = jnp.full((B,), -1, jnp.int32), jnp.ones((B,), bool)
        tok = jnp.zeros((B,), jnp.int32)
        res = {}
        for mix in list(mixes) + [(0.0, 0.0, 1.0)]:
          if over():
            break
          runner = PaskRunner(model, pol, batch=B, capacity=C + room,
                              kernel_knobs=json.loads(a.kernel_knobs))
          if a.recycle_logits:
            like = logits_like(B, cfg.vocab_size)
            def decode_b(*args, fn=runner.decode_fn):   # another name: another executable
              return fn(*args)
            recs = [Recycler(f, like, donate_argnums=(2, 3, 4))
                    for f in (runner.decode_fn, decode_b)[:2 if a.alternate else 1]]
            if a.alternate:   # two executables, so two CUDA graphs, launched in turn
              turn = itertools.cycle(recs)
              runner.decode_step = lambda *args, turn=turn: next(turn)(*args)
              runner.decode_step.lower = recs[0].lower
            else:
              runner.decode_step = recs[0]
          elif a.donate_state:
            runner.decode_step = jax.jit(runner.decode_fn, donate_argnums=(2, 3, 4))
          cache = pask_cache(runner, B, C, mix, seed=len(res) + 1)
          live_b = float(np.asarray(ledger.live_payload(cache, pol.cost, pol.c_full)).mean()) / (
              C * float(pol.c_full))
          budget = jnp.full((B,), controller.initial_balance(pol), jnp.float32)
          state = {"s": (cache, budget, ledger.init(B, G))}
          del cache

          def step():
            c, bud, led = state["s"]
            logits, c, bud, led, _ = runner.decode_step(runner.params, pol, c, bud, led, tok,
                                                        tags, sid, act)
            state["s"] = (c, bud, led)
            return logits
          t, t_launch, t_dev = timed(step, S)
          if a.state_params and not res:
            from flax import nnx
            as_state = nnx.split(model)[1]

            def step_state():
              c, bud, led = state["s"]
              logits, c, bud, led, _ = runner.decode_step(as_state, pol, c, bud, led, tok, tags,
                                                          sid, act)
              state["s"] = (c, bud, led)
              return logits
            ts = timed(step_state, S)
            del as_state
            print(f"  {layout} b{B} c{C} mix {tuple(round(m, 2) for m in mix)} with nnx.State "
                  f"weights: {ts[0] * 1e3:.2f} ms (launch {ts[1] * 1e3:.2f}, device "
                  f"{ts[2] * 1e3:.2f}); plain dict: launch {t_launch * 1e3:.2f}", flush=True)
          if np.asarray(state["s"][0].overflow).any():
            raise SystemExit(f"mix {mix}: the cache overflowed (pools sized too small)")
          hlo = None
          if a.profile:
            c_, b_, l_ = state["s"]
            hlo = runner.decode_step.lower(runner.params, pol, c_, b_, l_, tok, tags, sid,
                                           act).compile().as_text()
          name = f"pask_{layout}_b{B}_c{C}_mix{'-'.join(f'{m:.2f}' for m in mix)}"
          res[mix] = dict(ms=t * 1e3, launch_ms=t_launch * 1e3, device_ms=t_dev * 1e3,
                          live_B=live_b, traces=runner.traces["step"],
                          profile=prof(name, step, hlo))
          print(f"  {layout} b{B} c{C} mix {tuple(round(m, 2) for m in mix)}: {t * 1e3:.2f} ms "
                f"(launch {t_launch * 1e3:.2f}, device {t_dev * 1e3:.2f}; live B {live_b:.3f})",
                flush=True)
          state.clear()     # the step closure holds the dict: drop the cache it refers to
          state = runner = step = None   # free this mix's cache before the next
        t_full, prof_full = float("nan"), None
        full_launch = full_dev = float("nan")
        if not a.no_full and not over():
          full = Runner(model, batch=B, capacity=C + room, cache_dtype=jnp.bfloat16)
          fc = {"c": full.new_cache()._replace(length=jnp.full((B,), C, jnp.int32))}
          bits = jnp.full((B, -(-cfg.vocab_size // 32)), -1, jnp.int32)
          z, o, key = jnp.zeros((B,)), jnp.ones((B,)), jax.random.key(0)
          how = how_of(0.0, 1.0)   # greedy: the sampler's branch static (no conditional)

          def fstep():
            nxt, _, fc["c"] = full.step(full.params, fc["c"], tok, bits, key, z, o, how)
            return nxt
          t_full, full_launch, full_dev = timed(fstep, S)
          hlo = (full.step.lower(full.params, fc["c"], tok, bits, key, z, o, how).compile()
                 .as_text() if a.profile else None)
          prof_full = prof(f"full_{layout}_b{B}_c{C}", fstep, hlo)
          print(f"  {layout} b{B} c{C} plain-XLA Full KV: {t_full * 1e3:.2f} ms (launch "
                f"{full_launch * 1e3:.2f}, device {full_dev * 1e3:.2f})", flush=True)
          del fc, full
        allbf = res.get((0.0, 0.0, 1.0), {}).get("ms", float("nan"))
        for mix in mixes:
          if mix not in res:
            continue
          r = res[mix]
          row = {"shape": a.shape, "layout": layout, "lo_page": a.lo_page,
                 "lo_format": a.lo_format, "batch": B, "context": C,
                 "mix_RLH": [round(float(m), 4) for m in mix], "live_B": r["live_B"],
                 "pask_ms": r["ms"], "all_bf16_ms": allbf, "full_xla_ms": t_full * 1e3,
                 "pask_launch_ms": r["launch_ms"], "pask_device_ms": r["device_ms"],
                 "all_bf16_launch_ms": res.get((0.0, 0.0, 1.0), {}).get("launch_ms"),
                 "all_bf16_device_ms": res.get((0.0, 0.0, 1.0), {}).get("device_ms"),
                 "full_xla_launch_ms": full_launch * 1e3, "full_xla_device_ms": full_dev * 1e3,
                 "vs_all_bf16": allbf / r["ms"], "vs_full_xla": t_full * 1e3 / r["ms"],
                 "step_traces": r["traces"], "device": dev, "jax": jax.__version__,
                 "profile": r["profile"],
                 "profile_all_bf16": res.get((0.0, 0.0, 1.0), {}).get("profile"),
                 "profile_full": prof_full}
          rows_out.append(row)
          if a.json:
            with open(a.json, "a") as f:
              f.write(json.dumps(row) + "\n")
  print(f"\n{'layout':9s} {'B':>3s} {'ctx':>6s} {'mix R/L/H':16s} {'live B':>6s} {'PASK ms':>8s} "
        f"{'launch':>7s} {'device':>7s} {'allBF16':>8s} {'XLA full':>8s} {'launch':>7s} "
        f"{'device':>7s} {'x allBF16':>9s} {'x XLA':>6s}")
  for r in rows_out:
    print(f"{r['layout']:9s} {r['batch']:3d} {r['context']:6d} "
          f"{'/'.join(f'{m:.2f}' for m in r['mix_RLH']):16s} {r['live_B']:6.3f} "
          f"{r['pask_ms']:8.2f} {r['pask_launch_ms']:7.2f} {r['pask_device_ms']:7.2f} "
          f"{r['all_bf16_ms']:8.2f} {r['full_xla_ms']:8.2f} {r['full_xla_launch_ms']:7.2f} "
          f"{r['full_xla_device_ms']:7.2f} {r['vs_all_bf16']:9.2f} {r['vs_full_xla']:6.2f}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
