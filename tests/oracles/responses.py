"""A ``/generate`` response of a scenario's requests' shape, as SGLang writes one: the answer of
the stand-in servers in ``tests/test_engine_client.py`` and ``benchmarks/client.py``."""

from __future__ import annotations

import json

from evalsvc.scenarios import TOP_K

PROMPT_TOKENS = 200
CACHED = 120  # the prefix a hit would have cached: prompt logprobs are asked for after it


def response_body(max_new_tokens: int, prompt_tokens: int = PROMPT_TOKENS,
                  cached: int = CACHED) -> bytes:
    """A ``/generate`` response of the requests' shape, as SGLang writes one."""
    out = [[-0.25 - 0.01 * (i % 7), 100 + i, None] for i in range(max_new_tokens)]
    top = [[[-0.25 - 0.3 * j, 100 + i + 37 * j, None] for j in range(TOP_K)]
           for i in range(max_new_tokens)]
    inputs = [[-1.5 - 0.01 * (i % 5), i, None] for i in range(cached, prompt_tokens)]
    meta = {"id": "0", "finish_reason": {"type": "length", "length": max_new_tokens},
            "prompt_tokens": prompt_tokens, "completion_tokens": max_new_tokens,
            "cached_tokens": cached, "output_token_logprobs": out, "output_top_logprobs": top,
            "input_token_logprobs": inputs, "input_top_logprobs": None}
    return json.dumps({"text": "", "output_ids": [e[1] for e in out],
                       "meta_info": meta}).encode()
