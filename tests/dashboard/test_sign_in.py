"""Signing in to the dashboard, in process (Starlette's test client, the runner off): users of
``EVALSVC_USERS`` with plain and hashed tokens, the single tokens of before, the session cookie
(signed, HttpOnly, SameSite), signing out, a trusted proxy header only when configured, and what
a browser without a session meets (the sign-in page) beside an API client (the 401 as before)."""

from __future__ import annotations

import hashlib
import json
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path
from urllib.parse import parse_qsl, urlsplit

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from evalsvc.app import SESSION_COOKIE, create_app
from evalsvc.settings import Settings
from evalsvc.store.db import Store
from evalsvc.store.sessions import revoke, revoked

ALICE, BOB = "alice-token-0123456789", "bob-token-0123456789ab"
USERS = [{"name": "alice", "role": "write", "token": ALICE},
         {"name": "bob", "role": "read", "token_sha256": hashlib.sha256(BOB.encode()).hexdigest()}]
HTML = {"Accept": "text/html,application/xhtml+xml,*/*;q=0.8"}
SECRET = "a-session-secret-for-the-tests"


def make_client(tmp_path: Path, **overrides) -> TestClient:
    settings = Settings(data_dir=tmp_path / "data", database_url=f"sqlite:///{tmp_path / 'a.db'}",
                        nightly=False, **{"users": USERS, "session_secret": SECRET, **overrides})
    return TestClient(create_app(settings, start_runner=False))


def csrf_of(html: str) -> str:
    match = re.search(r'name="csrf_token" value="([^"]+)"', html)
    assert match, "no CSRF token in the page"
    return match.group(1)


def sign_in(c: TestClient, token: str, next_url: str = "/"):
    csrf = csrf_of(c.get("/login").text)
    return c.post("/login", data={"token": token, "next": next_url, "csrf_token": csrf},
                  follow_redirects=False)


def signed_in_as(html: str) -> tuple[str, str] | None:
    match = re.search(r'id="signed-in" data-user="([^"]+)" data-role="([^"]+)"', html)
    return match.groups() if match else None


def test_a_browser_without_a_session_goes_to_the_sign_in_page(tmp_path):
    with make_client(tmp_path) as c:
        resp = c.get("/regressions?state=open", headers=HTML, follow_redirects=False)
        assert resp.status_code == 303
        target = urlsplit(resp.headers["location"])
        assert target.path == "/login"
        assert dict(parse_qsl(target.query)) == {"next": "/regressions?state=open"}
        # an API client (no HTML asked for) gets the 401 it always got, the API too
        for path in ("/regressions", "/api/v1/jobs"):
            resp = c.get(path, follow_redirects=False)
            assert resp.status_code == 401 and "EVALSVC_READ_TOKEN" in resp.json()["detail"]
        assert c.get("/api/v1/jobs", headers=HTML).status_code == 401  # the API never redirects
        page = c.get("/login", headers=HTML)
        assert page.status_code == 200 and 'id="sign-in-form"' in page.text
        assert c.get("/static/dashboard.css").status_code == 200


def test_signing_in_sets_a_signed_httponly_samesite_cookie_and_signing_out_ends_it(tmp_path):
    with make_client(tmp_path) as c:
        resp = sign_in(c, "not-a-token-of-this-service", "/jobs")
        assert resp.status_code == 401
        assert "token: not a token of this service" in resp.text
        assert c.get("/jobs", follow_redirects=False).status_code == 401

        resp = sign_in(c, ALICE, "/jobs?status=done")
        assert resp.status_code == 303 and resp.headers["location"] == "/jobs?status=done"
        cookie = resp.headers["set-cookie"]
        assert cookie.startswith(f"{SESSION_COOKIE}=")
        flags = {f.strip().lower() for f in cookie.split(";")[1:]}
        assert {"httponly", "samesite=lax", "path=/"} <= flags
        assert "max-age=43200" in flags  # EVALSVC_SESSION_MAX_AGE_S
        assert "secure" not in flags  # EVALSVC_SESSION_HTTPS_ONLY is off
        for elsewhere in ("https://example.com/", "//example.com/", "/\t/example.com", "jobs"):
            resp = sign_in(c, ALICE, elsewhere)  # never to another site
            assert resp.status_code == 303 and resp.headers["location"] == "/", elsewhere
        page = c.get("/jobs")
        assert page.status_code == 200 and signed_in_as(page.text) == ("alice", "write")
        assert c.get("/api/v1/jobs").status_code == 200  # the page's live progress reads the API

        # the cookie is signed: altered, it names nobody
        value = c.cookies[SESSION_COOKIE]
        altered = value[:-3] + ("AAA" if value[-3:] != "AAA" else "BBB")
        resp = c.get("/jobs", headers={"Cookie": f"{SESSION_COOKIE}={altered}"},
                     follow_redirects=False)
        assert resp.status_code == 401
        resp = c.get("/jobs", headers={"Cookie": f"{SESSION_COOKIE}={value}"})
        assert signed_in_as(resp.text) == ("alice", "write")

        out = c.post("/logout", data={"csrf_token": csrf_of(page.text)}, follow_redirects=False)
        assert out.status_code == 303 and out.headers["location"] == "/login"
        assert "expires=thu, 01 jan 1970" in out.headers["set-cookie"].lower()
        assert c.get("/jobs", follow_redirects=False).status_code == 401


