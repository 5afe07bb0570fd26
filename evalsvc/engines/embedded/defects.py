"""Known defects of SGLang's hybrid-model cache paths that the embedded engine can reproduce.

Each is off by default and switches one mechanism to its buggy variant; none adds noise to numbers.

* ``snapshot-race`` (issue #24221): under the overlap scheduler, caching a chunked request's
  snapshot copies the slot on the scheduler side without waiting for the forward that writes it, so
  the tree keeps the state from before that chunk under the chunk's key. Acts with extra_buffer,
  overlap and chunked prefill; shows as KL on prefix hits of such prefixes.
  Unit of its strength: the request being cached (its snapshots take the racy copy).
* ``deferred-ops-dropped`` (PR #24954 review): with no_buffer, a request whose prefill is split into
  chunks loses the copy-on-write recorded at its prefix hit, so its first chunk runs on whatever its
  new slot held. Shows as KL on prefill hits with no_buffer and chunked prefill; cold requests keep
  their clear and are untouched.
  Unit: the request whose copy-on-write is dropped.
* ``stale-spec-metadata`` (PR #37165): the one-shot COW/clear indices of an extend batch are not reset
  in ``prepare_for_decode``; the draft-extend of every following MTP decode step replays them onto
  live draft state. Target outputs stay exact; only draft acceptance drops.
  Unit: the request that recorded an entry; only the affected requests' COW/clear entries survive
  into decode (the others are reset as the fix does).
* ``host-load-race``: a HiCache load hands the state slot over before the host-to-device copy
  completed: the request's copy-on-write reads the slot before the load lands. Shows as KL on
  host-tier hits.
  Unit: the request whose prefix hit loads the state from the host (its load lands late).
* ``mixed-chunk-tracking-dropped`` (PR #39342, fixed in SGLang 0.5.23): with ``--enable-mixed-chunk``
  and extra_buffer, merging the running decode requests into a prefill batch drops the prefill
  rows' snapshot plan, yet the snapshot's track slot is donated to the tree anyway, so a later hit
  on that prefix resumes from whatever the unwritten slot held. Acts only in mixed batches (a
  prefill while requests decode, no request asking for logprobs); shows as KL on prefix hits of
  prefixes prefilled that way.
  Unit: the prefill request whose snapshot is dropped.

Strength. Each defect takes a strength in (0, 1], the fraction of requests it affects:
``--inject-defect snapshot-race@0.25`` or ``EVALSVC_ENGINE_DEFECTS=snapshot-race@0.25,host-load-race``
(no ``@``: 1.0). A request is affected iff ``defect_fraction(defect, prompt_ids)``, a hash of the
defect's name and the request's prompt token ids mapped to [0, 1), is below the strength. The
selection is deterministic: the same prompts are affected in every run and process, whatever the
sampling seed; with strength 1.0 every request is affected, as without a strength. A request that is
not selected takes the correct mechanism, so a partial strength changes how often the bug strikes,
never the size of what it does.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Sequence
from enum import StrEnum


class Defect(StrEnum):
    SNAPSHOT_RACE = "snapshot-race"
    DEFERRED_OPS_DROPPED = "deferred-ops-dropped"
    STALE_SPEC_METADATA = "stale-spec-metadata"
    HOST_LOAD_RACE = "host-load-race"
    MIXED_CHUNK_TRACKING_DROPPED = "mixed-chunk-tracking-dropped"


ENV_VAR = "EVALSVC_ENGINE_DEFECTS"
FLAG = "--inject-defect"


def parse_defect(item: str, where: str) -> tuple[Defect, float]:
    """``NAME`` or ``NAME@STRENGTH`` (strength in (0, 1], default 1.0); ``where`` names the origin
    (a flag, a variable, a file) in the error."""
    name, sep, value = item.strip().partition("@")
    name = name.strip()
    try:
        defect = Defect(name)
    except ValueError:
        known = ", ".join(d.value for d in Defect)
        raise ValueError(f"unknown defect {name!r} (from {where}); known: {known}") from None
    if not sep:
        return defect, 1.0
    return defect, check_strength(defect, value.strip(), where)


def check_strength(defect: Defect | str, value: object, where: str) -> float:
    """A strength as a float in (0, 1]; ValueError naming the defect, the value and ``where``."""
    try:
        if isinstance(value, bool):
            raise ValueError
        strength = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        strength = math.nan
    if not (0.0 < strength <= 1.0):  # also refuses nan
        raise ValueError(f"defect {str(defect)!r}: strength {value!r} (from {where}) must be a "
                         "number in (0, 1]")
    return strength


def parse_defect_strengths(names: list[str] | None,
                           env: dict[str, str] | None = None) -> dict[Defect, float]:
    """Defects and their strengths from ``--inject-defect`` values and ``EVALSVC_ENGINE_DEFECTS``,
    in the order given. The same defect twice must have the same strength."""
    env = os.environ if env is None else env
    out: dict[Defect, float] = {}
    seen: dict[Defect, str] = {}
    items = [(n, FLAG) for n in names or []] + [(n, ENV_VAR) for n in env.get(ENV_VAR, "").split(",")]
    for item, where in items:
        if not item.strip():
            continue
        defect, strength = parse_defect(item, where)
        if defect in out and out[defect] != strength:
            raise ValueError(f"defect {defect.value!r}: strength {strength:g} (from {where}) "
                             f"conflicts with {out[defect]:g} (from {seen[defect]})")
        out.setdefault(defect, strength)
        seen.setdefault(defect, where)
    return out


def format_defects(strengths: dict[Defect, float] | dict[str, float]) -> str:
    """The ``EVALSVC_ENGINE_DEFECTS`` value of a mapping: ``name`` at 1.0, else ``name@strength``."""
    return ",".join(str(d) if s >= 1.0 else f"{d}@{float(s)!r}" for d, s in strengths.items())


def defect_fraction(defect: Defect | str, token_ids: Sequence[int]) -> float:
    """A deterministic hash of (defect name, prompt token ids) in [0, 1): the same in every process
    (blake2b, not Python's salted ``hash``)."""
    data = str(defect).encode() + b"\0" + ",".join(str(int(t)) for t in token_ids).encode()
    digest = hashlib.blake2b(data, digest_size=8).digest()
    return (int.from_bytes(digest, "big") >> 11) / float(1 << 53)  # 53 bits: never rounds to 1


def affects(defect: Defect | str, token_ids: Sequence[int], strength: float) -> bool:
    """Whether a defect of this strength acts on the request with these prompt token ids."""
    return strength >= 1.0 or defect_fraction(defect, token_ids) < strength
