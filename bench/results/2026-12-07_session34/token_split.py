"""Where Tracker.accept's time per token goes (issue 24, CPU): XGrammar's accept, the two
jump-forward strings the adapter reads, the structural tags (the parser-state id is not read
without a state vocabulary, as here and in the serving benchmark); on the
serving benchmark's grammar and a grammar-valid token path (bench/token_host.py).  Best of 5."""
import time

from bench.bench_serving import load_tokenizer, row_tools
from bench.token_host import token_path
from pask_jax.grammar import DEFAULT_STYLE, FCAdapter, GrammarCompiler, tool_call_grammar
from pask_jax.tracker import Tracker

tok, _ = load_tokenizer(".tok", ".tok")
vocab = 151936
fmt, indent = DEFAULT_STYLE.get("qwen2", ("json_list", None))
g = tool_call_grammar(GrammarCompiler(tok, vocab), row_tools(256), fmt, max_calls=1,
                      indent=indent, check=False)
ids = token_path(g, tok, vocab, 256)
best = {}
clock = time.perf_counter
for _ in range(5):
  tr = Tracker(g, FCAdapter(g, tok))
  m, ad = tr.matcher, tr.adapter
  t = dict(jf=0.0, acc=0.0, tag=0.0)
  for x in ids:
    t0 = clock()
    before = m.jump_forward().encode()
    t1 = clock()
    m.accept(x)
    t2 = clock()
    m.jump_forward()
    t3 = clock()
    ad.tag_bytes(ad.tb[x], before)
    t4 = clock()
    t["jf"] += (t1 - t0) + (t3 - t2)
    t["acc"] += t2 - t1
    t["tag"] += t4 - t3
  for k, v in t.items():
    best[k] = min(best.get(k, 1e9), v / len(ids) * 1e6)
print(len(ids), {k: round(v, 2) for k, v in best.items()})
