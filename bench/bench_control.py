"""Per-token cost of PASK's online control at growing history: tagging (host) + controller (jit).

A long tool-call answer (a JSON list of many calls) is fed token by token through the request's
grammar matcher and function-calling adapter (with a parser-state vocabulary, so the frontier is
read as in serving).  At each history length in ``--history`` we time the next ``--window``
tokens: bitmask fill, accept + tag (adapter, incl. frontier and incremental JSON scan), and the
jitted controller (Alg. 2) for a batch of ``--batch`` sequences.  Flat numbers across history =
O(1) per token, as §3.5 / B.7 claim for the controller and as the adapter must also achieve.

    python bench/bench_control.py --history 1024 8192 32768
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--history", type=int, nargs="+", default=[1024, 8192, 32768])
  ap.add_argument("--window", type=int, default=512)
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--json", default=None)
  a = ap.parse_args(argv)
  import jax
  import jax.numpy as jnp
  import numpy as np
  from models import gguf_io, registry
  from models.tokenizer import Tokenizer
  from pask_jax import controller, policy as P
  from pask_jax.grammar import GrammarCompiler, new_bitmask, tool_call_grammar
  from pask_jax.grammar.fc_adapter import FCAdapter
  from pask_jax.grammar.frontier import StateVocab

  tok = Tokenizer.from_gguf_metadata(gguf_io.read(registry.smollm2_path()).meta)
  tools = json.load(open(os.path.join(os.path.dirname(__file__), "..", "examples",
                                      "weather_tools.json")))
  gc = GrammarCompiler(tok, tok.vocab_size)
  n_need = max(a.history) + a.window
  call = '{"name": "get_weather", "arguments": {"city": "San Francisco", "unit": "celsius"}}'
  per_call = len(tok.encode(call + ", "))
  n_calls = int(n_need / (per_call - 1)) + 8  # tokens merge across calls a little
  g = tool_call_grammar(gc, tools, "json_list", max_calls=n_calls)
  text = "[" + ", ".join([call] * n_calls) + "]"
  ids = tok.encode(text)
  assert len(ids) >= n_need, (len(ids), n_need)
  m = g.matcher()
  ad = FCAdapter(g, tok, vocab=StateVocab(grow=True))
  bits = new_bitmask(1, tok.vocab_size)

  class Cfg:  # the SmolLM2 identity the cost model needs
    n_layers, n_kv_heads, head_dim = 30, 3, 64

  pol = P.demo(Cfg)
  B = a.batch

  @jax.jit
  def run_controller(pol, cands, sids, bal):
    """The controller over a window of tokens inside one jit (as inside the decode step: no
    per-token dispatch), batch B."""
    def body(bal, x):
      c, s = x
      acts, bal = controller.control_batch(pol, jnp.broadcast_to(c, (B, 4)),
                                           jnp.full((B,), s, jnp.int32), bal)
      return bal, acts
    return jax.lax.scan(body, bal, (cands, sids))

  bal = jnp.full((B,), controller.initial_balance(pol), jnp.float32)
  rows, t = [], 0
  for h in sorted(a.history):
    while t < h:  # advance the request to history h (untimed)
      ad.accept(m, ids[t])
      t += 1
    fill = tag = 0.0
    cands, sids = [], []
    for _ in range(a.window):
      t0 = time.perf_counter()
      m.fill(bits, 0)
      t1 = time.perf_counter()
      c, sid = ad.accept(m, ids[t])
      t2 = time.perf_counter()
      cands.append(c)
      sids.append(sid)
      fill, tag, t = fill + t1 - t0, tag + t2 - t1, t + 1
    xs = (jnp.asarray(np.stack(cands)), jnp.asarray(sids, jnp.int32))
    jax.block_until_ready(run_controller(pol, *xs, bal))  # compile (same shapes every window)
    t0 = time.perf_counter()
    for _ in range(5):
      bal, _ = run_controller(pol, *xs, bal)
    bal.block_until_ready()
    ctrl = (time.perf_counter() - t0) / 5
    w = a.window
    rows.append({"history": h, "fill_us": fill / w * 1e6, "tag_us": tag / w * 1e6,
                 "controller_us": ctrl / w * 1e6, "batch": B})
    print(f"history {h:>6}: bitmask fill {fill / w * 1e6:7.1f} µs  "
          f"accept+tag {tag / w * 1e6:7.1f} µs"
          f"  controller (in jit, batch {B}) {ctrl / w * 1e6:7.2f} µs per token", flush=True)
  if a.json:
    with open(a.json, "w") as f:
      json.dump(rows, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
