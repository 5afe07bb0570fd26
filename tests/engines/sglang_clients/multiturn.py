"""SGLang's multi-turn KL helpers (``sglang.test.kl_multiturn_utils``, unchanged) against a server,
shaped like SGLang's own kit (``sglang.test.kits.unified_radix_cache_kit``: a 3-turn run, a
prefill hit with branches, a decode hit with branches, each with the Mamba-aware cache bounds),
sized for a tiny CPU model. Run by a release env's python:

    <env python> multiturn.py BASE_URL VOCAB TRACK_INTERVAL KL_THRESHOLD

Prints one JSON object: per helper "pass", or the assertion that failed.
"""

from __future__ import annotations

import contextlib
import json
import random
import sys

from sglang.test import kl_multiturn_utils as mt

PREFIX, MAX_NEW, GROUPS, BRANCHES = 128, 128, 3, 3


def main() -> int:
    base, vocab, interval, threshold = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), \
        float(sys.argv[4])

    def ids(n: int, length: int, seed: int) -> list[list[int]]:
        rng = random.Random(seed)
        return [[rng.randint(1, vocab - 4) for _ in range(length)] for _ in range(n)]

    prompts = ids(GROUPS, PREFIX, 0)
    n = GROUPS * BRANCHES
    decode = mt.make_mamba_decode_assert(track_interval=interval)
    prefill = mt.make_mamba_prefill_assert(64)
    results = {}

    def run(name, fn):
        try:
            with contextlib.redirect_stdout(sys.stderr):  # the helpers print their progress
                fn()
            results[name] = "pass"
        except AssertionError as exc:
            results[name] = f"fail: {exc}"

    run("logprobs_match", lambda: mt.test_input_output_logprobs_match_helper(
        base, "embedded", threshold, prompts, turn_suffixes=[ids(GROUPS, 96, 100),
                                                             ids(GROUPS, 64, 200)],
        assert_decode_cached_tokens=decode, max_new_tokens=MAX_NEW))
    rng = random.Random(456)
    prefix_ids, full_ids = [], []
    for g in range(GROUPS):
        for b in range(BRANCHES):
            prefix_ids.append(list(prompts[g]))
            full_ids.append(prompts[g] + [rng.randint(1, vocab - 4) for _ in range(40 + b * 24)])
    run("prefill_cache_hit", lambda: mt.test_input_output_logprobs_match_prefill_cache_hit_helper(
        base, "embedded", threshold, prefix_input_ids=prefix_ids, full_input_ids=full_ids,
        turn_suffixes=[ids(n, 96, 789), ids(n, 64, 890)], assert_prefill_cached_tokens=prefill,
        assert_decode_cached_tokens=decode, branches_per_group=BRANCHES, max_new_tokens=MAX_NEW))
    first = [list(prompts[g]) for g in range(GROUPS) for _ in range(BRANCHES)]
    run("decode_cache_hit", lambda: mt.test_input_output_logprobs_match_decode_cache_hit_helper(
        base, "embedded", threshold, first, turn_suffixes=[ids(n, 96, 300), ids(n, 64, 400)],
        assert_decode_cached_tokens=decode, branches_per_group=BRANCHES, max_new_tokens=MAX_NEW))
    json.dump(results, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
