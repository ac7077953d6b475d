"""Token selection (pask_jax.sample): top-p rows as the sorted nucleus always drew them, top_p = 1
rows from the whole scaled distribution without a sort, per-row keys independent of the batch."""
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from pask_jax.sample import nucleus, sample

B, V = 6, 300


def old_nucleus(logits, key, temperature, top_p, greedy):
  """The sorted implementation every row used before top_p = 1 skipped the sort."""
  t = jnp.maximum(temperature, 1e-6)[:, None]
  scaled = logits / t
  order = jnp.argsort(-scaled, axis=-1)
  sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
  probs = jax.nn.softmax(sorted_logits, axis=-1)
  keep = (jnp.cumsum(probs, axis=-1) - probs) < top_p[:, None]
  pick = jax.random.categorical(key, jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
  sampled = jnp.take_along_axis(order, pick[:, None], axis=-1)[:, 0].astype(jnp.int32)
  return jnp.where(temperature <= 0, greedy, sampled)


def inputs(seed):
  rng = np.random.default_rng(seed)
  logits = jnp.asarray(rng.normal(size=(B, V)) * 3, jnp.float32)
  logits = jnp.where(jnp.asarray(rng.random((B, V)) < 0.3), -jnp.inf, logits)   # a grammar mask
  temperature = jnp.asarray(rng.uniform(0.3, 1.5, B), jnp.float32)
  top_p = jnp.asarray(rng.uniform(0.2, 0.95, B), jnp.float32)
  return logits, temperature, top_p


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_top_p_rows_draw_as_the_sorted_nucleus_did(seed):
  logits, t, p = inputs(seed)
  t = t.at[1].set(0.0)                                  # a greedy row beside them
  greedy = jnp.argmax(logits, -1).astype(jnp.int32)
  key = jax.random.key(seed)
  got = jax.jit(sample)(logits, key, t, p)
  assert jnp.array_equal(got, old_nucleus(logits, key, t, p, greedy))
  assert got[1] == greedy[1]
  # per-row keys (the serving engine's): each row as the row-wise sorted draw was
  keys = jax.random.split(key, B)
  want = jax.vmap(lambda l, k, tt, pp, g: old_nucleus(l[None], k, tt[None], pp[None], g[None])[0])(
      logits, keys, t, p, greedy)
  assert jnp.array_equal(jax.jit(nucleus)(logits, keys, t, p, greedy), want)


def test_top_p_one_draws_the_scaled_distribution_unsorted():
  logits, t, _ = inputs(5)
  p = jnp.ones((B,), jnp.float32)
  greedy = jnp.argmax(logits, -1).astype(jnp.int32)
  key = jax.random.key(9)
  got = jax.jit(sample)(logits, key, t, p)
  assert jnp.array_equal(got, jax.random.categorical(key, logits / t[:, None], axis=-1))
  # a masked token is never drawn
  assert bool(jnp.all(jnp.isfinite(jnp.take_along_axis(logits, got[:, None], -1))))
  # frequencies over many keys follow softmax(logits / t) (row 0; total variation)
  draw = jax.jit(jax.vmap(lambda k: nucleus(logits[:1], k, t[:1], p[:1], greedy[:1])[0]))
  n = 20000
  picks = np.asarray(draw(jax.random.split(jax.random.key(3), n)))
  freq = np.bincount(picks, minlength=V) / n
  want = np.asarray(jax.nn.softmax(logits[0] / t[0]))
  assert 0.5 * np.abs(freq - want).sum() < 0.03


def test_raw_uint32_keys_draw_as_typed_ones():
  logits, t, p = inputs(4)
  greedy = jnp.argmax(logits, -1).astype(jnp.int32)
  key = jax.random.key(2)
  for k, raw in ((key, jax.random.key_data(key)),
                 (jax.random.split(key, B), jax.random.key_data(jax.random.split(key, B)))):
    for pp in (p, jnp.ones_like(p)):
      assert jnp.array_equal(nucleus(logits, raw, t, pp, greedy), nucleus(logits, k, t, pp, greedy))


def test_a_rows_draw_does_not_depend_on_the_other_rows():
  """With per-row keys (the engine's seeds), a top_p = 1 row's token is the same whether or not
  another row of the batch needs the sort."""
  logits, t, p = inputs(7)
  greedy = jnp.argmax(logits, -1).astype(jnp.int32)
  keys = jax.random.split(jax.random.key(1), B)
  f = jax.jit(nucleus)
  ones = jnp.ones((B,), jnp.float32)
  mixed = ones.at[::2].set(p[::2])                       # even rows top-p, odd rows whole
  a, b = f(logits, keys, t, ones, greedy), f(logits, keys, t, mixed, greedy)
  assert jnp.array_equal(a[1::2], b[1::2])
  assert not jnp.array_equal(a, b)                       # the top-p rows did draw differently


def _sort_depths(jaxpr, depth=0):
  """Nesting depth (in conds) of every sort in ``jaxpr``."""
  out = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "sort":
      out.append(depth)
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      out += _sort_depths(sub, depth + (eqn.primitive.name == "cond"))
  return out


def test_the_sort_runs_only_under_both_conds():
  """Greedy steps pay an argmax, all-top_p = 1 steps a plain draw: the sort sits in the branch
  taken only when some sampling row has top_p < 1."""
  logits, t, p = inputs(0)
  jaxpr = jax.make_jaxpr(sample)(logits, jax.random.key(0), t, p).jaxpr
  assert _sort_depths(jaxpr) and all(d == 2 for d in _sort_depths(jaxpr))
