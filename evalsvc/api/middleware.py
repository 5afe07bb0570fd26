"""The service's outer guard, a pure ASGI middleware that acts on the request line and headers
before any route runs, so nothing reads a body it would refuse:

* Auth. A mutating request (any method but GET, HEAD and OPTIONS) needs the write token
  (``EVALSVC_API_TOKEN``) as a bearer token; with a read token but no write token set, writes are
  off (403). With ``EVALSVC_READ_TOKEN`` set, every read but ``/healthz`` and the dashboard's
  assets (``/static/``, ``/vendor/``: they hold no results) needs the read or the write token:
  the API, the dashboard, ``/metrics``, ``/docs``, ``/redoc`` and ``/openapi.json``. The routes'
  ``require_write``/``require_read`` dependencies check the same again.
* Parameters. A query parameter or a path holding what SQLite or PostgreSQL cannot store as text
  (NUL, a lone surrogate) is refused with 422 naming it.
* Body size. A body over ``EVALSVC_MAX_BODY_BYTES`` is refused with 413: at once when its
  Content-Length says so, else as soon as the bytes received pass the limit (a chunked body is
  counted as it arrives and never held beyond the limit).
"""

from __future__ import annotations

import hmac
from urllib.parse import parse_qsl

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from evalsvc.settings import Settings

READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
OPEN_PATHS = frozenset({"/healthz"})  # liveness probes carry no token
OPEN_PREFIXES = ("/static/", "/vendor/")  # the dashboard's CSS and scripts: no results in them


def unstorable(value: str) -> str | None:
    """Why a database cannot store ``value`` as text (None: it can): PostgreSQL refuses NUL, and
    neither SQLite nor PostgreSQL takes a lone surrogate (it is not encodable as UTF-8)."""
    if "\x00" in value:
        return "contains a NUL character (\\x00)"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return "contains a lone surrogate (not valid Unicode text)"
    return None


class BodyTooLarge(Exception):
    """Raised from ``receive`` once a body passes the limit (the guard answers 413)."""


class HttpGuard:
    def __init__(self, app: ASGIApp, settings: Settings) -> None:
        self.app = app
        self.settings = settings

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = _headers(scope)
        refusal = self._auth(scope, headers) or _parameters(scope)
        limit = self.settings.max_body_bytes
        length = headers.get(b"content-length")
        if refusal is None and length is not None:
            if not length.isdigit():
                refusal = JSONResponse({"detail": "Content-Length: not a number of bytes"},
                                       status_code=400)
            elif int(length) > limit:
                refusal = _too_large(limit)
        if refusal is not None:
            await refusal(scope, _no_body, send)
            return
        await self._limited(scope, receive, send, limit)

    def _auth(self, scope: Scope, headers: dict[bytes, bytes]) -> JSONResponse | None:
        write, read = self.settings.api_token, self.settings.read_token
        given = _bearer(headers)
        if scope["method"] not in READ_METHODS:
            if write:
                if _matches(given, [write]):
                    return None
                return _unauthorized("writes need the write token (EVALSVC_API_TOKEN) as "
                                     "'Authorization: Bearer TOKEN'")
            if read:
                return JSONResponse(
                    {"detail": "writes are off: this service has a read token but no write "
                               "token; they stay off until EVALSVC_API_TOKEN is set"},
                    status_code=403)
            return None  # no tokens at all: the service binds loopback only
        path = scope["path"]
        if not read or path in OPEN_PATHS or path.startswith(OPEN_PREFIXES):
            return None
        if _matches(given, [read, write]):
            return None
        return _unauthorized("reading needs the read token (EVALSVC_READ_TOKEN) or the write "
                             "token as 'Authorization: Bearer TOKEN'")

    async def _limited(self, scope: Scope, receive: Receive, send: Send, limit: int) -> None:
        received = 0
        exceeded = started = False

        async def limited_receive() -> Message:
            nonlocal received, exceeded
            if exceeded:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    exceeded = True
                    raise BodyTooLarge(f"the body passed {limit} bytes")
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if exceeded and not started:
                return  # whatever the app answers to the cut body, the answer is 413
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except Exception:
            if not exceeded:
                raise
        if exceeded and not started:
            await _too_large(limit)(scope, _no_body, send)


def _headers(scope: Scope) -> dict[bytes, bytes]:
    return {k.lower(): v for k, v in scope.get("headers", [])}


def _bearer(headers: dict[bytes, bytes]) -> bytes:
    scheme, _, credentials = headers.get(b"authorization", b"").partition(b" ")
    return credentials.strip() if scheme.lower() == b"bearer" else b""


def _matches(given: bytes, tokens: list[str | None]) -> bool:
    ok = False
    for token in tokens:
        if token:  # compare with each (no early exit): the time says nothing about which
            ok = hmac.compare_digest(given, token.encode()) or ok
    return ok


def _parameters(scope: Scope) -> JSONResponse | None:
    why = unstorable(scope["path"])
    if why:
        return _invalid(f"path: {why}")
    query = scope.get("query_string", b"").decode("latin-1")
    for name, value in parse_qsl(query, keep_blank_values=True):
        why = unstorable(name)
        if why:
            return _invalid(f"query: a parameter name {why}")
        why = unstorable(value)
        if why:
            return _invalid(f"query.{name}: {why}")
    return None


def _invalid(detail: str) -> JSONResponse:
    return JSONResponse({"detail": detail}, status_code=422)


def _unauthorized(detail: str) -> JSONResponse:
    return JSONResponse({"detail": detail}, status_code=401, headers={"WWW-Authenticate": "Bearer"})


def _too_large(limit: int) -> JSONResponse:
    return JSONResponse({"detail": f"request body too large: the limit is {limit} bytes "
                                   "(EVALSVC_MAX_BODY_BYTES)"}, status_code=413)


async def _no_body() -> Message:
    """What a refusal's response may receive: it never reads the request body."""
    return {"type": "http.disconnect"}
