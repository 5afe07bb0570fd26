"""Dashboard sessions ended by signing out (``revoked_sessions``): a session's cookie is signed
and holds no state the server could forget, so a copy taken before signing out would open the
pages until it expires. Signing out records the session's id until then; the guard refuses a
session whose id is recorded."""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from evalsvc.store.models import RevokedSession, utcnow


def revoke(session: Session, session_id: str, user: str, max_age_s: float,
           now: datetime | None = None) -> None:
    """Record that the session ``session_id`` of ``user`` ended: refused for ``max_age_s`` (the
    cookie's lifetime, counted from its last use, which is at the latest now); the records
    whose time is up go."""
    now = now or utcnow()
    session.execute(delete(RevokedSession).where(RevokedSession.expires_at < now))
    if session.get(RevokedSession, session_id) is None:
        session.add(RevokedSession(id=session_id, user_name=user[:200], revoked_at=now,
                                   expires_at=now + timedelta(seconds=max_age_s)))


def revoked(session: Session, session_id: str) -> bool:
    """Whether the session ``session_id`` was ended by signing out."""
    return session.scalar(select(RevokedSession.id).where(RevokedSession.id == session_id)) \
        is not None