def test_a_cookie_copied_before_signing_out_is_refused_after_it(tmp_path):
    """Signing out ends the session on the server: a copy of its cookie taken before opens
    nothing afterwards (a browser is sent to sign in, its copy cleared), in this service and
    the next one on the same store; another session of the same user goes on."""
    with make_client(tmp_path) as c, make_client(tmp_path) as other:
        assert sign_in(c, ALICE).status_code == 303
        copied = {"Cookie": f"{SESSION_COOKIE}={c.cookies[SESSION_COOKIE]}"}
        assert sign_in(other, ALICE).status_code == 303  # alice in a second browser
        page = c.get("/jobs")
        assert signed_in_as(page.text) == ("alice", "write")
        assert c.post("/logout", data={"csrf_token": csrf_of(page.text)},
                      follow_redirects=False).status_code == 303
        c.cookies.clear()
        resp = c.get("/jobs", headers=copied, follow_redirects=False)
        assert resp.status_code == 401
        assert c.get("/api/v1/jobs", headers=copied).status_code == 401
        resp = c.get("/jobs", headers={**copied, **HTML}, follow_redirects=False)
        assert resp.status_code == 303 and resp.headers["location"].startswith("/login")
        assert "expires=thu, 01 jan 1970" in resp.headers["set-cookie"].lower()
        page = c.get("/login", headers=copied)  # the sign-in page names nobody either
        assert page.status_code == 200 and signed_in_as(page.text) is None
        assert signed_in_as(other.get("/jobs").text) == ("alice", "write")
    with make_client(tmp_path) as c:  # the same store and secret: still refused
        assert c.get("/jobs", headers=copied, follow_redirects=False).status_code == 401


def test_revoked_sessions_are_kept_until_their_cookies_expire(db_url, engines):
    """A session's record lasts the cookie's lifetime from its end; records past it are
    dropped when the next session ends."""
    store = Store(db_url)
    engines.append(store.engine)
    start = datetime(2026, 12, 1, tzinfo=UTC)
    with store.session() as s:
        revoke(s, "first", "alice", 3600, now=start)
    with store.session() as s:
        assert revoked(s, "first") and not revoked(s, "second")
        revoke(s, "second", "bob", 3600, now=start + timedelta(minutes=59))
        assert revoked(s, "first")
    with store.session() as s:
        revoke(s, "third", "bob", 3600, now=start + timedelta(minutes=61))
    with store.session() as s:
        assert [revoked(s, sid) for sid in ("first", "second", "third")] == [False, True, True]
    store.close()


def test_hashed_tokens_and_the_single_tokens_sign_in_with_their_roles(tmp_path):
    with make_client(tmp_path, api_token="write-secret-token", read_token="read-secret-token") as c:
        for token, who in ((BOB, ("bob", "read")), ("write-secret-token", ("api-token", "write")),
                           ("read-secret-token", ("read-token", "read")), (ALICE, ("alice", "write"))):
            assert sign_in(c, token).status_code == 303, token
            assert signed_in_as(c.get("/").text) == who
        # a hashed token is a bearer token of the API too, with its role
        assert c.get("/api/v1/jobs", headers={"Authorization": f"Bearer {BOB}"}).status_code == 200


def test_the_single_write_token_signs_in_where_reads_are_open(tmp_path):
    """Today's setup (EVALSVC_API_TOKEN alone): pages open to all, a sign-in to act."""
    with make_client(tmp_path, users=[], api_token="write-secret-token") as c:
        page = c.get("/", headers=HTML)
        assert page.status_code == 200 and signed_in_as(page.text) is None
        assert 'id="sign-in"' in page.text
        assert sign_in(c, "write-secret-token").status_code == 303
        assert signed_in_as(c.get("/").text) == ("api-token", "write")


