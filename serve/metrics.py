"""``/metrics`` through ``prometheus_client``: request histograms and PASK's engine gauges.

One registry per app (not the process-global one: tests and benchmarks start several apps).

* Histograms, observed by the app when a request finishes (vLLM's names, ``pask_`` prefix):
  ``pask_time_to_first_token_seconds`` (arrival -> first token), ``pask_time_per_output_token_
  seconds`` (per request mean after the first), ``pask_e2e_request_latency_seconds`` (arrival ->
  answer), ``pask_request_queue_time_seconds`` (engine submit -> admission: slot and pages).
* HTTP outcomes: ``pask_http_requests_total{code}`` (chat completions by status class),
  ``pask_client_disconnects_total``.
* Engine state read at scrape time by a custom collector (the engine thread owns the numbers):
  queue depth, running, slots, pages free / total per pool (label ``pool`` = bf16 | int4),
  measured B of the finished requests (payload / Full-KV payload, aggregate), request outcomes,
  tokens, decode steps, R/L/H actions, cache overflows, grammar-compile pool state, engine up.
* Host time per decode step, from the engine's own step timers (``fill_s``, ``dispatch_s``,
  ``join_s``, ``wait_s``, ``accept_s``, ``alloc_s``: what ``bench/bench_serving.py`` reports), as
  summaries (``_count`` = decode steps, ``_sum`` = seconds): ``pask_step_launch_seconds``
  (inside the jitted step calls until they return: the launch, argument transfers included),
  ``pask_step_join_seconds`` (waiting for a forward launched on the launch thread to have been
  launched: what the thread did not hide; 0 without it),
  ``pask_step_wait_seconds`` (waiting for the device's tokens: a device-busy proxy; with the
  overlapped loop only what the host work did not hide) and ``pask_step_host_seconds`` (the
  host's own work: masks, page bookkeeping, accepting tokens).

* vLLM's names for the main ones, so that a dashboard or alert written for ``vllm serve`` reads
  this server (labelled ``model_name``, the first served name, as vLLM labels them):
  ``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc`` (the
  fuller of the two page pools, 0..1), ``vllm:prompt_tokens_total``,
  ``vllm:generation_tokens_total``, ``vllm:request_success_total{finished_reason}`` (stop,
  length; abort = cancelled), ``vllm:num_preemptions_total``, and the histograms
  ``vllm:time_to_first_token_seconds``, ``vllm:time_per_output_token_seconds``,
  ``vllm:e2e_request_latency_seconds``, ``vllm:request_queue_time_seconds`` (the same samples as
  the ``pask_`` ones).  :data:`VLLM_ALIASES` is the mapping.

Both exposition formats are served (``Accept: application/openmetrics-text`` picks OpenMetrics),
and both of prometheus_client's parsers read them (tests/test_serve_openai.py).
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily, Metric,
                                   SummaryMetricFamily)
from prometheus_client.exposition import choose_encoder

from pask_jax import actions as Act

_LAT = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
        20.0, 40.0, 80.0, 160.0, 640.0)
_TPOT = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
         0.75, 1.0, 2.5, 5.0, 10.0)


class _EngineCollector:
  def __init__(self, engine, grammars=None):
    self.engine, self.grammars = engine, grammars

  def describe(self):
    return []

  def collect(self):
    s = self.engine.snapshot()
    g = lambda k: float(s.get(k, 0))

    def gauge(name, doc, value=None, labels=None, samples=()):
      m = GaugeMetricFamily(f"pask_{name}", doc, value=value, labels=labels)
      for lab, v in samples:
        m.add_metric(lab, v)
      return m

    def counter(name, doc, value=None, labels=None, samples=()):
      m = CounterMetricFamily(f"pask_{name}", doc, value=value, labels=labels)
      for lab, v in samples:
        m.add_metric(lab, v)
      return m

    yield gauge("queue_depth", "requests waiting for a slot and pages", g("queue_depth"))
    yield gauge("running", "requests holding a decode slot", g("running"))
    yield gauge("slots", "decode batch slots", g("slots"))
    yield gauge("engine_up", "1 while the engine thread runs", float(self.engine.alive))
    pools = (("bf16", "hi"), ("int4", "lo"))
    yield gauge("pages_free", "KV pages free per pool", labels=["pool"],
                samples=[([p], g(k + "_free")) for p, k in pools])
    yield gauge("pages_total", "KV pages per pool", labels=["pool"],
                samples=[([p], g(k + "_total")) for p, k in pools])
    full = g("full_kv_bits")
    yield gauge("measured_b", "aggregate measured B of finished requests: scheduled KV payload "
                "over the Full-KV payload of the same lengths (NaN before the first)",
                g("payload_bits") / full if full else float("nan"))
    yield counter("requests", "requests finished by the engine, by outcome", labels=["outcome"],
                  samples=[([o], g("requests_" + o)) for o in
                           ("stop", "length", "cancelled", "error")])
    yield counter("prompt_tokens", "prompt tokens of finished requests", g("prompt_tokens"))
    yield counter("generation_tokens", "generated tokens of finished requests",
                  g("completion_tokens"))
    yield counter("decode_steps", "batched decode steps", g("decode_steps"))
    yield counter("decode_step_seconds", "time in decode steps", g("decode_step_s"))
    steps = g("decode_steps")
    yield SummaryMetricFamily("pask_step_launch_seconds", "host time inside the jitted decode "
                              "step calls until they return (launch), per step",
                              count_value=steps, sum_value=g("dispatch_s"))
    yield SummaryMetricFamily("pask_step_join_seconds", "host time waiting for the forward's "
                              "launch on the launch thread to end, per step", count_value=steps,
                              sum_value=g("join_s"))
    yield SummaryMetricFamily("pask_step_wait_seconds", "host time waiting for the device's "
                              "tokens (device busy proxy), per step", count_value=steps,
                              sum_value=g("wait_s"))
    yield SummaryMetricFamily("pask_step_host_seconds", "host work of a decode step (masks, "
                              "pages, accepting tokens), per step", count_value=steps,
                              sum_value=g("fill_s") + g("alloc_s") + g("accept_s"))
    yield counter("decode_rows", "active rows summed over decode steps", g("decode_rows"))
    yield counter("prefill_seconds", "time in prefills", g("prefill_s"))
    yield counter("admission_blocked", "engine iterations where the queue head waited for pages "
                  "while a slot was free", g("admission_blocked_pages"))
    yield counter("preemptions", "running requests preempted because a KV pool ran dry "
                  "(resumed later)", g("preemptions"))
    yield counter("kv_payload_bits", "scheduled KV payload of finished requests",
                  g("payload_bits"))
    yield counter("kv_full_bits", "Full-KV payload for the same lengths", full)
    yield counter("actions", "R/L/H actions over prompt and decode tokens and layer groups",
                  labels=["action"], samples=[([a], g("actions_" + a)) for a in Act.NAMES])
    yield counter("cache_overflows", "requests whose cache dropped an entry (should be 0)",
                  g("overflow"))
    if self.grammars is not None:
      p = self.grammars.snapshot()
      yield counter("grammar_compiles", "grammar compilations by result", labels=["result"],
                    samples=[([k], float(p[k])) for k in ("hits", "misses", "failures",
                                                          "timeouts", "busy")])
      yield gauge("grammar_cache_bytes", "bytes of compiled grammars cached",
                  float(p["cached_bytes"]))
      yield gauge("grammar_compiling", "compile jobs started and not finished (waiting or "
                  "running; a job outlives a client that left)", float(p["compiling"]))
      yield gauge("grammar_queue", "compile jobs waiting per lane", labels=["lane"],
                  samples=[([ln], float(p["queued_" + ln])) for ln in ("small", "large")])


# vLLM's name -> what it reads here (README's serving table repeats it).
VLLM_ALIASES = {
    "vllm:num_requests_running": "pask_running",
    "vllm:num_requests_waiting": "pask_queue_depth",
    "vllm:kv_cache_usage_perc": "1 - pask_pages_free / pask_pages_total of the fuller pool",
    "vllm:prompt_tokens_total": "pask_prompt_tokens_total",
    "vllm:generation_tokens_total": "pask_generation_tokens_total",
    "vllm:request_success_total": "pask_requests_total (outcome stop, length; cancelled as "
                                  "finished_reason abort)",
    "vllm:num_preemptions_total": "pask_preemptions_total",
    "vllm:time_to_first_token_seconds": "pask_time_to_first_token_seconds",
    "vllm:time_per_output_token_seconds": "pask_time_per_output_token_seconds",
    "vllm:e2e_request_latency_seconds": "pask_e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds": "pask_request_queue_time_seconds",
}


class _VllmCollector:
  """The :data:`VLLM_ALIASES` families, read at scrape time from the engine's snapshot and the
  app's histograms (copied sample by sample under vLLM's name, with the ``model_name`` label)."""

  def __init__(self, engine, histograms, model_name: str):
    self.engine, self.histograms, self.model = engine, histograms, model_name

  def describe(self):
    return []

  def collect(self):
    s = self.engine.snapshot()
    g = lambda k: float(s.get(k, 0))
    lab = ["model_name"]
    for name, doc, v in (("num_requests_running", "requests holding a decode slot", g("running")),
                         ("num_requests_waiting", "requests waiting for a slot and pages",
                          g("queue_depth"))):
      yield _gauge(f"vllm:{name}", doc, self.model, v)
    use = [1 - g(p + "_free") / g(p + "_total") for p in ("hi", "lo") if g(p + "_total") > 0]
    yield _gauge("vllm:kv_cache_usage_perc", "KV cache usage, 0..1 (the fuller page pool)",
                 self.model, max(use, default=0.0))
    for name, doc, key in (("prompt_tokens", "prompt tokens of finished requests",
                            "prompt_tokens"),
                           ("generation_tokens", "generated tokens of finished requests",
                            "completion_tokens"),
                           ("num_preemptions", "running requests preempted", "preemptions")):
      c = CounterMetricFamily(f"vllm:{name}", doc, labels=lab)
      c.add_metric([self.model], g(key))
      yield c
    c = CounterMetricFamily("vllm:request_success", "finished requests by finish reason",
                            labels=lab + ["finished_reason"])
    for reason, outcome in (("stop", "stop"), ("length", "length"), ("abort", "cancelled")):
      c.add_metric([self.model, reason], g("requests_" + outcome))
    yield c
    for h in self.histograms:
      for fam in h.collect():
        out = Metric("vllm:" + fam.name[len("pask_"):], fam.documentation, fam.type)
        for smp in fam.samples:
          out.add_sample("vllm:" + smp.name[len("pask_"):],
                         {"model_name": self.model, **smp.labels}, smp.value, smp.timestamp)
        yield out


def _gauge(name: str, doc: str, model: str, value: float) -> GaugeMetricFamily:
  m = GaugeMetricFamily(name, doc, labels=["model_name"])
  m.add_metric([model], value)
  return m


class Metrics:
  def __init__(self, engine, grammars=None, model_name: str = "pask-jax"):
    self.registry = CollectorRegistry(auto_describe=True)
    r = self.registry
    self.ttft = Histogram("pask_time_to_first_token_seconds", "request arrival to first token",
                          buckets=_LAT, registry=r)
    self.tpot = Histogram("pask_time_per_output_token_seconds",
                          "mean time per output token after the first, per request",
                          buckets=_TPOT, registry=r)
    self.e2e = Histogram("pask_e2e_request_latency_seconds", "request arrival to answer",
                         buckets=_LAT, registry=r)
    self.queue = Histogram("pask_request_queue_time_seconds",
                           "engine submit to admission (a slot and the pages)", buckets=_LAT,
                           registry=r)
    self.http = Counter("pask_http_requests", "chat completion requests by HTTP status",
                        ["code"], registry=r)
    self.disconnects = Counter("pask_client_disconnects", "clients gone before their answer",
                               registry=r)
    r.register(_EngineCollector(engine, grammars))
    r.register(_VllmCollector(engine, (self.ttft, self.tpot, self.e2e, self.queue), model_name))

  def render(self, accept: str) -> tuple[bytes, str]:
    encoder, ctype = choose_encoder(accept or "")
    return encoder(self.registry), ctype


def parse(text: str) -> dict[str, float]:
  """Prometheus text (as ``GET /metrics`` serves it) -> ``{'name{label="v",...}': value}``, read
  with prometheus_client's own parser (tests, benchmarks)."""
  from prometheus_client.parser import text_string_to_metric_families
  out = {}
  for fam in text_string_to_metric_families(text):
    for s in fam.samples:
      lab = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
      out[s.name + (f"{{{lab}}}" if lab else "")] = s.value
  return out
