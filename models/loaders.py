"""Loading decoders: an HF checkpoint directory, a GGUF file, or random weights from a config.

Each loader returns a :class:`Loaded` bundle ``(cfg, model, tokenizer)``; ``tokenizer`` is None
for random models.  Weights are converted to the ``[in, out]`` layout of :mod:`models.decoder`
and stacked over layers.  The host copies are in the model's dtype when that is bfloat16 (a BF16
checkpoint is never widened — safetensors' ``safe_open`` gives numpy bfloat16, a GGUF BF16 tensor
is a view of the memory-mapped file — and a quantized GGUF tensor is dequantized in row chunks,
each rounded to bfloat16 at once), float32 otherwise.  Each parameter is one 64-byte aligned host
array, filled in place (a GGUF tensor is dequantized straight into its layer's slice) and handed
to ``jax.device_put``, which on a CPU host uses it as it is; a GGUF's metadata is decoded straight
into Python values (:func:`models.gguf_io.read`: no numpy view per vocabulary string) and freed
before any weight is read.  Host memory while loading is the model plus one tensor's
scratch and the file's mapped pages, not twice the model.

Everything that can be wrong with a checkpoint is reported, by name, before any weight is read:
a missing directory or ``config.json``, an unknown architecture or unsupported setting, no
``*.safetensors`` (or shards named by the index that are absent), a missing or unreadable
``tokenizer.json`` (when a tokenizer is needed: ``need_tokenizer=True``, as the CLI, the server
and :mod:`pask_jax` ask).  After loading, a checkpoint tensor the decoder did not use (a bias of
an unsupported variant, say) is an error too: it would otherwise be a silently different model.
"""
from __future__ import annotations

import contextlib
import glob
import json
import os
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from models import gguf_io
from models.config import ModelConfig
from models.decoder import Decoder, rope_inv_freq
from models.tokenizer import Tokenizer


class Loaded(NamedTuple):
  cfg: ModelConfig
  model: Decoder
  tokenizer: Tokenizer | None


def random_model(cfg: ModelConfig, *, seed: int = 0, dtype=jnp.float32) -> Decoder:
  """Random weights (tests and speed benchmarks); norms are ones, RoPE as configured."""
  return Decoder(cfg, rngs=nnx.Rngs(seed), dtype=dtype)


# Per-layer tensor names: ours -> (HF suffix, GGUF suffix, transpose?)
_LAYER = {
    "attn_norm": ("input_layernorm.weight", "attn_norm.weight", False),
    "mlp_norm": ("post_attention_layernorm.weight", "ffn_norm.weight", False),
    "wq": ("self_attn.q_proj.weight", "attn_q.weight", True),
    "wk": ("self_attn.k_proj.weight", "attn_k.weight", True),
    "wv": ("self_attn.v_proj.weight", "attn_v.weight", True),
    "wo": ("self_attn.o_proj.weight", "attn_output.weight", True),
    "bq": ("self_attn.q_proj.bias", "attn_q.bias", False),
    "bk": ("self_attn.k_proj.bias", "attn_k.bias", False),
    "bv": ("self_attn.v_proj.bias", "attn_v.bias", False),
    "q_norm": ("self_attn.q_norm.weight", "attn_q_norm.weight", False),
    "k_norm": ("self_attn.k_norm.weight", "attn_k_norm.weight", False),
    "w_gate": ("mlp.gate_proj.weight", "ffn_gate.weight", True),
    "w_up": ("mlp.up_proj.weight", "ffn_up.weight", True),
    "w_down": ("mlp.down_proj.weight", "ffn_down.weight", True),
}
_TOP = {  # ours -> (HF name, GGUF name, transpose?)
    "embed": ("model.embed_tokens.weight", "token_embd.weight", False),
    "norm": ("model.norm.weight", "output_norm.weight", False),
    "lm_head": ("lm_head.weight", "output.weight", True),
}


def host_dtype(dtype) -> np.dtype:
  """The dtype a loader keeps a checkpoint's tensors in on the host: bfloat16 for a bfloat16
  model (what it will hold anyway), float32 for any other."""
  return np.dtype(jnp.bfloat16) if np.dtype(dtype) == np.dtype(jnp.bfloat16) else np.dtype(
      np.float32)


