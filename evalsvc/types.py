"""Plain data shared by every layer: what one engine response and one evaluated sample look like,
the verdicts a run and its scenarios take, and the statuses of a job.

No behaviour beyond small derived properties; logprobs are natural-log, aligned by token position.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Annotated, Any, Literal, NotRequired, Protocol, TypedDict


class Verdict(StrEnum):
    """A run's or a scenario's verdict, from best to worst (the order ``worst`` takes): the
    values are the strings stored and served."""

    PASS = "pass"
    EXPECTED = "expected"  # it fails as a known failure (a regression triaged expected) does
    INCONCLUSIVE = "inconclusive"  # the scenario did not exercise what it measures
    FAIL = "fail"
    MEASURED = "measured"  # measured, not judged yet (the harness's; ``judging.judge_run`` judges)
    INVALID = "invalid"  # the engine did not run what was asked
    ERROR = "error"
    CANCELLED = "cancelled"


VERDICT_ORDER = tuple(Verdict)  # best first


def worst(scenarios: Iterable[tuple[str, str, str | None]]) -> tuple[Verdict, str | None]:
    """The worst verdict of ``(name, verdict, reason)`` triples (pass for none) and, when it is
    not a pass, its reason: ``"NAME: REASON"`` of the first that has it; None for a pass."""
    items = list(scenarios)
    if not items:
        return Verdict.PASS, None
    verdict = max((Verdict(v) for _, v, _ in items), key=VERDICT_ORDER.index)
    if verdict == Verdict.PASS:
        return verdict, None
    name, _, reason = next(s for s in items if s[1] == verdict)
    return verdict, f"{name}: {reason}"


class MetricVerdict(StrEnum):
    """A metric's verdict in one scenario (``judging.Judgement``, the ``verdicts`` table): the
    values are the strings stored and served."""

    PASS = "pass"
    REGRESSION = "regression"
    IMPROVEMENT = "improvement"
    INCONCLUSIVE = "inconclusive"  # the scenario did not exercise it (hit coverage)
    EXPECTED = "expected"  # it regressed as a known failure did (an open regression triaged so)


class JobStatus(StrEnum):
    """A job's status: the values are the strings stored and served."""

    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


FINISHED_JOB_STATUSES = frozenset({JobStatus.DONE, JobStatus.FAILED, JobStatus.CANCELLED})


class RunStatus(StrEnum):
    """A run's status: the values are the strings stored and served."""

    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"
    CANCELLED = "cancelled"  # cancelled while it ran (its verdict says so too)


@dataclass(frozen=True)
class RunEvent:
    """What a dispatcher tells the job of one of its runs as it happens, a value on the job's
    queue (``Dispatcher.submit``'s ``events``): ``started`` when a slot starts it, ``engine`` once
    its engine's process exists on this machine (``pid``: its process group), ``ended`` once its
    future is done (``jobs.run.run_job`` posts that one itself)."""

    run_id: int
    kind: Literal["started", "engine", "ended"]
    pid: int | None = None


class EventQueue(Protocol):
    """Where a job's ``RunEvent``s go: a ``queue.Queue`` (its ``put``)."""

    def put(self, event: RunEvent) -> None: ...


@dataclass
class SpecCounters:
    """Raw speculative-decoding counters of one request, whatever the server version called them.

    ``verify_ct``: target verify forwards; ``correct_drafts``: accepted draft tokens (bonus tokens
    excluded); ``proposed_drafts``: draft tokens proposed (``verify_ct * (draft_tokens - 1)`` in
    SGLang's chain drafting); ``completion_tokens``: tokens generated, including the one sampled by
    prefill; ``histogram[i]``: verify steps that accepted exactly i drafts, when reported.
    """

    verify_ct: int
    completion_tokens: int
    correct_drafts: int | None = None
    proposed_drafts: int | None = None
    histogram: list[int] | None = None
    draft_tokens: int | None = None  # tokens per verify step (steps + 1 with top-k 1)


@dataclass
class TopLogprobs:
    """Per position, the top-k (token_id, logprob) pairs a server returned."""

    positions: list[list[tuple[int, float]]]


@dataclass
class Completion:
    """What a generate call returned, parsed: ``logprobs[i]`` is the logprob of ``token_ids[i]``."""

    token_ids: list[int]
    logprobs: list[float]
    prompt_tokens: int
    cached_tokens: int
    finish_reason: dict | None = None
    top: TopLogprobs | None = None
    input_logprobs: list[float | None] = field(default_factory=list)
    input_top: TopLogprobs | None = None
    spec: SpecCounters | None = None
    text: str = ""
    host_cached_tokens: int = 0


@dataclass(frozen=True)
class Stored:
    """How a sample field is kept in the store's ``samples`` table, beyond its type (an
    ``Annotated`` note on a ``SampleScalars`` field): a string's most characters; a column that
    takes NULL though the field always has a value (the store has always allowed it there); the
    value a row written without it gets."""

    length: int | None = None
    nullable: bool = False
    default: Any = None


NULLABLE = Stored(nullable=True)


