"""One loopback server for every tests/test_serve*.py module (started once per test session).

A real uvicorn server on 127.0.0.1 (a free port, a background thread) with the embedded default
model.  It runs the hand-written ``demo`` policy (R, L and H all occur, so both pools are used;
the default all-high policy is the special case that never reserves INT4 pages) and is small on
purpose (4 slots, 256-token context, pools of 20 pages where full provisioning would be 64) so
that page-limited admission actually happens.  Tests read counters as deltas (the server is
shared).  Every network call has a timeout and every loop a bound.
"""
from __future__ import annotations

import atexit
import functools
import socket
import threading
import time

import httpx
import openai

HI_PAGES = LO_PAGES = 20
TIMEOUT = 90.0
MODEL = "smollm2-135m-instruct"
WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]


@functools.lru_cache(maxsize=None)
def server() -> tuple[str, object, object]:
  """(base url, engine, app), started on first use and stopped at exit."""
  from serve.app import build
  app, engine = build(None, "demo", slots=4, context=256, hi_pages=HI_PAGES, lo_pages=LO_PAGES,
                      default_max_tokens=32, served_model_name=[MODEL, "smollm2"])
  return listen(app, engine.stop), engine, app


@functools.lru_cache(maxsize=None)
def options_server() -> tuple[str, object]:
  """(base url, app): a second app over the shared server's engine and grammar pool (no second
  model or compile) with the serve options on: ``api_key=KEY``, ``chat_template=TEMPLATE``
  (ignores tools: they reach the model in a system message), ``tool_call_parser="hermes"``."""
  from serve.app import create_app
  _, engine, first = server()
  prep = first.state.prep
  app = create_app(engine, prep.tok, prep.cfg, model_name=MODEL, default_max_tokens=32,
                   grammars=first.state.grammars, api_key=KEY, chat_template=TEMPLATE,
                   tool_call_parser="hermes")
  return listen(app), app


KEY = "sk-test-0123456789"
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}: {{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant: {% endif %}")


def listen(app, on_stop=None) -> str:
  """Serve ``app`` on a free loopback port (a background thread, stopped at exit); its URL."""
  import uvicorn
  sock = socket.socket()
  sock.bind(("127.0.0.1", 0))
  port = sock.getsockname()[1]
  srv = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_keep_alive=30))
  th = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
  th.start()
  for _ in range(400):   # bounded wait for the socket to serve
    if srv.started:
      break
    time.sleep(0.05)
  assert srv.started

  def stop():
    srv.should_exit = True
    th.join(10)
    if on_stop is not None:
      on_stop()
    sock.close()

  atexit.register(stop)
  return f"http://127.0.0.1:{port}"


def client(base: str) -> openai.OpenAI:
  return openai.OpenAI(base_url=base + "/v1", api_key="none", timeout=TIMEOUT, max_retries=0)


def metrics(base: str) -> dict:
  """/metrics parsed by prometheus_client: {'name{label="v"}': value}."""
  from serve.metrics import parse
  return parse(httpx.get(base + "/metrics", timeout=10).text)


def idle(base: str, bound: float = 60.0) -> dict:
  """/metrics once nothing runs or waits (cancellations are reaped within an engine iteration)."""
  t0 = time.time()
  while True:
    m = metrics(base)
    if m["pask_running"] == 0 and m["pask_queue_depth"] == 0 or time.time() - t0 > bound:
      return m
    time.sleep(0.1)


def pages_all_free(m: dict) -> bool:
  return (m['pask_pages_free{pool="bf16"}'] == m['pask_pages_total{pool="bf16"}'] == HI_PAGES
          and m['pask_pages_free{pool="int4"}'] == m['pask_pages_total{pool="int4"}'] == LO_PAGES)


def serve_kwargs(monkeypatch, argv: list[str]) -> dict:
  """What ``pask-jax serve ARGV`` hands ``serve.app.build`` (its keywords, plus ``model`` and
  ``policy``), with no model loaded and no server started (``monkeypatch``: pytest's)."""
  import uvicorn

  import serve.app
  from pask_jax.cli import main
  seen = {}

  class Engine:
    sizing = type("S", (), {"describe": staticmethod(lambda: "sizes")})()

    def stop(self):
      pass

  def build(*a, **kw):
    seen.update(kw, model=a[0], policy=a[1])
    return object(), Engine()

  monkeypatch.setattr(serve.app, "build", build)
  monkeypatch.setattr(uvicorn, "run", lambda *a, **kw: None)
  monkeypatch.delenv("PASK_API_KEY", raising=False)
  assert main(["serve", *argv]) == 0
  return seen
