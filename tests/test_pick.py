"""The serving engine's pick with its branches chosen on the host (``how``): the same tokens and
log-probs as the device-side ``lax.cond`` version for every mix of greedy / sampled / top-p /
log-prob rows, and no conditional left in the program (XLA's GPU runtime evaluates a
conditional's predicate on the host, waiting for the device there)."""
import functools

import jax
import numpy as np
import pytest

from serve.engine.step import how_of, how_of_packed, pick, pick_packed

B, V = 6, 1000
NW = (V + 31) // 32


def rows(rng, temps, top_ps, wants):
  logits = rng.standard_normal((B, V)).astype(np.float32) * 3
  bits = rng.integers(-2**31, 2**31 - 1, (B, NW), dtype=np.int64).astype(np.int32)
  bits[:, 0] |= 1   # at least one allowed token per row
  seeds = rng.integers(0, 2**32 - 1, B, dtype=np.uint64).astype(np.uint32)
  steps = rng.integers(0, 500, B).astype(np.int32)
  return (logits, bits, seeds, steps, np.asarray(temps, np.float32),
          np.asarray(top_ps, np.float32), np.asarray(wants, bool))


CASES = {   # per row: temperature, top_p, wants log-probs
    "greedy": ([0.0] * B, [1.0] * B, [False] * B),
    "greedy+lp": ([0.0] * B, [0.9] * B, [False, True] + [False] * (B - 2)),
    "sampled": ([0.0, 0.7, 1.3, 0.0, 0.5, 2.0], [1.0] * B, [False] * B),
    "top_p": ([0.0, 0.7, 1.3, 0.0, 0.5, 2.0], [1.0, 0.9, 0.5, 0.3, 1.0, 0.8], [True] * B),
    "top_p only on a greedy row": ([0.0, 0.7] + [0.0] * (B - 2), [0.5, 1.0] + [1.0] * (B - 2),
                                   [False] * B),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_static_branches_equal_the_device_conditionals(case):
  rng = np.random.default_rng(sorted(CASES).index(case))
  args = rows(rng, *CASES[case])
  how = how_of(*args[4:])
  a_tok, a_lp = jax.jit(pick)(*args)
  b_tok, b_lp = jax.jit(functools.partial(pick, how=how))(*args)
  np.testing.assert_array_equal(np.asarray(b_tok), np.asarray(a_tok))
  for x, y in zip(a_lp, b_lp):
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
  # the packed form the engine uploads gives the same ``how`` and the same tokens
  packed = np.concatenate([args[1], args[2].view(np.int32)[:, None], args[3][:, None],
                           args[6][:, None].astype(np.int32), args[4].view(np.int32)[:, None],
                           args[5].view(np.int32)[:, None]], axis=1)
  assert how_of_packed(packed) == how
  c_tok, _ = jax.jit(functools.partial(pick_packed, how=how))(args[0], packed)
  np.testing.assert_array_equal(np.asarray(c_tok), np.asarray(a_tok))


def test_how_names_what_the_rows_ask_for():
  assert how_of([0.0, 0.0], [0.5, 1.0], [False, False]) == (False, False, False)
  assert how_of([0.0, 0.8], [0.5, 1.0], [False, False]) == (True, False, False)
  assert how_of([0.0, 0.8], [1.0, 0.5], [False, True]) == (True, True, True)


def test_static_picks_compile_without_a_conditional():
  args = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in rows(np.random.default_rng(0),
                                                              *CASES["top_p"])]
  cond = jax.jit(pick).lower(*args).as_text()
  assert "stablehlo.case" in cond or "stablehlo.if" in cond   # what the old pick had
  for how in [(False, False, False), (True, False, True), (True, True, True)]:
    txt = jax.jit(functools.partial(pick, how=how)).lower(*args).as_text()
    assert "stablehlo.case" not in txt and "stablehlo.if" not in txt, how
