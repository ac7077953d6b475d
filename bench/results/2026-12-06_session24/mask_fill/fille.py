import time, json
import xgrammar as xgr
from pask_jax.testing import smollm2_grammars
from pask_jax.grammar.matcher import new_bitmask
tok, gc = smollm2_grammars()
V = tok.vocab_size
def run(ebnf, label):
  compiled = gc._compiler.compile_grammar(xgr.Grammar.from_ebnf(ebnf))
  m = xgr.GrammarMatcher(compiled)
  for t in tok.encode('{"city": "Par'): assert m.accept_token(t)
  bits = new_bitmask(1, V)
  m.fill_next_token_bitmask(bits, 0)
  t = time.perf_counter()
  for _ in range(20): m.fill_next_token_bitmask(bits, 0)
  print("%-60s %.3f ms/fill" % (label, (time.perf_counter() - t) / 20 * 1e3))
head = 'root ::= (("{" "\\"city\\"" ": " p "}"))\np ::= (("\\"" c{%s} "\\""))\n'
esc = 'e ::= (([\\"\\\\/bfnrt]) | ("u" [A-Fa-f0-9]{4}))\n'
for rep in ("0, 8", "2, -1", "0, 64"):
  run(head % rep + 'c ::= (([^\\"\\\\\\r\\n]))\n', f"xgrammar's class {{{rep}}}")
  run(head % rep + 'c ::= (([^\\0-\\x1f\\"\\\\]))\n', f"no controls class {{{rep}}}")
  run(head % rep + 'c ::= (([^\\0-\\x1f\\"\\\\]) | ("\\\\" e))\n' + esc, f"class | escape {{{rep}}}")
  run(head % rep + 'c ::= (([^\\0-\\x1f\\"\\\\]) | ("\\\\" [\\"\\\\/bfnrt]))\n', f"class | simple escape {{{rep}}}")
