"""SQL grammar (per database schema) and SQL tag adapter, with the real Qwen2.5 vocabulary.

The golden is written by hand from pask_jax/grammar/sql.py's docstring.  Code: class P/B/F,
role p/r/w/o (projection, relation, predicate (where/on/having), outside_schema), state
s/b/c (stable, boundary, critical), next L/N; "+" joins candidates.
"""
import functools
import os

import pytest

from pask_jax.testing import grammar_compiler, stored_tokenizer

from pask_jax import tags as T
from pask_jax.grammar import GrammarError
from pask_jax.grammar.sql import SQLAdapter, schema_from_ddl, sql_grammar

DATA = os.path.join(os.path.dirname(__file__), "data", "qwen_tokenizer.json.gz")
DDL = """CREATE TABLE singer (singer_id INTEGER PRIMARY KEY, name TEXT NOT NULL, country TEXT,
  age INTEGER, "full name" TEXT);
CREATE TABLE concert (concert_id INTEGER PRIMARY KEY,
  singer_id INTEGER REFERENCES singer(singer_id), year INTEGER, venue TEXT);"""
_C = {"P": T.Cls.PURE_SCAFFOLD, "B": T.Cls.SCHEMA_BEARING, "F": T.Cls.FREE_GENERATION}
_R = {"p": T.SQLRole.PROJECTION, "r": T.SQLRole.RELATION, "w": T.SQLRole.PREDICATE,
      "o": T.SQLRole.OUTSIDE_SCHEMA}
_S = {"s": T.SQLState.STABLE, "b": T.SQLState.BOUNDARY, "c": T.SQLState.CRITICAL}
_N = {"L": T.Next.LOOKAHEAD_CRITICAL, "N": T.Next.NO_LOOKAHEAD}


def code(c):
  out = []
  for part in c.split("+"):
    cr, s, n = part.split()
    out.append(T.sql(_C[cr[0]], _R[cr[1]], _S[s], _N[n]))
  return out


@functools.lru_cache(maxsize=None)
def setup():
  tok = stored_tokenizer(DATA)
  gc = grammar_compiler(tok)
  return tok, gc, sql_grammar(gc, DDL)


def test_join_and_predicate_golden_qwen():
  tok, _, g = setup()
  text = ("SELECT T1.name FROM singer AS T1 JOIN concert AS T2 ON T1.singer_id = T2.singer_id "
          "WHERE T2.year > 2014")
  golden = [
      ("SELECT", "Po s N"),               # forced clause keyword
      (" T", "Fp c L"), ("1", "Fp c L"),  # an alias qualifier: free
      (".name", "Pp b L+Bp c L"),         # crosses '.' and a column: two candidates
      (" FROM", "Po b N"),
      (" singer", "Br c L"),              # table choice; ", "/" AS"/" JOIN"... may follow
      (" AS", "Pr b N"), (" T", "Fr c L"), ("1", "Fr c L"),
      (" JOIN", "Po b N"),
      (" concert", "Br c N"),             # in a JOIN only " AS " or " ON " follows: " " forced
      (" AS", "Pr b N"), (" T", "Fr c L"), ("2", "Fr c L"),
      (" ON", "Po b N"),
      (" T", "Fw c L"), ("1", "Fw c L"),
      (".s", "Pw b N+Bw c N"),            # 's' selects singer_id: the rest is forced
      ("inger", "Bw s N"), ("_id", "Bw s N"),
      (" =", "Pw b N"), (" T", "Fw c L"), ("2", "Fw c L"),
      (".s", "Pw b N+Bw c N"), ("inger", "Bw s N"), ("_id", "Bw s L"),
      (" WHERE", "Po b N"),
      (" T", "Fw c L"), ("2", "Fw c L"), (".year", "Pw b N+Bw c N"),
      (" >", "Pw b L"), (" ", "Pw b L"),
      ("2", "Fw c L"), ("0", "Fw c L"), ("1", "Fw c L"), ("4", "Fw c L"),
  ]
  ad, m = SQLAdapter(g, tok), g.matcher()
  pieces = []
  for i in tok.encode(text):
    cands, _ = ad.accept(m, i)
    pieces.append((tok.decode([i]), [int(c) for c in cands if c != T.PAD]))
  assert [p for p, _ in pieces] == [p for p, _ in golden], "tokenization changed"
  for (p, got), (_, want) in zip(pieces, golden):
    assert got == code(want), (p, [T.describe(i) for i in got], want)
  cands, _ = ad.accept(m, tok.stop_ids[0])
  assert cands[0] == T.STOP and m.terminated


