"""Parser sharing in a policy stack (calibrate/shared.py) and tracker forks, with the real Qwen2.5
vocabulary: rows that share a prefix share one parser, a divergence forks it, and every row sees
exactly the masks, tags, parser states and termination of its own private tracker."""
import functools
import os

import numpy as np
import pytest

from pask_jax.testing import grammar_compiler, stored_tokenizer

from calibrate.shared import Forest, accept_rows
from calibrate.stack import Recorder
from pask_jax.grammar.fc_adapter import FCAdapter
from pask_jax.grammar.frontier import StateVocab
from pask_jax.grammar.matcher import new_bitmask
from pask_jax.grammar.sql import SQLAdapter, sql_grammar
from pask_jax.grammar.toolcall import tool_call_grammar

DATA = os.path.join(os.path.dirname(__file__), "data", "qwen_tokenizer.json.gz")
RNG = np.random.default_rng()
TOOLS = [{"type": "function", "function": {
    "name": "set_mode", "description": "Set the drive mode.",
    "parameters": {"type": "object", "properties": {
        "mode": {"type": "string", "enum": ["eco", "boost", "sport"]},
        "level": {"type": "integer"}, "note": {"type": "string"}},
        "required": ["mode", "level"]}}}]
DDL = """CREATE TABLE singer (singer_id INTEGER PRIMARY KEY, name TEXT, country TEXT, age INTEGER);
CREATE TABLE concert (concert_id INTEGER PRIMARY KEY, singer_id INTEGER, year INTEGER);"""


@functools.lru_cache(maxsize=None)
def setup():
  tok = stored_tokenizer(DATA)
  gc = grammar_compiler(tok)
  fc = tool_call_grammar(gc, TOOLS, "json_list", max_calls=2)
  return tok, gc, fc, sql_grammar(gc, DDL)


def script(grammar, tok, text: str) -> list[int]:
  """A grammar-valid token sequence spelling ``text``: longest allowed token at each step."""
  by_bytes = {}
  for i, b in enumerate(tok.token_bytes()):
    if b:
      by_bytes.setdefault(b, i)
  m, data, out = grammar.matcher(), text.encode(), []
  bits = new_bitmask(1, tok.vocab_size)
  while data:
    m.fill(bits, 0)
    allowed = np.unpackbits(bits[0].view(np.uint8), bitorder="little")
    cands = [by_bytes[data[:n]] for n in range(min(len(data), 24), 0, -1)
             if data[:n] in by_bytes and allowed[by_bytes[data[:n]]]]
    assert cands, f"the grammar allows no token for {data[:20]!r} of {text!r}"
    out.append(cands[0])
    assert m.accept(cands[0])
    data = data[len(tok.token_bytes()[cands[0]]):]
  return out


def fc_texts():
  def call(mode=None, level=None, note=None):
    mode = mode or str(RNG.choice(["eco", "boost", "sport"]))
    level = int(RNG.integers(0, 200)) if level is None else level
    note = (f', "note": "n{int(RNG.integers(0, 9))}"' if RNG.random() < 0.5 else "") \
        if note is None else note
    return (f'{{"name": "set_mode", "arguments": {{"mode": "{mode}", "level": {level}{note}}}}}',
            mode, level)
  base, mode, level = call()
  # copies of one request: identical, diverging late, diverging early, with a second call
  return [base, base, call(mode, level + 1000)[0], call()[0], f"[{base}, {call()[0]}]"]


def sql_texts():
  cols = ["name", "country", "age"]
  c = lambda: str(RNG.choice(cols))
  base = f"SELECT {c()} FROM singer WHERE age > {int(RNG.integers(10, 90))}"
  return [base, base, f"SELECT {c()}, {c()} FROM singer", base + " AND country = 'FR'",
          "SELECT year FROM concert"]


def wrap(texts, fmt):
  return [f"[{t}]" if fmt == "fc" and not t.startswith("[") else t for t in texts]


