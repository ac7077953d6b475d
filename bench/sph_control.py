"""Spherical KV's control plane against the work it steers (issue 26, G6 of docs/SPHERICAL_KV.md
§4): the RDR solve + tier encode ≤ 5 % of the prefill at 32K, the decode-time control ≤ 2 % of a
step, the metadata ≤ 3 % of the resident bytes.

Per (method, context): a :class:`~pask_jax.spherical.runner.SphRunner` of the harness method over
random weights of ``--shape`` (the weights' values do not change the times), ``--batch``
prompts of random ids of that length, the backend ``auto`` (the GPU tier kernels on a GPU, the
jnp reference on a CPU).  One begin and one step first (the compiles), then:

* ``--repeats`` begins with ``timers`` (best of): ``prefill_ms`` (the full-precision prefill,
  with the observation statistics RDR's features read; ``--prefill exact flash``: the runner's
  scratch-cache prefill and/or its one-chunk flash-attention prefill) and ``commit_ms`` (the
  features, the RDR plan, the tier encode, the cache writes); ``commit_share`` = commit / prefill;
* ``--steps`` decode steps chained (ms per step) and ``control_only`` (the step's control plane:
  the new token's route and balance, the gated rule's placement of the leaving token) called
  ``--steps`` times on the last state, back to back, waited for at the end: ``control_share``
  = control / step.  Alone, the control pays its own launches; inside the step it is fused, so
  the share is an upper bound;
* ``--cupti`` (GPU): ``control_share_device``, the device time of one control call's kernels
  over one step's (CUPTI, each alone), the control's share without its launches;
* ``metadata_share``: the report's non-K/V bytes over the resident bytes (largest over the
  batch; :meth:`SphRunner.metadata_bytes`).

One JSON line per row (and ``--out`` appends them).  CPU smoke::

    python bench/sph_control.py --shape tiny --context 256 --batch 2 --steps 4 --repeats 1
"""
from __future__ import annotations

import argparse
import sys
import time

GOALS = {"commit_share": 0.05, "control_share": 0.02, "metadata_share": 0.03}
SHAPES_EXTRA = {  # beside bench.bench_decode.SHAPES: the 1.5B coder's shape (G3, G6 name it)
    "qwen2.5-1.5b": dict(arch="qwen2", vocab_size=151936, hidden=1536, intermediate=8960,
                         n_layers=28, n_heads=12, n_kv_heads=2, head_dim=128, rope_theta=1e6,
                         tie_embeddings=True, max_position=32768,
                         name="Qwen2.5-1.5B shape (random weights)"),
}


