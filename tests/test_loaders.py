"""Loader host dtypes: a bfloat16 model is loaded without float32 host copies of its weights, and
is the float32 load rounded once (same parameters bit for bit, logits within bfloat16 error)."""
import json

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from models import gguf_io, load, load_hf, registry
from models.loaders import host_dtype
from pask_jax.testing import TINY, full_logprobs, relerr, smollm2

BF16 = np.dtype(ml_dtypes.bfloat16)


def _params(model) -> dict:
  return {k: np.asarray(v) for k, v in nnx.to_pure_dict(nnx.split(model)[1]).items()}


def _same_after_rounding(p32: dict, p16: dict):
  """Every weight of the bfloat16 load is the float32 load's weight rounded to bfloat16; the
  RoPE frequencies stay float32 and equal."""
  assert p32.keys() == p16.keys()
  for k in p32:
    if k == "inv_freq":
      assert p16[k].dtype == np.float32 and np.array_equal(p16[k], p32[k])
      continue
    assert p32[k].dtype == np.float32 and p16[k].dtype == BF16, k
    assert np.array_equal(p32[k].astype(BF16).view(np.uint16), p16[k].view(np.uint16)), k


def test_host_dtype():
  assert host_dtype(jnp.bfloat16) == BF16
  assert host_dtype(jnp.float32) == np.float32
  assert host_dtype(jnp.float16) == np.float32


def test_gguf_tensors_read_as_bfloat16_equal_float32_rounded(monkeypatch):
  reader = gguf_io.open_gguf(registry.smollm2_path())
  kinds = {}
  for t in reader.tensors:
    kinds.setdefault(t.tensor_type.name, t)
  assert {"F32", "Q4_1", "Q8_0"} <= set(kinds)
  for kind, t in kinds.items():
    f32 = gguf_io.tensor(t)
    b16 = gguf_io.tensor(t, BF16)
    assert f32.dtype == np.float32 and b16.dtype == BF16 and b16.shape == f32.shape, kind
    assert np.array_equal(f32.astype(BF16).view(np.uint16), b16.view(np.uint16)), kind
  # A quantized tensor over many row chunks is the same as in one.
  q = kinds["Q4_1"]
  whole = gguf_io.tensor(q, BF16)
  monkeypatch.setattr(gguf_io, "_CHUNK_ELEMS", 3 * whole.shape[-1] + 1)
  assert np.array_equal(gguf_io.tensor(q, BF16).view(np.uint16), whole.view(np.uint16))
  with pytest.raises(ValueError, match="float32 or bfloat16"):
    gguf_io.tensor(q, np.float16)


def test_gguf_quantized_tensors_dequantize_in_chunks_into_their_destination(monkeypatch):
  import gguf
  reader = gguf_io.open_gguf(registry.smollm2_path())
  q = next(t for t in reader.tensors if t.tensor_type.name == "Q4_1")
  shape = tuple(reversed([int(x) for x in q.shape]))
  whole = np.asarray(gguf.quants.dequantize(q.data, q.tensor_type), np.float32).reshape(shape)
  for dtype in (np.dtype(np.float32), BF16):
    want = whole.astype(dtype)
    got = gguf_io.tensor(q, dtype)
    assert got.dtype == dtype and got.ctypes.data % 64 == 0 and got.flags.c_contiguous
    assert np.array_equal(got.view(np.uint8), want.view(np.uint8))
    # Over many row chunks, into a transposed view (a layer slice of a stacked [in, out] array).
    monkeypatch.setattr(gguf_io, "_CHUNK_ELEMS", 3 * shape[-1] + 1)
    dst = np.zeros(shape[::-1], dtype)
    assert gguf_io.tensor(q, dtype, out=dst.T) is not None
    assert np.array_equal(dst.T.astype(np.float32), want.astype(np.float32))
    monkeypatch.undo()
  with pytest.raises(ValueError, match=r"out is float32\[.*\], the tensor bfloat16"):
    gguf_io.tensor(q, BF16, out=np.zeros(shape, np.float32))


def test_aligned_host_arrays_are_used_in_place_by_jax_on_the_cpu():
  """What the loaders rely on for no second copy of a weight on a CPU host."""
  import jax
  if jax.default_backend() != "cpu":
    pytest.skip("the CPU backend's zero-copy placement")
  for dtype in (np.float32, BF16):
    a = gguf_io.empty((3, 1000), dtype)
    assert a.ctypes.data % 64 == 0 and a.shape == (3, 1000) and a.dtype == dtype
    a[...] = 1
    assert jax.device_put(a).unsafe_buffer_pointer() == a.ctypes.data


