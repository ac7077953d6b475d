"""ASGI middleware in front of the routes: body limits and a last-resort error boundary.

* **Body size** (``max_body_bytes``): a larger body is read to its end and dropped (up to
  ``max(8 x limit, 32 MiB)``; beyond that it is refused at once with ``Connection: close``), then
  answered with a 413 with an OpenAI-style body on a connection that stays usable: answering
  before the client has sent its body made the client's write fail with a reset.
  Starlette/FastAPI's own ``max_body_size`` answers with a plain-text body that cannot be made
  OpenAI-style, hence this.
* **JSON nesting depth** (``max_json_depth``) of a JSON body, measured in linear time without
  parsing (strings stripped by one regex, brackets counted by a numpy cumulative sum): deeper
  bodies are a 400 before Python's recursive ``json.loads`` or pydantic see them (a body nested
  5,000 arrays deep raised RecursionError there).
* **Lone surrogates**: a ``\\ud800`` escape without its pair decodes to a Python string that the
  tokenizer and XGrammar reject with a TypeError; refused here with a 400 naming the byte offset.
* **API key** (:class:`Auth`, ``--api-key``): a missing or wrong ``Authorization: Bearer`` is a 401
  with an OpenAI-style body before the route runs.
* **Error boundary**: an exception escaping the app is answered with an OpenAI-style 500 and *not*
  re-raised.  Re-raising makes uvicorn close the socket after the response had been sent, which
  reset the client's next request on the same keep-alive connection.
"""
from __future__ import annotations

import hashlib
import json
import logging
import re
import secrets
from typing import Any, Callable

import numpy as np

from serve.protocol import error_body

log = logging.getLogger("pask.serve")

_STRINGS = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_SURROGATE = re.compile(rb'(?<!\\)(?:\\\\)*\\u([dD][89a-fA-F][0-9a-fA-F]{2})'
                        rb'(?:\\u([dD][c-fC-F][0-9a-fA-F]{2}))?')
_OPEN = np.zeros(256, np.int8)
_OPEN[[ord("["), ord("{")]] = 1
_OPEN[[ord("]"), ord("}")]] = -1


def json_depth(raw: bytes) -> int:
  """Bracket nesting depth of a JSON text, outside strings (linear time, no recursion)."""
  if not raw:
    return 0
  bare = _STRINGS.sub(b'""', raw)
  steps = _OPEN[np.frombuffer(bare, np.uint8)].astype(np.int32)
  return int(np.cumsum(steps).max(initial=0))


def lone_surrogate(raw: bytes) -> int | None:
  """Byte offset of the first ``\\uXXXX`` escape that is half of a surrogate pair, or None."""
  for m in _SURROGATE.finditer(raw):
    hi = int(m.group(1), 16)
    if not (0xD800 <= hi <= 0xDBFF and m.group(2)):
      return m.start(1) - 2
  return None


async def send_json(send, status: int, body: dict, close: bool = False) -> None:
  data = json.dumps(body).encode()
  headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
  if close:
    headers.append((b"connection", b"close"))
  await send({"type": "http.response.start", "status": status, "headers": headers})
  await send({"type": "http.response.body", "body": data})


