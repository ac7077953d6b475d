"""Every runner's fused decode step with the sampler's branches static (``how``,
:func:`pask_jax.sample.how_of`, passed by ``generate``): the same tokens and logits as with the
branches chosen on the device by ``lax.cond`` (``how=None``, the step before ``how`` existed) for
greedy, sampled and mixed batches with a fixed key; and, compiled for sm_90 without a GPU, no
conditional left in the step (XLA's GPU runtime runs a ``kConditional`` on the host: it copies
the predicate back and waits for the device, so a step holding one returns from its launch only
once it has run)."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import random_model
from pask_jax import policy as P
from pask_jax import tags as T
from pask_jax.baselines import triaxial as TX
from pask_jax.baselines.masked import Config, MaskedRunner
from pask_jax.decode import PaskRunner, Runner, Sampling, generate, pad_prompts
from pask_jax.grammar.matcher import new_bitmask
from pask_jax.sample import how_of
from pask_jax.spherical.runner import SphRunner
from pask_jax.testing import TINY
from pask_jax.tracker import FREE_TAG

pytestmark = pytest.mark.fast_compile

CFG = TINY["llama"]
B, CAP, STEPS = 2, 64, 4
KINDS = ("full", "pask", "masked", "triaxial", "sph")
CASES = {   # per row: temperature, top_p
    "greedy": ([0.0, 0.0], [1.0, 1.0]),
    "sampled": ([0.8, 1.3], [1.0, 1.0]),
    "top_p, one greedy row": ([0.0, 1.3], [0.5, 0.7]),
}


def make(kind):
  m = random_model(CFG, seed=3)
  if kind == "full":
    return Runner(m, batch=B, capacity=CAP)
  if kind == "pask":
    return PaskRunner(m, P.demo(CFG), batch=B, capacity=CAP)
  if kind == "masked":
    return MaskedRunner(m, batch=B, capacity=CAP).configure(Config("h2o", ratio=0.5, recent=8,
                                                                   sink=2))
  if kind == "triaxial":
    kn = TX.Knobs(prefix=2, low=2, high=8, window=4)
    free, prompt = T.fc(T.Cls.FREE_GENERATION), T.prompt(T.PromptLabel.PROTECTED_CONTENT)
    alloc = {"knobs": kn.asdict(), "budget": 0.5, "n_groups": 3,
             "units": {str(free): [2, 8, 3], str(prompt): [8, 3, 2]}}
    return TX.TriaxialRunner(m, batch=B, capacity=CAP).configure(kn, alloc)
  return SphRunner(m, batch=B, capacity=CAP, window=4, sink=2, obs=8).configure(0.3)


@pytest.fixture(scope="module", params=KINDS)
def runner(request):
  return make(request.param)


def decode(r, temps, top_ps, how):
  """The prompt's pick and STEPS chained steps -> (tokens [STEPS + 1, B], logits [STEPS, B, V])."""
  rng = np.random.default_rng(0)
  prompts = [rng.integers(1, CFG.vocab_size, n).tolist() for n in (21, 14)]
  tokens, lengths = pad_prompts(prompts, B, CAP)
  logits, state = r.begin(tokens, lengths)
  temp, top_p = np.asarray(temps, np.float32), np.asarray(top_ps, np.float32)
  bits = np.full(new_bitmask(B, CFG.vocab_size).shape, -1, np.int32)
  bits[0, 0] = 0x0F0F0F0F   # a grammar mask on one row
  tag_ids = np.broadcast_to(FREE_TAG, (B, T.N_CAND)).copy()
  state_ids, active = np.full((B,), -1, np.int32), np.ones((B,), bool)
  key = jax.random.key(7)
  nxt = r.select(logits, bits, key, temp, top_p, how)
  toks, lgs = [np.asarray(nxt)], []
  for i in range(STEPS):
    nxt, logits, state = r.advance_logits(state, nxt, tag_ids, state_ids, active, bits,
                                          jax.random.fold_in(key, i), temp, top_p, how)
    toks.append(np.asarray(nxt))
    lgs.append(np.asarray(logits))
  return np.stack(toks), np.stack(lgs)


@pytest.mark.parametrize("case", list(CASES))
def test_static_how_gives_the_device_conditionals_tokens(runner, case):
  temps, top_ps = CASES[case]
  how = how_of(temps, top_ps)
  assert how == {"greedy": (False, False), "sampled": (True, False)}.get(case, (True, True))
  want_tok, want_lg = decode(runner, temps, top_ps, None)
  got_tok, got_lg = decode(runner, temps, top_ps, how)
  np.testing.assert_array_equal(got_tok, want_tok)
  np.testing.assert_array_equal(got_lg, want_lg)


def test_generate_passes_its_samplings_how_once(monkeypatch):
  """``generate`` hands every ``select`` and ``advance`` the ``how`` of its ``Sampling``."""
  r = make("full")
  seen = []
  for name in ("select", "advance"):
    f = getattr(r, name)
    monkeypatch.setattr(r, name, lambda *a, f=f: (seen.append(a[-1]), f(*a))[1])
  no_stop = type("Tok", (), {"stop_ids": (), "decode": lambda self, ids: ""})()
  for s, how in ((Sampling(max_tokens=4), (False, False)),
                 (Sampling(max_tokens=4, temperature=0.7, seed=1), (True, False)),
                 (Sampling(max_tokens=4, temperature=0.7, top_p=0.9, seed=1), (True, True))):
    seen.clear()
    generate(r, no_stop, [[5, 6, 7]], sampling=s)
    assert seen == [how] * 4


# --- compiled for sm_90 (deviceless) -----------------------------------------------------------

def sm90_conditionals(r, kind, how) -> int:
  """``conditional`` instructions in the runner's ``step`` compiled for sm_90."""
  from jax.sharding import SingleDeviceSharding

  from pallas_kernels.gpu import aot
  sh = SingleDeviceSharding(aot.compile_only_device())
  z = jnp.zeros((B,), jnp.int32)
  f = jnp.zeros((B,), jnp.float32)
  bits = jnp.zeros(new_bitmask(B, CFG.vocab_size).shape, jnp.int32)
  rest = (bits, jax.random.key(0), f, f)
  if kind == "full":
    args = (r.params, jax.eval_shape(r.new_cache), z) + rest
  else:
    kv = jnp.zeros((CFG.n_layers, B, CAP, CFG.n_kv_heads, CFG.head_dim), jnp.bfloat16)
    state = jax.eval_shape(lambda: r.commit(P.lean(r.policy), r.new_cache(), kv, kv,
                                            jnp.zeros((B, CAP, T.N_CAND), jnp.int32),
                                            jnp.full((B,), 8, jnp.int32)))
    tags = jnp.broadcast_to(jnp.asarray(FREE_TAG), (B, T.N_CAND))
    args = (r.params, P.lean(r.policy), state, z, tags, z - 1, jnp.ones((B,), bool)) + rest
  sds = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), args)
  hlo = r.step.trace(*sds, how).lower().compile().as_text()
  return len(re.findall(r"\bconditional\(", hlo))


@pytest.mark.parametrize("kind", ["full", "pask"])
def test_sm90_step_with_a_static_how_holds_no_conditional(kind):
  r = make(kind)
  assert sm90_conditionals(r, kind, None) > 0   # the sampler's lax.cond, as before
  for how in ((False, False), (True, False), (True, True)):
    assert sm90_conditionals(r, kind, how) == 0, how
