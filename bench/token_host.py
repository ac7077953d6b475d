"""The serving engine's host work per generated token, alone (issue 24): no model, no device.

``bench/host_split.py`` times the engine loop in place, where the step competes for the host;
this times the per-token path by itself on the grammar and tokenizer of the serving benchmark
(``bench_serving.py``: the ``record_rows`` tool of ``--outputs`` rows, the model family's
tool-call style): per row of a batch and per token, the next-token bitmask fill
(``Tracker.fill``), the output path (``serve.engine.output.Output.accept``: grammar accept,
structural tags, parser-state id, incremental detokenization, the text delta), and inside it
the grammar + tags (``Tracker.accept``) and the detokenizer.  The token path is grammar-valid:
at each step a seeded random choice among the first 200 allowed ids (short tokens, as a model's
JSON mostly is).  Best of ``--repeats`` runs.

    python bench/token_host.py --tokenizer .tok --vocab 151936 --rows 8 --tokens 256
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np


def token_path(grammar, tok, vocab: int, n: int, seed: int = 0) -> list[int]:
  """``n`` grammar-valid token ids (fewer if the grammar completes)."""
  from pask_jax.grammar import FCAdapter
  from pask_jax.grammar.matcher import new_bitmask
  from pask_jax.tracker import Tracker
  rng = np.random.default_rng(seed)
  tr, bits, out = Tracker(grammar, FCAdapter(grammar, tok)), new_bitmask(1, vocab), []
  stops = set(tok.stop_ids)
  for _ in range(n):
    tr.fill(bits, 0)
    allowed = np.flatnonzero(np.unpackbits(bits[0].view(np.uint8), bitorder="little")[:vocab])
    allowed = [int(a) for a in allowed if a not in stops] or [int(a) for a in allowed]
    t = int(rng.choice(allowed[:200]))
    tr.accept(t)
    out.append(t)
    if tr.terminated:
      break
  return out


def request(tracker):
  """A ``serve.engine.Request`` that never ends by length, for ``Output.accept``."""
  from serve.engine import Request
  return Request(ids=[], max_tokens=1 << 30, tracker=tracker)


def measure(grammar, tok, vocab: int, ids: list[int], rows: int, repeats: int) -> dict:
  from pask_jax.grammar import FCAdapter
  from pask_jax.grammar.matcher import new_bitmask
  from pask_jax.tracker import Tracker
  from serve.detok import Detokenizer
  from serve.engine.output import Output
  bits, n = new_bitmask(rows, vocab), len(ids)
  best: dict[str, float] = {}

  def keep(k, seconds, per):
    best[k] = min(best.get(k, float("inf")), 1e6 * seconds / per)
  for _ in range(repeats):
    trs = [Tracker(grammar, FCAdapter(grammar, tok)) for _ in range(rows)]
    reqs, out = [request(t) for t in trs], Output(tok)
    tf = ta = 0.0
    for t in ids:
      t0 = time.perf_counter()
      for b in range(rows):
        trs[b].fill(bits, b)
      t1 = time.perf_counter()
      for b in range(rows):
        out.accept(reqs[b], t)
      tf, ta = tf + t1 - t0, ta + time.perf_counter() - t1
    keep("fill_us_per_row_token", tf, n * rows)
    keep("output_accept_us_per_row_token", ta, n * rows)
    tr, d, seen = Tracker(grammar, FCAdapter(grammar, tok)), Detokenizer(tok), []
    tg = td = 0.0
    for t in ids:
      t0 = time.perf_counter()
      tr.accept(t)
      t1 = time.perf_counter()
      seen.append(t)
      d.text(seen)
      tg, td = tg + t1 - t0, td + time.perf_counter() - t1
    keep("tracker_accept_us_per_token", tg, n)
    keep("detok_us_per_token", td, n)
  best["rows"], best["tokens"] = rows, n
  best["host_ms_per_step"] = rows * (best["fill_us_per_row_token"]
                                     + best["output_accept_us_per_row_token"]) / 1e3
  return best


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--tokenizer", default=".tok", help="a tokenizer.json directory or a GGUF")
  ap.add_argument("--arch", default="qwen2", help="the tool-call style's model family")
  ap.add_argument("--outputs", type=int, default=256, help="rows of the benchmark's tool")
  ap.add_argument("--vocab", type=int, default=None,
                  help="the model's vocabulary (bitmask width; default: the tokenizer's)")
  ap.add_argument("--rows", type=int, default=8)
  ap.add_argument("--tokens", type=int, default=256)
  ap.add_argument("--repeats", type=int, default=5)
  a = ap.parse_args(argv)
  from bench.bench_serving import load_tokenizer, row_tools
  from pask_jax.grammar import DEFAULT_STYLE, GrammarCompiler, tool_call_grammar
  tok, _ = load_tokenizer(a.tokenizer, a.tokenizer)
  vocab = a.vocab or tok.vocab_size
  fmt, indent = DEFAULT_STYLE.get(a.arch, ("json_list", None))
  grammar = tool_call_grammar(GrammarCompiler(tok, vocab), row_tools(a.outputs), fmt,
                              max_calls=1, indent=indent, check=False)
  ids = token_path(grammar, tok, vocab, a.tokens)
  print(json.dumps({"format": fmt, **measure(grammar, tok, vocab, ids, a.rows, a.repeats)}))


if __name__ == "__main__":
  main()