def _put(arr: np.ndarray, dtype) -> jax.Array:
  """A filled host array as a parameter: in the model's dtype already, handed over as it is (on
  the CPU backend JAX then uses the aligned buffer in place: no second copy); else converted."""
  if arr.dtype == np.dtype(dtype):
    return jax.device_put(arr)
  return jnp.asarray(arr, dtype)


def _assemble(cfg: ModelConfig, get: Callable[..., np.ndarray], which: int, dtype,
              desc: str) -> Decoder:
  """Build a Decoder from a tensor getter ``get(name, host dtype, out)`` (which=0: HF names, 1:
  GGUF names).  ``out`` is where the tensor goes (its checkpoint layout: a transposed view of the
  parameter where ours is transposed); the getter may write it and return it, or return another
  array, which is then copied in.  Each parameter is one 64-byte aligned host array filled in
  place (the layers of a stacked one one by one), then handed to JAX."""
  host = host_dtype(dtype)
  abstract = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0), dtype=dtype))
  gdef, state = nnx.split(abstract)
  pure = nnx.to_pure_dict(state)
  names = [n for n in pure if n != "inv_freq"]
  prefix = ("model.layers.{}.", "blk.{}.")[which]

  def fill(tensor: str, dst: np.ndarray, transpose: bool, want: tuple):
    into = dst.T if transpose else dst
    a = get(tensor, host, into)
    if a is into:
      return
    ours = a.T if transpose else a
    if tuple(ours.shape) != want:
      raise ValueError(f"tensor {tensor}: checkpoint shape {tuple(ours.shape)} != "
                       f"expected {want}")
    dst[...] = ours

  for name in tqdm(names, desc=desc, unit="tensor", leave=False):
    want = tuple(pure[name].shape)
    arr = gguf_io.empty(want, host)
    if name in _TOP:
      fill(_TOP[name][which], arr, _TOP[name][2], want)
    else:
      suffix, transpose = _LAYER[name][which], _LAYER[name][2]
      for i in range(cfg.n_layers):      # layer by layer: no list of per-layer copies
        fill(prefix.format(i) + suffix, arr[i], transpose, want[1:])
    pure[name] = _put(arr, dtype)
    del arr
  pure["inv_freq"] = jnp.asarray(pure_inv_freq(cfg, get, which))
  nnx.replace_by_pure_dict(state, pure)
  return nnx.merge(gdef, state)


def pure_inv_freq(cfg: ModelConfig, get, which: int) -> np.ndarray:
  factors = None
  if which == 1:
    try:
      factors = get("rope_freqs.weight", np.dtype(np.float32), None)
    except KeyError:
      pass
  return rope_inv_freq(cfg, factors)


# --- GGUF -----------------------------------------------------------------------------------

def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
  """Undo llama.cpp's q/k row permutation (interleaved RoPE -> rotate-half). w: [out, in]."""
  return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(
      w.shape)


def load_gguf(path: str | os.PathLike, *, dtype=jnp.float32) -> Loaded:
  meta, tensors = gguf_io.read(path)
  tensors = {t.name: t for t in tensors}    # views of the memory-mapped file
  cfg = ModelConfig.from_gguf_fields(meta, set(tensors))
  tok = Tokenizer.from_gguf_metadata(meta)   # before the weights: a bad tokenizer fails fast
  del meta

  def get(name: str, host: np.dtype, out: np.ndarray | None) -> np.ndarray:
    if name not in tensors:
      raise KeyError(name)
    t = tensors[name]
    permuted = cfg.arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight"))
    fits = (out is not None and not permuted and out.dtype == host
            and out.shape == tuple(reversed([int(x) for x in t.shape])))
    a = gguf_io.tensor(t, host, out if fits else None)
    if permuted:
      a = _unpermute(a, cfg.n_heads if name.endswith("attn_q.weight") else cfg.n_kv_heads)
    return a

  def get_checked(name: str, host: np.dtype, out: np.ndarray | None) -> np.ndarray:
    try:
      return get(name, host, out)
    except KeyError:
      if name == "rope_freqs.weight":
        raise
      raise ValueError(f"GGUF file {os.fspath(path)} has no tensor {name!r} needed by "
                       f"the {cfg.arch} architecture") from None

  model = _assemble(cfg, get_checked, 1, dtype, f"loading {os.path.basename(os.fspath(path))}")
  return Loaded(cfg, model, tok)