def measure(model, method: str, batch: int, context: int, steps: int, repeats: int,
            budget: float, seed: int = 0, prefill: str = "exact", cupti: bool = False) -> dict:
  import jax
  import numpy as np
  from pask_jax import tags as T
  from pask_jax.decode import capacity_for, pad_prompts
  from pask_jax.sample import how_of
  from pask_jax.spherical.runner import SphRunner
  from pask_jax.tracker import FREE_TAG
  cfg = model.cfg
  cap = capacity_for(context, steps + 2)
  r = SphRunner.for_method(model, method, batch=batch, capacity=cap, backend="auto",
                           prefill=prefill)
  if r.needs_policy:
    raise SystemExit(f"{method} needs a PASK policy: not timed here")
  r.configure(budget)
  rng = np.random.default_rng(seed)
  tokens, lengths = pad_prompts(rng.integers(1, cfg.vocab_size, (batch, context)).tolist(),
                                batch, cap)
  tag_ids = np.broadcast_to(FREE_TAG, (batch, T.N_CAND)).copy()
  state_ids, active = np.full((batch,), -1, np.int32), np.ones((batch,), bool)
  bits = np.full((batch, -(-cfg.vocab_size // 32)), -1, np.int32)
  temp, top_p = np.zeros((batch,), np.float32), np.ones((batch,), np.float32)
  how = how_of(temp, top_p)   # greedy: the sampler's branch static (no conditional)
  key = jax.random.key(seed)
  nxt = rng.integers(1, cfg.vocab_size, batch).astype(np.int32)

  def step(state):
    return r.advance(state, nxt, tag_ids, state_ids, active, bits, key, temp, top_p, how)[1]

  t0 = time.perf_counter()
  _, state = r.begin(tokens, lengths)
  state = jax.block_until_ready(step(state))
  jax.block_until_ready(r.control_only(state, tag_ids, state_ids, active))
  compile_s = time.perf_counter() - t0
  best = {}
  for _ in range(repeats):
    tm, state = {}, None   # the last state freed first: a 32K begin holds the prefill's K/V too
    _, state = r.begin(tokens, lengths, timers=tm)
    for k, v in tm.items():
      best[k] = min(best.get(k, float("inf")), v)
  t0 = time.perf_counter()
  for _ in range(steps):
    state = step(state)
  state = jax.block_until_ready(state)
  step_s = (time.perf_counter() - t0) / steps
  t0 = time.perf_counter()
  for _ in range(steps):
    out = r.control_only(state, tag_ids, state_ids, active)
  jax.block_until_ready(out)
  control_s = (time.perf_counter() - t0) / steps
  meta = max(x["metadata_share"] for x in r.report(state))
  row = {"method": method, "batch": batch, "context": context, "budget": budget,
         "prefill": prefill,
         "backend": jax.default_backend(), "device": str(jax.devices()[0].device_kind),
         "compile_s": round(compile_s, 2),
         "prefill_ms": 1e3 * best["prefill_s"], "commit_ms": 1e3 * best["commit_s"],
         "commit_share": best["commit_s"] / best["prefill_s"],
         "step_ms": 1e3 * step_s, "control_ms": 1e3 * control_s,
         "control_share": control_s / step_s, "metadata_share": meta}
  if cupti:   # device time of the kernels alone: the control's vs the whole step's
    from bench.bench_kernels import kernel_times
    try:
      ctl, row["control_cupti_ms"] = kernel_times(
          lambda s: r.control_only(s, tag_ids, state_ids, active), (state,))
      stp, row["step_cupti_ms"] = kernel_times(step, (state,))
      row["control_kernels"], row["step_kernels"] = len(ctl), len(stp)
      row["control_share_device"] = row["control_cupti_ms"] / row["step_cupti_ms"]
    except Exception as e:  # noqa: BLE001 -- CUPTI is a GPU-only extra: say why, keep the row
      row["cupti_error"] = f"{type(e).__name__}: {str(e)[:200]}"
  row["met"] = {k: bool(row[k] <= g) for k, g in GOALS.items()}
  return row


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--shape", default="qwen2.5-1.5b")
  ap.add_argument("--methods", nargs="+", default=["spherical", "sphkv-gated"])
  ap.add_argument("--context", type=int, nargs="+", default=[32768])
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--budget", type=float, default=0.35)
  ap.add_argument("--steps", type=int, default=16)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--prefill", nargs="+", default=["exact"], choices=["exact", "flash"],
                  help="SphRunner's prefill: 'exact' (f32 attention over a scratch cache of "
                       "the whole capacity) and/or 'flash' (cuDNN flash attention, the window's "
                       "votes alone): the commit's share against each")
  ap.add_argument("--cupti", action="store_true",
                  help="also the device time (CUPTI) of one control call's kernels and of one "
                       "step's: control_share_device, the control's share without its launches")
  ap.add_argument("--out", default=None, help="append the rows to this JSONL file")
  a = ap.parse_args(argv)
  import jax.numpy as jnp
  import jax
  from bench import print_row
  from bench.bench_decode import SHAPES
  from models import ModelConfig, random_model
  shapes = {**SHAPES, **SHAPES_EXTRA}
  if a.shape not in shapes:
    ap.error(f"--shape must be one of {sorted(shapes)}, got {a.shape!r}")
  cfg = ModelConfig(**shapes[a.shape])
  model = random_model(cfg, dtype=jnp.float32 if jax.default_backend() == "cpu"
                       else jnp.bfloat16)
  for ctx in a.context:
    for m in a.methods:
      for pf in a.prefill:
        row = {"shape": a.shape, **measure(model, m, a.batch, ctx, a.steps, a.repeats, a.budget,
                                           prefill=pf, cupti=a.cupti)}
        print_row(row, a.out)
  return 0


if __name__ == "__main__":
  sys.exit(main())
