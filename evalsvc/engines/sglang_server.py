"""SGLang's native HTTP API, as pure functions: command lines, request payloads, response parsers.

Nothing here does I/O. The embedded engine speaks the same API, so both engines share these. Field
and flag names that moved between SGLang releases are handled here and only here:

* ``--mamba-radix-cache-strategy`` is ``--mamba-scheduler-strategy`` before 0.5.15 (both exist
  until 0.5.19; 0.5.20 and later only know the new one).
* speculative counters in ``meta_info``: ``spec_num_correct_drafts`` / ``spec_num_proposed_drafts``
  / ``spec_correct_drafts_histogram`` (newest), ``spec_accepted_drafts`` / ``spec_proposed_drafts``
  / ``spec_accept_histogram`` (aliases up to about 0.5.16), ``spec_accept_token_num`` /
  ``spec_draft_token_num`` (older); ``spec_verify_ct`` everywhere.
* ``/server_info`` is ``/get_server_info`` on old releases; resolved arguments use the release's
  field names.
* the radix-tree core (``SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND``): no release reports it in
  ``/server_info``, so it is read from the engine's log (``parse_tree_core``). 0.5.19 and 0.5.20
  register a Rust core beside the Python one and run Python unless asked; from 0.5.21 Rust is the
  default, and where it cannot run SGLang falls back to Python, saying so only in an INFO line
  ``Using the Python TreeCore: <reason>`` (``tree_core_registry.resolve_tree_core_backend``).
  Before 0.5.19 the tree is Python only (0.5.17 and 0.5.18 know the variable, not ``rust``).
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
import re
from typing import Any

from evalsvc.types import Completion, SpecCounters, TopLogprobs

TREE_CORE_ENV = "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND"
RUST_CORE_IN = (0, 5, 19)  # the Rust radix-tree core is registered
RUST_DEFAULT_IN = (0, 5, 21)  # ... and is the default, with a logged fallback to Python
TREE_CORE_FALLBACK = re.compile(r"Using the Python TreeCore: ?(?P<reason>[^\r\n]*)")
# the line a server logs each time a planted defect acts on a request (a defect patch's edit, the
# embedded engine's injected defects): which requests a bug really reached
DEFECT_EVENT = "evalsvc defect {name} acted on request {rid}"
DEFECT_EVENT_LINE = re.compile(r"evalsvc defect (?P<name>\S+) acted on request (?P<rid>\S+)")
QUIET_LOG_LEVELS = ("warning", "error", "critical")  # hide SGLang's INFO fallback line
RENAMED_IN = {"mamba_radix_cache_strategy": ((0, 5, 15), "mamba_scheduler_strategy")}
BOOLEAN_FLAGS = {
    "disable_radix_cache", "disable_overlap_schedule", "enable_hierarchical_cache",
    "enable_deterministic_inference", "enable_metrics", "trust_remote_code", "skip_server_warmup",
}


class ResponseError(ValueError):
    """A server response that cannot be used (malformed, NaN logprobs); the message says why."""


def parse_version(version: str | None) -> tuple[int, ...]:
    """'0.5.8.dev20260129+gf959851eb' -> (0, 5, 8); None (newest) -> a large tuple."""
    if not version:
        return (1 << 30,)
    parts = []
    for piece in version.split("+")[0].split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits or not piece[0].isdigit():
            break
        parts.append(int(digits))
    return tuple(parts)


def flag_name(field: str, version: str | None = None) -> str:
    """The command-line spelling of a ServerArgs field for a given SGLang release."""
    renamed = RENAMED_IN.get(field)
    if renamed and parse_version(version) < renamed[0]:
        field = renamed[1]
    return "--" + field.replace("_", "-")


def build_flags(args: dict[str, Any], version: str | None = None) -> list[str]:
    """ServerArgs fields -> argv, in a stable order; booleans are store_true flags."""
    argv: list[str] = []
    for key in sorted(args):
        value = args[key]
        if value is None:
            continue
        if key in BOOLEAN_FLAGS or isinstance(value, bool):
            if value:
                argv.append(flag_name(key, version))
            continue
        argv += [flag_name(key, version), str(value)]
    return argv


LOOPBACK = ("127.0.0.1", "::1", "localhost")
# flags the command builders set themselves: never from a config's arguments, nor any abbreviation
# of them (argparse takes an unambiguous prefix such as --ho for --host)
LAUNCHER_FLAGS = ("model_path", "host", "port")


def engine_flags(args: dict[str, Any]) -> dict[str, Any]:
    """A config's arguments less the ones the launcher sets; ValueError for a key that is no
    ServerArgs field name or that argparse would read as a launcher flag."""
    rest = {}
    for key, value in args.items():
        if key in LAUNCHER_FLAGS:
            continue
        if (not isinstance(key, str) or not key.isidentifier() or not key.islower()
                or any(flag.startswith(key) for flag in LAUNCHER_FLAGS)):
            raise ValueError(f"engine flag {key!r}: not a flag a config may set (the launcher "
                             f"sets {', '.join(LAUNCHER_FLAGS)})")
        rest[key] = value
    return rest


def loopback(host: str) -> str:
    """Engines have no authentication: they listen on loopback only (ValueError otherwise)."""
    if host not in LOOPBACK:
        raise ValueError(f"engine host {host!r}: engines listen on loopback only "
                         f"({', '.join(LOOPBACK)})")
    return host


def build_command(args: dict[str, Any], *, port: int, python: str, version: str | None = None,
                  host: str = "127.0.0.1") -> list[str]:
    """``python -m sglang.launch_server`` with a config's arguments, for a given release."""
    return [python, "-m", "sglang.launch_server", "--model-path", str(args["model_path"]),
            "--host", loopback(host), "--port", str(port),
            *build_flags(engine_flags(args), version)]


