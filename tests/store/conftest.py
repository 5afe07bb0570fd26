"""Store fixtures over the databases of tests/conftest.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from evalsvc.store.db import Store


@pytest.fixture
def store(db_url: str) -> Iterator[Store]:
    """The migrated store on the test's database."""
    s = Store(db_url)
    yield s
    s.close()


@pytest.fixture
def results_dir(tmp_path):
    return tmp_path / "results"
