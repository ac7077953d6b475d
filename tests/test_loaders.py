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
  kinds = {}
  for t in gguf_io.read(registry.smollm2_path()).tensors:
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
  q = next(t for t in gguf_io.read(registry.smollm2_path()).tensors
           if t.tensor_type.name == "Q4_1")
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


def _same_as_the_gguf_reader(path):
  """gguf_io.read gives what gguf.GGUFReader gives: the metadata as gguf_io.metadata decodes it
  (keys in file order, the same Python types), and the same tensors (views of the file)."""
  got, reader = gguf_io.read(path), gguf_io.open_gguf(path)
  want = gguf_io.metadata(reader)
  assert list(got.meta) == list(want) and got.meta == want
  assert [type(v) for v in got.meta.values()] == [type(v) for v in want.values()]
  for k, v in want.items():
    if isinstance(v, list):
      assert [type(x) for x in got.meta[k]] == [type(x) for x in v], k
  assert len(got.tensors) == len(reader.tensors)
  for a, b in zip(got.tensors, reader.tensors):
    assert (a.name, a.tensor_type, a.n_elements, a.n_bytes, a.data_offset) == \
        (b.name, b.tensor_type, b.n_elements, b.n_bytes, b.data_offset)
    assert list(a.shape) == list(b.shape)
    assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
    assert np.array_equal(a.data.view(np.uint8), b.data.view(np.uint8)), a.name
    assert isinstance(a.data.base, np.memmap) or isinstance(a.data, np.memmap), a.name
  return got


def test_gguf_read_is_the_gguf_readers_metadata_and_tensors(tmp_path):
  import gguf
  got = _same_as_the_gguf_reader(registry.smollm2_path())      # 98k vocabulary strings, 272 tensors
  assert len(got.meta["tokenizer.ggml.tokens"]) == 49152 and len(got.tensors) == 272
  # Every value type, arrays of each, a custom alignment, plain and quantized tensors.
  w = gguf.GGUFWriter(str(tmp_path / "all.gguf"), "llama")
  w.add_custom_alignment(64)
  for i, (add, v) in enumerate([(w.add_uint8, 200), (w.add_int8, -100), (w.add_uint16, 60000),
                                (w.add_int16, -30000), (w.add_uint32, 4_000_000_000),
                                (w.add_int32, -2_000_000_000), (w.add_float32, 0.1),
                                (w.add_uint64, 2**63 + 5), (w.add_int64, -2**62),
                                (w.add_float64, 0.1), (w.add_bool, True), (w.add_bool, False),
                                (w.add_string, "héllo \u2603")]):
    add(f"k.{i}", v)
  w.add_array("a.int", [1, -2, 3])
  w.add_array("a.float", [0.5, 0.1])
  w.add_array("a.bool", [True, False, True])
  w.add_array("a.str", ["x", "", "ü\n"])
  w.add_key_value("a.u8", [1, 2, 255], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.UINT8)
  w.add_key_value("bad.utf8", b"\xff\xfeok", gguf.GGUFValueType.STRING)
  rng = np.random.default_rng(0)
  w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
  w.add_tensor("f16", rng.standard_normal((2, 7)).astype(np.float16))
  w.add_tensor("i32", np.arange(6, dtype=np.int32).reshape(2, 3))
  q8 = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32),
                            gguf.GGMLQuantizationType.Q8_0)
  w.add_tensor("q8", q8, raw_shape=q8.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  got = all_types = _same_as_the_gguf_reader(tmp_path / "all.gguf")
  assert got.meta["k.6"] == float(np.float32(0.1)) and got.meta["bad.utf8"] == "\ufffd\ufffdok"
  assert [t.data.shape for t in got.tensors] == [(3, 5), (2, 7), (2, 3), (4, 68)]
  assert all(t.data_offset % 64 == 0 for t in got.tensors)
  # What the parser leaves to gguf.GGUFReader: arrays of arrays, a big-endian file.
  for name, kw, key, val in (("nested", {}, "a.nested", [[1, 2], [3, 4]]),
                             ("big", {"endianess": gguf.GGUFEndian.BIG}, "k", 7)):
    w = gguf.GGUFWriter(str(tmp_path / f"{name}.gguf"), "llama", **kw)
    w.add_array(key, val) if isinstance(val, list) else w.add_uint32(key, val)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert _same_as_the_gguf_reader(tmp_path / f"{name}.gguf").meta["GGUF.kv_count"] == 2
  # A missing file, a foreign one and a truncated one: named.
  with pytest.raises(FileNotFoundError, match="GGUF file not found"):
    gguf_io.read(tmp_path / "none.gguf")
  (tmp_path / "foreign.gguf").write_bytes(b"PK\x03\x04" + bytes(100))
  raw = (tmp_path / "all.gguf").read_bytes()
  end = max(t.data_offset + t.data.nbytes for t in all_types.tensors)    # then the padding
  for n in (10, 30, 200, end - 1):
    (tmp_path / "cut.gguf").write_bytes(raw[:n])
    with pytest.raises(ValueError, match=r"cut.gguf is not a readable GGUF file: .*truncated"):
      gguf_io.read(tmp_path / "cut.gguf")
  with pytest.raises(ValueError, match=r"foreign.gguf is not a readable GGUF file: .*magic"):
    gguf_io.read(tmp_path / "foreign.gguf")


def test_aligned_host_arrays_are_used_in_place_by_jax_on_the_cpu():
  """What the loaders rely on for no second copy of a weight on a CPU host."""
  import jax
  if jax.default_backend() != "cpu":
    pytest.skip("the CPU backend's zero-copy placement")
  import gc
  import mmap
  big = (3, gguf_io.MAP_BYTES // 2 // 3 + 1)    # a memory map of its own (no huge pages)

  def owner(a):
    while isinstance(a, np.ndarray):
      a = a.base
    return a.obj if isinstance(a, memoryview) else a

  for shape in ((3, 1000), big):
    for dtype in (np.float32, BF16):
      a = gguf_io.empty(shape, dtype)
      assert a.ctypes.data % 64 == 0 and a.shape == shape and a.dtype == dtype
      assert a.flags.c_contiguous and a.flags.writeable
      assert isinstance(owner(a), mmap.mmap) == (shape == big)
      a[...] = 1
      a[-1, -1] = 2
      x = jax.device_put(a)
      assert x.unsafe_buffer_pointer() == a.ctypes.data
      del a
      gc.collect()      # the array gone, JAX's buffer keeps the memory
      got = np.asarray(x)
      assert got[-1, -1] == 2 and got.sum(dtype=np.float64) == got.size + 1


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
