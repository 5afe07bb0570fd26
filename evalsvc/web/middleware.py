"""The service's outer guard, a pure ASGI middleware that acts on the request line and headers
before any route runs, so nothing reads a body it would refuse:

* Auth (who is asking: ``evalsvc/web/auth.py``). With no accounts at all (no token, no user, no
  trusted header) everything is open (the service binds loopback only). Otherwise a mutating
  request of the API (any method but GET, HEAD and OPTIONS) needs a write token as a bearer token
  (``EVALSVC_API_TOKEN`` or a write user's); a dashboard form needs a signed-in (or
  proxy-named) user of role write, a read user is refused with 403 (the route checks the form's
  CSRF token); with no write account at all, writes are off (403). Reads are open with the write
  token alone; with a read token, any user or a trusted header, every read but ``/healthz``, the
  sign-in page and the dashboard's assets (``/static/``, ``/vendor/``: they hold no results) needs
  someone: a bearer token, a session or the header. A browser asking for a page (``Accept:
  text/html``) is sent to ``/login`` instead of getting the 401. A session ended by signing out (a
  copy of its cookie) is nobody: its id is looked up in the store (``session_ended``, in a worker
  thread), and its cookie is cleared. The routes' dependencies check the same again.
* Parameters. A query parameter or a path holding what SQLite or PostgreSQL cannot store as text
  (NUL, a lone surrogate) is refused with 422 naming it.
* Body size. A body over ``EVALSVC_MAX_BODY_BYTES`` is refused with 413: at once when its
  Content-Length says so, else as soon as the bytes received pass the limit (a chunked body is
  counted as it arrives and never held beyond the limit).
"""

from __future__ import annotations

from collections.abc import Callable
from urllib.parse import parse_qsl, quote

from sqlalchemy.exc import SQLAlchemyError
from starlette.concurrency import run_in_threadpool
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from evalsvc.settings import Settings
from evalsvc.web.auth import OPEN_USER, Accounts, User

READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
OPEN_PATHS = frozenset({"/healthz"})  # liveness probes carry no token
OPEN_PREFIXES = ("/static/", "/vendor/")  # the dashboard's CSS and scripts: no results in them
# signing in and out: open to anyone (their forms carry the session's CSRF token)
SIGN_IN_PATHS = frozenset({"/login", "/logout"})
# what is not the dashboard's: the API and its documents, and the service's own endpoints
API_PREFIXES = ("/api/", "/docs", "/redoc", "/openapi.json", "/metrics", "/healthz")
USER_SCOPE_KEY = "evalsvc.user"  # the User the guard found (None: nobody), for the routes


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
    """``session_ended(session_id)``: whether a signed-in session was ended by signing out (None:
    no session is ever looked up)."""

    def __init__(self, app: ASGIApp, settings: Settings, accounts: Accounts,
                 session_ended: Callable[[str], bool] | None = None) -> None:
        self.app = app
        self.settings = settings
        self.accounts = accounts
        self.session_ended = session_ended

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = _headers(scope)
        refusal = await self._auth(scope, headers) or _parameters(scope)
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

    async def _auth(self, scope: Scope, headers: dict[bytes, bytes]) -> Response | None:
        accounts = self.accounts
        path = scope["path"]
        try:
            user = accounts.identify(_bearer(headers), scope.get("session"), headers)
            if (user is not None and user.how == "session" and self.session_ended is not None
                    and path not in OPEN_PATHS and not path.startswith(OPEN_PREFIXES)
                    and await run_in_threadpool(self.session_ended, user.session_id)):
                scope["session"].clear()  # signed out: a copy of its cookie names nobody
                user = accounts.identify(b"", None, headers)
        except ValueError as exc:  # the trusted header holds no usable name
            return JSONResponse({"detail": str(exc)}, status_code=400)
        except SQLAlchemyError as exc:
            return JSONResponse({"detail": "the store cannot be used now (to look up a "
                                           f"session): {type(exc).__name__}"}, status_code=503)
        if user is None and not accounts.guarded:
            user = OPEN_USER  # no accounts at all: the service binds loopback only
        scope[USER_SCOPE_KEY] = user
        api = path.startswith(API_PREFIXES)
        if scope["method"] not in READ_METHODS:
            if not accounts.guarded or (path in SIGN_IN_PATHS and not api):
                return None
            if not accounts.writable:
                return JSONResponse({"detail": WRITES_OFF}, status_code=403)
            if api:  # the API takes bearer tokens
                if user is not None and user.how == "token" and user.can_write:
                    return None
                return _unauthorized("writes need a write token (EVALSVC_API_TOKEN, or a write "
                                     "user's of EVALSVC_USERS) as 'Authorization: Bearer TOKEN'")
            if user is None:  # a dashboard form
                return _sign_in(scope, headers) or _unauthorized(
                    "this form needs a signed-in user of role write (sign in at /login)")
            if not user.can_write:
                return JSONResponse({"detail": read_only(user)}, status_code=403)
            return None
        if (not accounts.reads_guarded or path in OPEN_PATHS or path.startswith(OPEN_PREFIXES)
                or path in SIGN_IN_PATHS or user is not None):
            return None
        return (None if api else _sign_in(scope, headers)) or _unauthorized(
            "reading needs a token as 'Authorization: Bearer TOKEN' (the read token "
            "EVALSVC_READ_TOKEN, the write token or a user's of EVALSVC_USERS), or a sign-in on "
            "the dashboard")

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


WRITES_OFF = ("writes are off: this service has no write token (EVALSVC_API_TOKEN, or a user of "
              "role write in EVALSVC_USERS); they stay off until one is set")


def read_only(user: User) -> str:
    return (f"{user.name} has the read role: this needs a user of role write (EVALSVC_USERS, "
            "or the write token EVALSVC_API_TOKEN)")


def _sign_in(scope: Scope, headers: dict[bytes, bytes]) -> Response | None:
    """A browser's request (it asks for HTML) goes to the sign-in page, coming back to the page
    it asked for; None for any other client."""
    if b"text/html" not in headers.get(b"accept", b""):
        return None
    root = scope.get("root_path", "")
    target = scope["path"]
    if scope["method"] in READ_METHODS and target != "/":
        query = scope.get("query_string", b"").decode("latin-1")
        target += f"?{query}" if query else ""
        return RedirectResponse(f"{root}/login?next={quote(target, safe='')}", status_code=303)
    return RedirectResponse(f"{root}/login", status_code=303)


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


def _unauthorized(detail: str) -> Response:
    return JSONResponse({"detail": detail}, status_code=401, headers={"WWW-Authenticate": "Bearer"})


def _too_large(limit: int) -> JSONResponse:
    return JSONResponse({"detail": f"request body too large: the limit is {limit} bytes "
                                   "(EVALSVC_MAX_BODY_BYTES)"}, status_code=413)


async def _no_body() -> Message:
    """What a refusal's response may receive: it never reads the request body."""
    return {"type": "http.disconnect"}
