"""Verdict thresholds (``evalsvc/configs/thresholds.yaml``): what counts as a regression, per config and
scenario, and how the history test is run.

The file has ``defaults``, then ``rules`` applied in order: a rule whose ``match`` fits a config and
scenario overrides the fields it sets (later rules win). ``match`` keys: ``matrix``, ``engine``,
``config`` (a glob), ``model``, ``scenario`` and any matrix axis (``strategy``, ``radix_cache``,
``overlap``, ``chunked_prefill``, ``hicache``, ``mtp``, ``deterministic``); a list means any of. A
matrix may carry its own ``thresholds`` and per-model ``accept_floor`` (the ``speculative``
scenario's), applied last.

Metrics: ``kl_k3_mean`` (the generated tokens against the reference: SGLang's method),
``extend_kl_k3_mean`` (the prompt tokens prefilled on a cached prefix against a cold prefill; hit
scenarios only) and ``accept_length`` (speculative decoding).

Per metric: ``max`` / ``min`` are fixed limits (a value beyond one is a regression whatever the
history says; an acceptance floor holds in the scenarios its rule matches, most rules naming the
``speculative`` scenario, the one that exists to measure it); ``min_effect`` and
``relative_effect`` are the smallest change against the baseline that the history test calls a
regression (the larger of ``min_effect`` and ``relative_effect`` x the
baseline mean): a difference must be both statistically clear and this large; ``tail: true`` adds
the history's tail test (a few samples far out, each beyond that floor and, with ``tail_factor``,
at least that many times the baseline's median sample, or ``noise`` where that is larger: the
engine's clean per-sample scale, for a baseline that repeats the reference exactly), for metrics
whose clean spread has no sampling in it. ``bit_exact: true``
(deterministic inference) makes any nonzero KL and any token that differs from the reference a
regression.
"""

from __future__ import annotations

import fnmatch
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, Field, ValidationError, field_validator

from evalsvc.matrix import (  # the rules' fields: one definition with a matrix's own
    AXES,
    DEFAULTS,
    METRIC_NAMES,
    SCENARIOS,
    MetricLimits,
    RuleBody,
    Strict,
    Thresholds,
)
from evalsvc.paths import SHIPPED_CONFIGS_DIR, config_file
from evalsvc.validation import describe_errors

# the shipped file; one in EVALSVC_CONFIGS_DIR replaces it (load_thresholds)
THRESHOLDS_FILE = SHIPPED_CONFIGS_DIR / "thresholds.yaml"
MATCH_KEYS = {"matrix", "engine", "config", "model", "scenario"} | (set(AXES) - {"model"})


class ThresholdError(ValueError):
    """A thresholds file that cannot be used; the message names the file and the key."""


class Rule(RuleBody):
    match: dict[str, Any] = Field(default_factory=dict)

    @field_validator("match")
    @classmethod
    def _known_keys(cls, match: dict[str, Any]) -> dict[str, Any]:
        for key, value in match.items():
            if key not in MATCH_KEYS:
                raise ValueError(f"unknown match key {key!r} (known: {', '.join(sorted(MATCH_KEYS))})")
            if key == "scenario":
                for s in value if isinstance(value, list) else [value]:
                    if s not in SCENARIOS:
                        raise ValueError(f"unknown scenario {s!r} (known: {', '.join(SCENARIOS)})")
        return match


class HistorySettings(Strict):
    window: int = Field(10, ge=1, le=1000)  # earlier runs of the fingerprint used as the baseline
    min_runs: int = Field(3, ge=1)  # fewer earlier runs: fixed limits only
    confidence: float = Field(0.999, gt=0, lt=1)  # of the interval on the difference
    change_point_alpha: float = Field(0.001, gt=0, lt=1)
    change_point_window: int = Field(30, ge=4, le=1000)  # runs of the series searched for a shift
    change_point_min_runs: int = Field(8, ge=4)  # series shorter than this are not searched
    permutations: int = Field(1999, ge=99)


class ThresholdsFile(Strict):
    history: HistorySettings = Field(default_factory=HistorySettings)
    defaults: RuleBody = Field(default_factory=RuleBody)
    rules: list[Rule] = Field(default_factory=list)


class Limits(BaseModel):
    """The thresholds in force for one config and scenario, after every rule that matched."""

    kl_k3_mean: MetricLimits = Field(default_factory=MetricLimits)
    extend_kl_k3_mean: MetricLimits = Field(default_factory=MetricLimits)
    accept_length: MetricLimits = Field(default_factory=MetricLimits)
    min_hit_coverage: float = 0.0
    bit_exact: bool = False
    rules: list[int] = Field(default_factory=list)  # indices of the rules that matched

    def effect_floor(self, metric: str, baseline_mean: float) -> float:
        lim: MetricLimits = getattr(self, metric)
        return max(lim.min_effect or 0.0, (lim.relative_effect or 0.0) * abs(baseline_mean))


def load_thresholds(path: Path | None = None) -> ThresholdsFile:
    path = path or config_file("thresholds.yaml")
    return _load(str(path), path.stat().st_mtime_ns if path.is_file() else 0)


@lru_cache(maxsize=8)
def _load(path_text: str, _mtime: int) -> ThresholdsFile:
    path = Path(path_text)
    if not path.is_file():
        return ThresholdsFile()
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ThresholdError(f"{path}: not valid YAML: {exc}") from None
    try:
        return ThresholdsFile.model_validate(raw)
    except ValidationError as exc:
        raise ThresholdError(f"{path}: {describe_errors(exc)}") from None


def matches(match: dict[str, Any], facts: dict[str, Any]) -> bool:
    for key, want in match.items():
        have = facts.get(key)
        options = want if isinstance(want, list) else [want]
        if key == "config":
            if have is None or not any(fnmatch.fnmatchcase(have, str(o)) for o in options):
                return False
        elif have not in options:
            return False
    return True


def _apply(limits: Limits, body: RuleBody) -> None:
    for metric in METRIC_NAMES:
        given: MetricLimits | None = getattr(body, metric)
        if given is not None:
            current: MetricLimits = getattr(limits, metric)
            setattr(limits, metric, current.model_copy(update=given.model_dump(exclude_unset=True)))
    if body.min_hit_coverage is not None:
        limits.min_hit_coverage = body.min_hit_coverage
    if body.bit_exact is not None:
        limits.bit_exact = body.bit_exact


def limits_for(*, matrix: str, engine: str, config: str, model: str, settings: dict[str, Any],
               scenario: str, thresholds: ThresholdsFile | None = None,
               matrix_thresholds: Thresholds | None = None,
               accept_floor: float | None = None) -> Limits:
    """The limits for one config (name, model key, axis settings) and scenario."""
    thresholds = thresholds or load_thresholds()
    facts = {**DEFAULTS, **settings, "matrix": matrix, "engine": engine, "config": config,
             "model": model, "scenario": scenario}
    limits = Limits()
    _apply(limits, thresholds.defaults)
    for i, rule in enumerate(thresholds.rules):
        if matches(rule.match, facts):
            _apply(limits, rule)
            limits.rules.append(i)
    rules_floor = limits.accept_length.min
    if matrix_thresholds is not None:
        _apply(limits, matrix_thresholds.for_scenario(scenario))
    if accept_floor is not None:
        limits.accept_length = limits.accept_length.model_copy(update={"min": accept_floor})
    if scenario != "speculative":  # a matrix's own floors are its speculative scenario's
        limits.accept_length = limits.accept_length.model_copy(update={"min": rules_floor})
    return limits
