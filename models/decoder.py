"""One Flax NNX decoder for the Qwen2/2.5, Qwen3 and Llama-3/SmolLM2 families.

Two layouts of the same weights (``Decoder.layout``):

* ``"stacked"`` (what loaders build): every layer weight stacked on a leading layer axis, the
  forward pass a ``lax.scan`` over layers, so compile time does not grow with depth.  What CPU
  runs (tests compile many shapes).
* ``"unrolled"`` (:func:`set_layout`; the default on GPU/TPU, see :func:`prepare`): one array per
  layer and weight, the Q|K|V and gate|up projections fused into one matmul each, and a Python
  loop over layers.  Inside a scan XLA materializes each layer's slice of every stacked weight
  before its matmul (a ``dynamic-slice`` copy fusion per weight: the weights are read twice and
  written once per step); per-layer arrays are read once, in place, and the fused projections
  halve the small launches of a decode step.

  The fused columns are ordered shard-major for a static factor ``Decoder.fused_tp`` (``tp``;
  1 on one device): ``w_qkv``'s columns are ``tp`` blocks, block i holding the query, key and
  value columns of heads ``[i·H/tp, (i+1)·H/tp)`` (``w_gu``: block i the gate and up columns
  ``[i·f/tp, …)``).  A contiguous split of the fused output over ``tp`` devices then gives each
  device whole heads, and the model splits the fused output by a reshape to ``[…, tp, C/tp]``
  and slices of the last axis (:func:`unfuse`), which an SPMD partitioner runs in place with
  no collective (:mod:`pask_jax.mesh`).  With ``tp`` = 1 it is the plain ``[q | k | v]``.

The KV cache is *not* part of the module: the
caller passes a cache pytree and an ``attend`` function, which is how the same decoder runs with
the dense Full-KV cache and with the PASK mixed-precision cache::

    attend(cache, layer, q[B,T,Hq,D], k[B,T,Hkv,D], v[B,T,Hkv,D], positions[B,T])
        -> (out[B,T,Hq,D], cache)

``q`` and ``k`` arrive with RoPE applied; ``layer`` is a traced int32 scalar (stacked layout) or
a Python int (unrolled layout).
"""
from __future__ import annotations

import math
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.config import ModelConfig

Attend = Callable[..., tuple[jax.Array, Any]]
LAYOUTS = ("stacked", "unrolled")
# The unrolled layout's fused weights and their parts, in column order within a shard block.
FUSED = {"w_qkv": ("wq", "wk", "wv"), "b_qkv": ("bq", "bk", "bv"), "w_gu": ("w_gate", "w_up")}
_LAYER_NAMES = ("attn_norm", "mlp_norm", "wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down",
                "bq", "bk", "bv", "q_norm", "k_norm")


class Buffer(nnx.Variable):
  """A non-trainable array that travels with the parameters (RoPE inverse frequencies)."""


