"""/metrics under vLLM's names (serve.metrics.VLLM_ALIASES): each alias reads the same number as
its ``pask_`` metric, labelled model_name, in both exposition formats.  No model: a fake engine."""
import numpy as np
from prometheus_client.openmetrics.parser import text_string_to_metric_families as om_parse
from prometheus_client.parser import text_string_to_metric_families as text_parse

from serve.metrics import VLLM_ALIASES, Metrics, parse

RNG = np.random.default_rng()


class FakeEngine:
  alive = True

  def __init__(self, snap):
    self.snap = snap

  def snapshot(self):
    return dict(self.snap)


def test_vllm_aliases_read_the_pask_numbers():
  r = lambda hi: int(RNG.integers(1, hi))
  snap = {"running": r(9), "queue_depth": r(9), "hi_total": 64, "hi_free": r(64),
          "lo_total": 128, "lo_free": r(128), "prompt_tokens": r(10_000),
          "completion_tokens": r(10_000), "preemptions": r(5), "requests_stop": r(50),
          "requests_length": r(50), "requests_cancelled": r(50), "requests_error": r(5)}
  m = Metrics(FakeEngine(snap), model_name="my-model")
  ttft = RNG.uniform(0.01, 3.0, size=int(RNG.integers(2, 9)))
  for t in ttft:
    m.ttft.observe(float(t))
  m.queue.observe(0.2)
  body, ctype = m.render("")
  got = parse(body.decode())
  lab = 'model_name="my-model"'
  assert got[f"vllm:num_requests_running{{{lab}}}"] == got["pask_running"] == snap["running"]
  assert got[f"vllm:num_requests_waiting{{{lab}}}"] == snap["queue_depth"]
  use = max(1 - snap["hi_free"] / 64, 1 - snap["lo_free"] / 128)
  assert abs(got[f"vllm:kv_cache_usage_perc{{{lab}}}"] - use) < 1e-12
  assert got[f"vllm:prompt_tokens_total{{{lab}}}"] == got["pask_prompt_tokens_total"]
  assert got[f"vllm:generation_tokens_total{{{lab}}}"] == snap["completion_tokens"]
  assert got[f"vllm:num_preemptions_total{{{lab}}}"] == snap["preemptions"]
  for reason, key in (("abort", "cancelled"), ("length", "length"), ("stop", "stop")):
    assert got[f'vllm:request_success_total{{finished_reason="{reason}",{lab}}}'] == \
        snap["requests_" + key]
  assert got[f"vllm:time_to_first_token_seconds_count{{{lab}}}"] == len(ttft)
  assert abs(got[f"vllm:time_to_first_token_seconds_sum{{{lab}}}"] - ttft.sum()) < 1e-9
  for k, v in got.items():   # every bucket equals the pask_ histogram's
    if k.startswith("vllm:time_to_first_token_seconds_bucket"):
      le = k.split("le=")[1].split(",")[0].rstrip("}")
      assert v == got[f"pask_time_to_first_token_seconds_bucket{{le={le}}}"]
  assert got[f"vllm:request_queue_time_seconds_count{{{lab}}}"] == 1
  names = {f.name for f in text_parse(body.decode())}
  for alias in VLLM_ALIASES:     # every documented alias is served
    assert alias.removesuffix("_total") in names, alias
  om, _ = m.render("application/openmetrics-text; version=1.0.0")
  assert {f.name for f in om_parse(om.decode())} >= {a.removesuffix("_total") for a in
                                                      VLLM_ALIASES}


def test_empty_pools_and_default_name():
  m = Metrics(FakeEngine({}))
  got = parse(m.render("")[0].decode())
  assert got['vllm:kv_cache_usage_perc{model_name="pask-jax"}'] == 0.0
  assert got['vllm:num_requests_running{model_name="pask-jax"}'] == 0.0
