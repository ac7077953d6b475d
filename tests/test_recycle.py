"""pask_jax.recycle: a jitted step whose logits are written into the previous call's logits
buffer (so XLA keeps one address for them and does not re-parameterize the step's CUDA graph).
Results equal plain ``jax.jit``'s on fresh random inputs, the previous logits are donated, and
the compiled step (CPU, and the PASK decode step compiled for sm_90 without a GPU) aliases the
logits output to the recycled parameter."""
import logging
import os
import re

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from pask_jax.recycle import Recycler, logits_like, upload  # noqa: E402

B, H, V = 4, 32, 96


def _step(w, state, x):
  """A toy decode step: state carried (and donated), logits [B, V] float32, a small output."""
  acc, n = state
  h = jnp.tanh(x @ w[:, :H] + acc)
  logits = (h @ w).astype(jnp.float32)
  return (logits, jnp.argmax(logits, -1).astype(jnp.int32)), (acc + h, n + 1)


def _alias(hlo: str) -> str:
  """The module header's ``input_output_alias={ {out}: (param, {index}, kind), ... }``."""
  head = hlo.split("\n", 1)[0]
  return head[head.index("input_output_alias="):]


def test_matches_jit_and_donates_the_previous_logits():
  ks = jax.random.split(jax.random.PRNGKey(0), 6)
  w = jax.random.normal(ks[0], (H, V), jnp.float32) / np.sqrt(H)
  init = lambda: (jax.random.normal(ks[1], (B, H), jnp.float32), jnp.zeros((B,), jnp.int32))
  xs = [jax.random.normal(k, (B, H), jnp.float32) for k in ks[2:]]
  plain = jax.jit(_step)
  rec = Recycler(_step, jax.ShapeDtypeStruct((B, V), jnp.float32), donate_argnums=(1,))
  s_ref, s_rec, seen = init(), init(), []
  for x in xs:
    (l_ref, a_ref), s_ref = plain(w, s_ref, x)
    out = rec(w, s_rec, x)
    (l_rec, a_rec), s_rec = out
    assert not l_rec.is_deleted()
    np.testing.assert_array_equal(np.asarray(l_rec), np.asarray(l_ref))
    np.testing.assert_array_equal(np.asarray(a_rec), np.asarray(a_ref))
    seen.append(l_rec)
  np.testing.assert_array_equal(np.asarray(s_rec[0]), np.asarray(s_ref[0]))
  assert int(s_rec[1][0]) == len(xs)
  # each call's logits were donated to the next call, the last ones are still readable
  assert [x.is_deleted() for x in seen] == [True] * (len(xs) - 1) + [False]


def test_compiled_step_aliases_the_logits_to_the_recycled_buffer():
  w = jnp.ones((H, V), jnp.float32)
  state = (jnp.ones((B, H), jnp.float32), jnp.zeros((B,), jnp.int32))
  rec = Recycler(_step, jax.ShapeDtypeStruct((B, V), jnp.float32), donate_argnums=(1,))
  alias = _alias(rec.lower(w, state, jnp.ones((B, H))).compile().as_text())
  # output 0 (the logits; outputs are flattened) into parameter 0 (the recycled buffer), and
  # each donated state leaf into some output of its shape
  assert re.search(r"\{0\}: \(0, \{\}", alias), alias
  assert len(re.findall(r"may-alias|must-alias", alias)) == 3, alias


def test_a_failed_or_bypassed_donation_leaves_a_fresh_buffer():
  """A call that fails after its buffer was donated, or logits the caller deleted itself: the
  next call donates fresh zeros instead of a deleted array."""
  rec = Recycler(_step, jax.ShapeDtypeStruct((B, V), jnp.float32), donate_argnums=(1,))
  w = jnp.ones((H, V), jnp.float32)
  state = lambda: (jnp.ones((B, H), jnp.float32), jnp.zeros((B,), jnp.int32))
  x = jnp.ones((B, H))
  (want, _), _ = jax.jit(_step)(w, state(), x)
  (l0, _), _ = rec(w, state(), x)
  good = rec._jit

  def fails(spent, *args):   # consumes (deletes) the donated buffer, then fails
    spent.delete()
    raise RuntimeError("device error")
  rec._jit = fails
  with pytest.raises(RuntimeError, match="device error"):
    rec(w, state(), x)
  assert l0.is_deleted()
  rec._jit = good
  (l1, _), _ = rec(w, state(), x)
  np.testing.assert_array_equal(np.asarray(l1), np.asarray(want))
  l1.delete()                # the caller drops the logits' buffer itself
  (l2, _), _ = rec(w, state(), x)
  np.testing.assert_array_equal(np.asarray(l2), np.asarray(want))


