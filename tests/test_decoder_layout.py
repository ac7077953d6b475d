"""The unrolled layer layout (per-layer arrays, fused Q|K|V and gate|up, Python layer loop) computes
what the stacked scan computes, for every family; conversions are exact both ways."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import ModelConfig, random_model
from models import decoder
from pask_jax import kv_dense

pytestmark = pytest.mark.fast_compile

_BASE = dict(vocab_size=97, hidden=64, intermediate=96, n_layers=3, n_heads=4, n_kv_heads=2,
             head_dim=16, max_position=256)
FAMILIES = {
    "llama": dict(arch="llama", tie_embeddings=True),
    "qwen2": dict(arch="qwen2", tie_embeddings=False),
    "qwen3": dict(arch="qwen3", tie_embeddings=True),
}


def _logits(model, tokens):
  B, T = tokens.shape
  cfg = model.cfg
  cache = kv_dense.init(cfg.n_layers, B, T, cfg.n_kv_heads, cfg.head_dim, jnp.float32)
  cache = cache._replace(length=jnp.full((B,), T, jnp.int32))
  pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  gdef, params = nnx.split(model)
  f = jax.jit(lambda p, t: nnx.merge(gdef, p)(t, pos, cache, kv_dense.attend))
  logits, out = f(params, tokens)
  return np.asarray(logits), np.asarray(out.k), np.asarray(out.v)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_unrolled_matches_stacked(family):
  cfg = ModelConfig(**_BASE, **FAMILIES[family], name=family)
  model = random_model(cfg, seed=3)
  tokens = jax.random.randint(jax.random.key(7), (2, 11), 0, cfg.vocab_size)
  want = _logits(model, tokens)
  before = {n: np.asarray(w) for n, w in model.layer_params().items()}
  decoder.set_layout(model, "unrolled")
  assert model.layout == "unrolled" and not hasattr(model, "wq") and len(model.layers) == 3
  blk = model.layers[1]
  hq, hkv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
  assert blk.w_qkv.shape == (cfg.hidden, hq + 2 * hkv) and blk.w_gu.shape == (cfg.hidden, 2 * 96)
  got = _logits(model, tokens)
  for g, w in zip(got, want):
    err = np.linalg.norm(g - w) / np.linalg.norm(w)
    assert err < 1e-5, err    # fp32: only the matmul blocking of the fused projections differs
  if family == "qwen2":   # (q/k/v biases) the columns ordered for 2 shards: the same numbers
    decoder.set_layout(model, "unrolled", tp=2)
    assert model.fused_tp == 2
    w = np.asarray(model.layers[1].w_qkv)
    q, k, v = (before[n][1] for n in ("wq", "wk", "wv"))
    half = lambda x, i: x[:, i * x.shape[1] // 2:(i + 1) * x.shape[1] // 2]
    np.testing.assert_array_equal(w, np.concatenate(
        [half(q, 0), half(k, 0), half(v, 0), half(q, 1), half(k, 1), half(v, 1)], axis=1))
    for g, w in zip(_logits(model, tokens), want):
      assert np.linalg.norm(g - w) / np.linalg.norm(w) < 1e-5
  decoder.set_layout(model, "stacked")
  after = model.layer_params()
  assert set(after) == set(before)
  for n, w in before.items():
    np.testing.assert_array_equal(np.asarray(after[n]), w)   # the round trip is exact


def test_layout_choice(monkeypatch):
  monkeypatch.delenv("PASK_LAYER_LAYOUT", raising=False)
  assert decoder.default_layout("cpu") == "stacked"
  assert decoder.default_layout("gpu") == decoder.default_layout("tpu") == "unrolled"
  monkeypatch.setenv("PASK_LAYER_LAYOUT", "unrolled")
  assert decoder.default_layout("cpu") == "unrolled"
  monkeypatch.setenv("PASK_LAYER_LAYOUT", "diagonal")
  with pytest.raises(ValueError, match="PASK_LAYER_LAYOUT"):
    decoder.default_layout()
  with pytest.raises(ValueError, match="layout must be one of"):
    decoder.set_layout(random_model(ModelConfig(**_BASE, arch="llama", name="x")), "diagonal")


def test_runner_keeps_an_explicit_layout(monkeypatch):
  from pask_jax.decode import Runner
  monkeypatch.setenv("PASK_LAYER_LAYOUT", "unrolled")
  cfg = ModelConfig(**_BASE, arch="llama", name="x")
  m = random_model(cfg)
  Runner(m, batch=1, capacity=8)
  assert m.layout == "unrolled"                      # auto: the default for this backend
  decoder.set_layout(m, "stacked")
  Runner(m, batch=1, capacity=8)
  assert m.layout == "stacked"                       # an explicit choice is kept
  # what a mesh of 2 does (pask_jax.mesh.prepare_model): the same rule, the fused columns
  # ordered for the mesh; an unrolled model fused for another mesh is re-fused
  assert decoder.prepare(m, tp=2).layout == "stacked" and m.fused_tp == 1
  m = random_model(cfg)
  assert decoder.prepare(m, tp=2).layout == "unrolled" and m.fused_tp == 2
  assert decoder.prepare(m).fused_tp == 1 and decoder.prepare(m, "unrolled", tp=4).fused_tp == 4
  with pytest.raises(ValueError, match="do not split into 3 shards"):
    decoder.set_layout(m, "unrolled", tp=3)
  with pytest.raises(ValueError, match="tp must be a positive int"):
    decoder.set_layout(m, "unrolled", tp=0)
