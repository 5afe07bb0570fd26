"""README.md's settings table is the one ``python -m evalsvc.settings --markdown`` generates from
the settings class, so that the two cannot drift (``--update README.md`` writes it anew)."""

from __future__ import annotations

from pathlib import Path

import pytest

from evalsvc.settings import TABLE_END, TABLE_START, Settings, main, markdown_table, with_table

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_table_is_the_generated_one():
    text = README.read_text()
    assert text.count(TABLE_START) == 1 and text.count(TABLE_END) == 1
    table = text.split(TABLE_START + "\n", 1)[1].split(TABLE_END, 1)[0]
    assert table == markdown_table(), ("README.md's settings table differs from the settings: "
                                       "run `python -m evalsvc.settings --update README.md`")
    assert with_table(text) == text


def test_every_setting_has_a_row_and_a_description():
    table = markdown_table()
    for name, field in Settings.model_fields.items():
        assert field.description, name
        assert f"| `EVALSVC_{name.upper()}` |" in table


def test_update_rewrites_only_the_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    readme = tmp_path / "README.md"
    readme.write_text(f"before\n{TABLE_START}\n| stale |\n{TABLE_END}\nafter\n")
    assert main(["--update", str(readme)]) == 0
    assert readme.read_text() == f"before\n{TABLE_START}\n{markdown_table()}{TABLE_END}\nafter\n"
    assert main(["--markdown"]) == 0
    assert capsys.readouterr().out == markdown_table()
    with pytest.raises(ValueError, match="markers"):
        with_table("no markers here\n")
