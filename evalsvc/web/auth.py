"""Who is asking: a bearer token, the dashboard's signed session, or a trusted proxy's header.

The accounts come from the settings: each user of ``EVALSVC_USERS`` (a name, a role, and a token or
its SHA-256), and the single tokens: ``EVALSVC_API_TOKEN`` (user ``api-token``, role write) and
``EVALSVC_READ_TOKEN`` (user ``read-token``, role read). A token is compared as its SHA-256 digest
with every account's, in constant time and without an early exit, so neither the time taken nor
the order says which one matched. Tokens are meant to be random (``secrets.token_hex(32)``): a
plain SHA-256 then stores them safely; it is no password hash.

A signed-in browser's session (Starlette's signed cookie) holds the user's name, a key derived
from the session secret and the account's digest, and a random session id: when a user's token
changes or the user is removed, their sessions end; signing out ends that one session, copies of
its cookie included (its id is recorded in the store until the cookie would expire:
``evalsvc.store.sessions``; the guard looks it up). With ``EVALSVC_TRUSTED_USER_HEADER`` set, a
request carrying that header is the user it names (the role of that name in ``EVALSVC_USERS``,
else ``EVALSVC_TRUSTED_USER_ROLE``).

Plain code, no web framework: the middleware and the routes' dependencies share it.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from typing import Any

from evalsvc.settings import Settings

READ, WRITE = "read", "write"
API_TOKEN_USER, READ_TOKEN_USER, OPEN_USER_NAME = "api-token", "read-token", "anonymous"
SESSION_USER, SESSION_KEY, SESSION_CSRF, SESSION_ID = "user", "key", "csrf", "sid"


@dataclass(frozen=True)
class Account:
    name: str
    role: str
    digest: bytes  # SHA-256 of the token


@dataclass(frozen=True)
class User:
    """Someone the service knows, and how it knows them: ``token`` (a bearer token), ``session``
    (signed in on the dashboard), ``header`` (named by the trusted proxy), ``open`` (a service
    with no accounts at all, on loopback)."""

    name: str
    role: str
    how: str
    session_id: str | None = None  # signed in on the dashboard: the session's id

    @property
    def can_write(self) -> bool:
        return self.role == WRITE


OPEN_USER = User(OPEN_USER_NAME, WRITE, "open")


def token_digest(token: str | bytes) -> bytes:
    return hashlib.sha256(token.encode() if isinstance(token, str) else token).digest()


def session_secret(settings: Settings) -> str:
    """The secret that signs sessions: the settings', else a random one for this process."""
    if settings.session_secret is not None:
        return settings.session_secret.get_secret_value()
    return secrets.token_urlsafe(32)


class Accounts:
    def __init__(self, settings: Settings, secret: str) -> None:
        self.secret = secret.encode()
        accounts = []
        for u in settings.users:
            digest = (token_digest(u.token.get_secret_value()) if u.token is not None
                      else bytes.fromhex(u.token_sha256))
            accounts.append(Account(u.name, u.role, digest))
        if settings.api_token:
            accounts.append(Account(API_TOKEN_USER, WRITE, token_digest(settings.api_token)))
        if settings.read_token:
            accounts.append(Account(READ_TOKEN_USER, READ, token_digest(settings.read_token)))
        self.accounts = accounts
        self.roles = {a.name: a.role for a in accounts}
        header = settings.trusted_user_header
        self.header = header.lower().encode() if header else None
        self.header_name = header
        self.header_role = settings.trusted_user_role
        # with a read token, any user or a trusted header, reads need someone; with the write
        # token alone they are open (as before users existed)
        self.reads_guarded = bool(settings.read_token or settings.users or header)
        self.guarded = self.reads_guarded or bool(settings.api_token)
        self.writable = (any(a.role == WRITE for a in accounts)
                         or (header is not None and self.header_role == WRITE))

    # ---- the three ways in -------------------------------------------------------------------
    def by_token(self, token: bytes) -> Account | None:
        if not token:
            return None
        given = token_digest(token)
        found = None
        for account in self.accounts:  # every one compared: no early exit
            if hmac.compare_digest(given, account.digest):
                found = account
        return found

    def session_key(self, account: Account) -> str:
        return hmac.new(self.secret, b"session:" + account.digest, hashlib.sha256).hexdigest()

    def by_session(self, session: dict[str, Any] | None) -> Account | None:
        if not session or not isinstance(session.get(SESSION_USER), str):
            return None
        key = session.get(SESSION_KEY)
        account = next((a for a in self.accounts if a.name == session[SESSION_USER]), None)
        if account is None or not isinstance(key, str):
            return None
        if not isinstance(session.get(SESSION_ID), str):  # made before sessions had ids
            return None
        return account if hmac.compare_digest(key.encode(), self.session_key(account).encode()) \
            else None

    def by_header(self, headers: dict[bytes, bytes]) -> User | None:
        """The user the trusted header names; ValueError when it holds no usable name."""
        if self.header is None or self.header not in headers:
            return None
        try:
            name = headers[self.header].decode("utf-8").strip()
        except UnicodeDecodeError:
            name = ""
        if not name or len(name) > 200 or not name.isprintable():
            raise ValueError(f"{self.header_name}: not a user name (1 to 200 printable "
                             "characters)")
        return User(name, self.roles.get(name, self.header_role), "header")

    def identify(self, bearer: bytes, session: dict[str, Any] | None,
                 headers: dict[bytes, bytes]) -> User | None:
        """Who a request is: its bearer token (a wrong one is nobody, whatever else it carries),
        else its session, else the trusted header; None: nobody. ValueError from the header."""
        if bearer:
            account = self.by_token(bearer)
            return User(account.name, account.role, "token") if account else None
        account = self.by_session(session)
        if account is not None:
            return User(account.name, account.role, "session", session[SESSION_ID])
        return self.by_header(headers)

    # ---- signing in and out --------------------------------------------------------------------
    def sign_in(self, session: dict[str, Any], account: Account) -> None:
        """A fresh session for ``account`` (nothing of the one before is kept, its CSRF token
        neither)."""
        session.clear()
        session[SESSION_USER] = account.name
        session[SESSION_KEY] = self.session_key(account)
        session[SESSION_CSRF] = secrets.token_urlsafe(32)
        session[SESSION_ID] = secrets.token_urlsafe(24)


def csrf_token(session: dict[str, Any]) -> str:
    """The session's CSRF token (made on first use): every form of the dashboard carries it."""
    token = session.get(SESSION_CSRF)
    if not isinstance(token, str):
        token = session[SESSION_CSRF] = secrets.token_urlsafe(32)
    return token


def csrf_matches(session: dict[str, Any], given: str | None) -> bool:
    token = session.get(SESSION_CSRF)
    if not isinstance(token, str) or not given:
        return False
    return hmac.compare_digest(token.encode(), given.encode("utf-8", "replace"))
