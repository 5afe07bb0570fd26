"""Shared test fixtures: the demo prompts, and databases.

Databases: tests taking ``db_url`` run once on SQLite and once on PostgreSQL, each in a database of
its own. PostgreSQL: a fresh database per test, created through the admin database named by
``EVALSVC_TEST_POSTGRES_URL`` (default: the local server's ``postgres`` database) and dropped
afterwards. Without a reachable server these tests are skipped, or fail when ``CI`` is set.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import resources
from pathlib import Path

import pytest
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError
from sqlalchemy.pool import NullPool


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def pytest_configure(config: pytest.Config) -> None:
    """SIGTERM (a CI runner's time limit, ``timeout``, ``kill``) stops the run as Ctrl-C does: the
    running test unwinds through its ``with`` blocks and fixtures, which stop the engines and
    services it started. Python's default would end the process at once and leave them running
    (an engine runs in a session of its own). In each pytest-xdist worker too. A
    ``KeyboardInterrupt``, not ``evalsvc.children.exit_on_sigterm``'s ``SystemExit``: pytest
    records a ``SystemExit`` as the test's failure and goes on to the next test."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The slow tests (engine processes, services, browsers: seconds to minutes each) first, in
    their order, then the rest: the workers then end on short tests together, not one worker on a
    long one while the other idles (longest first, by the one mark that says so)."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(autouse=True)
def torch_threads_as_an_engine() -> None:
    """The tests that run the engine's model in this process (``LocalEngine``, the model and
    numerics tests) run it with the torch threads an engine process has
    (``EVALSVC_ENGINE_THREADS``, default 1), not torch's default of one per core: on the tiny
    models the second thread only spins, and the in-process model tests cost 1.7 times the CPU
    with it (BENCHMARKS.md). Set where this process has torch already (each test checks again:
    a test module may import it late); a process without torch never imports it here."""
    torch = sys.modules.get("torch")
    if torch is None:
        return
    from evalsvc.engines.embedded.server import engine_threads

    if torch.get_num_threads() != engine_threads():
        torch.set_num_threads(engine_threads())


@pytest.fixture(scope="session")
def demo_prompts() -> list[str]:
    lines = resources.files("evalsvc").joinpath("assets/prompts/demo.jsonl").read_text()
    return [json.loads(line)["text"] for line in lines.splitlines() if line.strip()]


DEFAULT_POSTGRES_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
DB_PREFIX = f"evalsvc_test_{os.getpid()}_"
BACKENDS = ["sqlite", "postgresql"]


def postgres_admin_url() -> str:
    return os.environ.get("EVALSVC_TEST_POSTGRES_URL") or DEFAULT_POSTGRES_URL


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def _shown(url: str) -> str:
    return make_url(url).render_as_string(hide_password=True)


def _drop(admin: Engine, name: str) -> None:
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture(scope="session")
def postgres_admin() -> Iterator[Engine]:
    """An autocommit engine on the admin database; skips (fails under CI) when unreachable."""
    url = postgres_admin_url()
    admin = create_engine(url, isolation_level="AUTOCOMMIT", poolclass=NullPool,
                          connect_args={"connect_timeout": 5})
    try:
        with admin.connect() as conn:
            conn.execute(text("SELECT 1"))
    except OperationalError as exc:
        admin.dispose()
        msg = (f"PostgreSQL not reachable at {_shown(url)} (set EVALSVC_TEST_POSTGRES_URL): "
               f"{str(exc.orig or exc).strip().splitlines()[0]}")
        if in_ci():
            pytest.fail(f"CI is set and the store's PostgreSQL tests need a server: {msg}",
                        pytrace=False)
        pytest.skip(msg)
    yield admin
    # a safety net: anything a crashed test left behind
    with admin.connect() as conn:
        left = conn.execute(text("SELECT datname FROM pg_database WHERE datname LIKE :p"),
                            {"p": DB_PREFIX.replace("_", r"\_") + "%"}).scalars().all()
    for name in left:
        _drop(admin, name)
    admin.dispose()


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    """Engines a test makes on its database: appended here, disposed before the database goes
    (``db_url`` disposes them: it is torn down before this fixture)."""
    made: list[Engine] = []
    yield made
    for engine in made:
        engine.dispose()


@contextmanager
def database(request: pytest.FixtureRequest, kind: str, tmp_dir: Path,
             engines: list[Engine]) -> Iterator[str]:
    """The URL of an empty database of its own: a SQLite file, or a PostgreSQL database dropped
    afterwards (``engines`` disposed first)."""
    if kind == "sqlite":
        yield f"sqlite:///{tmp_dir / 'store.db'}"
        return
    admin: Engine = request.getfixturevalue("postgres_admin")
    name = f"{DB_PREFIX}{uuid.uuid4().hex[:10]}"
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield make_url(postgres_admin_url()).set(database=name).render_as_string(hide_password=False)
    finally:
        for engine in engines:
            engine.dispose()
        _drop(admin, name)


@pytest.fixture(params=BACKENDS)
def db_url(request: pytest.FixtureRequest, tmp_path: Path, engines: list[Engine]) -> Iterator[str]:
    """An empty database for one test: a SQLite file in tmp_path, or a PostgreSQL database."""
    with database(request, request.param, tmp_path, engines) as url:
        yield url


@pytest.fixture(scope="module", params=BACKENDS)
def module_db_url(request: pytest.FixtureRequest, tmp_path_factory) -> Iterator[str]:
    """An empty database shared by a module's tests (for read-only tests on one data set)."""
    with database(request, request.param, tmp_path_factory.mktemp("store"), []) as url:
        yield url


