"""pask_jax.traces: counters of traces that clear_caches zeroes with the compiled programs."""
import jax
import jax.numpy as jnp
import numpy as np

from pask_jax.traces import Traces, clear_caches


def test_clear_caches_zeroes_live_counters_and_the_next_call_traces_once():
  t, other = Traces(), Traces()   # equal contents: both must stay registered
  x = jnp.asarray(np.random.default_rng().normal(size=(3,)), jnp.float32)

  def body(v):
    t["f"] += 1
    return v * 2

  f = jax.jit(body)
  f(x)
  f(x + 1)
  assert t["f"] == 1 and other == Traces()
  other["g"] = 5
  clear_caches()
  assert t == Traces() and other == Traces()
  np.testing.assert_allclose(np.asarray(f(x)), np.asarray(x) * 2)
  assert t["f"] == 1   # compiled again, counted as the first of the programs jax now holds
