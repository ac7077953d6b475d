"""Host time of one grammar-mask fill (XGrammar's ``fill_next_token_bitmask``) inside a JSON
string, per schema shape: the engine fills one row per running request every decode step, on
the host (issue 24), so a shape whose fill costs milliseconds sets the step's time.

  python bench/grammar_fill.py                 (SmolLM2's tokenizer; --repeats N)

Prints a markdown table: each string schema compiled by XGrammar as is and by
``GrammarCompiler.json_schema`` (schema_check + matcher.schema_ebnf), the matcher advanced into
the string (``{"city": "Par``), then ms per fill; and bounded repetitions of three character
rules written as EBNF (why schema_ebnf keeps one character class).
"""
from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

PREFIX = '{"city": "Par'
SCHEMAS = [{"type": "string"}, {"type": "string", "maxLength": 8},
           {"type": "string", "maxLength": 64}, {"type": "string", "minLength": 2}]
RULES = {"XGrammar's class": '(([^\\"\\\\\\r\\n]))',
         "class without controls": '(([^\\0-\\x1f\\"\\\\]))',
         "class or escape": '(([^\\0-\\x1f\\"\\\\]) | ("\\\\" e))'}
ESCAPE = 'e ::= (([\\"\\\\/bfnrt]) | ("u" [A-Fa-f0-9]{4}))\n'


def per_fill(xgr, tok, compiled, repeats: int) -> float:
  """ms per fill of one row, the matcher inside the string."""
  from pask_jax.grammar.matcher import new_bitmask
  m = xgr.GrammarMatcher(compiled)
  for t in tok.encode(PREFIX):
    if not m.accept_token(t):
      raise SystemExit(f"the grammar refused {PREFIX!r}")
  bits = new_bitmask(1, tok.vocab_size)
  m.fill_next_token_bitmask(bits, 0)
  t0 = time.perf_counter()
  for _ in range(repeats):
    m.fill_next_token_bitmask(bits, 0)
  return (time.perf_counter() - t0) / repeats * 1e3


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--repeats", type=int, default=20)
  a = ap.parse_args(argv)
  from pask_jax.grammar.matcher import import_xgrammar
  from pask_jax.testing import smollm2_grammars
  xgr = import_xgrammar()
  tok, gc = smollm2_grammars()
  comp = xgr.GrammarCompiler(gc.info)
  print(f"vocabulary {tok.vocab_size}; ms per fill inside the string\n")
  print("| property schema | XGrammar as is | json_schema (ours) |\n|---|---|---|")
  for s in SCHEMAS:
    sch = json.dumps({"type": "object", "properties": {"city": s}, "required": ["city"]})
    raw = comp.compile_json_schema(sch, any_whitespace=False, strict_mode=True)
    ours = gc.json_schema(sch).compiled
    print(f"| `{json.dumps(s)}` | {per_fill(xgr, tok, raw, a.repeats):.3f} | "
          f"{per_fill(xgr, tok, ours, a.repeats):.3f} |")
  print("\n| character rule | {0, 8} | {2, -1} | {0, 64} |\n|---|---|---|---|")
  head = 'root ::= (("{" "\\"city\\"" ": " p "}"))\np ::= (("\\"" c{%s} "\\""))\n'
  for name, rule in RULES.items():
    cells = [per_fill(xgr, tok, comp.compile_grammar(xgr.Grammar.from_ebnf(
        head % rep + f"c ::= {rule}\n" + ESCAPE)), a.repeats) for rep in ("0, 8", "2, -1", "0, 64")]
    print(f"| {name} | " + " | ".join(f"{c:.3f}" for c in cells) + " |")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
