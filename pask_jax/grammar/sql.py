"""Text-to-SQL: a per-database EBNF grammar for a practical SQLite subset, and its tag adapter.

Grammar (:func:`sql_grammar_text`, :func:`sql_grammar`): one ``SELECT`` statement ::

  SELECT [DISTINCT] <cols | aggregates | *> FROM <table [AS alias]>, ... [JOIN ... ON <pred>]*
  [WHERE <pred>] [GROUP BY <cols> [HAVING <pred>]] [ORDER BY <col|agg> [ASC|DESC], ...]
  [LIMIT n] [;]

with predicates of AND/OR/NOT, parentheses, comparisons, LIKE, [NOT] IN (list | subquery),
[NOT] BETWEEN, IS [NOT] NULL, and nested SELECTs in WHERE operands and FROM.  Table and column
identifiers are alternatives taken from the database (SQLite DDL run in an in-memory database,
so only DDL that SQLite accepts is used); identifiers that are not plain words are double-quoted.
Choices: canonical spacing (one space between words, ``", "`` in lists, spaces around comparison
operators) and upper-case keywords, so that punctuation and keyword tails are forced and carry no
decision; an alias is declared with ``AS``; any identifier may qualify a column (aliases cannot be
tracked by a context-free grammar).  The productions carry the roles in their names (``proj_*``,
``rel_*``, ``pred_*``, ``out_*``), which also makes the parser-state keys readable.

Adapter (:class:`SQLAdapter`, ``accept(matcher, token) -> (int32[4], state id)`` like
:class:`~pask_jax.grammar.fc_adapter.FCAdapter`): an incremental scan of the accepted SQL text
tracks the clause (per parenthesis level) and the current word; per byte:

* role: ``projection`` in the SELECT list, GROUP BY and ORDER BY; ``relation`` in FROM/JOIN
  items; ``predicate`` in WHERE, ON and HAVING; ``outside_schema`` for the clause keywords
  themselves (SELECT, FROM, JOIN, ON, WHERE, GROUP BY, HAVING, ORDER BY, LIMIT), the LIMIT
  value and the final ``;``.  Whitespace takes the tag of the next word in its token.
* class: ``schema_bearing`` for table and column identifiers of the database; ``free_generation``
  for literals and aliases; ``pure_scaffold`` for keywords, functions, operators and punctuation.
  A word still being written gets every class its prefix allows (e.g. a prefix of both a column
  and a keyword → two candidates); an unknown word is an alias (free_generation).
* state: ``stable`` when all bytes of the group were forced by the grammar; otherwise
  ``boundary`` for pure_scaffold (a structural choice: which clause or operator comes next) and
  ``critical`` for identifiers and literals (a schema or value choice).
* next: ``lookahead_critical`` when the jump-forward string after the token is empty and the
  matcher has not terminated.
"""
from __future__ import annotations

import re
import sqlite3
from typing import Sequence

from pask_jax import tags as T
from pask_jax.grammar.fc_adapter import Adapter
from pask_jax.grammar.frontier import StateVocab
from pask_jax.grammar.matcher import GrammarCompiler, GrammarError, Grammar

Cls, Role = T.Cls, T.SQLRole

AGGS = ("COUNT", "SUM", "AVG", "MIN", "MAX")
CLAUSE_KW = {"SELECT": "select", "FROM": "from", "JOIN": "from", "ON": "on", "WHERE": "where",
             "GROUP": "group", "HAVING": "having", "ORDER": "order", "LIMIT": "limit"}
# Keywords that are part of a clause keyword (their role is outside_schema too).
CLAUSE_PART = {"BY", "INNER", "LEFT"}
KEYWORDS = frozenset(set(CLAUSE_KW) | CLAUSE_PART | set(AGGS) | {
    "DISTINCT", "AS", "AND", "OR", "NOT", "LIKE", "IN", "BETWEEN", "IS", "NULL", "ASC", "DESC"})
ROLE_OF = {None: Role.OUTSIDE_SCHEMA, "select": Role.PROJECTION, "from": Role.RELATION,
           "on": Role.PREDICATE, "where": Role.PREDICATE, "having": Role.PREDICATE,
           "group": Role.PROJECTION, "order": Role.PROJECTION, "limit": Role.OUTSIDE_SCHEMA}