class Guard:
  """Starlette middleware (``app.add_middleware(Guard, ...)``): see the module docstring."""

  def __init__(self, app, max_body_bytes: int = 2 << 20, max_json_depth: int = 64,
               on_error: Callable[[BaseException], Any] | None = None):
    self.app, self.max_body, self.max_depth = app, int(max_body_bytes), int(max_json_depth)
    self.drain = max(8 * self.max_body, 32 << 20)
    self.on_error = on_error

  async def __call__(self, scope, receive, send):
    if scope["type"] != "http":
      return await self.app(scope, receive, send)
    started = False

    async def tracked_send(message):
      nonlocal started
      if message["type"] == "http.response.start":
        started = True
      await send(message)

    try:
      if scope.get("method") in ("POST", "PUT", "PATCH"):
        replay = await self._checked_body(scope, receive, tracked_send)
        if replay is None:
          return
        receive = replay
      await self.app(scope, receive, tracked_send)
    except Exception as e:  # noqa: BLE001 — the boundary: a bug must not reset the connection
      log.exception("unhandled error in %s %s", scope.get("method"), scope.get("path"))
      if self.on_error is not None:
        self.on_error(e)
      if not started:
        await send_json(send, 500, error_body(f"internal server error: {type(e).__name__}",
                                              "server_error"))

  async def _checked_body(self, scope, receive, send):
    """Read the whole body within the limits; a replaying ``receive``, or None once refused."""
    length = None
    for k, v in scope.get("headers") or ():
      if k == b"content-length":
        try:
          length = int(v)
        except ValueError:
          length = None
    if length is not None and length > self.drain:
      await self._too_large(send, length, close=True)
      return None
    chunks, total = [], 0
    while True:
      msg = await receive()
      if msg["type"] == "http.disconnect":
        return None
      body = msg.get("body", b"")
      total += len(body)
      if total > self.max_body:
        if total > self.drain:
          await self._too_large(send, total, close=True)
          return None
        chunks = []   # drained, not kept: the answer is a 413 on a reusable connection
      else:
        chunks.append(body)
      if not msg.get("more_body", False):
        break
    if total > self.max_body:
      await self._too_large(send, total, close=False)
      return None
    raw = b"".join(chunks)
    ctype = b""
    for k, v in scope.get("headers") or ():
      if k == b"content-type":
        ctype = v.lower()
    if not ctype or b"json" in ctype:
      depth = json_depth(raw)
      if depth > self.max_depth:
        await send_json(send, 400, error_body(
            f"the request body nests JSON {depth} levels deep; this server's limit is "
            f"{self.max_depth} (--max-json-depth)", code="json_too_deep"))
        return None
      at = lone_surrogate(raw)
      if at is not None:
        await send_json(send, 400, error_body(
            f"the request body has a lone UTF-16 surrogate escape at byte {at} "
            f"({raw[at:at + 6].decode('ascii', 'replace')}): strings must be valid Unicode",
            code="invalid_unicode"))
        return None
    sent = False

    async def replay():
      nonlocal sent
      if not sent:
        sent = True
        return {"type": "http.request", "body": raw, "more_body": False}
      return await receive()

    return replay

  async def _too_large(self, send, n: int, close: bool) -> None:
    await send_json(send, 413, error_body(
        f"the request body has {n} bytes or more; this server's limit is {self.max_body} bytes "
        "(--max-body-bytes)", code="request_too_large"), close=close)


class Auth:
  """Starlette middleware: every path except ``open_paths`` needs ``Authorization: Bearer KEY``
  with one of ``keys``.  vLLM checks only paths that start with ``/v1`` (``/tokenize``,
  ``/detokenize``, ``/version``, ``/health`` and ``/metrics`` stay open there); here only
  ``/health`` and ``/metrics`` are open (probes and scrapers carry no key), compared exactly
  on the ASGI path.  Keys are compared as SHA-256 digests with ``secrets.compare_digest``
  against every key, so the time taken says nothing about a key."""

  def __init__(self, app, keys: list[str], open_paths: tuple[str, ...] = ("/health", "/metrics")):
    if not keys or any(not isinstance(k, str) or not k for k in keys):
      raise ValueError("an API key must be a non-empty string")
    self.app, self.open = app, frozenset(open_paths)
    self.digests = [hashlib.sha256(k.encode("utf-8")).digest() for k in keys]

  def allowed(self, headers) -> bool:
    value = None
    for k, v in headers or ():
      if k == b"authorization":
        value = v
    if value is None:
      return False
    scheme, _, token = value.partition(b" ")
    if scheme.lower() != b"bearer":
      return False
    got = hashlib.sha256(token.strip()).digest()
    ok = False
    for d in self.digests:
      ok |= secrets.compare_digest(got, d)
    return ok

  async def __call__(self, scope, receive, send):
    if scope["type"] != "http" or scope.get("path") in self.open or \
        self.allowed(scope.get("headers")):
      return await self.app(scope, receive, send)
    has = any(k == b"authorization" for k, _ in scope.get("headers") or ())
    msg = ("Incorrect API key provided." if has else
           "You didn't provide an API key. You need to provide your API key in an "
           "Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).")
    data = json.dumps(error_body(msg, code="invalid_api_key")).encode()
    await send({"type": "http.response.start", "status": 401,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(data)).encode()),
                            (b"www-authenticate", b"Bearer")]})
    await send({"type": "http.response.body", "body": data})
