"""Key centering (models.center): the same attention, a smaller INT4 key error."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import ModelConfig, center, decoder, fingerprint, random_model
from pallas_kernels import int4

pytestmark = pytest.mark.fast_compile   # tiny random models (tests/conftest.py) ...

CFG = ModelConfig(arch="qwen2", vocab_size=97, hidden=64, intermediate=96, n_layers=3, n_heads=4,
                  n_kv_heads=2, head_dim=16, rope_theta=1e6)


def offset_model(seed=0, offset=12.0):
  """A random model whose keys carry a large offset in the slowest RoPE channel pair of each
  head (what Qwen2.5's key bias does), so per-token INT4 of the keys loses most of its levels."""
  m = random_model(CFG, seed=seed)
  D = CFG.head_dim
  bk = np.array(m.bk[...]).reshape(CFG.n_layers, CFG.n_kv_heads, D)
  rng = np.random.default_rng(seed)
  bk[..., D // 2 - 1] += offset * rng.choice([-1, 1], bk.shape[:2])
  bk[..., D - 1] += offset * rng.choice([-1, 1], bk.shape[:2])
  m.bk[...] = jnp.asarray(bk.reshape(CFG.n_layers, -1))
  return m


def attend(quantize):
  """Plain causal attention; with ``quantize`` the keys and values past the first 4 positions go
  through the cache's INT4 round trip (pallas_kernels.int4: per-token scale)."""
  def f(c, idx, q, k, v, positions):
    if quantize:
      keep = (positions[0] < 4)[None, :, None, None]
      k = jnp.where(keep, k, int4.dequantize(*int4.quantize_packed(k), jnp.float32))
      v = jnp.where(keep, v, int4.dequantize(*int4.quantize_packed(v), jnp.float32))
    o, _ = center.record_attend(jnp.zeros((CFG.n_layers,) + k.shape[2:]), idx, q, k, v, positions)
    return o, c
  return f


def logits(m, ids, quantize=False):
  ids = jnp.asarray(ids, jnp.int32)[None]
  pos = jnp.arange(ids.shape[1], dtype=jnp.int32)[None]
  return np.asarray(m(ids, pos, 0, attend(quantize))[0][0])


def tokens(seed, n=96):
  return np.random.default_rng(seed).integers(0, CFG.vocab_size, n)


def relerr(a, b):
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("layout", ["stacked", "unrolled"])
def test_centering_keeps_the_function(layout):
  m = offset_model()
  ids = tokens(1)
  ref = logits(m, ids)
  mu = center.estimate(m, tokens(2, 200))
  assert mu.shape == (CFG.n_layers, CFG.n_kv_heads, CFG.head_dim)
  assert float(jnp.abs(mu).max()) > 5.0   # it found the offset
  decoder.set_layout(m, layout)
  center.apply(m, mu)
  np.testing.assert_allclose(np.asarray(center.current(m)), np.asarray(mu), rtol=1e-6)
  assert relerr(logits(m, ids), ref) < 1e-5


def test_centering_cuts_the_int4_error():
  m = offset_model()
  ids = tokens(3)
  raw = relerr(logits(m, ids, quantize=True), logits(m, ids))
  center.apply(m, center.estimate(m, tokens(4, 200)))   # estimated on other tokens
  cen = relerr(logits(m, ids, quantize=True), logits(m, ids))
  assert cen < raw / 3, (raw, cen)


def test_estimate_of_a_centered_model_is_its_centering():
  m = offset_model()
  cal = tokens(5, 200)
  mu = center.estimate(m, cal)
  center.apply(m, mu)
  again = center.estimate(m, cal)   # the mean of the centered keys is ~0, plus μ added back
  np.testing.assert_allclose(np.asarray(again), np.asarray(mu), atol=1e-4)


def test_centering_changes_the_fingerprint():
  m = offset_model()
  before = fingerprint(m)
  center.apply(m, center.estimate(m, tokens(6, 64)))
  assert fingerprint(m) != before


def test_bad_inputs_name_the_problem():
  m = offset_model()
  with pytest.raises(ValueError, match="needs more than"):
    center.estimate(m, [1, 2, 3])
  with pytest.raises(ValueError, match="shape"):
    center.apply(m, jnp.zeros((CFG.n_layers, CFG.n_kv_heads, CFG.head_dim + 1)))


@pytest.mark.fast_compile(False)   # ... but this one runs the real SmolLM2
def test_load_centers_a_registered_model():
  from models import load
  m = load(None, dtype=jnp.float32, need_tokenizer=True, center_keys=True)
  mu = center.current(m.model)
  assert mu.shape == (m.cfg.n_layers, m.cfg.n_kv_heads, m.cfg.head_dim)
  assert float(jnp.abs(mu).sum()) > 0
  # named by its source (models.fingerprint), and the attribute does not upset nnx.jit
  assert m.model.k_center_source.startswith("center.TEXT:")
  np.testing.assert_allclose(np.asarray(center.estimate(m.model, m.tokenizer.encode(center.TEXT))),
                             np.asarray(mu, np.float32), rtol=2e-2, atol=2e-2)
  # Uncentered: the default load (pask_jax.testing.smollm2 is load(), kept once per process;
  # other files of this worker have usually loaded it already).
  from pask_jax.testing import smollm2
  plain = smollm2()
  assert plain.tokenizer is not None and not hasattr(plain.model, "k_center")
  assert jax.tree.leaves(center.current(plain.model))[0].sum() == 0


def test_fingerprint_names_an_estimated_centering_by_its_source():
  """A centering from center.center() is digested by where it came from, so a GPU process whose
  autotuned GEMMs round μ differently still resumes the same calibration — but only while
  k_center holds the values recorded with the source; one applied or changed otherwise is
  digested by value."""
  m = offset_model()
  mu = center.estimate(m, tokens(6, 64))
  center.apply(m, mu)
  tagged = lambda src: f"{src}|mu:{center.values_digest(m.k_center[...])}"
  m.k_center_source = tagged("text:abc")
  assert center.source(m) == "text:abc"
  a = fingerprint(m)
  center.apply(m, mu * (1 + 1e-2))            # another process's rounding of the same estimate
  assert m.k_center_source is None and fingerprint(m) != a
  m.k_center_source = tagged("text:abc")
  assert fingerprint(m) == a
  m.k_center_source = tagged("text:other")
  assert fingerprint(m) != a
  m.k_center_source = tagged("text:abc")
  m.k_center[...] = m.k_center[...] * 2       # changed in place: the source no longer counts
  assert center.source(m) is None and fingerprint(m) != a