# ---- requests --------------------------------------------------------------------------------

def build_generate_payload(input_ids: list[int], *, max_new_tokens: int, temperature: float,
                           seed: int | None = None, logprob_start_len: int = -1,
                           top_logprobs_num: int = 0, ignore_eos: bool = True,
                           rid: str | None = None) -> dict[str, Any]:
    """A ``/generate`` body that asks for logprobs of every generated token."""
    sampling: dict[str, Any] = {"max_new_tokens": max_new_tokens, "temperature": temperature,
                                "ignore_eos": ignore_eos}
    if seed is not None:
        sampling["sampling_seed"] = seed
    payload: dict[str, Any] = {"input_ids": list(input_ids), "sampling_params": sampling,
                               "return_logprob": True, "logprob_start_len": logprob_start_len}
    if top_logprobs_num:
        payload["top_logprobs_num"] = top_logprobs_num
    if rid is not None:
        payload["rid"] = rid
    return payload


def build_plain_payload(input_ids: list[int], *, max_new_tokens: int, temperature: float,
                        seed: int | None = None, ignore_eos: bool = True) -> dict[str, Any]:
    """A ``/generate`` body that asks for no logprobs at all: a server with
    ``--enable-mixed-chunk`` may run its prefill in the same batch as the running decode steps
    (SGLang mixes no batch in which any request asks for logprobs)."""
    sampling: dict[str, Any] = {"max_new_tokens": max_new_tokens, "temperature": temperature,
                                "ignore_eos": ignore_eos}
    if seed is not None:
        sampling["sampling_seed"] = seed
    return {"input_ids": list(input_ids), "sampling_params": sampling}


def build_reference_payload(prompt_ids: list[int], output_ids: list[int], *,
                            top_logprobs_num: int = 0, rid: str | None = None) -> dict[str, Any]:
    """SGLang's reference: a teacher-forced prefill of prompt + output (``max_new_tokens=0``,
    ``logprob_start_len=0``), whose last ``len(output)`` input logprobs are the reference."""
    payload: dict[str, Any] = {
        "input_ids": list(prompt_ids) + list(output_ids),
        "sampling_params": {"max_new_tokens": 0, "temperature": 0.0},
        "return_logprob": True, "logprob_start_len": 0}
    if top_logprobs_num:
        payload["top_logprobs_num"] = top_logprobs_num
    if rid is not None:
        payload["rid"] = rid
    return payload


