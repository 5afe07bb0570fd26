"""Workloads through ``datasets``: shipped prompts, local files, ShareGPT's shape, errors."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from evalsvc.matrix import WorkloadSpec
from evalsvc.workloads import (
    WorkloadError,
    _sharegpt_prompts,
    check_dataset,
    is_local,
    load_prompts,
    workload_version,
)


def test_builtin_demo_is_deterministic_and_seeded():
    a = load_prompts(WorkloadSpec(num_prompts=6))
    b = load_prompts(WorkloadSpec(num_prompts=6))
    assert [p.id for p in a] == [p.id for p in b] and len({p.id for p in a}) == 6
    other = load_prompts(WorkloadSpec(num_prompts=6, seed=1))
    assert [p.id for p in other] != [p.id for p in a]
    assert workload_version(WorkloadSpec(num_prompts=6), a) != workload_version(
        WorkloadSpec(num_prompts=6, seed=1), other)


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet", ".csv"])
def test_local_files(tmp_path, suffix):
    rows = [{"id": f"q{i}", "prompt": f"question number {i} " * 5} for i in range(5)]
    path = tmp_path / f"prompts{suffix}"
    if suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif suffix == ".parquet":
        pd.DataFrame(rows).to_parquet(path)
    else:
        pd.DataFrame(rows).to_csv(path, index=False)
    prompts = load_prompts(WorkloadSpec(dataset=str(path), text_field="prompt", num_prompts=3))
    assert len(prompts) == 3
    assert {p.text for p in prompts} <= {r["prompt"] for r in rows}


def test_missing_field_and_file_are_named(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"id": 1, "body": "x" * 50}) + "\n")
    with pytest.raises(WorkloadError, match=r"text_field.*'text'.*fields: id, body"):
        load_prompts(WorkloadSpec(dataset=str(path)))
    with pytest.raises(WorkloadError, match="no such file"):
        load_prompts(WorkloadSpec(dataset=str(tmp_path / "absent.jsonl")))
    with pytest.raises(WorkloadError, match="builtin:nope"):
        load_prompts(WorkloadSpec(dataset="builtin:nope"))


def test_sharegpt_first_human_turns(tmp_path):
    convs = [{"id": f"c{i}", "conversations": [
        {"from": "human", "value": f"Please explain topic {i}. " * 20},
        {"from": "gpt", "value": "Sure."}]} for i in range(6)]
    convs.append({"id": "short", "conversations": [{"from": "human", "value": "hi"}]})
    convs.append({"id": "bot-first", "conversations": [{"from": "gpt", "value": "x" * 300}]})
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(convs))
    prompts = _sharegpt_prompts(path, WorkloadSpec(num_prompts=4))
    assert len(prompts) == 4
    assert all(p.id.startswith("c") and "explain topic" in p.text for p in prompts)


def test_paths_are_never_taken_for_hub_names(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "prompts").mkdir()
    for path in ("/etc/passwd", "./x", "../x", "~/x", "a/b/c", "a/../b", "p.jsonl", "prompts",
                 str(tmp_path / "prompts"), "a\\b", "hf://x"):
        assert is_local(path), path
    for name in ("squad", "openai/gsm8k", "builtin:demo"):
        assert not is_local(name), name


def test_local_datasets_under_a_root_only(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    (root / "p.jsonl").write_text(json.dumps({"text": "a prompt " * 5}) + "\n")
    (root / "dir").mkdir()
    (tmp_path / "out.jsonl").write_text((root / "p.jsonl").read_text())
    spec = WorkloadSpec(dataset="p.jsonl")
    assert check_dataset(spec, allow_local=False, root=root) == str(root / "p.jsonl")
    for dataset in ("../out.jsonl", str(tmp_path / "out.jsonl"), "dir", "absent.jsonl"):
        with pytest.raises(WorkloadError, match=r"workload\.dataset"):
            check_dataset(WorkloadSpec(dataset=dataset), allow_local=False, root=root)
    with pytest.raises(WorkloadError, match="not accepted"):
        check_dataset(spec, allow_local=False, root=None)
    assert check_dataset(WorkloadSpec(dataset="openai/gsm8k"), allow_local=False) == "openai/gsm8k"


@pytest.mark.parametrize(("name", "data"), [
    ("bad.parquet", b"PAR1 cut short"), ("bad.jsonl", b"[1, 2]\n"), ("bad.jsonl", b"\xff\xfe\n"),
    ("bad.csv", b""), ("bad.json", b"hello"), ("bad.jsonl", b"secret-token-123 not json\n"),
])
def test_unreadable_files_are_refused_without_their_contents(tmp_path, name, data):
    (tmp_path / name).write_bytes(data)
    with pytest.raises(WorkloadError, match="cannot be read") as err:
        check_dataset(WorkloadSpec(dataset=str(tmp_path / name)))
    assert "secret" not in str(err.value)
