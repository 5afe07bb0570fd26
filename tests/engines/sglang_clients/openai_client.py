"""SGLang's own OpenAI client dependency (the ``openai`` package of a release's env) against a
server: what it parses from each endpoint, as JSON on stdout. Run by the env's python:

    <env python> openai_client.py BASE_URL
"""

from __future__ import annotations

import json
import sys

import openai

PROMPT = "def add(a, b):\n    return"
# under 64 tokens once templated (the embedded engine's byte-level tokens): never a prefix-cache hit,
# so the chat and its stream compute the same numbers (a hit equals a cold recompute only to float32
# rounding)
CHAT = [{"role": "system", "content": "Python."}, {"role": "user", "content": PROMPT}]


def main() -> int:
    client = openai.OpenAI(base_url=sys.argv[1] + "/v1", api_key="none")
    out: dict = {"openai_version": openai.__version__}
    models = client.models.list()
    out["models"] = [m.id for m in models.data]
    model = models.data[0].id
    greedy = {"temperature": 0, "max_tokens": 8, "extra_body": {"ignore_eos": True}}

    c = client.completions.create(model=model, prompt=PROMPT, logprobs=2, **greedy)
    out["completion"] = {"text": c.choices[0].text, "finish_reason": c.choices[0].finish_reason,
                         "token_logprobs": c.choices[0].logprobs.token_logprobs,
                         "top_logprobs": c.choices[0].logprobs.top_logprobs,
                         "usage": c.usage.model_dump()}
    parts, finish = [], None
    for chunk in client.completions.create(model=model, prompt=PROMPT, stream=True,
                                           stream_options={"include_usage": True}, **greedy):
        if chunk.choices:
            parts.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
        elif chunk.usage is not None:
            out["completion_stream_usage"] = chunk.usage.model_dump()
    out["completion_stream"] = {"text": "".join(parts), "chunks": len(parts),
                                "finish_reason": finish}

    r = client.chat.completions.create(model=model, messages=CHAT, logprobs=True, top_logprobs=2,
                                       **greedy)
    msg = r.choices[0].message
    out["chat"] = {"role": msg.role, "content": msg.content,
                   "finish_reason": r.choices[0].finish_reason,
                   "logprobs": [(t.token, t.bytes, t.logprob, len(t.top_logprobs))
                                for t in r.choices[0].logprobs.content],
                   "usage": r.usage.model_dump()}
    parts, roles, logprobs = [], [], []
    for chunk in client.chat.completions.create(model=model, messages=CHAT, stream=True,
                                                logprobs=True, **greedy):
        delta = chunk.choices[0].delta
        roles.append(delta.role)
        parts.append(delta.content or "")
        if chunk.choices[0].logprobs is not None:
            logprobs += [t.logprob for t in chunk.choices[0].logprobs.content]
        if chunk.choices[0].finish_reason:
            out["chat_stream_finish"] = chunk.choices[0].finish_reason
    out["chat_stream"] = {"content": "".join(parts), "first_role": roles[0],
                          "logprobs": logprobs}
    try:
        client.completions.create(model=model, prompt=PROMPT, max_tokens=4, logit_bias={"1": 5})
    except openai.BadRequestError as exc:
        out["refused"] = {"status": exc.status_code, "message": str(exc)}
    json.dump(out, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
