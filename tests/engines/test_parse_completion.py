"""``parse_completion``'s column-wise reading of logprob entries against the entry-by-entry
parser it sped up (kept here as it was): the same Completion, field for field and object for
object, and the same error naming the field, on random well-formed and malformed responses."""

from __future__ import annotations

import copy
import math
import random
from dataclasses import asdict
from typing import Any

import pytest

from evalsvc.engines import sglang_server
from evalsvc.engines.sglang_server import ResponseError, parse_completion
from evalsvc.types import Completion, TopLogprobs


def _triples(entries: Any, field: str) -> list[tuple[float | None, int]]:
    if entries is None:
        return []
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
    positions = []
    for i, pos in enumerate(entries):
        positions.append([] if pos is None else
                         [(tid, lp) for lp, tid in _triples(pos, f"{field}[{i}]")])
    return TopLogprobs(positions)


def straightforward(resp: Any, draft_tokens: int | None = None) -> Completion:
    """``parse_completion`` as it was."""
    if not isinstance(resp, dict) or "meta_info" not in resp:
        raise ResponseError("the /generate response has no meta_info")
    meta = resp["meta_info"]
    out = _triples(meta.get("output_token_logprobs"), "output_token_logprobs")
    ids = [tid for _, tid in out]
    given = resp.get("output_ids")
    if meta.get("output_token_logprobs") is None and given is not None:
        ids = list(given)
    elif given is not None and list(given) != ids:
        raise ResponseError("output_ids and output_token_logprobs disagree")
    lps = []
    for i, (lp, _) in enumerate(out):
        if lp is None or not math.isfinite(lp):
            raise ResponseError(f"meta_info.output_token_logprobs[{i}]: logprob is {lp!r}")
        lps.append(lp)
    inputs = [lp for lp, _ in _triples(meta.get("input_token_logprobs"), "input_token_logprobs")]
    for i, lp in enumerate(inputs):
        if lp is not None and not math.isfinite(lp):
            raise ResponseError(f"meta_info.input_token_logprobs[{i}]: logprob is {lp!r}")
    details = meta.get("cached_tokens_details") or {}
    return Completion(
        token_ids=ids, logprobs=lps, prompt_tokens=int(meta.get("prompt_tokens", 0)),
        cached_tokens=int(meta.get("cached_tokens", 0)), finish_reason=meta.get("finish_reason"),
        top=_top(meta.get("output_top_logprobs"), "output_top_logprobs"),
        input_logprobs=inputs, input_top=_top(meta.get("input_top_logprobs"), "input_top_logprobs"),
        spec=sglang_server.parse_spec_counters(meta, draft_tokens), text=resp.get("text", ""),
        host_cached_tokens=int(details.get("host", 0) or 0))


def response(rng: random.Random) -> dict[str, Any]:
    n, m = rng.choice([0, 1, 5, 32]), rng.choice([0, 1, 9])
    out = [[-rng.random() * 5, rng.randrange(1000), None] for _ in range(n)]
    inputs = [[None if i == 0 else -rng.random(), rng.randrange(1000), None] for i in range(m)]

    def top(count: int) -> list:
        return [None if rng.random() < 0.1 else
                [[-rng.random() * 3, rng.randrange(1000), "x"] for _ in range(rng.choice([0, 1, 5]))]
                for _ in range(count)]

    return {"text": "t", "output_ids": [e[1] for e in out],
            "meta_info": {"prompt_tokens": m + 3, "cached_tokens": rng.randrange(3),
                          "output_token_logprobs": out, "input_token_logprobs": inputs,
                          "output_top_logprobs": top(n) if rng.random() < 0.8 else None,
                          "input_top_logprobs": top(m) if rng.random() < 0.3 else None,
                          "spec_verify_ct": rng.choice([0, 3]), "completion_tokens": n}}