def test_gguf_bf16_tensor_read_as_bfloat16_is_a_view_of_the_file(tmp_path):
  import gguf
  x = (np.arange(24, dtype=np.float32).reshape(4, 6) / 7).astype(BF16)
  w = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
  w.add_tensor("a", x.view(np.uint16), raw_dtype=gguf.GGMLQuantizationType.BF16)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  t = gguf_io.open_gguf(tmp_path / "t.gguf").tensors[0]
  b16, f32 = gguf_io.tensor(t, BF16), gguf_io.tensor(t)
  assert b16.dtype == BF16 and np.shares_memory(b16, t.data)   # no host copy at all
  assert np.array_equal(b16.view(np.uint16), x.view(np.uint16))
  assert f32.dtype == np.float32 and np.array_equal(f32, x.astype(np.float32))


def test_gguf_bfloat16_load_is_the_float32_load_rounded():
  m32 = smollm2()
  m16 = load(dtype=jnp.bfloat16)
  _same_after_rounding(_params(m32.model), _params(m16.model))
  ids = m32.tokenizer.encode("What's the weather in Tokyo? Answer in JSON.")
  lp32 = full_logprobs(m32.model, ids)
  lp16 = full_logprobs(m16.model, ids)
  assert relerr(lp16, lp32) < 2e-2
  assert (lp16.argmax(-1) == lp32.argmax(-1)).mean() >= 0.9


def _hf_checkpoint(tmp_path, torch_dtype):
  import torch
  import transformers
  cfg = TINY["qwen2"]
  hf = transformers.Qwen2Config(
      vocab_size=cfg.vocab_size, hidden_size=cfg.hidden, intermediate_size=cfg.intermediate,
      num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
      num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, rope_theta=cfg.rope_theta,
      rms_norm_eps=cfg.rms_eps, tie_word_embeddings=cfg.tie_embeddings,
      max_position_embeddings=128)
  torch.manual_seed(0)
  ref = transformers.AutoModelForCausalLM.from_config(hf).eval()
  with torch.no_grad():
    for name, p in ref.named_parameters():
      if "norm" in name or name.endswith("bias"):
        p.add_(0.1 * torch.randn_like(p))
  ref.to(torch_dtype).save_pretrained(tmp_path, max_shard_size="100KB")
  return cfg


@pytest.mark.parametrize("stored", ["bfloat16", "float32"])
def test_hf_bfloat16_load_is_the_float32_load_rounded(tmp_path, stored):
  import torch
  from safetensors import safe_open
  cfg = _hf_checkpoint(tmp_path, getattr(torch, stored))
  files = sorted(tmp_path.glob("*.safetensors"))
  assert len(files) > 1
  with safe_open(files[0], framework="numpy") as h:
    assert {h.get_tensor(k).dtype for k in h.keys()} == {BF16 if stored == "bfloat16"
                                                          else np.dtype(np.float32)}
  m32, m16 = load_hf(tmp_path), load_hf(tmp_path, dtype=jnp.bfloat16)
  p32, p16 = _params(m32.model), _params(m16.model)
  _same_after_rounding(p32, p16)
  # Stored BF16 widens exactly: the float32 load holds the checkpoint's values.
  with safe_open(str(tmp_path / json.loads((tmp_path / "model.safetensors.index.json")
                                           .read_text())["weight_map"]["model.norm.weight"]),
                 framework="numpy") as h:
    stored_norm = h.get_tensor("model.norm.weight")
  assert np.array_equal(p32["norm"], stored_norm.astype(np.float32))
  ids = np.random.default_rng(5).integers(0, cfg.vocab_size, 24).tolist()
  lp32, lp16 = full_logprobs(m32.model, ids), full_logprobs(m16.model, ids)
  assert relerr(lp16, lp32) < 2e-2


def test_hf_non_float_tensor_is_refused_by_name(tmp_path):
  import torch
  from safetensors import safe_open
  from safetensors.numpy import save_file
  _hf_checkpoint(tmp_path, torch.float32)
  tensors = {}
  for f in tmp_path.glob("*.safetensors"):
    with safe_open(f, framework="numpy") as h:
      tensors.update({k: h.get_tensor(k) for k in h.keys()})
    f.unlink()
  (tmp_path / "model.safetensors.index.json").unlink()
  tensors["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].astype(np.int8)
  save_file(tensors, str(tmp_path / "model.safetensors"))
  with pytest.raises(ValueError, match="embed_tokens.weight.*unsupported dtype I8"):
    load_hf(tmp_path, dtype=jnp.bfloat16)


def test_hf_layer_of_the_wrong_shape_is_named(tmp_path):
  import torch
  _hf_checkpoint(tmp_path, torch.bfloat16)
  conf = json.loads((tmp_path / "config.json").read_text())
  conf["intermediate_size"] += 1
  (tmp_path / "config.json").write_text(json.dumps(conf))
  with pytest.raises(ValueError, match=r"layers\.0\.mlp\.\w+_proj\.weight: checkpoint shape"):
    load_hf(tmp_path, dtype=jnp.bfloat16)