# ---- responses -------------------------------------------------------------------------------

_ENTRY_TYPES = {list, tuple}
_LOGPROB_TYPES = {float, type(None)}
_FIRST, _SECOND = operator.itemgetter(0), operator.itemgetter(1)
_NOT_NONE = functools.partial(operator.is_not, None)


def _columns(entries: list) -> tuple[list[float | None], list[int]] | None:
    """The logprobs and token ids of ``[logprob, token_id, text]`` entries as SGLang writes them:
    each a list (or tuple) with a float or null logprob and an int id. None for anything else,
    which the entry-by-entry checks then name. (A few C-level passes instead of a Python loop: a
    response's top-5 lists are hundreds of entries.)"""
    try:
        if not (set(map(type, entries)) <= _ENTRY_TYPES and min(map(len, entries), default=2) >= 2):
            return None
    except TypeError:
        return None
    lps, ids = list(map(_FIRST, entries)), list(map(_SECOND, entries))
    if set(map(type, ids)) <= {int} and set(map(type, lps)) <= _LOGPROB_TYPES:
        return lps, ids
    return None


def _triples(entries: Any, field: str) -> list[tuple[float | None, int]]:
    if entries is None:
        return []
    if type(entries) is list and (columns := _columns(entries)) is not None:
        return list(zip(*columns, strict=True))
    if not isinstance(entries, list):
        raise ResponseError(f"meta_info.{field}: expected a list, got {type(entries).__name__}")
    out = []
    for i, e in enumerate(entries):
        if not isinstance(e, list | tuple) or len(e) < 2:
            raise ResponseError(f"meta_info.{field}[{i}]: expected [logprob, token_id, text]")
        lp, tid = e[0], e[1]
        if lp is not None and not isinstance(lp, int | float):
            raise ResponseError(f"meta_info.{field}[{i}]: logprob {lp!r} is not a number")
        if not isinstance(tid, int):
            raise ResponseError(f"meta_info.{field}[{i}]: token id {tid!r} is not an integer")
        out.append((None if lp is None else float(lp), tid))
    return out


def _top(entries: Any, field: str) -> TopLogprobs | None:
    if entries is None:
        return None
    if type(entries) is list and all(pos is None or type(pos) is list for pos in entries):
        columns = _columns(list(itertools.chain.from_iterable(pos for pos in entries if pos)))
        if columns is not None:  # every position's entries at once, then cut per position
            pairs = list(zip(columns[1], columns[0], strict=True))
            positions, at = [], 0
            for pos in entries:
                n = len(pos) if pos else 0
                positions.append(pairs[at: at + n])
                at += n
            return TopLogprobs(positions)
    positions = []
    for i, pos in enumerate(entries):
        positions.append([] if pos is None else
                         [(tid, lp) for lp, tid in _triples(pos, f"{field}[{i}]")])
    return TopLogprobs(positions)


def parse_spec_counters(meta: dict[str, Any], draft_tokens: int | None = None) -> SpecCounters | None:
    """Speculative counters of one response, under any release's names; None without MTP."""
    verify = meta.get("spec_verify_ct")
    if not verify:
        return None
    correct = _first(meta, "spec_num_correct_drafts", "spec_accepted_drafts")
    proposed = _first(meta, "spec_num_proposed_drafts", "spec_proposed_drafts")
    if correct is None and meta.get("spec_accept_token_num") is not None:
        correct = meta["spec_accept_token_num"]  # oldest: accepted draft tokens
        proposed = meta.get("spec_draft_token_num", proposed)
    hist = _first(meta, "spec_correct_drafts_histogram", "spec_accept_histogram")
    return SpecCounters(verify_ct=int(verify), completion_tokens=int(meta["completion_tokens"]),
                        correct_drafts=None if correct is None else int(correct),
                        proposed_drafts=None if proposed is None else int(proposed),
                        histogram=None if hist is None else [int(x) for x in hist],
                        draft_tokens=draft_tokens)


