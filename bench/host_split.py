"""Where the serving engine's host time per decode step goes, function by function (issue 24).

The engine's own timers (``fill``, ``dispatch``, ``wait``, ``accept``: ``bench_serving.py``'s
``host_ms_per_step``) say which phase of a step is long; this says what inside it: each listed
function of the engine loop, the step and the per-token output path is wrapped with a wall-clock
timer (no profiler: ``cProfile`` and ``--profile`` inflate Python-heavy code several times), then
``bench/bench_serving.py`` runs with the arguments given, and the table prints calls, seconds,
µs per call and µs per decode step of each.  Nested functions count inside their callers too
(``Loop._land`` holds ``Output.accept``, which holds ``Tracker.accept``, ...).

    python bench/host_split.py --shape qwen2.5-0.5b --tokenizer .tok --inputs 8192 \\
        --outputs 256 --concurrency 8 --methods pask --kv-memory 16 --page 16 --lo-format int4

On a CPU host the XLA step competes with Python for the cores, so the per-token rows there
are upper bounds; the device machine (16 cores, the step on the GPU) gives the real split.
"""
from __future__ import annotations

import collections
import os
import runpy
import sys
import time

# (module, class or None, function, label): the engine loop, the step's launches, the transfers,
# the per-token output path and the grammar.
TARGETS = (
    ("serve.engine.loop", "Loop", "_iterate", "Loop._iterate"),
    ("serve.engine.loop", "Loop", "_land", "Loop._land"),
    ("serve.engine.loop", "Loop", "_launch", "Loop._launch"),
    ("serve.engine.loop", "Loop", "_admit", "Loop._admit"),
    ("serve.engine.loop", "Loop", "_grow", "Loop._grow"),
    ("serve.engine.loop", "Loop", "_finish", "Loop._finish"),
    ("serve.engine.loop", "Loop", "_accept", "Loop._accept"),
    ("serve.engine.step", "Step", "pick", "Step.pick"),
    ("serve.engine.step", "PagedStep", "forward", "PagedStep.forward"),
    ("serve.engine.step", "DenseStep", "forward", "DenseStep.forward"),
    ("serve.engine.step", "PagedStep", "serial", "PagedStep.serial"),
    ("serve.engine.step", "DenseStep", "serial", "DenseStep.serial"),
    ("serve.engine.step", None, "upload", "upload"),
    ("serve.engine.batch", "Batch", "mask", "Batch.mask"),
    ("serve.engine.batch", "Batch", "packed", "Batch.packed"),
    ("serve.engine.batch", "Batch", "host", "Batch.host"),
    ("serve.engine.batch", "Batch", "feed", "Batch.feed"),
    ("serve.engine.batch", "Batch", "defer", "Batch.defer"),
    ("serve.engine.pages", "PagePools", "record_late", "PagePools.record_late"),
    ("serve.engine.pages", "PagePools", "growth", "PagePools.growth"),
    ("serve.engine.output", "Output", "accept", "Output.accept"),
    ("serve.engine.output", "Output", "send", "Output.send"),
    ("serve.engine.output", "Output", "_stop_text", "Output._stop_text"),
    ("serve.detok", "Detokenizer", "text", "Detokenizer.text"),
    ("pask_jax.tracker", "Tracker", "accept", "Tracker.accept"),
    ("pask_jax.tracker", "Tracker", "fill", "Tracker.fill"),
    ("pask_jax.grammar.fc_adapter", "Adapter", "_tag", "Adapter._tag"),
    ("pask_jax.grammar.fc_adapter", "Adapter", "_state_id", "Adapter._state_id"),
)


class Split:
  """Per-call wall-clock samples of the wrapped functions, by label.

  The run includes warm-up, where the first calls of each executable compile (tens of ms), so
  the table leads with the median per call and a steady-state estimate per step (the median
  times the calls per step) beside the plain totals."""

  def __init__(self):
    self.samples: dict[str, list[float]] = collections.defaultdict(list)
    self.undo: list = []

  @property
  def calls(self) -> collections.Counter:
    return collections.Counter({k: len(v) for k, v in self.samples.items()})

  @property
  def seconds(self) -> collections.Counter:
    return collections.Counter({k: sum(v) for k, v in self.samples.items()})

  def wrap(self, owner, name: str, label: str) -> None:
    f = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
    add, clock = self.samples[label].append, time.perf_counter

    def timed(*args, **kwargs):
      t0 = clock()
      try:
        return f(*args, **kwargs)
      finally:
        add(clock() - t0)
    timed.__wrapped__ = f
    setattr(owner, name, timed)
    self.undo.append((owner, name, f))

  def install(self, targets=TARGETS) -> "Split":
    import importlib
    for mod, cls, fn, label in targets:
      m = importlib.import_module(mod)
      self.wrap(getattr(m, cls) if cls else m, fn, label)
    return self

  def remove(self) -> None:
    for owner, name, f in reversed(self.undo):
      setattr(owner, name, f)
    self.undo.clear()

  def stats(self, label: str, steps: int) -> dict:
    """calls, total seconds, median and 90th-percentile µs per call, and the steady-state µs
    per step (median per call × calls per step)."""
    v = sorted(self.samples[label])
    n = len(v)
    med, p90 = v[n // 2], v[min(n - 1, (9 * n) // 10)]
    return {"calls": n, "seconds": sum(v), "median_us": 1e6 * med, "p90_us": 1e6 * p90,
            "steady_us_per_step": 1e6 * med * n / max(steps, 1)}

  def table(self, steps: int) -> str:
    rows = [f"{'function':24s} {'calls':>8s} {'seconds':>9s} {'med us':>9s} {'p90 us':>9s} "
            f"{'us/step':>9s}"]
    stats = {k: self.stats(k, steps) for k, v in self.samples.items() if v}
    for k in sorted(stats, key=lambda k: -stats[k]["steady_us_per_step"]):
      s = stats[k]
      rows.append(f"{k:24s} {s['calls']:8d} {s['seconds']:9.3f} {s['median_us']:9.1f} "
                  f"{s['p90_us']:9.1f} {s['steady_us_per_step']:9.1f}")
    return "\n".join(rows)


STEPS = ("PagedStep.forward", "DenseStep.forward", "PagedStep.serial", "DenseStep.serial")


def main(argv: list[str]) -> None:
  split = Split().install()
  here = os.path.dirname(os.path.abspath(__file__))
  sys.argv = [os.path.join(here, "bench_serving.py")] + argv
  try:
    runpy.run_path(sys.argv[0], run_name="__main__")
  finally:
    split.remove()
    steps = sum(split.calls[k] for k in STEPS)
    print(f"# host split over {steps} decode steps (launches of the forward or serial step; "
          "every cell of the run, warm-up included); us/step = median per call x calls per step")
    print(split.table(steps))


if __name__ == "__main__":
  main(sys.argv[1:])