class SampleScalars(TypedDict):
    """One sample's scalars, the columns of its row in the store (``Sample``): token counts, the
    means and maxima over its generated tokens of the KL estimators (nats), the index of the first
    token whose logprobs differ from the reference's (None: none), the same of the extend (the
    prompt tokens prefilled on a cached prefix, against a cold prefill; None without any).

    The one declaration of those columns: ``store.models.SampleRow`` makes its columns from it
    (``SAMPLE_COLUMNS``); the migrations, history, must agree (tests/store/test_sample_schema.py).
    A column takes NULL when its field may be None or absent, or is noted ``NULLABLE``."""

    prompt_id: Annotated[str, Stored(length=200)]
    prompt_tokens: int
    cached_tokens: int
    host_cached_tokens: Annotated[int, Stored(default=0)]
    completion_tokens: int
    hit: bool
    kl_k1_mean: Annotated[float, NULLABLE]
    kl_k2_mean: Annotated[float, NULLABLE]
    kl_k3_mean: Annotated[float, NULLABLE]
    kl_k3_max: Annotated[float, NULLABLE]
    topk_kl_mean: NotRequired[float]  # with both sides' top-k lists
    same_top_rate: NotRequired[float]
    first_divergence: int | None
    accept_length: float | None  # completion tokens per verify step (speculative decoding)
    extend_tokens: Annotated[int, NULLABLE]  # NULL: stored before the extend was measured
    extend_kl_k3_mean: float | None
    extend_kl_k3_max: float | None


class SampleTokens(TypedDict):
    """One sample's per-token lists, kept in the run's Parquet file: the output ids, both sides'
    logprobs (natural log, aligned by position), and per position both sides' top-k ids and
    logprobs (None without them); the same of the extend's prompt tokens (ids and both sides'
    logprobs, no top-k)."""

    output_ids: list[int]
    decode_logprobs: list[float]
    reference_logprobs: list[float]
    decode_top_ids: list[list[int]] | None
    decode_top_logprobs: list[list[float | None]] | None
    reference_top_ids: list[list[int]] | None
    reference_top_logprobs: list[list[float | None]] | None
    extend_ids: list[int]
    extend_logprobs: list[float]
    extend_reference_logprobs: list[float]


class SampleFields(SampleScalars, SampleTokens):
    """One evaluated sample, as ``harness.score`` makes it."""

    sample_id: str


# the keys of each part, in the order the store and the Parquet file take them
SAMPLE_FIELDS = tuple(SampleScalars.__annotations__)
TOKEN_FIELDS = tuple(SampleTokens.__annotations__)


@dataclass(frozen=True)
class SampleColumn:
    """One column of the store's ``samples`` table, as ``SampleScalars`` declares it: the
    field's name, its Python type (str, int, float or bool), whether it takes NULL, a string's
    length, a default for rows written without it."""

    name: str
    type: type
    nullable: bool
    length: int | None = None
    default: Any = None


def _column(name: str, hint: Any) -> SampleColumn:
    nullable, stored = False, Stored()
    while True:
        origin = typing.get_origin(hint)
        if origin is NotRequired:
            nullable, hint = True, typing.get_args(hint)[0]
        elif origin is Annotated:
            hint, *notes = typing.get_args(hint)
            stored = next((n for n in notes if isinstance(n, Stored)), stored)
        elif origin in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(hint) if a is not type(None)]
            nullable = nullable or len(args) < len(typing.get_args(hint))
            (hint,) = args
        else:
            break
    if hint not in (str, int, float, bool):
        raise TypeError(f"sample field {name}: {hint!r} is no column type (str, int, float, bool)")
    return SampleColumn(name, hint, nullable or stored.nullable, stored.length, stored.default)


SAMPLE_COLUMNS = tuple(_column(name, hint) for name, hint in
                       typing.get_type_hints(SampleScalars, include_extras=True).items())


@dataclass
class ScenarioResult:
    """One scenario of one run: its verdict, scalar metrics and a row per sample. The harness
    leaves a scenario it measured ``measured`` (its reason: what the measurement noted, such as
    the planted defects that acted); ``judging.judge_run`` judges it (pass, fail, inconclusive,
    expected)."""

    scenario: str
    verdict: str
    reason: str = ""
    metrics: dict[str, Any] = field(default_factory=dict)
    samples: list[SampleFields] = field(default_factory=list)
    seconds: float = 0.0


@dataclass
class RunResult:
    """One config on one engine, executed: what was asked, what ran, and how it scored."""

    config: str
    fingerprint: str
    model: str
    settings: dict[str, Any]
    requested_args: dict[str, Any]
    verdict: str  # worst of the scenarios', or invalid / error / cancelled for the whole run
    reason: str = ""
    resolved_args: dict[str, Any] = field(default_factory=dict)
    command: list[str] = field(default_factory=list)
    scenarios: list[ScenarioResult] = field(default_factory=list)
    startup_seconds: float | None = None
    seconds: float = 0.0
    log_path: str | None = None
    reference: dict[str, Any] = field(default_factory=lambda: {"kind": "same_server"})