@pytest.mark.parametrize("together", [False, True], ids=["row", "accept_rows"])
@pytest.mark.parametrize("kind", ["fc", "sql"])
def test_forest_rows_equal_private_trackers(kind, together):
  """Row by row (``accept``) or all live rows at once (``accept_rows``: one accept per node and
  token), with a private tracker's row mixed in."""
  tok, _, fc, sqlg = setup()
  g = fc if kind == "fc" else sqlg
  texts = wrap(fc_texts() if kind == "fc" else sql_texts(), kind)
  scripts = [script(g, tok, t) + [tok.stop_ids[0]] for t in texts]
  adapter = FCAdapter if kind == "fc" else SQLAdapter
  va, vb = StateVocab(grow=True), StateVocab(grow=True)
  forest = Forest(lambda i: Recorder(g, adapter(g, tok, vocab=va)))
  # one request, V rows (with accept_rows, one row has a tracker of its own, accepting alone)
  shared = [Recorder(g, adapter(g, tok, vocab=va)) if together and r == 3 else forest.row(0)
            for r in range(len(scripts))]
  private = [Recorder(g, adapter(g, tok, vocab=vb)) for _ in scripts]
  W = new_bitmask(1, tok.vocab_size).shape[1]
  for t in range(max(map(len, scripts))):
    live = [r for r, s in enumerate(scripts) if t < len(s)]
    ba, bb = np.zeros((len(scripts), W), np.int32), np.zeros((len(scripts), W), np.int32)
    for r in live:
      shared[r].fill(ba, r)
      private[r].fill(bb, r)
      np.testing.assert_array_equal(ba[r], bb[r], err_msg=f"mask row {r} step {t}")
    if together:
      got = accept_rows([shared[r] for r in live], np.asarray([scripts[r][t] for r in live]))
    else:
      got = [(shared[r].accept(scripts[r][t]), shared[r].terminated) for r in live]
      got = (np.stack([a[0] for a, _ in got]), np.asarray([a[1] for a, _ in got]),
             np.asarray([d for _, d in got]))
    for j, r in enumerate(live):
      tb, sb = private[r].accept(scripts[r][t])
      np.testing.assert_array_equal(got[0][j], tb)
      assert va.keys()[got[1][j]] == vb.keys()[sb]
      assert got[2][j] == shared[r].terminated == private[r].terminated
  for a, b in zip(shared, private):
    np.testing.assert_array_equal(np.stack(a.tags), np.stack(b.tags))
    assert [va.keys()[x] for x in a.states] == [vb.keys()[x] for x in b.states]
  assert all(s.terminated for s in shared)
  assert forest.forks >= 2                          # the texts diverge at least twice
  assert forest.accepts < sum(map(len, scripts))    # and share their common prefixes


def test_tracker_fork_is_independent():
  tok, _, fc, _ = setup()
  a_text, b_text = '[{"name": "set_mode", "arguments": {"mode": "eco", "level": 3}}]', \
      '[{"name": "set_mode", "arguments": {"mode": "eco", "level": 41, "note": "x"}}]'
  stop = [tok.stop_ids[0]]
  a, b = script(fc, tok, a_text) + stop, script(fc, tok, b_text) + stop
  k = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
  vocab = StateVocab(grow=True)
  tr = Recorder(fc, FCAdapter(fc, tok, vocab=vocab))
  for t in a[:k]:
    tr.accept(t)
  fork = tr.fork()
  out_a = [tr.accept(t) for t in a[k:]]
  out_b = [fork.accept(t) for t in b[k:]]
  for toks, got in ((a, out_a), (b, out_b)):
    fresh = Recorder(fc, FCAdapter(fc, tok, vocab=vocab))
    want = [fresh.accept(t) for t in toks][k:]
    for (x, s), (y, u) in zip(got, want):
      np.testing.assert_array_equal(x, y)
      assert s == u
  assert tr.terminated and fork.terminated
  assert len(fork.tags) == len(b) and len(tr.tags) == len(a)


class _Fake:
  """A tracker whose mask is a function of its request and accepted tokens."""

  terminated = False

  def __init__(self, i, seq=()):
    self.i, self.seq = i, tuple(seq)

  def fill(self, bits, row):
    bits[row] = np.random.default_rng(abs(hash((self.i,) + self.seq))).integers(
        -2**31, 2**31 - 1, bits.shape[1], dtype=np.int32)

  def accept(self, token):
    self.seq += (token,)
    return np.zeros(4, np.int32), -1

  def fork(self):
    return _Fake(self.i, self.seq)


@pytest.mark.parametrize("words", [1, 37])
def test_row_masks_hold_one_row_per_parser_state(words):
  """calibrate.stack.row_masks: every row's mask is what its own tracker writes (finished and
  unconstrained rows allow every token), rows at one prefix node share a mask row — through a
  no-transition PositionTracker too — and the row count is padded to a power of two (>= 8),
  capped at B when B is not one."""
  from calibrate.stack import row_masks
  from pask_jax.tracker import PositionTracker, Tracker
  forest = Forest(_Fake)
  trs = [Tracker(), forest.row(0), forest.row(0), PositionTracker(forest.row(0), (4, 16))]
  trs += [forest.row(i) for i in range(1, 8)] + [forest.row(9)]
  for t in trs[1:]:
    t.accept(5)   # every row of request 0 moves to the same child node
  B = len(trs)
  running = np.ones(B, bool)
  running[-1] = False
  masks, rows = row_masks(trs, running, words)
  want = np.full((B, words), -1, np.int32)
  for b in np.flatnonzero(running):
    trs[b].fill(want, b)
  np.testing.assert_array_equal(masks[rows], want)
  assert rows[0] == rows[-1] and np.all(masks[rows[0]] == -1)   # unconstrained, finished
  assert rows[1] == rows[2] == rows[3]                           # one node, PositionTracker too
  assert len(set(rows.tolist())) == 9 and masks.shape == (B, words)   # 9 states: 16 > B = 12
  running[4:] = False
  masks, rows = row_masks(trs, running, words)
  assert masks.shape == (8, words) and len(set(rows.tolist())) == 2
