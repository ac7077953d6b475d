"""bench/host_split.py: every function it times exists under its name (a rename would silently
drop a row), the wrappers count and time calls, pass results and errors through, and come off."""
import importlib
import time

import pytest

from bench.host_split import STEPS, TARGETS, Split


def test_every_target_resolves_and_the_steps_are_among_them():
  for mod, cls, fn, label in TARGETS:
    owner = importlib.import_module(mod)
    owner = getattr(owner, cls) if cls else owner
    assert callable(getattr(owner, fn)), label
  assert set(STEPS) <= {t[3] for t in TARGETS}


class _Thing:
  def work(self, x):
    time.sleep(0.002)
    if x < 0:
      raise ValueError("negative")
    return 2 * x


def test_split_times_calls_and_comes_off():
  original = _Thing.__dict__["work"]
  s = Split()
  s.wrap(_Thing, "work", "Thing.work")
  t = _Thing()
  assert [t.work(i) for i in range(3)] == [0, 2, 4]
  with pytest.raises(ValueError, match="negative"):
    t.work(-1)
  assert s.calls["Thing.work"] == 4 and s.seconds["Thing.work"] >= 0.008
  st = s.stats("Thing.work", steps=2)
  assert st["calls"] == 4 and 2000 <= st["median_us"] <= st["p90_us"]
  assert st["steady_us_per_step"] == pytest.approx(2 * st["median_us"])
  table = s.table(steps=2).splitlines()
  assert table[1].split()[:2] == ["Thing.work", "4"]
  s.remove()
  assert _Thing.__dict__["work"] is original and _Thing().work(5) == 10


def test_token_host_times_a_grammar_valid_path():
  """bench/token_host.py: its token path is accepted by a fresh parser, and every part of the
  per-token host work is measured."""
  from bench.bench_serving import row_tools
  from bench.token_host import measure, token_path
  from pask_jax.grammar import tool_call_grammar
  from pask_jax.testing import grammar_compiler, smollm2_tokenizer
  tok = smollm2_tokenizer()
  g = tool_call_grammar(grammar_compiler(tok, tok.vocab_size), row_tools(4), "json_list",
                        max_calls=1, check=False)
  ids = token_path(g, tok, tok.vocab_size, 24, seed=1)
  assert len(ids) == 24 and ids != token_path(g, tok, tok.vocab_size, 24, seed=2)
  m = g.matcher()
  assert all(m.accept(t) for t in ids)
  r = measure(g, tok, tok.vocab_size, ids, rows=2, repeats=1)
  assert r["rows"] == 2 and r["tokens"] == 24
  for k in ("fill_us_per_row_token", "output_accept_us_per_row_token",
            "tracker_accept_us_per_token", "detok_us_per_token", "host_ms_per_step"):
    assert r[k] > 0, k
