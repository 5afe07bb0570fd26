"""What readers without the write role see of the server's paths: in a job's error, a run's and
a scenario's reasons, and the run's log and samples files, a path under the data directory is
shown relative to it (``<data>/logs/JOB/...``), and any other absolute path by its last part
alone (``.../config.json``). Users of role write (and a service with no accounts, on loopback)
see them as stored."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from evalsvc.web.auth import User

# an absolute path of two parts or more, not inside a word, a URL or a fraction ("tokens/s",
# "http://host:port/generate", "1/2"): what follows a space, a quote or a bracket
_PART = r"[^\s'\"`,;:()\[\]{}<>/]+"
PATH = re.compile(rf"(?<![\w.:/~-])(?:/{_PART}){{2,}}")

Shown = Callable[[str | None], str | None]


def redact_paths(text: str, data_dir: str | Path) -> str:
    roots = sorted({str(Path(data_dir).absolute()), str(Path(data_dir).resolve())}, key=len,
                   reverse=True)

    def shown(match: re.Match) -> str:
        path = match.group(0)
        end = len(path.rstrip("."))  # the full stop of a sentence is no part of it
        path, tail = path[:end], path[end:]
        for root in roots:
            if path == root or path.startswith(root + "/"):
                return f"<data>{path[len(root):]}{tail}"
        return f".../{path.rsplit('/', 1)[-1]}{tail}"

    return PATH.sub(shown, text)


def for_reader(user: User | None, data_dir: str | Path) -> Shown:
    """How ``user`` sees a message or a path: as stored for a user of role write, else with the
    server's paths redacted."""
    if user is not None and user.can_write:
        return lambda text: text
    return lambda text: text if text is None else redact_paths(text, data_dir)


def job_as_seen(job: dict[str, Any], shown: Shown) -> dict[str, Any]:
    """A job's dict (``queries.job_detail``, ``job_summaries``) with its error as ``shown``."""
    if job.get("error") is not None:
        job["error"] = shown(job["error"])
    return job


def run_as_seen(run: dict[str, Any], shown: Shown) -> dict[str, Any]:
    """A run's dict (``queries.run_detail``, a job's runs) with its reason, its scenarios'
    reasons and its files as ``shown``."""
    for key in ("reason", "log_path", "samples_path"):
        if run.get(key) is not None:
            run[key] = shown(run[key])
    for scenario in run.get("scenarios") or []:
        if isinstance(scenario, dict) and scenario.get("reason") is not None:
            scenario["reason"] = shown(scenario["reason"])
    return run
