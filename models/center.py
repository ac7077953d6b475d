"""Key centering: subtract a fixed per-channel mean from every post-RoPE key.

Attention is invariant to a shift of all keys of a head by one vector μ: ``q·(k − μ) = q·k − q·μ``
moves every score of a query by the same amount, which the softmax cancels. So the centered model
computes the same function (up to rounding) and every cache, kernel and baseline stays as it is.
What changes is quantization: some models' keys carry a large per-channel offset (Qwen2.5's key
bias, in the slowly rotating RoPE channels), and a per-token INT4 scale must then cover the offset,
leaving few levels for the part of the key that varies. On Qwen2.5-Coder-1.5B that offset makes
per-token INT4 keys cost a whole-model logit RMS of 14.9 against 0.39 once centered
(``bench/RESULTS.md``, "Spherical KV, G0"). KIVI quantizes keys per channel for the same reason.

μ is estimated once per model from a fixed text (:data:`TEXT`, the shape of a tool-calling
prompt), over positions past the first ``SINK`` (attention sinks have atypical keys), and kept
in the model as one weight ``k_center`` [L, Hkv, D] (one array in either layer layout), which
the decoder subtracts after RoPE. It is part of the weights, so model fingerprints (calibration
stages, campaign cells) tell a centered model from an uncentered one.
"""
from __future__ import annotations

import hashlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

SINK = 4
VERSION = 1   # of the estimator: part of a centering's recorded source (models.fingerprint)

TEXT = """You are a helpful assistant with access to the following functions. Use them if \
required.
[{"name": "get_weather", "description": "Get the current weather in a given city.", \
"parameters": {"type": "object", "properties": {"city": {"type": "string", "description": \
"The city, e.g. San Francisco"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, \
"required": ["city"]}}, {"name": "calculate_area", "description": "Area of a rectangle or a \
circle.", "parameters": {"type": "object", "properties": {"shape": {"type": "string"}, \
"dimensions": {"type": "array", "items": {"type": "number"}}}, "required": ["shape", \
"dimensions"]}}, {"name": "search_books", "description": "Find books by author, title or year.", \
"parameters": {"type": "object", "properties": {"author": {"type": "string"}, "year": \
{"type": "integer"}, "limit": {"type": "integer", "default": 10}}}}]
User: What is the weather like in Paris today, in celsius? Also, what is the area of a circle \
with a radius of 3.5 meters, and which books did Ursula K. Le Guin publish in 1969?
Assistant: I will call the functions one at a time.
get_weather(city="Paris", unit="celsius")
calculate_area(shape="circle", dimensions=[3.5])
search_books(author="Ursula K. Le Guin", year=1969, limit=5)
def fibonacci(n: int) -> list[int]:
    \"\"\"Return the first n Fibonacci numbers.\"\"\"
    out = [0, 1]
    while len(out) < n:
        out.append(out[-1] + out[-2])
    return out[:n]
SELECT name, COUNT(*) AS orders FROM customers JOIN orders ON customers.id = orders.customer_id \
WHERE orders.created_at >= '2024-01-01' GROUP BY name ORDER BY orders DESC LIMIT 10;
"""


def record_attend(mu, idx, q, k, v, positions):
  """An ``attend`` for :class:`models.Decoder` that records the layer's mean key and runs plain
  causal attention (GQA), so the next layer sees what the model computes."""
  B, T, H, D = q.shape
  Hkv = k.shape[2]
  kf = k.astype(jnp.float32)
  mu = mu.at[idx].set(jnp.mean(kf[:, SINK:], axis=(0, 1)))
  qg = q.astype(jnp.float32).reshape(B, T, Hkv, H // Hkv, D)
  s = jnp.einsum("bthgd,bshd->bhgts", qg, kf) / jnp.sqrt(jnp.float32(D))
  causal = positions[:, None, None, :, None] >= positions[:, None, None, None, :]
  p = jax.nn.softmax(jnp.where(causal, s, -jnp.inf), axis=-1)
  o = jnp.einsum("bhgts,bshd->bthgd", p, v.astype(jnp.float32))
  return o.reshape(B, T, H, D).astype(q.dtype), mu


def estimate(model, tokens) -> jax.Array:
  """The mean post-RoPE key of every layer and KV head over ``tokens`` (past the first
  :data:`SINK`): [L, Hkv, D] float32, of the uncentered model (a centering the model already has
  is added back)."""
  cfg = model.cfg
  ids = jnp.asarray(tokens, jnp.int32)[None]
  if ids.shape[1] <= SINK + 1:
    raise ValueError(f"key centering needs more than {SINK + 1} tokens, got {ids.shape[1]}")
  pos = jnp.arange(ids.shape[1], dtype=jnp.int32)[None]
  mu0 = jnp.zeros((cfg.n_layers, cfg.n_kv_heads, cfg.head_dim), jnp.float32)

  @nnx.jit
  def run(model, ids, pos, mu0):
    _, mu = model(ids, pos, mu0, record_attend, last_only=jnp.zeros((1,), jnp.int32))
    return mu

  return run(model, ids, pos, mu0) + current(model)


def current(model) -> jax.Array:
  """The centering the model applies ([L, Hkv, D] float32; zeros when it has none)."""
  cfg = model.cfg
  zero = jnp.zeros((cfg.n_layers, cfg.n_kv_heads, cfg.head_dim), jnp.float32)
  if hasattr(model, "k_center"):
    return model.k_center[...].astype(jnp.float32)
  return zero


def apply(model, mu) -> None:
  """Make ``model`` subtract ``mu`` [L, Hkv, D] from its post-RoPE keys (in place; the model's
  dtype)."""
  cfg = model.cfg
  mu = jnp.asarray(mu)
  want = (cfg.n_layers, cfg.n_kv_heads, cfg.head_dim)
  if mu.shape != want:
    raise ValueError(f"key centering has shape {mu.shape}, the model needs {want}")
  model.k_center = nnx.Param(mu.astype(model.embed[...].dtype))
  model.k_center_source = None   # values of unknown origin: the fingerprint digests them


def center(loaded) -> jax.Array:
  """Estimate the key centering of a loaded model (:class:`models.Loaded`) from :data:`TEXT`
  and apply it; returns μ."""
  ids = loaded.tokenizer.encode(TEXT)
  mu = estimate(loaded.model, ids)
  apply(loaded.model, mu)
  # What models.fingerprint digests instead of μ's values (see there): the estimator's version,
  # its text and sink, and the exact values recorded (a later change to k_center voids it).
  src = hashlib.sha256(f"{VERSION}:{SINK}:{list(ids)}".encode()).hexdigest()[:16]
  mu_digest = values_digest(loaded.model.k_center[...])
  loaded.model.k_center_source = f"center.TEXT:{src}|mu:{mu_digest}"
  return mu


def source(model) -> str | None:
  """Where ``model``'s key centering came from (recorded by :func:`center`), while ``k_center``
  still holds the exact values recorded with it; else None (``models.fingerprint`` then digests
  the values)."""
  rec = getattr(model, "k_center_source", None)
  if not rec or not hasattr(model, "k_center"):
    return None
  src, _, digest = rec.rpartition("|mu:")
  return src if digest == values_digest(model.k_center[...]) else None


def values_digest(x) -> str:
  """sha256 (16 hex digits) of an array's exact bytes, shape and dtype."""
  a = np.asarray(x)
  return hashlib.sha256(f"{a.shape}:{a.dtype}:".encode() + a.tobytes()).hexdigest()[:16]
