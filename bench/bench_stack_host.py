"""Host-side cost of one stacked calibration decode step (issue 5), without the device step.

The vmapped Runtime-V loop (:func:`calibrate.stack.run_stack`) runs V policies × N requests as
V·N rows of one :func:`pask_jax.decode.generate` loop.  Per step the host accepts each row's
token in its grammar parser (shared across rows of one request with the same prefix), fills the
next-token bitmask rows and ships them to the device.  This benchmark times exactly that host
work on the real BFCL prompts and grammars with the real tokenizer, by replacing the device
runner with a stand-in that picks a grammar-valid token per row (the lowest allowed id, and with
probability ``--diverge`` per row and step the highest, so copies of a request diverge as
interventions do).  The stand-in's own time is measured and subtracted.

    python bench/bench_stack_host.py --model qwen2.5-coder-0.5b-instruct --policies 24 \
        --cases 40 --steps 60 [--no-share]

Prints JSON: host ms per step (total, and the runner stand-in excluded), rows, distinct parser
nodes, accepts and forks.
"""
from __future__ import annotations

import argparse
import json
import time
from types import SimpleNamespace

import jax
import numpy as np


class HostRunner:
  """The runner interface of :func:`pask_jax.decode.generate` with no model: the next token of
  each row is an allowed id of its bitmask (so every parser sees a valid sequence)."""

  def __init__(self, batch: int, vocab: int, capacity: int, n_req: int, diverge: float, seed=0):
    self.batch, self.capacity = batch, capacity
    self.cfg = SimpleNamespace(vocab_size=vocab)
    self.n_req, self.diverge = n_req, diverge
    self.rng = np.random.default_rng(seed)
    self.runner_s = 0.0
    self.steps = 0

  def _pick(self, bits) -> np.ndarray:
    t0 = time.perf_counter()
    b = np.asarray(bits)
    nz = b != 0
    lo_w = nz.argmax(1)
    hi_w = b.shape[1] - 1 - nz[:, ::-1].argmax(1)
    r = np.arange(b.shape[0])
    lo_word = b[r, lo_w].view(np.uint32)
    hi_word = b[r, hi_w].view(np.uint32)
    lo_bit = np.array([(int(w) & -int(w)).bit_length() - 1 for w in lo_word])
    hi_bit = np.array([int(w).bit_length() - 1 for w in hi_word])
    lo, hi = lo_w * 32 + lo_bit, hi_w * 32 + hi_bit
    flip = self.rng.random(b.shape[0]) < self.diverge
    out = np.where(flip, hi, lo).astype(np.int32)
    self.runner_s += time.perf_counter() - t0
    return out

  def begin(self, tokens, lengths, prompt_tags=None):
    return None, None

  def select(self, logits, bits, key, temp, top_p, how=None):
    return self._pick(bits)

  def advance(self, state, tokens, tag_ids, state_ids, active, bits, key, temp, top_p,
              how=None):
    self.steps += 1
    return self._pick(bits), state

  def report(self, state):
    return None


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
  ap.add_argument("--policies", type=int, default=24, help="V (stacked interventions)")
  ap.add_argument("--cases", type=int, default=40, help="calibration cases per category")
  ap.add_argument("--categories", nargs="+", default=["simple_python", "multiple"])
  ap.add_argument("--steps", type=int, default=60, help="max tokens per row")
  ap.add_argument("--diverge", type=float, default=0.01)
  ap.add_argument("--no-share", action="store_true", help="one parser per row")
  ap.add_argument("--profile", default=None, help="write a cProfile of the loop here")
  a = ap.parse_args(argv)

  from calibrate import bfcl, tasks
  from calibrate.shared import Forest
  from models import gguf_io, registry
  from models.config import ModelConfig
  from models.tokenizer import Tokenizer
  from pask_jax import decode as dec
  from pask_jax.grammar import GrammarCompiler

  meta, tensors = gguf_io.read(registry.resolve(a.model))
  cfg = ModelConfig.from_gguf_fields(meta, {t.name for t in tensors})
  tok = Tokenizer.from_gguf_metadata(meta)
  cases = bfcl.load(a.categories, split="calibration", seed=0)
  by: dict[str, list] = {}
  for c in cases:
    by.setdefault(c.category, []).append(c)
  cases = [c for v in by.values() for c in v[:a.cases]]
  task = tasks.BFCLTask(cases, tok, arch=cfg.arch, compiler=GrammarCompiler(tok, cfg.vocab_size))
  N, V = len(task.requests), a.policies
  runner = HostRunner(V * N, cfg.vocab_size, 1 << 20, N, a.diverge)
  prompts = [r.ids for _ in range(V) for r in task.requests]
  ptags = [r.tags for _ in range(V) for r in task.requests]
  if a.no_share:
    trackers = [task.tracker(i) for _ in range(V) for i in range(N)]
    forest = None
  else:
    forest = Forest(task.tracker)
    trackers = [forest.row(i) for _ in range(V) for i in range(N)]
  sampling = dec.Sampling(max_tokens=a.steps)
  prof = None
  if a.profile:
    import cProfile
    prof = cProfile.Profile()
    prof.enable()
  t0 = time.perf_counter()
  res = dec.generate(runner, tok, prompts, trackers=trackers, prompt_tags=ptags, sampling=sampling)
  wall = time.perf_counter() - t0
  if prof is not None:
    prof.disable()
    prof.dump_stats(a.profile)
  steps = runner.steps + 1
  out = {"rows": V * N, "policies": V, "requests": N, "steps": steps, "share": not a.no_share,
         "host_ms_per_step": 1e3 * (wall - runner.runner_s) / steps,
         "wall_ms_per_step": 1e3 * wall / steps,
         "mean_tokens": float(np.mean([len(r.tokens) for r in res])),
         "platform": jax.devices()[0].platform}
  if forest is not None:
    out.update(accepts=forest.accepts, forks=forest.forks)
  print(json.dumps(out))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
