"""Alerts: a webhook message (Slack-compatible JSON) when a job opens regressions and when it closes
them.

When a job ends, the regressions its runs opened become one ``appeared`` alert and the ones its
runs closed one ``resolved`` alert; the store holds at most one of each kind per job, and a
regression is opened once per series until it resolves, so nothing is announced twice, whatever
restarts or retries happen. Delivery is separate: undelivered alerts are posted to
``EVALSVC_ALERT_WEBHOOK`` and retried (up to ``MAX_ATTEMPTS``) at the next job end or service start.
"""

from __future__ import annotations

import logging
from typing import Any

import httpx
from sqlalchemy import select
from sqlalchemy.orm import Session, aliased

from evalsvc.store.db import Store
from evalsvc.store.models import Alert, Build, Commit, Regression, Run, utcnow
from evalsvc.tls import tls_context

log = logging.getLogger("evalsvc.alerts")
MAX_ATTEMPTS = 5
LABELS = {"kl_k3_mean": "KL", "accept_length": "acceptance"}


def collect(session: Session, job_id: str, public_url: str | None = None) -> list[Alert]:
    """Create the job's alerts (if it opened or closed regressions and has none of that kind)."""
    first, resolved = aliased(Run), aliased(Run)
    opened = session.scalars(select(Regression).join(first, Regression.first_run_id == first.id)
                             .where(first.job_id == job_id).order_by(Regression.id)).all()
    closed = session.scalars(select(Regression)
                             .join(resolved, Regression.resolved_run_id == resolved.id)
                             .where(resolved.job_id == job_id).order_by(Regression.id)).all()
    out = []
    for kind, regs in (("appeared", opened), ("resolved", closed)):
        if not regs or session.scalars(select(Alert).where(Alert.job_id == job_id,
                                                           Alert.kind == kind)).first():
            continue
        alert = Alert(job_id=job_id, kind=kind, regression_ids=[r.id for r in regs],
                      payload=message(session, kind, regs, job_id, public_url))
        session.add(alert)
        out.append(alert)
        log.info("alert: %d regression(s) %s", len(regs), kind)
    session.flush()
    return out


def _commit_label(session: Session, run_id: int | None) -> str:
    if run_id is None:
        return "?"
    row = session.execute(select(Commit.sha, Commit.version, Commit.repository)
                          .join(Build, Build.commit_id == Commit.id)
                          .join(Run, Run.build_id == Build.id).where(Run.id == run_id)).first()
    if row is None:
        return "?"
    return (row.sha or "")[:10] or f"{row.repository}=={row.version}"


def message(session: Session, kind: str, regs: list[Regression], job_id: str,
            public_url: str | None) -> dict[str, Any]:
    """Slack's incoming-webhook JSON: ``text`` (shown in notifications, and all that simpler
    receivers read) and ``blocks`` (the same, formatted)."""
    icon = ":rotating_light:" if kind == "appeared" else ":white_check_mark:"
    head = (f"{icon} evalsvc: {len(regs)} regression(s) {kind} in job {job_id}")
    lines = []
    for r in regs:
        run_id = r.first_run_id if kind == "appeared" else r.resolved_run_id
        where = f"at {_commit_label(session, run_id)}"
        if kind == "appeared" and r.last_good_run_id:
            where += f" (last good {_commit_label(session, r.last_good_run_id)})"
        link = f" <{public_url.rstrip('/')}/runs/{run_id}|run {run_id}>" if public_url else ""
        lines.append(f"• {r.config} / {r.scenario} / {LABELS.get(r.metric, r.metric)} "
                     f"{where}{link}")
    text = head + "\n" + "\n".join(lines)
    return {"text": text,
            "blocks": [{"type": "section", "text": {"type": "mrkdwn", "text": text}}]}


def deliver(store: Store, webhook: str | None, timeout: float = 10.0) -> int:
    """Post the undelivered alerts; returns how many were delivered now."""
    if not webhook:
        return 0
    with store.session() as s:
        pending = [(a.id, a.payload) for a in s.scalars(
            select(Alert).where(Alert.delivered_at.is_(None), Alert.attempts < MAX_ATTEMPTS)
            .order_by(Alert.id))]
    sent = 0
    for alert_id, payload in pending:
        error = None
        try:
            resp = httpx.post(webhook, json=payload, timeout=timeout, verify=tls_context())
            if resp.status_code >= 300:
                error = f"HTTP {resp.status_code}: {resp.text[:200]}"
        except httpx.HTTPError as exc:
            error = f"{type(exc).__name__}: {exc}"
        with store.session() as s:
            a = s.get(Alert, alert_id)
            a.attempts += 1
            a.error = error
            if error is None:
                a.delivered_at = utcnow()
                sent += 1
            else:
                log.warning("alert %d not delivered (attempt %d): %s", alert_id, a.attempts, error)
    return sent
