"""The results store: SQLAlchemy models, migrations, recording and queries."""

from __future__ import annotations

from sqlalchemy.engine import make_url


def shown_url(url: str) -> str:
    """A database URL as logs and messages show it: its password hidden."""
    return make_url(url).render_as_string(hide_password=True)