# --- HF checkpoint directory ------------------------------------------------------------------

def _safetensor_files(path: str) -> list[str]:
  """The checkpoint's weight files; the shards an index names must all be there."""
  index = os.path.join(path, "model.safetensors.index.json")
  if os.path.exists(index):
    try:
      with open(index) as f:
        shards = sorted(set(json.load(f)["weight_map"].values()))
    except (json.JSONDecodeError, KeyError, AttributeError) as e:
      raise ValueError(f"{index} is not a safetensors index ({type(e).__name__}: {e})") from None
    missing = [s for s in shards if not os.path.exists(os.path.join(path, s))]
    if missing:
      raise FileNotFoundError(f"{path}: shards named by model.safetensors.index.json are missing: "
                              f"{', '.join(missing[:4])}{' …' if len(missing) > 4 else ''}")
    return [os.path.join(path, s) for s in shards]
  files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
  if not files:
    raise FileNotFoundError(f"no *.safetensors files in {path} (an HF checkpoint directory needs "
                            "config.json, *.safetensors and tokenizer.json)")
  return files


# Checkpoint tensors that carry no weights of ours (rotary caches some exports keep).
_IGNORED = ("rotary_emb.inv_freq",)


def load_hf(path: str | os.PathLike, *, dtype=jnp.float32, need_tokenizer: bool = False) -> Loaded:
  """An HF checkpoint directory (``config.json``, ``*.safetensors``, ``tokenizer.json``)."""
  from safetensors import safe_open
  path = os.fspath(path)
  if not os.path.isdir(path):
    raise FileNotFoundError(f"HF checkpoint directory not found: {path}")
  cfg = ModelConfig.from_hf(path)
  files = _safetensor_files(path)
  tok = None
  if os.path.exists(os.path.join(path, "tokenizer.json")):
    tok = Tokenizer.from_hf_dir(path)
  elif need_tokenizer:
    raise FileNotFoundError(f"no tokenizer.json in {path}: generation needs the checkpoint's "
                            "tokenizer (config.json, *.safetensors and tokenizer.json)")
  with contextlib.ExitStack() as files_open:
    where: dict[str, tuple[str, Any]] = {}
    for f in files:
      try:
        h = files_open.enter_context(safe_open(f, framework="numpy"))
        for k in h.keys():
          where[k] = (f, h)
      except Exception as e:  # noqa: BLE001 — a truncated or foreign file: say which
        raise ValueError(f"{f} is not a readable safetensors file: {e}") from None
    used: set[str] = set()

    def get(name: str, host: np.dtype, out: np.ndarray | None) -> np.ndarray:
      if name not in where:
        if name == "lm_head.weight" and cfg.tie_embeddings:
          raise KeyError(name)
        raise ValueError(f"checkpoint {path} has no tensor {name!r}")
      used.add(name)
      return _read_safetensor(*where[name], name, host)

    model = _assemble(cfg, get, 0, dtype, f"loading {os.path.basename(path)}")
  extra = sorted(n for n in where if n not in used and not n.endswith(_IGNORED)
                 and not (n == "lm_head.weight" and cfg.tie_embeddings))
  if extra:
    raise ValueError(f"checkpoint {path} has tensors the {cfg.arch} decoder does not use "
                     f"(an unsupported variant?): {', '.join(extra[:4])}"
                     f"{f' and {len(extra) - 4} more' if len(extra) > 4 else ''}")
  return Loaded(cfg, model, tok)


_FLOATS = ("BF16", "F16", "F32", "F64")


