"""Loopback soak of ``pask-jax serve`` under hostile traffic (issue 16's deliverable 4).

Starts ``python -m pask_jax.cli serve`` as a subprocess on 127.0.0.1 (a free port; its stderr
goes to ``OUT/server.log``), then:

1. **idle**: ``--idle`` valid small requests one after another (the probe: a short chat
   message, ``--max-tokens`` tokens) — their latency on an otherwise idle server, in
   ``--windows`` + 1 idle windows: before the soak, between its stretches and after it (on a
   shared machine the speed drifts over a run; the idle probes see the same drift as the
   soak's); **control**: ``--control`` probes
   beside the soak's valid load alone (``--valid-inflight`` valid requests), which separates
   what valid requests cost each other (their prefills run between the probe's decode steps)
   from what the rest of the traffic adds;
2. **soak**: ``--requests`` requests (>= 2,000) from ``--concurrency`` (32) workers over
   keep-alive connections, in ``--windows`` stretches of equal count (each drains before the
   next idle window), stopping by itself at ``--max-seconds``.  One worker sends only
   probes; the others draw from a seeded mix: valid requests (free text, json_schema, a
   json_schema with ``$defs``/``$ref``, streams, stop, logprobs; with ``--with-tools`` also tools
   in auto/required/named mode and a ``$ref`` tool schema), malformed ones (bad
   JSON, wrong types, unknown fields, wrong model, bad routes/methods), hostile ones (nesting
   bombs, bracket floods, a 400 KB ``{x`` prompt, huge enums, wide schemas, unsatisfiable and
   dangling-$ref schemas, lone surrogates, oversized bodies) and clients that disconnect
   (mid-stream, or before a non-streamed answer).  At most ``--valid-inflight`` of the mixed
   requests that reach the engine (:data:`ENGINE_BOUND`) are in flight at once: the engine's
   slots are not all taken by other requests, so what the probe measures is the interference of
   the rest of the traffic (HTTP handling, validation, grammar compilation, prompt labelling,
   the other requests' prefills) with its decoding;
3. waits until the engine is idle and reads ``/metrics`` and ``/health``.

Reports (one JSON object, ``OUT/result.json``): status codes per kind, responses >= 500,
connection resets (a request that got no response although its client did not hang up on
purpose), probe p50/p99 idle vs. during the soak and their ratio, pages leaked per pool, engine
errors (request outcome "error"), tracebacks in the server log, wall time.  Exit status 1 when a
goal fails: no 5xx, no resets, no leaked pages, no engine errors, probe p99 <= 2x idle.

  python bench/bench_soak.py --requests 2000 --concurrency 32 --max-tokens 4 \\
      --out bench/results/DATE_soak
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import datetime
import json
import os
import random
import socket
import subprocess
import sys
import time

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAME = "soak"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 12}},
                                                "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"enum": ["UTC", "CET", "PST"]}}, "required": ["tz"]}}}
REF_TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "$defs": {"Id": {"type": "integer", "minimum": 0, "maximum": 999}},
    "properties": {"id": {"$ref": "#/$defs/Id"}, "next": {"$ref": "#"}}, "required": ["id"]}}}
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["ok", "n"], "additionalProperties": False}
PROBE = [{"role": "user", "content": "Say hi."}]
# Kinds whose requests reach the engine (valid ones, hostile ones that are valid after all, and
# disconnecting clients, which decode until they hang up): at most --valid-inflight at once.
ENGINE_BOUND = ("valid:", "disconnect:", "hostile:flood_fits", "hostile:wide_schema",
                "hostile:huge_enum", "hostile:deep_schema")
PROMPTS = ["Hi!", "What is 3+5?", "Name a fruit.", "Say something nice.", "Capital of France?"]


def pct(xs, q):
  xs = sorted(xs)
  return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None


def ratio(soak, idle, q):
  a, b = pct(soak, q), pct(idle, q)
  return round(a / b, 3) if a and b else None


def interval(soak, idle, q, n=2000, seed=0):
  """5th and 95th percentiles of ``ratio`` over bootstrap resamples of both samples."""
  if not soak or not idle:
    return None
  rng = random.Random(seed)
  rs = sorted(pct(rng.choices(soak, k=len(soak)), q) / pct(rng.choices(idle, k=len(idle)), q)
              for _ in range(n))
  return [round(rs[int(0.05 * n)], 3), round(rs[int(0.95 * n)], 3)]


def body(messages, **kw):
  return {"model": NAME, "messages": messages, **kw}


def nest(depth: int) -> dict:
  s = {"type": "string"}
  for _ in range(depth):
    s = {"type": "object", "properties": {"a": s}, "required": ["a"]}
  return s


MIX = {"valid": 30, "malformed": 25, "hostile": 35, "disconnect": 10}


REF_SCHEMA = {"type": "object", "$defs": {"Flag": {"type": "boolean"}},
              "properties": {"ok": {"$ref": "#/$defs/Flag"}, "more": {"$ref": "#"}},
              "required": ["ok"]}
VALID = ("text", "json", "json_ref", "stream", "stop", "logprobs")
TOOLS = ("tools_auto", "tools_required", "tools_named", "ref_tool")


def mixed(rng: random.Random, i: int, mt: int, mix: dict = MIX, tools: bool = False):
  """(kind, method, path, json-or-bytes, stream, client timeout) of the i-th mixed request."""
  msg = [{"role": "user", "content": rng.choice(PROMPTS)}]
  k = rng.choices(list(mix), list(mix.values()))[0]
  P = "/v1/chat/completions"
  if k == "valid":
    v = rng.choice(VALID + (TOOLS if tools else ()))
    b = body(msg, max_tokens=rng.randint(1, mt), seed=i, temperature=rng.choice([0, 0.7]))
    if v in ("json", "json_ref"):
      b["response_format"] = {"type": "json_schema", "json_schema": {
          "name": "s", "schema": SCHEMA if v == "json" else REF_SCHEMA}}
    elif v.startswith("tools"):
      b.update(tools=[WEATHER, TIME], max_tokens=3 * mt,
               messages=[{"role": "user", "content": "Weather in Paris?"}])
      if v == "tools_required":
        b["tool_choice"] = "required"
      elif v == "tools_named":
        b["tool_choice"] = {"type": "function", "function": {"name": "get_time"}}
    elif v == "ref_tool":
      b.update(tools=[REF_TOOL], tool_choice="required", max_tokens=3 * mt)
    elif v == "stop":
      b["stop"] = [" ", "!"]
    elif v == "logprobs":
      b.update(logprobs=True, top_logprobs=3)
    return "valid:" + v, "POST", P, b, v == "stream", 300
  if k == "malformed":
    v = rng.choice(["bad_json", "no_messages", "bad_type", "unknown_field", "wrong_model",
                    "bad_route", "bad_method", "max_tokens_0", "bad_role", "unknown_tool"])
    payload = {
        "bad_json": b'{"model": "soak", "messages": [',
        "no_messages": body(None) | {"messages": None},
        "bad_type": body(msg, max_tokens="5"),
        "unknown_field": body(msg, top_k=5),
        "wrong_model": {"model": "gpt-4o", "messages": msg},
        "bad_route": body(msg), "bad_method": None,
        "max_tokens_0": body(msg, max_tokens=0),
        "bad_role": body([{"role": "wizard", "content": "x"}]),
        "unknown_tool": body(msg, tools=[WEATHER], tool_choice={"type": "function",
                                                                "function": {"name": "no"}}),
    }[v]
    method, path = ("GET", P) if v == "bad_method" else ("POST", "/v1/completion") \
        if v == "bad_route" else ("POST", P)
    return "malformed:" + v, method, path, payload, False, 60
  if k == "hostile":
    v = rng.choice(["nest_bomb", "bracket_flood", "brace_prompt", "huge_enum", "wide_schema",
                    "unsat", "dangling_ref", "surrogate", "oversized", "deep_schema",
                    "flood_fits"])
    if v == "nest_bomb":
      d = rng.choice([1000, 5000, 20000])
      p = (b'{"model": "soak", "messages": ' + b"[" * d + b"]" * d + b"}")
    elif v == "bracket_flood":
      p = body([{"role": "user", "content": rng.choice(["[", "{", "[{"]) * rng.choice(
          [1000, 5000])}], max_tokens=2)
    elif v == "flood_fits":
      p = body([{"role": "user", "content": "[" * 12 + '{"a": ' * 4}], max_tokens=2)
    elif v == "brace_prompt":
      p = body([{"role": "user", "content": "{x" * 200_000}], max_tokens=2)
    elif v == "huge_enum":
      n = rng.choice([20_000, 20_001, 20_002])   # three distinct schemas, then cached
      p = body(msg, max_tokens=2, response_format={"type": "json_schema", "json_schema": {
          "name": "e", "schema": {"enum": [f"value_{j}" for j in range(n)]}}})
    elif v == "wide_schema":
      n = rng.choice([600, 800])
      p = body(msg, max_tokens=2, response_format={"type": "json_schema", "json_schema": {
          "name": "w", "schema": {"type": "object", "properties": {
              f"p{j}": {"type": "string"} for j in range(n)}}}})
    elif v == "unsat":
      s = rng.choice([{"not": {}}, {"allOf": [{"type": "string"}, {"type": "integer"}]},
                      {"type": "object", "required": ["a"], "additionalProperties": False}])
      p = body(msg, response_format={"type": "json_schema", "json_schema": {"name": "u",
                                                                            "schema": s}})
    elif v == "dangling_ref":
      p = body(msg, tools=[{"type": "function", "function": {"name": "f", "parameters": {
          "type": "object", "properties": {"x": {"$ref": "#/properties/name"}}}}}])
    elif v == "surrogate":
      p = b'{"model": "soak", "messages": [{"role": "user", "content": "\\ud800 hi"}]}'
    elif v == "oversized":
      p = b'{"model": "soak", "messages": "' + b"a" * (3 << 20) + b'"}'
    else:
      p = body(msg, response_format={"type": "json_schema", "json_schema": {
          "name": "d", "schema": nest(rng.choice([40, 150]))}})
    return "hostile:" + v, "POST", P, p, False, 300
  v = rng.choice(["mid_stream", "before_answer"])
  b = body(msg, max_tokens=mt, seed=i)
  return "disconnect:" + v, "POST", P, b, v == "mid_stream", rng.uniform(0.05, 0.4)


async def send(cl: httpx.AsyncClient, base, kind, method, path, payload, stream, timeout):
  """-> record {kind, status, s, error}; status 0 for a client that hung up on purpose."""
  t0 = time.perf_counter()
  kw = {"timeout": timeout}
  if isinstance(payload, bytes):
    kw.update(content=payload, headers={"content-type": "application/json"})
  elif payload is not None:
    kw["json"] = payload
  rec = {"kind": kind, "status": None, "error": None}
  try:
    if stream:
      async with cl.stream(method, base + path, **kw) as r:
        rec["status"] = r.status_code
        n = 0
        async for line in r.aiter_lines():
          n += 1
          if kind.startswith("disconnect") and n >= 2:
            rec["status"] = 0
            break
    else:
      r = await cl.request(method, base + path, **kw)
      rec["status"] = r.status_code
      if r.status_code >= 400:
        e = r.json().get("error") or {}
        if not (e.get("message") and "type" in e):
          rec["error"] = "non-OpenAI error body"
  except httpx.TimeoutException:
    if kind.startswith("disconnect"):
      rec["status"] = 0
    else:
      rec["error"] = "timeout"
  except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError, httpx.ConnectError) as e:
    rec["error"] = "reset:" + type(e).__name__
  rec["s"] = time.perf_counter() - t0
  rec["t0"] = t0
  return rec


def start_server(a, out: str) -> tuple[subprocess.Popen, str]:
  sock = socket.socket()
  sock.bind(("127.0.0.1", 0))
  port = sock.getsockname()[1]
  sock.close()
  cmd = [sys.executable, "-m", "pask_jax.cli", "serve", "--policy", a.policy, "--slots",
         str(a.slots), "--context", str(a.context), "--port", str(port), "--served-model-name",
         NAME, "--default-max-tokens", str(a.max_tokens), "--log-level", "warning",
         "--prefill-chunk", str(a.prefill_chunk), "--prefill-share", str(a.prefill_share)]
  if a.model:
    cmd += ["--model", a.model]
  log = open(os.path.join(out, "server.log"), "w")
  # ``-m`` from the repository root runs this checkout's code (the working directory comes first).
  proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
  base = f"http://127.0.0.1:{port}"
  t0 = time.time()
  while time.time() - t0 < 600:
    if proc.poll() is not None:
      raise SystemExit(f"the server exited ({proc.returncode}); see {out}/server.log")
    try:
      if httpx.get(base + "/health", timeout=2).status_code == 200:
        return proc, base
    except httpx.HTTPError:
      pass
    time.sleep(1)
  proc.kill()
  raise SystemExit("the server did not start within 600 s")


def scrape(base: str) -> dict:
  from serve.metrics import parse
  return parse(httpx.get(base + "/metrics", timeout=30).text)


async def soak(a, base: str) -> dict:
  limits = httpx.Limits(max_connections=a.concurrency + 2,
                        max_keepalive_connections=a.concurrency + 2)
  async with httpx.AsyncClient(limits=limits) as cl:
    # warm-up: compile the prefill buckets and the small schemas once (not measured)
    for _ in range(3):
      await send(cl, base, "warmup", "POST", "/v1/chat/completions",
                 body(PROBE, max_tokens=a.max_tokens), False, 300)
    extra: list[dict] = []   # the idle and control probes' records (requests.jsonl)

    async def probe(kind="idle"):
      r = await send(cl, base, kind, "POST", "/v1/chat/completions",
                     body(PROBE, max_tokens=a.max_tokens), False, 300)
      assert r["status"] == 200, r
      extra.append(r)
      return r["s"]

    async def idle_window(n):
      for _ in range(1200):   # idle first: nothing running or queued (cancellations reaped)
        m = scrape(base)      # and no grammar compiling (one outlives a client that left)
        if m["pask_running"] == 0 and m["pask_queue_depth"] == 0 and \
            m.get("pask_grammar_compiling", 0) == 0:
          break
        await asyncio.sleep(0.1)
      return [await probe() for _ in range(n)]

    # The idle probes are spread over windows between stretches of the soak, so that they see
    # the same machine as the soak's probes (on a shared machine the idle p99 of 50 probes
    # before and 50 after ranged 0.65-0.96 s between runs): --windows stretches, an idle
    # window before each and after the last.
    W = max(1, a.windows)
    per = [a.idle // (W + 1) + (1 if w < a.idle % (W + 1) else 0) for w in range(W + 1)]
    idle = [await idle_window(per[0])]
    # control: the same engine-bound valid load as the soak, without the rest of its traffic
    crng = random.Random(a.seed + 1)
    control: list[float] = []
    busy = True

    async def background():
      while busy:
        job = mixed(crng, 0, a.max_tokens, {"valid": 1}, a.with_tools)
        await send(cl, base, *job)

    bg = [asyncio.ensure_future(background()) for _ in range(a.valid_inflight)]
    for _ in range(a.control):
      control.append(await probe("control"))
    busy = False
    await asyncio.gather(*bg)
    rng = random.Random(a.seed)
    mix = {k: float(v) for k, v in (x.split("=") for x in a.mix.split(","))}
    plan = [mixed(rng, i, a.max_tokens, mix, a.with_tools) for i in range(a.requests)]
    recs: list[dict] = []
    probes: list[float] = []
    deadline = time.perf_counter() + a.max_seconds
    valid_sem = asyncio.Semaphore(a.valid_inflight)
    wall = 0.0
    for w in range(W):
      seg = plan[w * len(plan) // W:(w + 1) * len(plan) // W]
      it = iter(seg)
      left = [len(seg)]
      t0 = time.perf_counter()

      async def worker():
        for job in it:
          if time.perf_counter() > deadline:
            return
          if job[0].startswith(ENGINE_BOUND):
            async with valid_sem:
              recs.append(await send(cl, base, *job))
          else:
            recs.append(await send(cl, base, *job))
          left[0] -= 1

      async def prober():
        while time.perf_counter() < deadline and left[0] > 0:
          r = await send(cl, base, "probe", "POST", "/v1/chat/completions",
                         body(PROBE, max_tokens=a.max_tokens), False, 300)
          recs.append(r)
          if r["status"] == 200:
            probes.append(r["s"])

      await asyncio.gather(prober(), *[worker() for _ in range(a.concurrency - 1)])
      wall += time.perf_counter() - t0
      idle.append(await idle_window(per[w + 1]))
  return {"recs": recs, "idle": [x for w in idle for x in w], "idle_windows": idle,
          "control": control, "probes": probes, "wall": wall, "extra": extra}


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--requests", type=int, default=2000, help="mixed requests (the probe's extra)")
  ap.add_argument("--concurrency", type=int, default=32)
  ap.add_argument("--valid-inflight", type=int, default=1,
                  help="mixed valid requests in flight at most (see the module docstring)")
  ap.add_argument("--idle", type=int, default=100,
                  help="probe requests on the idle server (spread over the idle windows)")
  ap.add_argument("--windows", type=int, default=10,
                  help="the soak runs in this many stretches, with an idle window before each "
                       "and after the last")
  ap.add_argument("--control", type=int, default=30,
                  help="probe requests beside the valid load alone (no other traffic)")
  ap.add_argument("--max-tokens", type=int, default=4)
  ap.add_argument("--max-seconds", type=float, default=1200.0, help="stop issuing after this")
  ap.add_argument("--model", default=None)
  ap.add_argument("--policy", default="demo")
  ap.add_argument("--slots", type=int, default=4)
  ap.add_argument("--context", type=int, default=256)
  ap.add_argument("--prefill-chunk", type=int, default=512, choices=[64, 128, 256, 512],
                  help="the server's --prefill-chunk")
  ap.add_argument("--prefill-share", type=float, default=1 / 3, help="the server's --prefill-share")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--with-tools", action="store_true",
                  help="valid tool requests too (their prompts carry the tools system message, "
                       "a prefill several times the probe's)")
  ap.add_argument("--mix", default=",".join(f"{k}={v}" for k, v in MIX.items()),
                  help="weights of the mixed kinds")
  ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results",
                                                str(datetime.date.today()) + "_soak"))
  a = ap.parse_args(argv)
  os.makedirs(a.out, exist_ok=True)
  t_start = time.time()
  proc, base = start_server(a, a.out)
  try:
    startup = time.time() - t_start
    before = scrape(base)
    res = asyncio.run(soak(a, base))
    for _ in range(600):   # cancellations are reaped at the engine's next iteration
      m = scrape(base)
      if m["pask_running"] == 0 and m["pask_queue_depth"] == 0:
        break
      time.sleep(0.1)
    health = httpx.get(base + "/health", timeout=10).status_code
  finally:
    proc.terminate()
    try:
      proc.wait(30)
    except subprocess.TimeoutExpired:
      proc.kill()
  recs = res["recs"]
  log = open(os.path.join(a.out, "server.log")).read()
  by = collections.defaultdict(collections.Counter)
  for r in recs:
    by[r["kind"]][str(r["status"]) if r["error"] is None else r["error"]] += 1
  d = lambda k: m.get(k, 0) - before.get(k, 0)
  idle_p50, idle_p99 = pct(res["idle"], 0.5), pct(res["idle"], 0.99)
  soak_p50, soak_p99 = pct(res["probes"], 0.5), pct(res["probes"], 0.99)
  ctl_p50, ctl_p99 = pct(res["control"], 0.5), pct(res["control"], 0.99)
  leaked = {p: int(m[f'pask_pages_total{{pool="{p}"}}'] - m[f'pask_pages_free{{pool="{p}"}}'])
            for p in ("bf16", "int4")}
  out = {
      "date": datetime.datetime.now().isoformat(timespec="seconds"),
      "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip(),
      "command": "python bench/bench_soak.py " + " ".join(argv if argv is not None
                                                           else sys.argv[1:]),
      "config": {k: getattr(a, k) for k in ("requests", "concurrency", "valid_inflight", "idle",
                                            "windows",
                                            "control", "max_tokens", "max_seconds", "policy",
                                            "slots",
                                            "context", "seed", "mix", "with_tools",
                                            "prefill_chunk", "prefill_share")},
      "startup_s": round(startup, 1), "soak_wall_s": round(res["wall"], 1),
      "requests_sent": len(recs), "mixed_sent": sum(r["kind"] != "probe" for r in recs),
      "status_by_kind": {k: dict(v) for k, v in sorted(by.items())},
      "responses_5xx": sum(1 for r in recs if (r["status"] or 0) >= 500),
      "connection_resets": sum(1 for r in recs if (r["error"] or "").startswith("reset")),
      "client_timeouts": sum(1 for r in recs if r["error"] == "timeout"),
      "non_openai_error_bodies": sum(1 for r in recs if r["error"] == "non-OpenAI error body"),
      "probe_idle_s": {"n": len(res["idle"]), "p50": idle_p50, "p99": idle_p99,
                       "windows": len(res["idle_windows"]),
                       "p50_by_window": [pct(w, 0.5) for w in res["idle_windows"]]},
      "probe_soak_s": {"n": len(res["probes"]), "p50": soak_p50, "p99": soak_p99},
      "probe_valid_load_s": {"n": len(res["control"]), "p50": ctl_p50, "p99": ctl_p99},
      "probe_p99_ratio": round(soak_p99 / idle_p99, 3) if soak_p99 and idle_p99 else None,
      # the ratio at other quantiles (100 idle probes estimate a p99 poorly: it is their
      # maximum), and a bootstrap interval of the p99 ratio (both samples resampled)
      "probe_ratio_by_quantile": {f"p{round(100 * q)}": ratio(res["probes"], res["idle"], q)
                                  for q in (0.5, 0.9, 0.95, 0.99)},
      "probe_p99_ratio_90pct_interval": interval(res["probes"], res["idle"], 0.99),
      "probe_p99_ratio_vs_valid_load": round(soak_p99 / ctl_p99, 3) if soak_p99 and ctl_p99
                                       else None,
      "pages_leaked": leaked,
      "engine_errors": int(d('pask_requests_total{outcome="error"}')),
      "engine_cancelled": int(d('pask_requests_total{outcome="cancelled"}')),
      "cache_overflows": int(d("pask_cache_overflows_total")),
      "grammar": {k: int(d(f'pask_grammar_compiles_total{{result="{k}"}}'))
                  for k in ("hits", "misses", "failures", "timeouts", "busy")},
      "server_log_tracebacks": log.count("Traceback"),
      "health_after": health,
  }
  out["goals"] = {"no_5xx_from_content": out["responses_5xx"] == 0,
                  "no_connection_resets": out["connection_resets"] == 0,
                  "no_leaked_pages": leaked == {"bf16": 0, "int4": 0},
                  "no_engine_errors": out["engine_errors"] == 0,
                  "probe_p99_within_2x_idle": bool(out["probe_p99_ratio"] is not None
                                                   and out["probe_p99_ratio"] <= 2.0),
                  "healthy_after": health == 200}
  text = json.dumps(out, indent=1)
  print(text)
  every = recs + res["extra"]   # the soak's requests, then the idle and control probes
  t_first = min(r["t0"] for r in every) if every else 0
  with open(os.path.join(a.out, "requests.jsonl"), "w") as f:   # every request, for analysis
    for r in sorted(every, key=lambda r: r["t0"]):
      f.write(json.dumps({**r, "t0": round(r["t0"] - t_first, 3), "s": round(r["s"], 3)}) + "\n")
  with open(os.path.join(a.out, "result.json"), "w") as f:
    f.write(text + "\n")
  return 0 if all(out["goals"].values()) else 1


if __name__ == "__main__":
  sys.exit(main())
