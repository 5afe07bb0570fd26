"""What readers without the write role see of the server's paths: in a job's error, a run's and
a scenario's reasons, the run's log and samples files, its command line, its arguments asked for
and resolved, its reference server's, its build's environment and manifest and, on the job's
page, its engine log's tail, a path under the data directory is shown relative to it
(``<data>/logs/JOB/...``), and any other absolute path by its last part alone
(``.../config.json``). Users of role write (and a service with no accounts, on loopback) see them
as stored."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from evalsvc.store.reads import JobBuild, JobRead, JobRunRead, JobSummary, RunDetail
from evalsvc.web.auth import User

# an absolute path of two parts or more, not inside a word, a URL or a fraction ("tokens/s",
# "http://host:port/generate", "1/2"): what follows a space, a quote or a bracket
_PART = r"[^\s'\"`,;:()\[\]{}<>/]+"
PATH = re.compile(rf"(?<![\w.:/~-])(?:/{_PART}){{2,}}")

Shown = Callable[[str | None], str | None]
J = TypeVar("J", bound=JobRead | JobSummary)
R = TypeVar("R", bound=JobRunRead | RunDetail)
B = TypeVar("B", bound=JobBuild)


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


def job_as_seen(job: J, shown: Shown) -> J:
    """A job (``queries.job_detail``'s, ``job_summaries``') with its error as ``shown``: a copy
    where that changes it."""
    if job.error is None:
        return job
    return job.model_copy(update={"error": shown(job.error)})


def deep_shown(value: Any, shown: Shown) -> Any:
    """``value`` with each string in it (in lists and dicts too, keys aside) as ``shown``."""
    if isinstance(value, str):
        return shown(value)
    if isinstance(value, list | tuple):
        return [deep_shown(v, shown) for v in value]
    if isinstance(value, dict):
        return {k: deep_shown(v, shown) for k, v in value.items()}
    return value


# a run's fields that may hold server paths: its messages and files, its command line and
# arguments, its reference server's, and what a page adds of it (the arguments' table, the log)
RUN_TEXT = ("reason", "log_path", "samples_path", "command", "requested_args", "resolved_args",
            "reference", "args", "log")


def run_as_seen(run: R, shown: Shown) -> R:
    """A run (``queries.run_detail``'s, a job's runs, a page's view of one) with the fields of
    ``RUN_TEXT`` it has and its scenarios' reasons as ``shown``: a copy where that changes it."""
    update: dict[str, object] = {key: deep_shown(value, shown) for key in RUN_TEXT
                                 if (value := getattr(run, key, None)) is not None}
    if isinstance(run, RunDetail):
        update["scenarios"] = [s if s.reason is None
                               else s.model_copy(update={"reason": shown(s.reason)})
                               for s in run.scenarios]
    return run.model_copy(update=update) if update else run


def build_as_seen(build: B, shown: Shown) -> B:
    """A job's build (``queries.job_builds``) with its base environment and manifest (a source
    checkout's location, the environment's interpreter) as ``shown``: a copy."""
    return build.model_copy(update={"base_env": deep_shown(build.base_env, shown),
                                    "manifest": deep_shown(build.manifest, shown)})
