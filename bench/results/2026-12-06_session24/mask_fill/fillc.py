import time, json
import numpy as np
import xgrammar as xgr
from pask_jax.testing import smollm2_grammars
from pask_jax.grammar.matcher import new_bitmask
tok, gc = smollm2_grammars()
V = tok.vocab_size
def bench(schema, prefix, label, raw=False):
  if raw:
    info = xgr.TokenizerInfo.from_huggingface if False else None
    comp = gc._c if hasattr(gc, "_c") else None
  g = gc.json_schema(schema)
  m = g.matcher()
  for t in tok.encode(prefix): assert m.accept(t)
  bits = new_bitmask(1, V)
  m.fill(bits, 0)
  t = time.perf_counter()
  for _ in range(20): m.fill(bits, 0)
  print("%-40s %.2f ms/fill" % (label, (time.perf_counter() - t) / 20 * 1e3))
obj = lambda s: {"type": "object", "properties": {"city": s}, "required": ["city"]}
bench(obj({"type": "string"}), '{"city": "Par', "plain string")
bench(obj({"type": "string", "maxLength": 8}), '{"city": "Par', "maxLength 8")
bench(obj({"type": "string", "maxLength": 64}), '{"city": "Par', "maxLength 64")
bench(obj({"type": "string", "minLength": 2}), '{"city": "Par', "minLength 2")
bench(obj({"type": "integer", "minimum": 1, "maximum": 9}), '{"city": ', "integer 1..9")