def _first(meta: dict[str, Any], *keys: str) -> Any:
    for k in keys:
        if meta.get(k) is not None:
            return meta[k]
    return None


def parse_completion(resp: Any, draft_tokens: int | None = None) -> Completion:
    """A ``/generate`` response (single) -> Completion; refuses NaN or malformed logprobs."""
    if not isinstance(resp, dict) or "meta_info" not in resp:
        raise ResponseError("the /generate response has no meta_info")
    meta = resp["meta_info"]
    out = _triples(meta.get("output_token_logprobs"), "output_token_logprobs")
    given = resp.get("output_ids")
    if given == [] and meta.get("completion_tokens") == 0:
        # a request that generates nothing (a reference prefill, max_new_tokens=0): with
        # speculative decoding SGLang still reports the prefill's next-token logprob as an output
        # logprob (0.5.17 on the CPU); no token was output, so there is none
        out = []
    ids = list(map(_SECOND, out))
    if meta.get("output_token_logprobs") is None and given is not None:
        ids = list(given)  # no logprobs asked for
    elif given is not None and list(given) != ids:
        raise ResponseError("output_ids and output_token_logprobs disagree")
    lps = list(map(_FIRST, out))
    if None in lps or not all(map(math.isfinite, lps)):
        i, lp = next((i, lp) for i, lp in enumerate(lps) if lp is None or not math.isfinite(lp))
        raise ResponseError(f"meta_info.output_token_logprobs[{i}]: logprob is {lp!r}")
    inputs = list(map(_FIRST, _triples(meta.get("input_token_logprobs"), "input_token_logprobs")))
    if not all(map(math.isfinite, filter(_NOT_NONE, inputs))):
        i, lp = next((i, lp) for i, lp in enumerate(inputs)
                     if lp is not None and not math.isfinite(lp))
        raise ResponseError(f"meta_info.input_token_logprobs[{i}]: logprob is {lp!r}")
    details = meta.get("cached_tokens_details") or {}
    return Completion(
        token_ids=ids, logprobs=lps, prompt_tokens=int(meta.get("prompt_tokens", 0)),
        cached_tokens=int(meta.get("cached_tokens", 0)), finish_reason=meta.get("finish_reason"),
        top=_top(meta.get("output_top_logprobs"), "output_top_logprobs"),
        input_logprobs=inputs, input_top=_top(meta.get("input_top_logprobs"), "input_top_logprobs"),
        spec=parse_spec_counters(meta, draft_tokens), text=resp.get("text", ""),
        host_cached_tokens=int(details.get("host", 0) or 0))


def parse_server_info(info: dict[str, Any]) -> dict[str, Any]:
    """Resolved server arguments under the newest field names, plus ``version`` and
    ``avg_spec_accept_length`` (from ``internal_states[0]``) when present."""
    if not isinstance(info, dict):
        raise ResponseError("/server_info did not return a JSON object")
    out = dict(info)
    for new, (_, old) in RENAMED_IN.items():
        if new not in out and old in out:
            out[new] = out[old]
    states = info.get("internal_states") or [{}]
    if isinstance(states, list) and states and isinstance(states[0], dict):
        out["avg_spec_accept_length"] = states[0].get("avg_spec_accept_length")
    return out


def host_tier_size(resolved: dict[str, Any]) -> tuple[int | None, int | None]:
    """The host tier's size from a server's resolved arguments, as (tokens, Mamba states): the
    device pools' sizes times ``--hicache-ratio``; (None, None) without HiCache or where
    ``--hicache-size`` (GB) sets it instead; states None where the Mamba pool's size is not said."""
    tokens = resolved.get("max_total_tokens") or resolved.get("max_total_num_tokens")
    states = resolved.get("max_mamba_cache_size")
    ratio = resolved.get("hicache_ratio")
    if not resolved.get("enable_hierarchical_cache") or resolved.get("hicache_size") \
            or not tokens or not ratio:
        return None, None
    return int(tokens * float(ratio)), int(states * float(ratio)) if states else None