def same(got: Completion, want: Completion) -> None:
    assert asdict(got) == asdict(want)
    for a, b in ((got.logprobs, want.logprobs), (got.input_logprobs, want.input_logprobs)):
        assert [type(x) for x in a] == [type(x) for x in b]
    for side in ("top", "input_top"):
        a, b = getattr(got, side), getattr(want, side)
        if a is not None:
            assert [[tuple(map(type, e)) for e in p] for p in a.positions] == \
                [[tuple(map(type, e)) for e in p] for p in b.positions]


@pytest.mark.parametrize("seed", range(40))
def test_well_formed_responses_parse_as_before(seed: int) -> None:
    resp = response(random.Random(seed))
    same(parse_completion(copy.deepcopy(resp), 4), straightforward(copy.deepcopy(resp), 4))


# odd but accepted entries: int logprobs, bool ids, tuples, long entries, NaN in a top list (the
# top-k KL refuses it where it reads it)
ODD = [("output_token_logprobs", 1, [-1, 7, None]), ("output_token_logprobs", 0, (-0.5, True)),
       ("output_top_logprobs", 2, [[math.nan, 1]]),
       ("input_top_logprobs", 0, [[-1, 3], [-0.5, 4, "y", "extra"]]),
       ("output_top_logprobs", 1, [(-0.25, 5, None)])]
# and what is refused, naming the field
BAD = [("output_token_logprobs", 1, [None, 7, None]), ("output_token_logprobs", 2, [math.nan, 7]),
       ("output_token_logprobs", 0, [-0.5]), ("output_token_logprobs", 1, "x"),
       ("output_token_logprobs", 1, ["-0.5", 7]), ("output_token_logprobs", 1, [-0.5, 7.0]),
       ("input_token_logprobs", 2, [math.inf, 3]), ("output_top_logprobs", 1, [[-0.5, "a"]]),
       ("output_top_logprobs", 1, "not a list"),
       ("input_token_logprobs", None, {"a": 1}), ("output_top_logprobs", 0, [[-1.0, 2], [-2.0]])]


def mutated(field: str, index: int | None, value: Any) -> dict[str, Any]:
    rng = random.Random(1)
    while True:
        resp = response(rng)
        meta = resp["meta_info"]
        if len(meta["output_token_logprobs"]) > 3 and len(meta["input_token_logprobs"]) > 3:
            break
    meta["output_top_logprobs"] = [[[-0.5, 1]] for _ in meta["output_token_logprobs"]]
    meta["input_top_logprobs"] = [[[-0.5, 1]] for _ in meta["input_token_logprobs"]]
    if index is None:
        meta[field] = value
    else:
        meta[field][index] = value
    resp["output_ids"] = None
    return resp


@pytest.mark.parametrize(("field", "index", "value"), ODD)
def test_odd_entries_parse_as_before(field: str, index: int, value: Any) -> None:
    resp = mutated(field, index, value)
    same(parse_completion(copy.deepcopy(resp)), straightforward(copy.deepcopy(resp)))


@pytest.mark.parametrize(("field", "index", "value"), BAD)
def test_bad_entries_are_refused_as_before(field: str, index: int | None, value: Any) -> None:
    resp = mutated(field, index, value)
    with pytest.raises((ResponseError, ValueError, TypeError)) as want:
        straightforward(copy.deepcopy(resp))
    with pytest.raises(type(want.value)) as got:
        parse_completion(copy.deepcopy(resp))
    assert str(got.value) == str(want.value)


def test_a_response_that_generated_nothing_has_no_output_logprobs() -> None:
    """SGLang with speculative decoding reports a prefill's next-token logprob as an output
    logprob of a request that generated nothing (``max_new_tokens=0``, the reference prefill):
    no token was output, so the completion has none. Anything else that disagrees is refused."""
    meta = {"output_token_logprobs": [[-1.5, 302, None]], "completion_tokens": 0,
            "input_token_logprobs": [[None, 7, None], [-2.0, 9, None]], "prompt_tokens": 2}
    done = parse_completion({"output_ids": [], "meta_info": meta})
    assert done.token_ids == [] and done.logprobs == [] and done.input_logprobs == [None, -2.0]
    with pytest.raises(ResponseError, match="disagree"):
        parse_completion({"output_ids": [], "meta_info": {**meta, "completion_tokens": 1}})