def rope_inv_freq(cfg: ModelConfig, freq_factors: np.ndarray | None = None) -> np.ndarray:
  """Inverse frequencies ``[D/2]`` for rotate-half RoPE, with llama3 scaling if configured.

  ``freq_factors`` is GGUF's ``rope_freqs.weight`` (llama3 scaling precomputed as divisors).
  """
  d = cfg.head_dim
  inv = 1.0 / (cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
  if freq_factors is not None:
    inv = inv / np.asarray(freq_factors, np.float64)
  elif cfg.rope_scaling is not None:  # HF's llama3 rule
    s = dict(cfg.rope_scaling)
    factor, lo, hi = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    lo_wl, hi_wl = old / lo, old / hi
    smooth = (old / wavelen - lo) / (hi - lo)
    scaled = np.where(wavelen > lo_wl, inv / factor, inv)
    mid = (wavelen <= lo_wl) & (wavelen >= hi_wl)
    inv = np.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
  return inv.astype(np.float32)


def fuse(parts, tp: int = 1) -> jax.Array:
  """Concatenate ``parts`` on their last axis, shard-major for ``tp`` shards: ``tp`` blocks,
  block i the i-th of ``tp`` equal slices of each part, in order (``tp`` = 1: the plain
  concatenation)."""
  if tp == 1:
    return jnp.concatenate(parts, axis=-1)
  blocks = [w.reshape(*w.shape[:-1], tp, w.shape[-1] // tp) for w in parts]
  w = jnp.concatenate(blocks, axis=-1)
  return w.reshape(*w.shape[:-2], -1)


def unfuse(x: jax.Array, widths: tuple[int, ...], tp: int = 1) -> list[jax.Array]:
  """:func:`fuse`'s inverse on the last axis: the parts of widths ``widths`` (each a multiple
  of ``tp``).  A reshape that splits the sharded axis by its shard count and slices of the
  unsharded rest: in place on every shard, no collective."""
  cuts = np.cumsum(widths)[:-1]
  if tp == 1:
    return jnp.split(x, cuts, axis=-1)
  y = x.reshape(*x.shape[:-1], tp, x.shape[-1] // tp)
  return [p.reshape(*x.shape[:-1], -1) for p in jnp.split(y, cuts // tp, axis=-1)]


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
  xf = x.astype(jnp.float32)
  xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  return (xf * w.astype(jnp.float32)).astype(x.dtype)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
  """Rotate-half RoPE. x: [B, T, H, D]; positions: [B, T]."""
  ang = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
  cos, sin = jnp.cos(ang)[:, :, None, :], jnp.sin(ang)[:, :, None, :]
  xf = x.astype(jnp.float32)
  x1, x2 = jnp.split(xf, 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class Decoder(nnx.Module):
  """Decoder-only transformer; weights are ``x @ W`` ([in, out]) and stacked over layers."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
    self.cfg = cfg
    L, d, f, D = cfg.n_layers, cfg.hidden, cfg.intermediate, cfg.head_dim
    hq, hkv = cfg.n_heads * D, cfg.n_kv_heads * D
    init = lambda *shape, fan_in: nnx.Param(
        (jax.random.normal(rngs.params(), shape, jnp.float32) / math.sqrt(fan_in)).astype(dtype))
    ones = lambda *shape: nnx.Param(jnp.ones(shape, dtype))
    self.embed = init(cfg.vocab_size, d, fan_in=d)
    self.attn_norm, self.mlp_norm = ones(L, d), ones(L, d)
    self.wq, self.wk, self.wv = init(L, d, hq, fan_in=d), init(L, d, hkv, fan_in=d), init(
        L, d, hkv, fan_in=d)
    self.wo = init(L, hq, d, fan_in=hq)
    if cfg.qkv_bias:
      self.bq, self.bk, self.bv = init(L, hq, fan_in=16), init(L, hkv, fan_in=16), init(
          L, hkv, fan_in=16)
    if cfg.qk_norm:
      self.q_norm, self.k_norm = ones(L, D), ones(L, D)
    self.w_gate, self.w_up = init(L, d, f, fan_in=d), init(L, d, f, fan_in=d)
    self.w_down = init(L, f, d, fan_in=f)
    self.norm = ones(d)
    if not cfg.tie_embeddings:
      self.lm_head = init(d, cfg.vocab_size, fan_in=d)
    self.inv_freq = Buffer(jnp.asarray(rope_inv_freq(cfg)))

  layout = "stacked"
  layout_chosen = False   # set by set_layout: runners keep an explicit choice
  fused_tp = 1            # unrolled layout: the shard count its fused columns are ordered for

  def layer_params(self) -> dict[str, jax.Array]:
    """Stacked layout: the stacked per-layer weights, by name."""
    return {n: getattr(self, n)[...] for n in _LAYER_NAMES if hasattr(self, n)}

  def __call__(self, tokens: jax.Array, positions: jax.Array, cache: Any, attend: Attend,
               *, last_only: jax.Array | None = None) -> tuple[jax.Array, Any]:
    """tokens, positions: [B, T] -> (logits [B, T, V] float32, cache).

    ``last_only``: optional [B] int32 index; then only the logits at that step are computed
    ([B, 1, V]), which is what prefill needs (the lm_head over a long prompt is expensive).
    """
    cfg = self.cfg
    B, T = tokens.shape
    x = jnp.take(self.embed[...], tokens, axis=0)
    inv_freq = self.inv_freq[...]
    # One [L, Hkv, D] array in either layout (not one per layer: each is an argument to launch).
    k_center = self.k_center[...] if hasattr(self, "k_center") else None

    hq, hkv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    tp = self.fused_tp

    def layer(carry, xs):
      # Named scopes label the ops in device profiles (bench/profile_step.py groups by them).
      x, cache = carry
      p, idx = xs
      with jax.named_scope("norm"):
        h = rms_norm(x, p["attn_norm"], cfg.rms_eps)
      with jax.named_scope("qkv"):
        if "w_qkv" in p:                                 # unrolled layout: one fused matmul
          qkv = h @ p["w_qkv"]
          if cfg.qkv_bias:
            qkv = qkv + p["b_qkv"]
          q, k, v = unfuse(qkv, (hq, hkv, hkv), tp)
        else:
          q, k, v = h @ p["wq"], h @ p["wk"], h @ p["wv"]
          if cfg.qkv_bias:
            q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
      q = q.reshape(B, T, cfg.n_heads, cfg.head_dim)
      k = k.reshape(B, T, cfg.n_kv_heads, cfg.head_dim)
      v = v.reshape(B, T, cfg.n_kv_heads, cfg.head_dim)
      with jax.named_scope("rope"):
        if cfg.qk_norm:
          q, k = rms_norm(q, p["q_norm"], cfg.rms_eps), rms_norm(k, p["k_norm"], cfg.rms_eps)
        q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
        if k_center is not None:   # models.center: a shift attention cancels, for INT4's sake
          k = k - k_center[idx].astype(k.dtype)
      with jax.named_scope("attend"):
        o, cache = attend(cache, idx, q, k, v, positions)
      with jax.named_scope("out_proj"):
        x = x + o.reshape(B, T, -1).astype(x.dtype) @ p["wo"]
      with jax.named_scope("norm"):
        h = rms_norm(x, p["mlp_norm"], cfg.rms_eps)
      with jax.named_scope("mlp"):
        if "w_gu" in p:
          gu = h @ p["w_gu"]
          gate, up = unfuse(gu, (cfg.intermediate,) * 2, tp)
        else:
          gate, up = h @ p["w_gate"], h @ p["w_up"]
        x = x + (jax.nn.silu(gate) * up) @ p["w_down"]
      return (x, cache), None

    if self.layout == "unrolled":
      carry = (x, cache)
      for i, blk in enumerate(self.layers):
        carry, _ = layer(carry, ({n: w[...] for n, w in vars(blk).items()
                                  if isinstance(w, nnx.Variable)}, i))
      x, cache = carry
    else:
      idx = jnp.arange(cfg.n_layers, dtype=jnp.int32)
      (x, cache), _ = jax.lax.scan(layer, (x, cache), (self.layer_params(), idx))
    if last_only is not None:
      x = jnp.take_along_axis(x, last_only[:, None, None].astype(jnp.int32), axis=1)
    with jax.named_scope("lm_head"):
      x = rms_norm(x, self.norm[...], cfg.rms_eps)
      head = self.embed[...].T if cfg.tie_embeddings else self.lm_head[...]
      logits = jnp.einsum("btd,dv->btv", x, head, preferred_element_type=jnp.float32)
    return logits, cache


class Block(nnx.Module):
  """One layer's weights in the unrolled layout (fused ``w_qkv`` / ``b_qkv`` and ``w_gu``)."""

  def __init__(self, **weights: jax.Array):
    for name, w in weights.items():
      setattr(self, name, nnx.Param(w))


def set_layout(model: Decoder, layout: str, *, tp: int = 1) -> Decoder:
  """Convert ``model`` to ``layout`` in place (same weights, bit for bit) and return it.

  Stacked -> unrolled splits every stacked weight into per-layer arrays and concatenates
  ``wq|wk|wv`` (and biases) into ``w_qkv`` and ``w_gate|w_up`` into ``w_gu`` along the output
  axis, shard-major for ``tp`` shards (:func:`fuse`; ``tp`` is ignored for "stacked");
  unrolled -> stacked undoes it.  An unrolled model fused for another ``tp`` goes through the
  stacked layout.  Weights are converted one name at a time and the old arrays dropped, so
  peak memory is the model plus its largest stacked weight.
  """
  if layout not in LAYOUTS:
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
  if isinstance(tp, bool) or not isinstance(tp, (int, np.integer)) or tp < 1:
    raise ValueError(f"tp must be a positive int, got {tp!r}")
  tp = int(tp) if layout == "unrolled" else 1
  if model.layout == layout and model.fused_tp == tp:
    model.layout_chosen = True
    return model
  if model.layout == layout:      # unrolled for another shard count
    set_layout(model, "stacked")
  cfg, L = model.cfg, model.cfg.n_layers
  hq, hkv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
  widths = {"w_qkv": (hq, hkv, hkv), "b_qkv": (hq, hkv, hkv), "w_gu": (cfg.intermediate,) * 2}
  if layout == "unrolled":
    if any(w % tp for ws in widths.values() for w in ws):
      raise ValueError(f"the fused projections' parts {widths['w_qkv']} and "
                       f"{widths['w_gu']} do not split into {tp} shards")
    blocks: list[dict[str, jax.Array]] = [{} for _ in range(L)]
    parts = {p for ps in FUSED.values() for p in ps}
    for name in _LAYER_NAMES:
      if hasattr(model, name) and name not in parts:
        w = getattr(model, name)[...]
        for i in range(L):
          blocks[i][name] = w[i]
        delattr(model, name)
    for name, ps in FUSED.items():
      if not all(hasattr(model, p) for p in ps):
        continue
      ws = [getattr(model, p)[...] for p in ps]
      for i in range(L):
        blocks[i][name] = fuse([w[i] for w in ws], tp)
      for p in ps:
        delattr(model, p)
    model.layers = nnx.List([Block(**b) for b in blocks])
  else:
    blocks = [{n: w[...] for n, w in vars(b).items() if isinstance(w, nnx.Variable)}
              for b in model.layers]
    for name in list(blocks[0]):
      w = jnp.stack([b.pop(name) for b in blocks])
      if name in FUSED:
        for n, part in zip(FUSED[name], unfuse(w, widths[name], model.fused_tp)):
          setattr(model, n, nnx.Param(part))
      else:
        setattr(model, name, nnx.Param(w))
      del w
    del model.layers
  model.layout, model.fused_tp = layout, tp
  model.layout_chosen = True
  return model


def default_layout(backend: str | None = None) -> str:
  """``$PASK_LAYER_LAYOUT`` if set, else "unrolled" on GPU/TPU and "stacked" on CPU (where tests
  compile many shapes and a scan keeps compiles short)."""
  env = os.environ.get("PASK_LAYER_LAYOUT")
  if env:
    if env not in LAYOUTS:
      raise ValueError(f"PASK_LAYER_LAYOUT must be one of {LAYOUTS}, got {env!r}")
    return env
  backend = backend or jax.default_backend()
  return "stacked" if backend == "cpu" else "unrolled"


def prepare(model: Decoder, layout: str = "auto", *, tp: int = 1) -> Decoder:
  """The layout a runner executes (in place), its fused columns ordered for ``tp`` shards.
  "auto": a layout chosen earlier with :func:`set_layout` stays (re-fused if unrolled for
  another ``tp``); otherwise :func:`default_layout`."""
  if layout == "auto":
    layout = model.layout if getattr(model, "layout_chosen", False) else default_layout()
  return set_layout(model, layout, tp=tp)


def split(model: Decoder) -> tuple[Any, dict]:
  """``(graphdef, params)``: ``nnx.split`` with the state as a plain nested dict
  (``nnx.to_pure_dict``), the form every runner's jitted functions take (``nnx.merge`` accepts
  it).  A jit call flattens its arguments on every call, on the host: the 0.5B's ``nnx.State``
  (172 arrays) cost a trivial jitted function 219 µs per call on the 2-core host, its plain
  dict 64 µs (flax's State flattens node by node in Python, a dict in C++).  The dict holds the
  arrays as they are now: unlike the State it does not follow later in-place updates of
  ``model`` (``nnx.update``): split after them."""
  graphdef, state = nnx.split(model)
  return graphdef, nnx.to_pure_dict(state)
