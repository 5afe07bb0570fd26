"""Workloads through ``datasets``: shipped prompts, local files, ShareGPT's shape, errors."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from evalsvc.matrix import WorkloadSpec
from evalsvc.workloads import WorkloadError, _sharegpt_prompts, load_prompts, workload_version


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
