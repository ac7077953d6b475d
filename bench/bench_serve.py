"""Bounded loopback load test of ``pask-jax serve`` (issue 7's acceptance).

Starts the server in-process on 127.0.0.1 (a free port; or targets ``--url``), then fires
``--requests`` requests from ``--concurrency`` client threads: ``--malformed`` of them malformed
(bad JSON, missing fields, max_tokens <= 0, an unknown tool in tool_choice), ``--disconnect`` of
them clients that hang up (mid-stream, or before a non-streamed answer), the rest valid (free
text, json_object, json_schema, tools; streamed or not).  Every call has a timeout.

Checks (exit status 1 if one fails): no 5xx at all, every malformed request got 400, every valid
one 200, the engine still healthy, and afterwards every page back in the pools (/metrics).
Prints one JSON line of numbers (``--out`` also writes it).

  python bench/bench_serve.py --requests 500 --concurrency 32 --max-tokens 8
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import random
import socket
import sys
import threading
import time

import httpx

WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}, "required": ["city"]}}}]
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}
PROMPTS = ["Hi!", "What is 3+5?", "Name a fruit.", "Say something nice.", "What is the capital "
           "of France?", "Tell me about the sea. " * 6]


def metrics(base: str) -> dict:
  from serve.metrics import parse
  return parse(httpx.get(base + "/metrics", timeout=10).text)


MODEL = "x"   # set from /v1/models at start


def one(base: str, i: int, a, rng: random.Random) -> dict:
  url = base + "/v1/chat/completions"
  r = rng.random()
  msgs = [{"role": "user", "content": rng.choice(PROMPTS)}]
  t0 = time.perf_counter()
  if r < a.malformed:
    bad = rng.choice([b'{"model": "x", "messages": [', b'{"model": "x"}', b"", json.dumps(
        {"model": MODEL, "messages": msgs, "max_tokens": 0}).encode(), json.dumps(
        {"model": MODEL, "messages": msgs, "tools": WEATHER,
         "tool_choice": {"type": "function", "function": {"name": "nope"}}}).encode()])
    s = httpx.post(url, content=bad, timeout=30,
                   headers={"content-type": "application/json"}).status_code
    return {"kind": "malformed", "status": s, "s": time.perf_counter() - t0}
  body = {"model": MODEL, "messages": msgs, "max_tokens": rng.randint(1, a.max_tokens),
          "seed": i, "temperature": rng.choice([0.0, 0.7])}
  kind = rng.choices(["text", "json_object", "json_schema", "tools"], [55, 15, 15, 15])[0]
  if kind == "json_object":
    body["response_format"] = {"type": "json_object"}
  elif kind == "json_schema":
    body["response_format"] = {"type": "json_schema", "json_schema": {"name": "a",
                                                                       "schema": SCHEMA}}
  elif kind == "tools":
    body.update(tools=WEATHER, messages=[{"role": "user", "content": "Weather in Paris?"}])
  if r < a.malformed + a.disconnect:
    if rng.random() < 0.7:   # mid-stream: read the first line or two, then hang up
      with httpx.stream("POST", url, json=dict(body, stream=True, max_tokens=a.max_tokens),
                        timeout=a.timeout) as resp:
        for _ in zip(range(rng.randint(1, 3)), resp.iter_lines()):
          pass
    else:                    # a non-streaming client that gives up
      try:
        httpx.post(url, json=body, timeout=rng.uniform(0.05, 0.5))
      except httpx.TimeoutException:
        pass
    return {"kind": "disconnect", "status": 0, "s": time.perf_counter() - t0}
  stream = rng.random() < 0.3
  if stream:
    toks, first = 0, None
    with httpx.stream("POST", url, json=dict(body, stream=True), timeout=a.timeout) as resp:
      status = resp.status_code
      for line in resp.iter_lines():
        if line.startswith("data: {"):
          c = json.loads(line[6:])
          d = (c.get("choices") or [{}])[0].get("delta") or {}
          if d.get("content") or d.get("tool_calls"):   # the first token's text, not the role
            first = first or time.perf_counter() - t0
          if c.get("usage"):
            toks = c["usage"]["completion_tokens"]
    return {"kind": kind, "status": status, "s": time.perf_counter() - t0, "tokens": toks,
            "stream": True, "ttft": first}
  resp = httpx.post(url, json=body, timeout=a.timeout)
  toks = resp.json()["usage"]["completion_tokens"] if resp.status_code == 200 else 0
  return {"kind": kind, "status": resp.status_code, "s": time.perf_counter() - t0, "tokens": toks}


def pct(xs, q):
  xs = sorted(xs)
  return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--url", default=None, help="target a running server instead of starting one")
  ap.add_argument("--requests", type=int, default=500)
  ap.add_argument("--concurrency", type=int, default=32)
  ap.add_argument("--malformed", type=float, default=0.2)
  ap.add_argument("--disconnect", type=float, default=0.1)
  ap.add_argument("--max-tokens", type=int, default=8)
  ap.add_argument("--timeout", type=float, default=300.0, help="per request, seconds")
  ap.add_argument("--model", default=None)
  ap.add_argument("--policy", default="all-high")
  ap.add_argument("--slots", type=int, default=8)
  ap.add_argument("--context", type=int, default=256)
  ap.add_argument("--hi-pages", type=int, default=None)
  ap.add_argument("--lo-pages", type=int, default=None)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--out", default=None)
  a = ap.parse_args(argv)

  server = None
  t_start = time.perf_counter()
  if a.url is None:
    from pask_jax import platform
    platform.pick()   # CPU unless this host has an accelerator (as the CLI does)
    import uvicorn
    from serve.app import build
    app, engine = build(a.model, a.policy, slots=a.slots, context=a.context,
                        hi_pages=a.hi_pages, lo_pages=a.lo_pages, default_max_tokens=a.max_tokens)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    for _ in range(600):
      if server.started:
        break
      time.sleep(0.05)
    base = f"http://127.0.0.1:{sock.getsockname()[1]}"
  else:
    base = a.url.rstrip("/")
  startup_s = time.perf_counter() - t_start
  global MODEL
  MODEL = httpx.get(base + "/v1/models", timeout=10).json()["data"][0]["id"]
  before = metrics(base)
  rng = random.Random(a.seed)
  seeds = [random.Random(rng.random()) for _ in range(a.requests)]
  t0 = time.perf_counter()
  with cf.ThreadPoolExecutor(a.concurrency) as ex:
    res = list(ex.map(lambda x: one(base, x[0], a, x[1]), enumerate(seeds)))
  wall = time.perf_counter() - t0
  # Cancellations are reaped at the engine's next iteration: wait (bounded) until idle.
  for _ in range(600):
    m = metrics(base)
    if m["pask_running"] == 0 and m["pask_queue_depth"] == 0:
      break
    time.sleep(0.1)
  d = lambda k: m.get(k, 0) - before.get(k, 0)
  valid = [r for r in res if r["kind"] not in ("malformed", "disconnect")]
  ok = [r for r in valid if r["status"] == 200]
  tokens = sum(r.get("tokens", 0) for r in ok)
  health = httpx.get(base + "/health", timeout=10).status_code
  out = {
      "requests": len(res), "concurrency": a.concurrency, "max_tokens": a.max_tokens,
      "policy": a.policy, "slots": a.slots, "context": a.context, "startup_s": round(startup_s, 1),
      "wall_s": round(wall, 1), "requests_per_s": round(len(res) / wall, 2),
      "valid": len(valid), "valid_200": len(ok),
      "malformed": sum(r["kind"] == "malformed" for r in res),
      "malformed_400": sum(r["kind"] == "malformed" and r["status"] == 400 for r in res),
      "disconnecting_clients": sum(r["kind"] == "disconnect" for r in res),
      "status_5xx": sum(r["status"] >= 500 for r in res),
      "completion_tokens": tokens, "tokens_per_s": round(tokens / wall, 1),
      "latency_p50_s": round(pct([r["s"] for r in ok], 0.5), 2),
      "latency_p95_s": round(pct([r["s"] for r in ok], 0.95), 2),
      "ttft_p50_s": (round(pct([r["ttft"] for r in ok if r.get("ttft")], 0.5), 2)
                     if any(r.get("ttft") for r in ok) else None),
      "tpot_ms_mean": round(1e3 * d("pask_time_per_output_token_seconds_sum")
                            / max(1, d("pask_time_per_output_token_seconds_count")), 1),
      "decode_step_ms_mean": round(1e3 * d("pask_decode_step_seconds_total")
                                   / max(1, d("pask_decode_steps_total")), 1),
      "mean_active_rows": round(
          d("pask_decode_rows_total") / max(1, d("pask_decode_steps_total")), 2),
      "engine_cancelled": int(d('pask_requests_total{outcome="cancelled"}')),
      "engine_errors": int(d('pask_requests_total{outcome="error"}')),
      "server_disconnects_seen": int(d("pask_client_disconnects_total")),
      "admission_blocked_pages": int(d("pask_admission_blocked_total")),
      "measured_B": m.get("pask_measured_b"),
      "pages_used_after": {p: m[f'pask_pages_total{{pool="{p}"}}']
                           - m[f'pask_pages_free{{pool="{p}"}}'] for p in ("bf16", "int4")},
      "pages_free_after": {p: m[f'pask_pages_free{{pool="{p}"}}'] for p in ("bf16", "int4")},
      "health_after": health,
  }
  if server is not None:
    out["decode_step_compiles"] = engine.runner.traces["step"]
  checks = {"no_5xx": out["status_5xx"] == 0,
            "malformed_all_400": out["malformed_400"] == out["malformed"],
            "valid_all_200": out["valid_200"] == out["valid"],
            "pages_back": out["pages_used_after"] == {"bf16": 0, "int4": 0},
            "healthy": health == 200, "no_engine_errors": out["engine_errors"] == 0}
  out["checks"] = checks
  line = json.dumps(out)
  print(line)
  if a.out:
    with open(a.out, "w") as f:
      f.write(line + "\n")
  if server is not None:
    server.should_exit = True
    engine.stop()
  return 0 if all(checks.values()) else 1


if __name__ == "__main__":
  sys.exit(main())