@pytest.mark.fast_compile
def test_pask_decode_step_for_sm90_writes_its_logits_into_the_recycled_buffer():
  """The PASK decode step through a Recycler, compiled for sm_90 on this host: the logits output
  aliases the recycled parameter (on a GPU XLA then places it, and the intermediates it hosts,
  in that parameter's buffer: one address every step)."""
  from models import ModelConfig, decoder, random_model
  from pallas_kernels.gpu import aot as gpu_aot
  from pask_jax import cache as pc
  from pask_jax import ledger
  from pask_jax import policy as P
  from pask_jax.decode import PaskRunner
  from pask_jax.tracker import FREE_TAG
  cfg = ModelConfig(arch="qwen2", vocab_size=512, hidden=128, intermediate=256, n_layers=2,
                    n_heads=4, n_kv_heads=2, head_dim=64)
  pol = P.demo(cfg)
  Bt, C = 8, 512 + 17
  model = random_model(cfg, dtype=jnp.bfloat16)
  decoder.prepare(model, "unrolled")
  r = PaskRunner(model, pol, batch=Bt, capacity=C, backend="gpu",
                 kernel_knobs={"int4_kernel": "mosaic"})
  rec = Recycler(r.decode_fn, logits_like(Bt, cfg.vocab_size), donate_argnums=(2, 3, 4))
  cache = jax.eval_shape(lambda: pc.init_for(cfg, Bt, pol, capacity=C, page=r.page, lo_page=128,
                                             lo_format="int4", hi_capacity=C // 4,
                                             lo_capacity=C // 2))
  z = jnp.zeros((Bt,), jnp.int32)
  hlo = gpu_aot.compile_hlo(rec.jitted, rec.like, r.params, pol, cache,
                            jnp.zeros((Bt,), jnp.float32), ledger.init(Bt, pol.n_groups), z,
                            jnp.broadcast_to(jnp.asarray(FREE_TAG), (Bt, 4)), z - 1,
                            jnp.ones((Bt,), bool))
  assert re.search(r"\{0\}: \(0, \{\}", _alias(hlo)), _alias(hlo)[:300]


@pytest.mark.parametrize("kind", ["full", "pask", "masked"])
def test_runners_recycle_their_logits_on_a_gpu_and_generate_the_same(monkeypatch, kind):
  """Where steps run as CUDA graphs (``recycle.graphs()``, forced here) the runners' ``step``
  recycles its logits buffer (compiled once): ``generate`` (which samples inside the step and
  discards the logits) produces the same tokens as with plain ``jax.jit``, and every step's
  logits but the last were donated to the next step."""
  from models import random_model
  from pask_jax import policy as P
  from pask_jax import recycle
  from pask_jax.baselines.masked import Config, MaskedRunner
  from pask_jax.decode import PaskRunner, Runner, Sampling, generate
  from pask_jax.testing import TINY
  cfg = TINY["qwen2"]
  m = random_model(cfg, seed=7)
  rng = np.random.default_rng(7)
  prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (24, 17)]
  no_stop = type("Tok", (), {"stop_ids": (), "decode": lambda self, ids: ""})()

  def run(graphs: bool):
    monkeypatch.setattr(recycle, "graphs", lambda: graphs)
    if kind == "full":
      r = Runner(m, batch=2, capacity=64)
    elif kind == "pask":
      r = PaskRunner(m, P.demo(cfg), batch=2, capacity=64)
    else:
      r = MaskedRunner(m, batch=2, capacity=64)
      r.configure(Config("h2o", ratio=0.5, recent=8, sink=2))
    seen = []
    step = r.step
    r.traces.clear()

    def spy(*args):
      out = step(*args)
      seen.append(out[1])
      return out
    r.step = spy
    res = generate(r, no_stop, prompts, sampling=Sampling(max_tokens=8, temperature=0.8, seed=3))
    assert r.traces["step"] == 1   # one compile: the recycled buffer has the logits' type
    return step, [x.tokens for x in res], seen

  plain, want, _ = run(False)
  rec, got, seen = run(True)
  assert not isinstance(plain, Recycler) and isinstance(rec, Recycler)
  assert got == want and len(seen) >= 7
  assert all(x.is_deleted() for x in seen[:-1]) and not seen[-1].is_deleted()


def test_upload_is_a_transfer_of_a_copy(caplog):
  """``upload`` runs no XLA program (``jnp.asarray`` of a NumPy array compiles and runs
  ``stage``: one more executable per input per step), copies the host buffer (a CPU device
  would alias it, and the loops rewrite theirs), and canonicalizes the dtype as jnp does."""
  x = np.arange(3 * 7 * 13, dtype=np.int64).reshape(3, 7, 13)   # a shape nothing else uses
  stage = lambda: [r for r in caplog.records if "stage" in r.getMessage()]
  with jax.log_compiles(True), caplog.at_level(logging.WARNING):
    y = upload(x)
    assert not stage(), caplog.text
    jnp.asarray(x + 1)
    assert stage(), "jnp.asarray no longer compiles stage: upload may be unnecessary"
  x[:] = -1
  assert y.dtype == jnp.int32 and int(y[0, 0, 1]) == 1 and int(y.sum()) == 272 * 273 // 2
  # an int32 buffer on a 64-byte boundary: one a CPU device aliases when it may (jax's
  # ``may_alias=False`` does not stop it for NumPy inputs: only the copy does)
  raw = np.empty(4096 + 16, np.int32)
  off = (-raw.ctypes.data % 64) // 4
  z = raw[off:off + 4096]
  z[:] = 5
  assert z.ctypes.data % 64 == 0
  w = upload(z)
  z[:] = -1
  assert int(w.sum()) == 5 * 4096

