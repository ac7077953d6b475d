"""The serving engine's host time per decode step on /metrics: ``pask_step_launch_seconds``
(inside the jitted step calls), ``pask_step_join_seconds`` (waiting for the launch thread),
``pask_step_wait_seconds`` (waiting for the device) and ``pask_step_host_seconds`` are exported as
summaries and grow with the steps run, in the overlapped loop (with and without the launch
thread) and the serial loop."""
import functools

import pytest

from models import ModelConfig, gguf_io, random_model, registry
from models.tokenizer import Tokenizer
from pask_jax import policy as P
from serve.engine import Engine, Request
from serve.metrics import Metrics, parse

pytestmark = pytest.mark.fast_compile

CFG = ModelConfig(arch="llama", vocab_size=49152, hidden=64, intermediate=128, n_layers=2,
                  n_heads=4, n_kv_heads=2, head_dim=16, tie_embeddings=True)
PARTS = ("launch", "join", "wait", "host")


@functools.lru_cache(maxsize=None)
def engine(overlap: bool, thread: bool = False):
  tok = Tokenizer.from_gguf_metadata(gguf_io.read(registry.smollm2_path()).meta)
  pol = P.build(P.demo_entries(3), CFG, b_d=0.5, b_p=0.5, window=8, sink=2)
  return Engine(random_model(CFG, seed=0), tok, pol, slots=2, context=128, page=4,
                overlap=overlap, launch_thread=thread), tok


def scrape(m: Metrics) -> dict:
  text, ctype = m.render("text/plain")
  assert ctype.startswith("text/plain")
  return parse(text.decode())


@pytest.mark.parametrize("overlap,thread", [(True, False), (True, True), (False, False)])
def test_step_host_times_are_exported_and_grow_with_steps(overlap, thread):
  e, tok = engine(overlap, thread)
  assert e.overlap == overlap and e.step.threaded == thread
  m = Metrics(e)
  before = scrape(m)
  for p in PARTS:   # exported before any step, as summaries
    assert before[f"pask_step_{p}_seconds_count"] == before["pask_decode_steps_total"]
    assert f"pask_step_{p}_seconds_sum" in before
  done = []
  for i in range(3):
    ids = tok.encode(f"Say something about the number {i}.")
    r = Request(ids=ids, tags=None, max_tokens=6 + i)
    r.emit = lambda kind, payload: done.append(kind) if kind != "delta" else None
    e.submit(r)
  e.run_until_idle(max_iterations=500)
  assert done == ["done"] * 3
  after = scrape(m)
  steps = after["pask_decode_steps_total"] - before["pask_decode_steps_total"]
  assert steps >= 8   # the longest request's tokens after its first
  for p in PARTS:
    assert after[f"pask_step_{p}_seconds_count"] - before[f"pask_step_{p}_seconds_count"] == steps
    grew = after[f"pask_step_{p}_seconds_sum"] - before[f"pask_step_{p}_seconds_sum"]
    if p == "join" and not thread:   # only the launch thread is joined: next to nothing
      assert grew < 0.05, grew
    else:
      assert grew > 0, p
