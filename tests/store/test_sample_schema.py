"""The per-sample columns are declared once (``types.SampleScalars``, read as ``SAMPLE_COLUMNS``):
the store's ``samples`` table is made from that declaration, and the migrated database (alembic
head) has the same columns, one by one: name, type, length, NULL or not."""

from __future__ import annotations

from sqlalchemy import inspect

from evalsvc.store.db import make_engine
from evalsvc.store.models import SampleRow
from evalsvc.types import SAMPLE_COLUMNS, SAMPLE_FIELDS, SampleColumn

KEY = ["id", "run_id", "scenario", "sample_id"]  # the row's own key, not a sample field


def shape(name: str, sql_type, nullable: bool) -> tuple:
    return (name, sql_type.python_type, getattr(sql_type, "length", None), nullable)


def declared(c: SampleColumn) -> tuple:
    return (c.name, c.type, c.length, c.nullable)


def test_the_declaration_is_the_row_type():
    assert tuple(c.name for c in SAMPLE_COLUMNS) == SAMPLE_FIELDS
    assert {c.name: c.nullable for c in SAMPLE_COLUMNS if c.nullable} == dict.fromkeys(
        ["kl_k1_mean", "kl_k2_mean", "kl_k3_mean", "kl_k3_max", "topk_kl_mean", "same_top_rate",
         "first_divergence", "accept_length", "extend_tokens", "extend_kl_k3_mean",
         "extend_kl_k3_max"], True)


def test_the_table_is_made_from_the_declaration():
    columns = list(SampleRow.__table__.columns)
    assert [c.name for c in columns] == KEY + list(SAMPLE_FIELDS)
    orm = {c.name: shape(c.name, c.type, c.nullable) for c in columns[len(KEY):]}
    assert orm == {c.name: declared(c) for c in SAMPLE_COLUMNS}
    assert SampleRow.__table__.c.host_cached_tokens.default.arg == 0


def test_the_migrated_database_agrees_column_by_column(store, engines):
    engine = make_engine(store.url)
    engines.append(engine)
    found = {c["name"]: c for c in inspect(engine).get_columns("samples")}
    assert set(found) == set(KEY) | set(SAMPLE_FIELDS)
    for c in SAMPLE_COLUMNS:
        db = found[c.name]
        assert shape(c.name, db["type"], db["nullable"]) == declared(c), c.name
