"""Known defects of SGLang's hybrid-model cache paths that the embedded engine can reproduce.

Each is off by default and switches one mechanism to its buggy variant; none adds noise to numbers.

* ``snapshot-race`` (issue #24221): under the overlap scheduler, caching a chunked request's
  snapshot copies the slot on the scheduler side without waiting for the forward that writes it, so
  the tree keeps the state from before that chunk under the chunk's key. Acts with extra_buffer,
  overlap and chunked prefill; shows as KL on prefix hits of such prefixes.
* ``deferred-ops-dropped`` (PR #24954 review): with no_buffer, a request whose prefill is split into
  chunks loses the copy-on-write recorded at its prefix hit, so its first chunk runs on whatever its
  new slot held. Shows as KL on prefill hits with no_buffer and chunked prefill; cold requests keep
  their clear and are untouched.
* ``stale-spec-metadata`` (PR #37165): the one-shot COW/clear indices of an extend batch are not reset
  in ``prepare_for_decode``; the draft-extend of every following MTP decode step replays them onto
  live draft state. Target outputs stay exact; only draft acceptance drops.
* ``host-load-race``: a HiCache load hands the state slot over before the host-to-device copy
  completed: the request's copy-on-write reads the slot before the load lands. Shows as KL on
  host-tier hits.
"""

from __future__ import annotations

import os
from enum import StrEnum


class Defect(StrEnum):
    SNAPSHOT_RACE = "snapshot-race"
    DEFERRED_OPS_DROPPED = "deferred-ops-dropped"
    STALE_SPEC_METADATA = "stale-spec-metadata"
    HOST_LOAD_RACE = "host-load-race"


ENV_VAR = "EVALSVC_ENGINE_DEFECTS"


def parse_defects(names: list[str] | None, env: dict[str, str] | None = None) -> list[Defect]:
    """Defects from ``--inject-defect`` values and the ``EVALSVC_ENGINE_DEFECTS`` variable."""
    env = os.environ if env is None else env
    raw = list(names or []) + [n for n in env.get(ENV_VAR, "").split(",")]
    out: list[Defect] = []
    for name in (n.strip() for n in raw):
        if not name:
            continue
        try:
            defect = Defect(name)
        except ValueError:
            known = ", ".join(d.value for d in Defect)
            raise ValueError(f"unknown defect {name!r} (from --inject-defect or {ENV_VAR}); "
                             f"known: {known}") from None
        if defect not in out:
            out.append(defect)
    return out
