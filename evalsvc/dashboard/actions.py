"""What people do from the dashboard's pages: sign in and out, triage a regression, start a
bisection from it, post a job, cancel one.

Each form carries the session's CSRF token and posts here; each action goes through the service
code the API's routes call (``verdicts.triage_regression``, ``Bisector.submit``,
``JobService.submit`` and ``cancel``), which records it with the user and the time. Only users of
role write act (``require_form_write``); the guard refuses the others before the body is read, and
the pages show them no controls. A refused form comes back with the problem named and nothing
stored.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Form, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse
from pydantic import ValidationError

from evalsvc.bisect import BisectCreate
from evalsvc.dashboard.views import job_form, page, problem, regression_page
from evalsvc.jobs import JobCreate, JobError
from evalsvc.store.audit import Actor
from evalsvc.store.sessions import revoke
from evalsvc.validation import describe_errors
from evalsvc.verdicts import triage_regression
from evalsvc.web.auth import Accounts, User, csrf_matches
from evalsvc.web.deps import ServicesDep, SessionDep, current_user, require_read
from evalsvc.web.middleware import WRITES_OFF, read_only
from evalsvc.web.params import JobId, RegressionId, TriageUpdate

log = logging.getLogger("evalsvc.dashboard")
VIA = "dashboard"
TRIGGER = "dashboard"  # the trigger of the jobs posted here

FormText = Annotated[str, Form(max_length=5000)]
CsrfField = Annotated[str | None, Form(max_length=200)]


class FormRefused(Exception):
    """A form the dashboard will not act on (no user, a read user, no valid CSRF token): the
    error page, with this status and message."""

    def __init__(self, status_code: int, message: str) -> None:
        super().__init__(message)
        self.status_code, self.message = status_code, message


async def form_refused(request: Request, exc: FormRefused) -> HTMLResponse:
    return problem(request, exc.status_code, exc.message)


def check_csrf(request: Request, given: str | None) -> None:
    if not csrf_matches(request.session, given):
        raise FormRefused(403, "csrf_token: missing, or not this session's (a form from an "
                               "earlier sign-in, or from another site): reload the page and "
                               "send the form again")


def require_form_write(request: Request, csrf_token: CsrfField = None) -> User:
    """A user of role write sending a form of this session (the guard checked the role already;
    the CSRF token needs the body)."""
    accounts: Accounts = request.app.state.accounts
    user = current_user(request)
    if accounts.guarded and not accounts.writable:
        raise FormRefused(403, WRITES_OFF)
    if user is None:
        raise FormRefused(401, "this needs a signed-in user of role write: sign in first")
    if not user.can_write:
        raise FormRefused(403, read_only(user))
    check_csrf(request, csrf_token)
    return user


FormUser = Annotated[User, Depends(require_form_write)]
sign_in_router = APIRouter(include_in_schema=False, default_response_class=HTMLResponse)
router = APIRouter(dependencies=[Depends(require_read)], include_in_schema=False,
                   default_response_class=HTMLResponse)


def _actor(user: User) -> Actor:
    return Actor(user.name, VIA)


def _next(target: str | None) -> str:
    """Where to go after signing in: a path of this site, never another site."""
    if (not target or not target.startswith("/") or target.startswith("//") or "\\" in target
            or not target.isprintable()):
        return "/"
    return target


# ---- signing in and out ------------------------------------------------------------------------

def login_page(request: Request, status_code: int = 200, error: str | None = None,
               next_url: str = "/") -> HTMLResponse:
    accounts: Accounts = request.app.state.accounts
    return page(request, "login.html", status_code, title="Sign in", error=error,
                next_url=_next(next_url), tokens=bool(accounts.accounts),
                header=accounts.header_name)


@sign_in_router.get("/login")
def read_login_page(request: Request, next: Annotated[str, Query(max_length=2000)] = "/"
                    ) -> HTMLResponse:
    """The sign-in form: a token of this service (a user's, or the write or read token)."""
    return login_page(request, next_url=next)


@sign_in_router.post("/login")
def create_session(request: Request, token: Annotated[str, Form(max_length=500)] = "",
                   next: Annotated[str, Form(max_length=2000)] = "/",
                   csrf_token: CsrfField = None) -> Any:
    """Sign in: a token of this service starts a session (a signed, HttpOnly, SameSite cookie)."""
    check_csrf(request, csrf_token)
    accounts: Accounts = request.app.state.accounts
    account = accounts.by_token(token.strip().encode())
    if account is None:
        client = request.client.host if request.client else "?"
        log.warning("sign-in refused from %s: not a token of this service", client)
        return login_page(request, 401, "token: not a token of this service", next)
    accounts.sign_in(request.session, account)
    log.info("%s signed in (role %s)", account.name, account.role)
    return RedirectResponse(_next(next), status_code=303)


@sign_in_router.post("/logout")
def delete_session(request: Request, csrf_token: CsrfField = None) -> RedirectResponse:
    """Sign out: the session ends, on the server too: its cookie is cleared, and its id is
    recorded until the cookie would have expired, so a copy of the cookie names nobody."""
    check_csrf(request, csrf_token)
    user = current_user(request)
    if user is not None and user.how == "session" and user.session_id is not None:
        services = request.app.state.services
        max_age = services.settings.session_max_age_s
        services.store.write(lambda s: revoke(s, user.session_id, user.name, max_age),
                             f"the end of a session of {user.name}")
        log.info("%s signed out", user.name)
    request.session.clear()
    return RedirectResponse(request.url_for("read_login_page").path, status_code=303)


# ---- regressions ---------------------------------------------------------------------------------

@router.post("/regressions/{regression_id}/triage")
def create_triage_form(regression_id: RegressionId, request: Request, session: SessionDep,
                       services: ServicesDep, user: FormUser, triage: FormText = "",
                       comment: FormText = "", link: FormText = "") -> Any:
    """Triage a regression (acknowledged, expected, fixed, or untriaged again) with a comment and
    a link."""
    try:
        body = TriageUpdate(triage=triage or None, comment=comment.strip() or None,
                            link=link.strip() or None)
    except ValidationError as exc:
        return regression_page(request, session, regression_id, 422, error=describe_errors(exc),
                               comment=comment, link=link)
    try:  # committed before the redirect is answered (the page it leads to shows the triage)
        with services.store.session() as s:
            triage_regression(s, regression_id, body.triage, body.comment,
                                      actor=_actor(user), link=body.link)
    except KeyError:
        return problem(request, 404, f"no regression {regression_id}")
    url = request.url_for("read_regression_page", regression_id=regression_id)
    return RedirectResponse(f"{url.path}#history", status_code=303)


@router.post("/regressions/{regression_id}/bisect")
def create_bisection_form(regression_id: RegressionId, request: Request, session: SessionDep,
                          services: ServicesDep, user: FormUser,
                          num_prompts: FormText = "") -> Any:
    """Start a bisection of a regression: between its last good and its first bad commit."""
    try:
        workload = {"num_prompts": int(num_prompts)} if num_prompts.strip() else None
    except ValueError:
        return regression_page(request, session, regression_id, 422,
                               error=f"num_prompts: {num_prompts[:50]!r} is not a whole number")
    try:
        bisect_id = services.bisector.submit(
            BisectCreate(regression_id=regression_id, workload=workload), actor=_actor(user))
    except JobError as exc:
        return regression_page(request, session, regression_id, 422, error=str(exc))
    return RedirectResponse(request.url_for("read_bisection_page", bisect_id=bisect_id).path,
                            status_code=303)


# ---- jobs ------------------------------------------------------------------------------------------

def _patches(text: str) -> list[str]:
    return [p.strip() for p in text.replace("\n", ",").split(",") if p.strip()]


@router.post("/jobs")
def create_job_form(request: Request, services: ServicesDep, user: FormUser,
                    matrix: FormText = "",
                    configs: Annotated[list[str] | None, Form(max_length=1000)] = None,
                    baseline_source: FormText = "", baseline_patches: FormText = "",
                    second_build: FormText = "", contender_source: FormText = "",
                    contender_patches: FormText = "", num_prompts: FormText = "",
                    track: FormText = "", priority: FormText = "0", engine_env: FormText = "",
                    model: FormText = "") -> Any:
    """Post a job: a matrix, or some of its configs, on one build or two (say a commit with and
    without a fix, compared when it is done)."""
    builds = [(baseline_source.strip(), baseline_patches.strip())]
    if second_build:
        builds.append((contender_source.strip(), contender_patches.strip()))
    values = {"num_prompts": num_prompts, "track": bool(track), "priority": priority,
              "engine_env": engine_env, "model": model}

    def refused(error: str) -> HTMLResponse:
        return page(request, "job_new.html", 422, title="Post a job",
                    form=job_form(matrix, configs or [], builds, services.settings, **values,
                                  error=error))

    try:
        prompts = int(num_prompts) if num_prompts.strip() else None
        rank = int(priority or 0)
    except ValueError:
        return refused("num_prompts, priority: whole numbers")
    try:
        body = JobCreate(matrix=matrix, configs=configs or None,
                         builds=[{"source": source or None, "patches": _patches(patches)}
                                 for source, patches in builds],  # errors: builds.N.FIELD
                         workload={"num_prompts": prompts} if prompts is not None else None,
                         engine_env=engine_env.strip() or None, model=model.strip() or None,
                         track=bool(track), priority=rank)
    except ValidationError as exc:
        return refused(describe_errors(exc))
    try:
        job_id = services.jobs.submit(body, trigger=TRIGGER, actor=_actor(user))
    except JobError as exc:
        return refused(str(exc))
    return RedirectResponse(request.url_for("read_job_page", job_id=job_id).path,
                            status_code=303)


@router.post("/jobs/{job_id}/cancel")
def create_cancel_form(job_id: JobId, request: Request, services: ServicesDep,
                       user: FormUser) -> Any:
    """Cancel a job: a queued one never starts, a running one stops its engines."""
    if services.jobs.cancel(job_id, actor=_actor(user)) is None:
        return problem(request, 404, f"no job {job_id}")
    return RedirectResponse(request.url_for("read_job_page", job_id=job_id).path,
                            status_code=303)

