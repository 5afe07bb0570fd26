"""EVALSVC_CONFIGS_DIR: the operator's own matrices, thresholds.yaml and nightly.yaml, looked up
before the shipped ones in evalsvc/configs (a file of the same name there overrides the shipped
one; the other shipped files stay available), names kept inside their directory, and a bad value
refused naming the setting."""

from __future__ import annotations

import pytest
import yaml
from pydantic import ValidationError

from evalsvc.matrix import MatrixError, load_matrix, matrix_files, matrix_names
from evalsvc.nightly import load_schedules
from evalsvc.paths import SHIPPED_CONFIGS_DIR, config_file, configs_dirs
from evalsvc.settings import Settings
from evalsvc.thresholds import THRESHOLDS_FILE, load_thresholds

SMOKE = yaml.safe_load((SHIPPED_CONFIGS_DIR / "smoke.yaml").read_text())


def matrix(name: str, description: str) -> str:
    return yaml.safe_dump({**SMOKE, "name": name, "description": description})


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    directory = tmp_path / "mine"
    directory.mkdir()
    monkeypatch.setenv("EVALSVC_CONFIGS_DIR", str(directory))
    return directory


def test_shipped_files_are_package_data():
    assert SHIPPED_CONFIGS_DIR.parent.name == "evalsvc" and SHIPPED_CONFIGS_DIR.name == "configs"
    assert {"smoke", "smoke-bf16", "mamba-full", "sglang-cpu"} <= set(matrix_names())
    assert THRESHOLDS_FILE.is_file() and (SHIPPED_CONFIGS_DIR / "nightly.yaml").is_file()


def test_unset_or_empty_means_the_shipped_files_alone(monkeypatch):
    monkeypatch.delenv("EVALSVC_CONFIGS_DIR", raising=False)
    assert configs_dirs() == [SHIPPED_CONFIGS_DIR]
    monkeypatch.setenv("EVALSVC_CONFIGS_DIR", "")
    assert configs_dirs() == [SHIPPED_CONFIGS_DIR]
    assert Settings().configs_dir is None


def test_a_new_matrix_joins_the_shipped_ones(user_dir):
    (user_dir / "mine.yaml").write_text(matrix("mine", "the operator's own"))
    assert matrix_files()["mine"] == user_dir / "mine.yaml"
    assert {"mine", "smoke", "smoke-bf16"} <= set(matrix_names())
    assert load_matrix("mine").description == "the operator's own"
    assert load_matrix("smoke").description == SMOKE["description"]  # the shipped one, still
    assert Settings().configs_dir == user_dir.resolve()


def test_a_file_of_the_same_name_overrides_the_shipped_one(user_dir):
    (user_dir / "smoke.yaml").write_text(matrix("smoke", "overridden"))
    assert load_matrix("smoke").description == "overridden"
    assert matrix_files()["smoke"] == user_dir / "smoke.yaml"
    assert matrix_names().count("smoke") == 1
    # thresholds.yaml and nightly.yaml: the same rule
    assert config_file("thresholds.yaml") == THRESHOLDS_FILE
    (user_dir / "thresholds.yaml").write_text(THRESHOLDS_FILE.read_text())
    (user_dir / "nightly.yaml").write_text("schedules: []\n")
    assert config_file("thresholds.yaml") == user_dir / "thresholds.yaml"
    assert load_thresholds() is not None
    assert load_schedules() == []


def test_the_operators_matrices_go_through_the_engine_flag_allowlist(user_dir, tmp_path):
    data = {**SMOKE, "name": "flags", "extra_args": {"some-unknown-flag": True}}
    (user_dir / "flags.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(MatrixError, match="extra_args"):
        load_matrix("flags")
    elsewhere = tmp_path / "flags.yaml"  # the operator's own file, by path: not checked
    elsewhere.write_text(yaml.safe_dump(data))
    assert load_matrix(elsewhere).extra_args == {"some-unknown-flag": True}


@pytest.mark.parametrize("name", ["../smoke", "../mine/smoke", "/etc/passwd", "sub/x", "..", "a\0b"])
def test_a_name_never_leaves_its_directory(user_dir, name):
    (user_dir / "sub").mkdir()
    (user_dir / "sub" / "x.yaml").write_text(matrix("x", "below"))
    with pytest.raises(MatrixError, match="by name, not by path"):
        load_matrix(name)


def test_a_link_out_of_the_directory_is_not_followed(user_dir, tmp_path):
    outside = tmp_path / "outside.yaml"
    outside.write_text(matrix("evil", "outside the directory"))
    (user_dir / "evil.yaml").symlink_to(outside)
    assert "evil" not in matrix_names()
    with pytest.raises(MatrixError, match="no such matrix"):
        load_matrix("evil")


@pytest.mark.parametrize("kind", ["missing", "file"])
def test_a_bad_directory_is_refused_naming_the_setting(tmp_path, monkeypatch, kind):
    bad = tmp_path / "nope"
    if kind == "file":
        bad.write_text("not a directory")
    monkeypatch.setenv("EVALSVC_CONFIGS_DIR", str(bad))
    expected = "no such directory" if kind == "missing" else "not a directory"
    with pytest.raises(ValidationError, match=f"EVALSVC_CONFIGS_DIR=.*{expected}"):
        Settings()
    with pytest.raises(ValueError, match=f"EVALSVC_CONFIGS_DIR=.*{expected}"):
        load_matrix("smoke")


def test_the_api_lists_and_serves_the_operators_matrices(user_dir, tmp_path):
    from fastapi.testclient import TestClient

    from evalsvc.app import create_app

    (user_dir / "mine.yaml").write_text(matrix("mine", "the operator's own"))
    (user_dir / "smoke.yaml").write_text(matrix("smoke", "overridden"))
    settings = Settings(data_dir=tmp_path / "data", nightly=False)
    with TestClient(create_app(settings, start_runner=False)) as client:
        listed = {m["name"]: m for m in client.get("/api/v1/matrices").json()}
        assert listed["mine"]["description"] == "the operator's own"
        assert listed["smoke"]["description"] == "overridden" and "smoke-bf16" in listed
        assert client.get("/api/v1/matrices/mine").json()["name"] == "mine"
        assert client.get("/api/v1/matrices/..%2Fmine").status_code == 404