_PLAIN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def schema_from_ddl(ddl: str) -> dict[str, list[str]]:
  """``{table: [columns]}`` of SQLite DDL, executed in an in-memory database (validates it)."""
  con = sqlite3.connect(":memory:")
  try:
    con.executescript(ddl)
    tables = [r[0] for r in con.execute(
        "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%' "
        "ORDER BY rowid")]
    out = {t: [r[1] for r in con.execute(f'PRAGMA table_info("{t}")')] for t in tables}
  except sqlite3.Error as e:
    raise GrammarError(f"SQLite rejects this DDL: {e}") from None
  finally:
    con.close()
  if not out:
    raise GrammarError("the DDL defines no table")
  return out


def _ident(name: str) -> str:
  """EBNF literal of an identifier as written in SQL (plain, or double-quoted)."""
  sql = name if _PLAIN.match(name) and name.upper() not in KEYWORDS else \
      '"' + name.replace('"', '""') + '"'
  return '"' + sql.replace("\\", "\\\\").replace('"', '\\"') + '"'


def sql_grammar_text(schema: dict[str, list[str]]) -> str:
  tables = sorted(set(schema))
  cols = sorted({c for cs in schema.values() for c in cs})
  if not cols:
    raise GrammarError("the schema has no columns")
  alt = lambda xs: " | ".join(_ident(x) for x in xs)
  aggs = " | ".join(f'"{a}"' for a in AGGS)
  return f"""root ::= query ";"?
query ::= "SELECT " ("DISTINCT ")? proj_list " FROM " rel_list rel_join* pred_where? proj_group? proj_order? out_limit?
proj_list ::= proj_item (", " proj_item)*
proj_item ::= "*" | proj_expr (" AS " alias)?
proj_expr ::= agg_call | col_ref | qual ".*" | number | string
agg_call ::= agg "(" ("DISTINCT ")? (col_ref | "*") ")"
agg ::= {aggs}
rel_list ::= rel_item (", " rel_item)*
rel_item ::= (rel_table | "(" query ")") (" AS " alias)?
rel_join ::= (" JOIN " | " INNER JOIN " | " LEFT JOIN ") rel_item " ON " pred_expr
pred_where ::= " WHERE " pred_expr
pred_expr ::= pred_and (" OR " pred_and)*
pred_and ::= pred_atom (" AND " pred_atom)*
pred_atom ::= "(" pred_expr ")" | "NOT " pred_atom | operand " " cmp " " operand | operand (" NOT")? " LIKE " string | operand (" NOT")? " IN (" (query | value (", " value)*) ")" | operand (" NOT")? " BETWEEN " operand " AND " operand | operand " IS " ("NOT ")? "NULL"
operand ::= col_ref | value | agg_call | "(" query ")"
cmp ::= "=" | "!=" | "<>" | "<" | "<=" | ">" | ">="
value ::= number | string | "NULL"
proj_group ::= " GROUP BY " col_ref (", " col_ref)* (" HAVING " pred_expr)?
proj_order ::= " ORDER BY " order_item (", " order_item)*
order_item ::= (agg_call | col_ref) (" ASC" | " DESC")?
out_limit ::= " LIMIT " [0-9]+
col_ref ::= (qual ".")? column
qual ::= rel_table | alias
rel_table ::= {alt(tables)}
column ::= {alt(cols)}
alias ::= [A-Za-z_] [A-Za-z0-9_]*
number ::= "-"? [0-9]+ ("." [0-9]+)?
string ::= "'" ([^'\\n] | "''")* "'"
"""  # noqa: E501 (EBNF rules are one line each)


def sql_grammar(compiler: GrammarCompiler, ddl: str) -> Grammar:
  """The grammar of one database; ``meta["schema"]`` holds ``{table: [columns]}``."""
  schema = schema_from_ddl(ddl)
  g = compiler.ebnf(sql_grammar_text(schema))
  g.kind, g.meta = "sql", {"schema": schema, "ddl": ddl}
  return g


class _Word:
  """An identifier or keyword being scanned; its tags are resolved when its token ends."""
  __slots__ = ("text", "role", "after_as", "closed", "qualifier", "ad")

  def __init__(self, ad: "SQLAdapter", role, after_as: bool):
    self.ad, self.role, self.after_as = ad, role, after_as
    self.text, self.closed, self.qualifier = "", False, False

  def tags(self):
    ad, w = self.ad, self.text
    if self.after_as:
      return (Cls.FREE_GENERATION, self.role)
    if self.closed:
      if w in KEYWORDS:
        return (Cls.PURE_SCAFFOLD, self._kw_role(w))
      if self.qualifier:
        return (Cls.SCHEMA_BEARING if w in ad.tables else Cls.FREE_GENERATION, self.role)
      return (Cls.SCHEMA_BEARING if w in ad.names else Cls.FREE_GENERATION, self.role)
    out = [(Cls.PURE_SCAFFOLD, r) for r in
           dict.fromkeys(self._kw_role(k) for k in KEYWORDS if k.startswith(w))]
    if any(n.startswith(w) for n in ad.names):
      out.append((Cls.SCHEMA_BEARING, self.role))
    if not out:
      return (Cls.FREE_GENERATION, self.role)
    return out[0] if len(out) == 1 else tuple(out)

  def _kw_role(self, kw):
    return Role.OUTSIDE_SCHEMA if kw in CLAUSE_KW or kw in CLAUSE_PART else self.role