def _read_safetensor(file: str, h, name: str, host: np.dtype) -> np.ndarray:
  """One tensor of an open safetensors file (``safe_open(..., framework="numpy")``, which gives
  BF16 as an ml_dtypes bfloat16 array) in the host dtype: a BF16 tensor of a bfloat16 model is
  taken as it is; any other is rounded once (F16 and F64 through float32, which holds F16
  exactly)."""
  dt = h.get_slice(name).get_dtype()
  if dt not in _FLOATS:
    raise ValueError(f"tensor {name} in {file}: unsupported dtype {dt} (loadable: "
                     f"{', '.join(_FLOATS)})")
  try:
    a = h.get_tensor(name)
  except TypeError as e:   # a safetensors release that cannot give numpy a bfloat16 array
    raise ValueError(f"tensor {name} in {file}: this safetensors cannot read {dt} into numpy "
                     f"({e}); upgrade it: pip install -U safetensors") from None
  if a.dtype == host:
    return a
  return a.astype(np.float32, copy=False).astype(host, copy=False)


def load(path_or_name: str | os.PathLike | None = None, *, dtype=jnp.float32,
         need_tokenizer: bool = False, center_keys: bool = False) -> Loaded:
  """A registered model name, a GGUF file, or an HF checkpoint directory.

  ``need_tokenizer``: refuse, before any weight loads, a checkpoint without a tokenizer.
  ``center_keys``: estimate and apply the key centering of :mod:`models.center` (needs the
  tokenizer; the model computes the same function, its INT4 keys lose far less)."""
  from models import registry
  path = registry.resolve(path_or_name)
  if os.path.isdir(path):
    m = load_hf(path, dtype=dtype, need_tokenizer=need_tokenizer or center_keys)
  elif not os.path.exists(path):
    raise FileNotFoundError(f"model not found: {path} (not a file, a directory, nor one of the "
                            f"registered names: {', '.join(registry.NAMES)})")
  else:
    with open(path, "rb") as f:
      magic = f.read(4)
    if magic != b"GGUF":
      raise ValueError(f"{path} is neither a GGUF file nor an HF checkpoint directory")
    m = load_gguf(path, dtype=dtype)
  if center_keys:
    if m.tokenizer is None:
      raise ValueError(f"{path}: key centering needs the checkpoint's tokenizer")
    from models import center
    center.center(m)
  return m


def fingerprint(model) -> dict[str, Any]:
  """What identifies a model's numbers: its full config, the parameter dtype and a digest of the
  weights (every parameter's shape and dtype, a strided sample of up to 4096 values of each and
  its sum — cheap on a multi-GB model, and different for any two checkpoints that are not
  copies), the same in either layer layout.  Calibration keys its saved stages on it.

  Everything digested must be the same in every process that loads the same checkpoint, or a
  calibration cannot resume: the sums are taken on the host in float64 (a device reduction may
  order its additions differently from run to run; ``np.sum(..., dtype=float64)`` casts in
  chunks, no float64 copy of a multi-GB array), and a key centering estimated by
  :func:`models.center.center` is named by where it came from (``model.k_center_source``), not
  by its values, which a GPU forward pass reproduces only to within a rounding (its GEMMs are
  autotuned per process).  The source counts only while ``k_center`` still holds the values it
  was recorded with (their exact digest is part of it): a centering applied or changed by any
  other means is digested by value."""
  import hashlib

  from models import decoder
  layout, tp = getattr(model, "layout", "stacked"), getattr(model, "fused_tp", 1)
  if layout != "stacked":   # a runner converted it (GPU/TPU): digest the loaders' layout
    decoder.set_layout(model, "stacked")
    try:
      return fingerprint(model)
    finally:
      decoder.set_layout(model, layout, tp=tp)
  h = hashlib.sha256()
  _, state = nnx.split(model)
  flat = sorted(nnx.to_pure_dict(state).items())
  from models import center
  source = center.source(model)
  dtype = None
  for name, x in flat:
    x = jnp.asarray(x)
    dtype = dtype or str(x.dtype)
    h.update(f"{name}:{x.shape}:{x.dtype}:".encode())
    if name == "k_center" and source is not None:
      h.update(f"source:{source}".encode())
      continue
    flat_x = x.reshape(-1)
    step = max(1, flat_x.size // 4096)
    h.update(np.asarray(flat_x[::step][:4096], np.float32).tobytes())
    h.update(np.float64(np.sum(np.asarray(x), dtype=np.float64)).tobytes())
  return {"config": json.loads(model.cfg.to_json()), "dtype": dtype,
          "weights": h.hexdigest()[:20]}
