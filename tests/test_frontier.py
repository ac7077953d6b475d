"""Guard for XGrammar's private frontier string (pinned versions) and the parser-state
vocabulary."""
import pytest

from pask_jax.grammar import frontier as F

SAMPLE = """There are 4 steps in history. Last step: [
ParserState(rule_id=1, sequence_id=8, element_id=8, rule_start_pos=0, sub_element_id=0), 
ParserState(rule_id=12, sequence_id=40, element_id=-1, rule_start_pos=20, sub_element_id=3), 
]"""  # noqa: W291 (the dump as XGrammar prints it)


def test_parse_known_state_string():
  st = F.parse(SAMPLE)
  assert st == [F.ParserState(1, 8, 8, 0, 0), F.ParserState(12, 40, -1, 20, 3)]
  assert st[1].rule_id == 12 and st[1].sub_element_id == 3 and st[1].rule_start_pos == 20


@pytest.mark.parametrize("bad", [
    "Earley state: rule=1",                                                  # header changed
    "There are 1 steps in history. Last step: [\nParserState(rule=1, seq=2)\n]",  # fields changed
    "There are 1 steps in history. Last step: [\nParserState(rule_id=1, sequence_id=8, ",
])
def test_unrecognized_strings_fail_loudly(bad):
  with pytest.raises(F.FrontierError):
    F.parse(bad)


def test_version_pin():
  F.check_version()  # the installed xgrammar must be a supported one
  with pytest.raises(F.FrontierError, match="pinned to 0.2.8, 0.2.9"):
    F.check_version("0.3.0")


def _matcher(ebnf):
  import xgrammar as xgr
  info = xgr.TokenizerInfo([bytes([b]) for b in range(256)])  # a byte vocabulary: fast
  compiled = xgr.GrammarCompiler(info).compile_grammar(xgr.Grammar.from_ebnf(ebnf))
  return compiled, xgr.GrammarMatcher(compiled)


def test_live_matcher_string_parses_into_named_rules():
  """The real private string of the installed XGrammar, on a grammar with role-named rules."""
  compiled, m = _matcher('root ::= "SELECT " proj_list " FROM " rel_table\n'
                         'proj_list ::= ("name" | "age") (", " proj_list)?\n'
                         'rel_table ::= "singer" | "concert"')
  fr = F.Frontier(compiled)
  assert {"root", "proj_list", "rel_table"} <= set(fr.names)
  keys = []
  for text in ("SELECT ", "na", "me FROM ", "sing"):
    assert m.accept_string(text)
    st = fr.states(m)
    assert st and all(0 <= s.rule_id < len(fr.names) and s.element_id >= 0 for s in st)
    keys.append(fr.key(m))
  assert "proj_list:" in keys[0] and "rel_table:" in keys[2] and "rel_table:" in keys[3]
  assert keys[2] != keys[3]
  # Same state, same key, from a fresh matcher (the key does not depend on history length).
  _, m2 = _matcher('root ::= "SELECT " proj_list " FROM " rel_table\n'
                   'proj_list ::= ("name" | "age") (", " proj_list)?\n'
                   'rel_table ::= "singer" | "concert"')
  m2.accept_string("SELECT age, name FROM sing")
  assert fr.key(m2) == keys[3]


def test_state_vocab():
  v = F.StateVocab(grow=True)
  assert [v("a"), v("b"), v("a")] == [0, 1, 0] and len(v) == 2
  frozen = F.StateVocab.from_json(v.to_json())
  assert frozen("b") == 1 and frozen("c") == F.UNSEEN and len(frozen) == 2
  assert F.key_hash("a|b") == F.key_hash("a|b") != F.key_hash("a|c")
  assert 0 <= F.key_hash("x") < 2 ** 63
