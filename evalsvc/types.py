"""Plain data shared by every layer: what one engine response and one evaluated sample look like.

No behaviour beyond small derived properties; logprobs are natural-log, aligned by token position.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

VERDICTS = ("pass", "fail", "inconclusive", "invalid", "error")


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


@dataclass
class ScenarioResult:
    """One scenario of one run: its verdict, scalar metrics and a row per sample."""

    scenario: str
    verdict: str
    reason: str = ""
    metrics: dict[str, Any] = field(default_factory=dict)
    samples: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0


@dataclass
class RunResult:
    """One config on one engine, executed: what was asked, what ran, and how it scored."""

    config: str
    fingerprint: str
    model: str
    settings: dict[str, Any]
    requested_args: dict[str, Any]
    verdict: str  # worst of the scenarios', or invalid / error for the whole run
    reason: str = ""
    resolved_args: dict[str, Any] = field(default_factory=dict)
    command: list[str] = field(default_factory=list)
    scenarios: list[ScenarioResult] = field(default_factory=list)
    startup_seconds: float | None = None
    seconds: float = 0.0
    log_path: str | None = None
    reference: dict[str, Any] = field(default_factory=lambda: {"kind": "same_server"})