GOOD = [
    "SELECT * FROM singer",
    "SELECT DISTINCT country FROM singer ORDER BY country ASC LIMIT 5;",
    "SELECT country, COUNT(*) FROM singer GROUP BY country HAVING COUNT(*) > 1 ORDER BY COUNT(*) DESC",  # noqa: E501
    "SELECT COUNT(DISTINCT T1.name) AS n FROM singer AS T1 LEFT JOIN concert AS T2 ON T1.singer_id = T2.singer_id",  # noqa: E501
    "SELECT name FROM singer WHERE singer_id IN (SELECT singer_id FROM concert WHERE year BETWEEN 2010 AND 2015)",  # noqa: E501
    "SELECT T.name FROM (SELECT name, age FROM singer) AS T WHERE T.age >= 30 OR NOT (name LIKE 'A%')",  # noqa: E501
    "SELECT name FROM singer WHERE country IS NOT NULL AND age NOT IN (1, 2) AND name = 'O''Hara'",
    'SELECT "full name" FROM singer',
    "SELECT AVG(age), MAX(age) FROM singer, concert WHERE singer.singer_id = concert.singer_id",
]
BAD = ["SELECT * FROM band", "select * from singer", "SELECT nickname FROM singer",
       "SELECT * FROM singer WHERE", "SELECT name FROM singer LIMIT x"]


def test_grammar_accepts_subset_and_rejects_others():
  _, _, g = setup()
  for q in GOOD:
    m = g.matcher()
    assert m.m.accept_string(q) and m.m.is_completed(), q
  for q in BAD:
    m = g.matcher()
    assert not (m.m.accept_string(q) and m.m.is_completed()), q


def test_bad_ddl_and_schema():
  with pytest.raises(GrammarError, match="SQLite"):
    schema_from_ddl("CREATE TABLE x (a INTEGER")
  with pytest.raises(GrammarError, match="no table"):
    schema_from_ddl("-- nothing")
  assert schema_from_ddl(DDL)["concert"] == ["concert_id", "singer_id", "year", "venue"]


def roles_of(ad, chunks):
  out = {}
  for ch in chunks:
    ids = [int(c) for c in ad.tag_bytes(ch.encode()) if c != T.PAD]
    out.setdefault(ch.strip(), []).append(
        {(T.Cls(T.unpack(i)[1]).name, T.SQLRole(T.unpack(i)[2]).name) for i in ids})
  return out


def test_nested_select_roles_and_clause_stack():
  tok, _, g = setup()
  ad = SQLAdapter(g, tok)
  q = ("SELECT name FROM singer WHERE singer_id IN ( SELECT singer_id FROM concert ) "
       "AND age > 3 GROUP BY country HAVING COUNT ( * ) > 1 LIMIT 2 ;")
  chunks = [w + " " for w in q.split(" ")]
  r = roles_of(ad, chunks)
  assert r["name"] == [{("SCHEMA_BEARING", "PROJECTION")}]
  assert r["singer"] == [{("SCHEMA_BEARING", "RELATION")}]
  assert r["singer_id"] == [{("SCHEMA_BEARING", "PREDICATE")}, {("SCHEMA_BEARING", "PROJECTION")}]
  assert r["concert"] == [{("SCHEMA_BEARING", "RELATION")}]
  assert r["age"] == [{("SCHEMA_BEARING", "PREDICATE")}]  # back in WHERE after ')'
  assert r["country"] == [{("SCHEMA_BEARING", "PROJECTION")}]
  assert r["COUNT"] == [{("PURE_SCAFFOLD", "PREDICATE")}]   # HAVING
  assert r["3"] == [{("FREE_GENERATION", "PREDICATE")}]
  assert r["2"] == [{("FREE_GENERATION", "OUTSIDE_SCHEMA")}]  # LIMIT value
  for kw in ("SELECT", "FROM", "WHERE", "GROUP", "BY", "HAVING", "LIMIT"):
    assert all(s == {("PURE_SCAFFOLD", "OUTSIDE_SCHEMA")} for s in r[kw]), kw
  assert r["AND"] == [{("PURE_SCAFFOLD", "PREDICATE")}]
  assert r[";"] == [{("PURE_SCAFFOLD", "OUTSIDE_SCHEMA")}]


def test_partial_word_candidates_and_quoted_identifier():
  tok, _, g = setup()
  ad = SQLAdapter(g, tok)
  ad.tag_bytes(b"SELECT name FROM singer")
  got = {T.SQLRole(T.unpack(int(c))[2]).name for c in ad.tag_bytes(b" OR") if c != T.PAD}
  assert got == {"OUTSIDE_SCHEMA", "RELATION"}  # ORDER (clause) or OR (in FROM's role)
  ad.reset()
  ad.tag_bytes(b"SELECT ")
  got = [int(x) for x in ad.tag_bytes(b'"full name"', forced=b'"') if x != T.PAD]
  assert got == [T.sql(T.Cls.PURE_SCAFFOLD, T.SQLRole.PROJECTION, T.SQLState.BOUNDARY,
                       T.Next.NO_LOOKAHEAD),   # the quotes (the opening one forced, not the end)
                 T.sql(T.Cls.SCHEMA_BEARING, T.SQLRole.PROJECTION, T.SQLState.CRITICAL,
                       T.Next.NO_LOOKAHEAD)]   # the quoted column name