def test_a_changed_token_ends_its_sessions(tmp_path):
    with make_client(tmp_path) as c:
        assert sign_in(c, ALICE).status_code == 303
        cookie = {"Cookie": f"{SESSION_COOKIE}={c.cookies[SESSION_COOKIE]}"}
    rotated = [{**USERS[0], "token": "alice-new-token-0123456789"}, USERS[1]]
    with make_client(tmp_path, users=rotated) as c:
        assert c.get("/", headers=cookie, follow_redirects=False).status_code == 401
    with make_client(tmp_path) as c:  # the same settings again: the session holds
        assert signed_in_as(c.get("/", headers=cookie).text) == ("alice", "write")
    with make_client(tmp_path, session_secret="another-secret-of-the-tests") as c:
        assert c.get("/", headers=cookie, follow_redirects=False).status_code == 401


def test_signing_in_and_out_needs_the_forms_csrf_token(tmp_path):
    with make_client(tmp_path) as c:
        c.get("/login")
        for data in ({"token": ALICE}, {"token": ALICE, "csrf_token": "forged"}):
            resp = c.post("/login", data=data, follow_redirects=False)
            assert resp.status_code == 403 and "csrf_token" in resp.text
        assert c.get("/", follow_redirects=False).status_code == 401
        assert sign_in(c, ALICE).status_code == 303
        assert c.post("/logout", follow_redirects=False).status_code == 403
        assert signed_in_as(c.get("/").text) == ("alice", "write")


def test_the_trusted_header_names_the_user_only_when_configured(tmp_path):
    header = "X-Forwarded-User"
    with make_client(tmp_path, trusted_user_header=header) as c:
        # a user of EVALSVC_USERS has their role; anyone else the default (read)
        assert signed_in_as(c.get("/", headers={header: "alice"}).text) == ("alice", "write")
        assert signed_in_as(c.get("/", headers={header: "carol"}).text) == ("carol", "read")
        assert c.get("/api/v1/jobs", headers={header: "carol"}).status_code == 200
        assert c.get("/", headers={header: " "}).status_code == 400
        # the API's writes still take bearer tokens only
        resp = c.post("/api/v1/jobs", json={"matrix": "smoke"}, headers={header: "alice"})
        assert resp.status_code == 401
    with make_client(tmp_path, trusted_user_header=header, trusted_user_role="write") as c:
        assert signed_in_as(c.get("/", headers={header: "carol"}).text) == ("carol", "write")
    with make_client(tmp_path) as c:  # not configured: the header is nobody
        assert c.get("/", headers={header: "alice"}, follow_redirects=False).status_code == 401
        assert c.get("/", headers={**HTML, header: "alice"},
                     follow_redirects=False).status_code == 303


def test_users_come_from_the_environment_as_json(tmp_path, monkeypatch):
    monkeypatch.setenv("EVALSVC_USERS", json.dumps(USERS))
    settings = Settings()
    assert [(u.name, u.role) for u in settings.users] == [("alice", "write"), ("bob", "read")]
    assert settings.users[0].token.get_secret_value() == ALICE
    assert ALICE not in repr(settings)  # a secret, not shown
    bad = [({"name": "x", "role": "write", "token": ALICE,
             "token_sha256": "0" * 64}, "give token or token_sha256"),
           ({"name": "x", "role": "write"}, "give token or token_sha256"),
           ({"name": "api-token", "token": ALICE}, "reserved"),
           ({"name": "a b", "token": ALICE}, "not a user name"),
           ({"name": "x", "role": "admin", "token": ALICE}, "role"),
           ({"name": "x", "token_sha256": "abc"}, "token_sha256"),
           ({"name": "x", "tokn": ALICE}, "tokn")]
    for user, why in bad:
        with pytest.raises(ValidationError, match=why):
            Settings(users=[user])
    with pytest.raises(ValidationError, match="alice named more than once"):
        Settings(users=[USERS[0], USERS[0]])
    monkeypatch.setenv("EVALSVC_USERS", '[{"name": "alice"')
    with pytest.raises(ValidationError, match=r"users\n.*not valid JSON"):
        Settings()
    # empty variables (compose's ${EVALSVC_USERS:-}) set nothing
    for name in ("EVALSVC_USERS", "EVALSVC_SESSION_SECRET", "EVALSVC_TRUSTED_USER_HEADER"):
        monkeypatch.setenv(name, "")
    settings = Settings()
    assert (settings.users, settings.session_secret, settings.trusted_user_header) == ([], None, None)