def resolved_mismatches(requested: dict[str, Any], resolved: dict[str, Any]) -> list[str]:
    """Where a server did not run what a config asked for (``auto`` may resolve to anything;
    ``NEXTN`` is an alias of ``EAGLE``)."""
    problems = []
    for key, want in requested.items():
        if key in ("model_path", "host", "port") or key not in resolved:
            continue
        got = resolved[key]
        if key == "mamba_radix_cache_strategy" and (want == "auto" or requested.get(
                "disable_radix_cache")):
            continue
        if key == "speculative_algorithm" and {str(want).upper(), str(got).upper()} <= {"NEXTN",
                                                                                       "EAGLE"}:
            continue
        if isinstance(want, bool) or isinstance(got, bool):
            if bool(want) != bool(got):
                problems.append(f"{key}: asked {want}, server runs {got}")
        elif isinstance(want, int | float) and isinstance(got, int | float):
            if float(want) != float(got):
                problems.append(f"{key}: asked {want}, server runs {got}")
        elif str(want) != str(got):
            problems.append(f"{key}: asked {want!r}, server runs {got!r}")
    if not requested.get("disable_overlap_schedule") and resolved.get("disable_overlap_schedule"):
        problems.append("disable_overlap_schedule: asked overlap on, server runs it off")
    return problems


def parse_tree_core(log: str | None, *, asked: str | None, version: str | None,
                    embedded: bool = False) -> dict[str, Any]:
    """Which radix-tree core a server runs, from the start of its log: ``radix_tree_core``
    (``python``, ``rust``, or None where the log cannot tell) and ``radix_tree_core_fallback``
    (SGLang's reason for running Python where Rust was asked for or the default, else None).

    ``asked``: the value of ``SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND`` in the engine's
    environment (None: unset); ``version``: the server's release (``/server_info``'s
    ``version``); ``embedded``: the embedded engine, which has the Python core only and logs
    SGLang's fallback line when asked for Rust; ``log``: None when there is none, or when its level
    hides INFO lines."""
    found = TREE_CORE_FALLBACK.search(log or "")
    if found:
        return {"radix_tree_core": "python",
                "radix_tree_core_fallback": found.group("reason").strip() or "(no reason given)"}
    if embedded:
        return {"radix_tree_core": "python", "radix_tree_core_fallback": None if asked != "rust"
                else "the embedded engine has no Rust TreeCore"}
    release = parse_version(version)
    if release < RUST_CORE_IN:
        return {"radix_tree_core": "python", "radix_tree_core_fallback": None if asked != "rust"
                else f"sglang {version} has no Rust TreeCore (it came in 0.5.19)"}
    if release < RUST_DEFAULT_IN:  # no fallback: Rust loads when asked, or the server fails
        return {"radix_tree_core": asked or "python", "radix_tree_core_fallback": None}
    core = asked or "rust"
    if core == "rust" and log is None:  # a fallback would be in the log
        return {"radix_tree_core": None, "radix_tree_core_fallback": None}
    return {"radix_tree_core": core, "radix_tree_core_fallback": None}


def parse_defect_events(log: str) -> list[tuple[str, str]]:
    """``(defect, rid)`` of every ``DEFECT_EVENT`` line in ``log``, in order."""
    return [(m.group("name"), m.group("rid")) for m in DEFECT_EVENT_LINE.finditer(log)]


def tree_core_mismatch(asked: str | None, found: dict[str, Any], why_unknown: str = "") -> str | None:
    """Where a server does not run the radix-tree core a config asked for (None: it does, or
    nothing was asked)."""
    if asked is None:
        return None
    core = found.get("radix_tree_core")
    if core is None:
        return (f"radix_tree_core: asked {asked!r}, and which core the server runs cannot be told"
                f"{f' ({why_unknown})' if why_unknown else ''}")
    if core != asked:
        reason = found.get("radix_tree_core_fallback")
        return (f"radix_tree_core: asked {asked!r}, server runs {core!r}"
                f"{f' (Using the Python TreeCore: {reason})' if reason else ''}")
    return None
