"""Who did what: the audit events people's actions leave (a triage, a job submitted or cancelled,
a bisection started), written in the transaction of the action itself, and read back per target."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, or_, select
from sqlalchemy.orm import Session

from evalsvc.store.models import AuditEvent

TARGETS = ("regression", "job", "bisection")
ACTIONS = ("triage", "submit", "cancel", "bisect")


@dataclass(frozen=True)
class Actor:
    """A person acting: their user name, and where they acted (``api`` or ``dashboard``)."""

    name: str
    via: str


def record(session: Session, actor: Actor, action: str, target_type: str, target_id: str | int,
           comment: str | None = None, details: dict[str, Any] | None = None) -> AuditEvent:
    """Add an event to ``session`` (committed, or rolled back, with the action)."""
    if action not in ACTIONS or target_type not in TARGETS:
        raise ValueError(f"audit: unknown action {action!r} on {target_type!r}")
    event = AuditEvent(user_name=actor.name, via=actor.via, action=action,
                       target_type=target_type, target_id=str(target_id), comment=comment,
                       details=details)
    session.add(event)
    return event


def event_dict(e: AuditEvent) -> dict[str, Any]:
    return {"id": e.id, "at": e.at, "user": e.user_name, "via": e.via, "action": e.action,
            "target_type": e.target_type, "target_id": e.target_id, "comment": e.comment,
            "details": e.details}


def history(session: Session, targets: Iterable[tuple[str, str | int]], limit: int = 500
            ) -> list[dict[str, Any]]:
    """The events on any of ``targets`` ((type, id) pairs), oldest first."""
    pairs = [(t, str(i)) for t, i in targets]
    if not pairs:
        return []
    q = (select(AuditEvent)
         .where(or_(*[(AuditEvent.target_type == t) & (AuditEvent.target_id == i)
                      for t, i in pairs]))
         .order_by(AuditEvent.at, AuditEvent.id).limit(limit))
    return [event_dict(e) for e in session.scalars(q)]


def events(session: Session, *, target_type: str | None = None, target_id: str | None = None,
           user: str | None = None, limit: int = 100) -> list[dict[str, Any]]:
    """Events, newest first, filtered by target and user."""
    q = select(AuditEvent).order_by(AuditEvent.at.desc(), AuditEvent.id.desc()).limit(limit)
    if target_type is not None:
        q = q.where(AuditEvent.target_type == target_type)
    if target_id is not None:
        q = q.where(AuditEvent.target_id == target_id)
    if user is not None:
        q = q.where(AuditEvent.user_name == user)
    return [event_dict(e) for e in session.scalars(q)]


def last_triage_by(session: Session, regression_ids: list[int]) -> dict[int, str]:
    """Who triaged each of these regressions last (those nobody triaged are left out)."""
    if not regression_ids:
        return {}
    last = (select(func.max(AuditEvent.id))
            .where(AuditEvent.action == "triage", AuditEvent.target_type == "regression",
                   AuditEvent.target_id.in_([str(i) for i in regression_ids]))
            .group_by(AuditEvent.target_id))
    return {int(e.target_id): e.user_name
            for e in session.scalars(select(AuditEvent).where(AuditEvent.id.in_(last)))}
