"""The store's read models: what ``queries`` returns, one frozen model per shape of row, shared by
the API (they are its response models, so their fields are its JSON's keys, in this order) and the
dashboard (its templates and views read their attributes).

A status or verdict column (``models.EnumString``) reads back as its enum's member, or as the
string it is when the enum lacks it: its field here takes either (the enum first), and serves its
string. The verdicts of metric judgements (``VerdictRead.verdict``), regressions' states and
bisections' statuses are plain strings: no enum of theirs yet.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, computed_field

from evalsvc.types import JobStatus, RunStatus, Verdict

# the enum's member where it has the value, else the string as stored
VerdictValue = Annotated[Verdict | str, Field(union_mode="left_to_right")]
JobStatusValue = Annotated[JobStatus | str, Field(union_mode="left_to_right")]
RunStatusValue = Annotated[RunStatus | str, Field(union_mode="left_to_right")]


class ReadModel(BaseModel):
    """A row as the store reads it: immutable (a view that adds to it makes a copy or a model of
    its own)."""

    model_config = ConfigDict(frozen=True)


# ---- results -----------------------------------------------------------------------------------

class MetricPoint(ReadModel):
    """One value of a metric's history (``queries.metric_history``): its commit, build and run."""

    commit: str
    sha: str | None
    version: str | None
    committed_at: datetime | None
    patch_set: str
    run_id: int
    fingerprint: str
    config: str
    scenario: str
    value: float | None
    ci_low: float | None
    ci_high: float | None
    count: int | None


class LatestRun(ReadModel):
    """The newest run of a fingerprint and patch set (``queries.latest_per_config``) with its
    verdict and its scenarios' verdicts."""

    run_id: int
    config: str
    fingerprint: str
    commit: str
    patch_set: str
    verdict: VerdictValue | None
    scenarios: dict[str, VerdictValue]


class ScenarioComparison(ReadModel):
    """One config and scenario of two builds (``queries.compare``): both values, the delta
    (contender - baseline) and, over the samples both runs have, a paired bootstrap interval of it
    (``paired_samples`` of them; none: no interval)."""

    config: str
    fingerprint: str
    scenario: str
    baseline: float | None
    contender: float | None
    delta: float | None
    ci_low: float | None
    ci_high: float | None
    paired_samples: int
    baseline_run: int
    contender_run: int


class MetricValue(ReadModel):
    """A scalar metric of a scenario of a run, with its interval and count where it has them."""

    value: float | None
    ci_low: float | None
    ci_high: float | None
    count: int | None


class VerdictRead(ReadModel):
    """One metric of one scenario of a run, judged (``queries.verdict_read``), with its
    evidence: the keys of ``judging.Judgement``."""

    scenario: str
    metric: str
    verdict: str  # pass regression improvement inconclusive expected
    method: str  # coverage threshold bit_exact history change_point
    value: float | None
    baseline: float | None
    diff_low: float | None
    diff_high: float | None
    threshold: float | None
    p_value: float | None
    evidence: dict[str, Any] | None
    reason: str | None


class JudgedComparison(ScenarioComparison):
    """A ``ScenarioComparison`` judged as one step of a series whose only earlier run is the
    baseline's (``verdicts.compare_builds``): the paired test's verdict, reason and test, and the
    whole judgement (``paired``); all None for a metric without verdicts."""

    paired_verdict: str | None = None
    paired_reason: str | None = None
    paired_test: str | None = None
    paired: VerdictRead | None = None


class ScenarioDetail(ReadModel):
    """A scenario of a run: its verdict and why, its time, and its metrics by name."""

    scenario: str
    verdict: VerdictValue
    reason: str | None
    seconds: float | None
    metrics: dict[str, MetricValue]


class RunDetail(ReadModel):
    """One run (``queries.run_detail``): arguments asked for and resolved, reference, command,
    status and verdict, files, its build, its scenarios with their metrics, and its verdicts."""

    id: int
    job_id: str
    config: str
    matrix: str
    model: str
    fingerprint: str
    settings: dict[str, Any]
    requested_args: dict[str, Any]
    resolved_args: dict[str, Any] | None
    reference: dict[str, Any] | None
    command: list[str] | None
    status: RunStatusValue
    verdict: VerdictValue | None
    reason: str | None
    seconds: float | None
    startup_seconds: float | None
    log_path: str | None
    samples_path: str | None
    commit: str
    patch_set: str
    scenarios: list[ScenarioDetail]
    verdicts: list[VerdictRead]


class GoldenRunRead(ReadModel):
    """The golden run of a fingerprint."""

    fingerprint: str
    run_id: int
    label: str | None
    config: str


class SampleStats(ReadModel):
    """A sample's statistics as a run's page lists them (``queries.run_samples``)."""

    scenario: str
    sample_id: str
    prompt_id: str
    hit: bool
    cached_tokens: int
    kl_k3_mean: float | None
    first_divergence: int | None