class SQLAdapter(Adapter):
  """Tags of SQL outputs of :func:`sql_grammar` (see the module docstring for the choices).

  ``grammar``: from :func:`sql_grammar` (or pass ``schema={table: [columns]}``).
  """

  def __init__(self, grammar, tokenizer, *, schema: dict[str, list[str]] | None = None,
               vocab: StateVocab | None = None, stop_ids: Sequence[int] | None = None):
    super().__init__(grammar, tokenizer, vocab=vocab, stop_ids=stop_ids)
    schema = schema if schema is not None else grammar.meta["schema"]
    self.tables = frozenset(schema)
    self.names = frozenset(set(schema) | {c for cs in schema.values() for c in cs})
    self.reset()

  def reset(self) -> None:
    self.clauses: list[str | None] = [None]  # clause per parenthesis level
    self.word: _Word | None = None
    self.quote: str | None = None   # "'" in a string literal, '"' in a quoted identifier
    self.quote_end = False          # just saw a quote that may close (or double) the literal
    self.number = False
    self.prev_word = ""             # last closed word (for AS)

  def _copy_state(self, new: "SQLAdapter") -> None:
    new.clauses = list(self.clauses)
    if self.word is not None:
      w = new.word = object.__new__(_Word)
      for k in _Word.__slots__:
        setattr(w, k, getattr(self.word, k))
      w.ad = new

  def _pack(self, c, r, crit, nxt):
    if not crit:
      st = T.SQLState.STABLE
    else:
      st = T.SQLState.BOUNDARY if c == Cls.PURE_SCAFFOLD else T.SQLState.CRITICAL
    return T.sql(c, r, st, nxt)

  def _role(self):
    return ROLE_OF[self.clauses[-1]]

  def _idle(self):
    return (Cls.PURE_SCAFFOLD, self._role())

  def _close_word(self, qualifier: bool = False):
    w = self.word
    w.closed, w.qualifier = True, qualifier
    if w.text in CLAUSE_KW:
      self.clauses[-1] = CLAUSE_KW[w.text]
    self.prev_word = w.text
    self.word = None

  def _feed(self, c: int):
    ch = chr(c)
    if self.quote is not None:
      if self.quote_end:
        self.quote_end = False
        if ch == self.quote:  # doubled quote: still inside
          return self._lit_tag()
        self.quote = None
      elif ch == self.quote:
        self.quote_end = True
        return (Cls.PURE_SCAFFOLD, self._role())
      else:
        return self._lit_tag()
    if self.word is not None:
      if ch.isalnum() or ch == "_" or c >= 0x80:
        self.word.text += ch
        return self.word
      self._close_word(qualifier=ch == ".")
    if self.number:
      if ch.isdigit() or ch == ".":
        return (Cls.FREE_GENERATION, self._role())
      self.number = False
    if ch.isspace():
      return None
    if ch.isdigit():
      self.number = True
      return (Cls.FREE_GENERATION, self._role())
    if ch.isalpha() or ch == "_" or c >= 0x80:
      self.word = _Word(self, self._role(), self.prev_word == "AS")
      self.word.text = ch
      return self.word
    self.prev_word = ""
    if ch in "'\"":
      self.quote = ch
      return (Cls.PURE_SCAFFOLD, self._role())
    if ch == "(":
      tag = (Cls.PURE_SCAFFOLD, self._role())
      self.clauses.append(self.clauses[-1])
      return tag
    if ch == ")":
      if len(self.clauses) > 1:
        self.clauses.pop()
      return (Cls.PURE_SCAFFOLD, self._role())
    if ch == ";":
      return (Cls.PURE_SCAFFOLD, Role.OUTSIDE_SCHEMA)
    return (Cls.PURE_SCAFFOLD, self._role())

  def _lit_tag(self):
    # Inside '...': a value (free); inside "...": a quoted schema identifier.
    cls = Cls.FREE_GENERATION if self.quote == "'" else Cls.SCHEMA_BEARING
    return (cls, self._role())
