"""Reference log-probabilities from an independent implementation (transformers + torch, fp32).

Loads a GGUF with ``transformers`` (its own GGUF reader, tokenizer conversion and modelling code),
greedily continues each prompt for ``new`` tokens, then records for every position from the last
prompt token on: the top-``topk`` token ids and log-probabilities, and the greedy token.
``scripts/parity_reference.py`` stores it for ``tests/test_parity.py``; the opt-in live test calls
:func:`reference` directly (needs torch + transformers + accelerate).
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
import tempfile

import numpy as np

PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a Python function that reverses a string."}],
    [{"role": "system", "content": "You answer in JSON."},
     {"role": "user",
      "content": "Give me the weather in Tokyo as {\"city\": ..., \"temp_c\": ...}."}],
]


@contextlib.contextmanager
def _parsed_once():
  """transformers reads a GGUF three times (tokenizer, config, weights), each time with a new
  ``gguf.GGUFReader`` (~3 s of CPU apiece for SmolLM2's 98k vocabulary strings), and builds gguf's
  tensor-name map once per module of the model (~4 s): inside, each is made once per arguments
  and shared, the same gguf objects (transformers imports both names from gguf when it calls)."""
  import gguf
  reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
  readers: dict = {}

  class Reader(reader):
    def __new__(cls, path, *a, **k):
      key = (os.path.realpath(path), a, tuple(sorted(k.items())))
      if key not in readers:
        readers[key] = reader(path, *a, **k)
      return readers[key]

    def __init__(self, *a, **k):   # made by reader(...) above
      pass

  gguf.GGUFReader, gguf.get_tensor_name_map = Reader, functools.lru_cache(None)(name_map)
  try:
    yield readers
  finally:
    gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map


def reference(gguf_path: str, new: int, topk: int) -> dict:
  import torch
  from transformers import AutoModelForCausalLM, AutoTokenizer
  d = tempfile.mkdtemp()
  os.symlink(os.path.abspath(gguf_path), os.path.join(d, "m.gguf"))
  with _parsed_once() as readers:
    tok = AutoTokenizer.from_pretrained(d, gguf_file="m.gguf")
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file="m.gguf",
                                                 dtype=torch.float32).eval()
  assert len(readers) == 1, readers      # the one file, parsed once
  out = {"prompts": json.dumps(PROMPTS), "new": new, "topk": topk}
  for i, msgs in enumerate(PROMPTS):
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False).input_ids
    with torch.no_grad():
      gen = model.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False,
                           pad_token_id=tok.eos_token_id)[0].tolist()
      logits = model(torch.tensor([gen])).logits[0].float()
    lp = torch.log_softmax(logits, -1)[len(ids) - 1:len(gen)].numpy()
    top = np.argsort(-lp, -1)[:, :topk]
    out[f"ids_{i}"] = np.array(gen, np.int32)
    out[f"plen_{i}"] = len(ids)
    out[f"top_{i}"] = top.astype(np.int32)
    out[f"toplp_{i}"] = np.take_along_axis(lp, top, -1).astype(np.float32)
  return out