class KnownFailureRef(ReadModel):
    """The known failure a scenario fails as (an ``expected`` verdict's evidence): the regression
    triaged expected, and where to read about it."""

    regression_id: int
    link: str | None = None


# ---- jobs and commits --------------------------------------------------------------------------

class JobRunRead(ReadModel):
    """A run of a job, as the job lists it (``queries.job_detail``): its config, build, status,
    verdict and scenario verdicts."""

    id: int
    config: str
    fingerprint: str
    build_id: int
    build: str  # the commit's ref, "+PATCH_SET" when it has one
    status: RunStatusValue
    verdict: VerdictValue | None
    reason: str | None
    scenarios: dict[str, VerdictValue]


class JobRead(ReadModel):
    """A job with its spec and its runs (``queries.job_detail``)."""

    id: str
    trigger: str
    status: JobStatusValue
    priority: int
    spec: dict[str, Any]
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    error: str | None
    cancel_requested_at: datetime | None
    runs_errored: int
    runs: list[JobRunRead]


class JobSummary(ReadModel):
    """A job in the jobs list (``queries.job_summaries``): its runs counted by status
    (``progress``) and by verdict."""

    id: str
    trigger: str
    status: JobStatusValue
    priority: int
    matrix: str | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    error: str | None
    progress: dict[str, int]
    verdicts: dict[str, int]
    runs_errored: int


class JobBuild(ReadModel):
    """An engine build a job's runs used (``queries.job_builds``): its commit, patch set, probe
    answers, base environment and manifest."""

    id: int
    commit: str
    repository: str
    sha: str | None
    version: str | None
    branch: str | None
    committed_at: datetime | None
    patch_set: str
    probes: dict[str, Any] | None
    base_env: dict[str, Any] | None
    manifest: dict[str, Any] | None


class CommitSummary(ReadModel):
    """A commit (``queries.commit_summaries``) with the verdict counts of its configs' latest
    runs, per build (``builds``, by patch set) and in all (``verdicts``)."""

    ref: str
    repository: str
    sha: str | None
    version: str | None
    branch: str | None
    committed_at: datetime | None
    builds: dict[str, dict[str, int]]

    @computed_field  # type: ignore[prop-decorator]
    @property
    def verdicts(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for counts in self.builds.values():
            for verdict, n in counts.items():
                total[verdict] = total.get(verdict, 0) + n
        return total


class TrendCommit(ReadModel):
    id: int
    ref: str
    committed_at: datetime | None


class TrendRun(ReadModel):
    id: int
    commit_id: int
    patch_set: str
    fingerprint: str
    config: str
    matrix: str
    model: str


class TrendWindow(ReadModel):
    """The overview's window (``queries.trend_window``): its commits, oldest first, and the runs of
    all their builds, in run order."""

    commits: list[TrendCommit]
    runs: list[TrendRun]


# ---- regressions, bisections, alerts -----------------------------------------------------------

class RunBrief(ReadModel):
    """A run a regression points at: its job and commit."""

    id: int
    job_id: str
    commit: str
    sha: str | None
    committed_at: datetime | None


class RegressionRead(ReadModel):
    """A regression (``queries.regression_read``): its series, state and triage, the runs it
    points at, and the verdict of the run that opened it (``evidence``; None where none was
    stored)."""

    id: int
    state: str  # open | resolved
    config: str
    matrix: str
    fingerprint: str
    patch_set: str
    scenario: str
    metric: str
    runs_seen: int
    opened_at: datetime
    resolved_at: datetime | None
    triage: str | None  # acknowledged | expected | fixed
    comment: str | None
    link: str | None
    expected_level: float | None
    triaged_at: datetime | None
    first_run: RunBrief
    last_run: RunBrief
    last_good_run: RunBrief | None
    resolved_run: RunBrief | None
    evidence: VerdictRead | None


class RegressionCounts(ReadModel):
    """How many regressions are open, and how many of them nobody has triaged yet."""

    open: int
    untriaged: int


class BisectionBrief(ReadModel):
    """A bisection of a regression, as the regression lists it."""

    id: str
    status: str
    first_bad: str | None


class BisectionRead(ReadModel):
    """A bisection (``queries.bisection_read``): its range, config, candidates, steps and first
    bad commit (or why it stopped)."""

    id: str
    status: str  # queued running done failed
    repository: str
    good: str
    bad: str
    matrix: str
    config: str
    scenario: str
    metric: str | None
    candidates: list[str] | None
    steps: list[dict[str, Any]]
    first_bad: str | None
    runs_used: int
    error: str | None
    regression_id: int | None
    created_at: datetime
    finished_at: datetime | None


class AlertRead(ReadModel):
    """An alert made (``queries.alerts``): its kind, regressions and text, and its delivery."""

    id: int
    job_id: str
    kind: str  # appeared | resolved
    regression_ids: list[int]
    text: str | None
    created_at: datetime
    delivered_at: datetime | None
    attempts: int
    error: str | None
