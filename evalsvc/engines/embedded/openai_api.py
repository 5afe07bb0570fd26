"""The OpenAI-compatible surface SGLang serves, over the embedded engine.

``GET /v1/models`` (and ``/v1/models/{model}``), ``POST /v1/completions`` and
``/v1/chat/completions``, streamed and not, with logprobs, as SGLang 0.5.23's
``entrypoints/openai`` builds them (``serving_completions.py``, ``serving_chat.py``,
``protocol.py``). As there, a request becomes a native ``/generate`` request (the same field
checks refuse what the engine cannot honour, naming the field), unknown fields are ignored, and
errors are SGLang's ``ErrorResponse``. Chat messages are rendered by the model's chat template
(``tokenizer.py``); the shipped models have no reasoning or tool-call parser, so ``tools`` are
refused.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, StrictInt, ValidationError

from .outputs import build_output, sse
from .protocol import (
    GenerateReqIn,
    RequestError,
    StreamRefused,
    check_body,
    describe,
    normalize,
    openai_error,
    read_json,
)
from .scheduler import GenerateInput
from .tokenizer import ChatTemplateError, TextTokenizer

CHAT_ROLES = {"system", "developer", "user", "assistant", "tool", "function"}


class StreamOptions(BaseModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _Request(BaseModel):
    """What both requests share (SGLang's CompletionRequest / ChatCompletionRequest fields)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str = "default"
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    min_tokens: int = 0
    regex: str | None = None
    ebnf: str | None = None
    stop_token_ids: list[StrictInt] | None = None
    stop_regex: str | list[str] | None = None
    no_stop_trim: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    response_format: dict[str, Any] | None = None
    custom_params: dict | None = None
    watermark: dict[str, Any] | None = None
    return_hidden_states: bool | str = False
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    return_cached_tokens_details: bool = False
    return_spec_tokens_details: bool = False
    return_token_ids: bool = False
    # fields passed through to the native request, which honours or refuses them
    _passthrough: dict[str, Any] = PrivateAttr(default_factory=dict)


PASSTHROUGH = ("lora_path", "session_id", "session_params", "custom_logit_processor",
               "images_config", "mm_processor_kwargs", "rid", "extra_key", "cache_salt",
               "priority", "custom_labels", "bootstrap_host", "bootstrap_port", "bootstrap_room",
               "disagg_prefill_dp_rank")
CHAT_PASSTHROUGH = ("video_config", "max_dynamic_patch", "min_dynamic_patch", "use_audio_in_video",
                    "return_sampling_mask", "sampling_logprobs_mode")


class CompletionIn(_Request):
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    json_schema: str | None = None
    best_of: int | None = None  # SGLang ignores it
    echo: bool = False
    logprobs: int | None = Field(None, ge=0)
    max_tokens: int = Field(16, gt=0)
    suffix: str | None = None  # SGLang ignores it without a completion template
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0


class ChatIn(_Request):
    messages: list[dict[str, Any]]
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)
    max_tokens: int | None = Field(None, gt=0)
    max_completion_tokens: int | None = Field(None, gt=0)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_prompt_token_ids: bool = False
    return_meta_info: bool = False
    return_input_ids_in_sglext: bool = False
    return_output_ids_in_sglext: bool = False
    input_ids: list[StrictInt] | None = None
    return_flat_raw_output_top_logprobs: bool = False
    return_flat_raw_top_logprobs_b64: bool = True
    # read by reasoning and tool-call parsers and by chat templates that have such modes; the
    # shipped models have none, so (as SGLang does then) they change nothing
    parallel_tool_calls: bool = True
    reasoning_effort: str | float | None = None
    thinking: Any = None
    task: str | None = None
    separate_reasoning: bool = True
    stream_reasoning: bool = True


def _body(raw: Any, model: type[_Request]) -> _Request:
    if not isinstance(raw, dict):
        raise RequestError("the request body must be a JSON object")
    check_body(raw)
    req = model.model_validate(raw)
    dp = raw.get("routed_dp_rank", raw.get("data_parallel_rank"))
    names = PASSTHROUGH + (CHAT_PASSTHROUGH if model is ChatIn else ())
    req._passthrough = {k: raw[k] for k in names if k in raw}
    if dp is not None:
        req._passthrough["routed_dp_rank"] = dp
    return req


def sampling_params(req: _Request, *, temperature: float, top_p: float, top_k: int, min_p: float,
                    repetition_penalty: float, max_new_tokens: int | None) -> dict[str, Any]:
    """SGLang's ``_build_sampling_params`` / ``to_sampling_params``, response_format included."""
    sp: dict[str, Any] = {
        "temperature": temperature, "max_new_tokens": max_new_tokens,
        "min_new_tokens": req.min_tokens, "stop": req.stop, "stop_token_ids": req.stop_token_ids,
        "stop_regex": req.stop_regex, "top_p": top_p, "top_k": top_k, "min_p": min_p,
        "presence_penalty": req.presence_penalty, "frequency_penalty": req.frequency_penalty,
        "repetition_penalty": repetition_penalty, "regex": req.regex,
        "json_schema": getattr(req, "json_schema", None), "ebnf": req.ebnf, "n": req.n,
        "no_stop_trim": req.no_stop_trim, "ignore_eos": req.ignore_eos,
        "skip_special_tokens": req.skip_special_tokens, "logit_bias": req.logit_bias,
        "custom_params": req.custom_params, "sampling_seed": req.seed, "watermark": req.watermark,
    }
    fmt = req.response_format or {}
    if fmt.get("type") == "json_schema":
        schema = (fmt.get("json_schema") or {}).get("schema")
        if schema is None:
            raise RequestError("schema_ is required for json_schema response format request.")
        sp["json_schema"] = json.dumps(schema)
    elif fmt.get("type") == "json_object":
        sp["json_schema"] = '{"type": "object"}'
    elif fmt.get("type") == "structural_tag":
        sp["structural_tag"] = json.dumps(fmt)
    elif fmt and fmt.get("type") != "text":
        raise RequestError(f"response_format.type: {fmt.get('type')!r} is not one of 'text', "
                           "'json_object', 'json_schema', 'structural_tag'")
    return sp


def native_inputs(engine, body: dict[str, Any]) -> tuple[list[GenerateInput], bool]:
    """A native ``/generate`` body, checked as ``/generate`` checks it."""
    try:
        native = GenerateReqIn.model_validate(body)
    except ValidationError as exc:
        raise RequestError(describe(exc)) from None
    return normalize(native, engine.scheduler.model.cfg.vocab_size,
                     engine.scheduler.tokenizer.encode)


def render_chat(tok: TextTokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                **kwargs: Any) -> str:
    """The prompt of a conversation; messages whose content the model cannot read are refused."""
    if not messages:
        raise RequestError("Messages cannot be empty.")
    for i, msg in enumerate(messages):
        role = msg.get("role")
        if not isinstance(role, str) or role.lower() not in CHAT_ROLES:
            raise RequestError(f"messages[{i}].role: must be one of {sorted(CHAT_ROLES)}")
        content = msg.get("content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" \
                        or not isinstance(part.get("text"), str):
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise RequestError(f"messages[{i}].content[{j}]: {kind!r} content is not "
                                       "supported (the shipped models are text-only)")
        elif content is not None and not isinstance(content, str):
            raise RequestError(f"messages[{i}].content: must be a string or a list of parts")
    normalized = [{**m, "role": m["role"].lower()} for m in messages]
    try:
        return tok.apply_chat_template(normalized, add_generation_prompt=add_generation_prompt,
                                       **kwargs)
    except ChatTemplateError as exc:
        raise RequestError(str(exc)) from None


def usage(prompt: int, completion: int, cached: int | None) -> dict[str, Any]:
    """SGLang's UsageInfo (``prompt_tokens_details`` with --enable-cache-report)."""
    return {"prompt_tokens": prompt, "total_tokens": prompt + completion,
            "completion_tokens": completion,
            "prompt_tokens_details": None if cached is None else {"cached_tokens": cached},
            "reasoning_tokens": 0, "completion_tokens_details": None}


def lossless_token_text(tok: TextTokenizer, token_id: int, text: str | None) -> str:
    """SGLang's ``_lossless_token_text``: a token that is a fragment of a UTF-8 character is shown
    as its raw bytes in latin-1, so nothing is lost."""
    if text is not None and "\ufffd" not in text:
        return text
    raw = tok.token_bytes(token_id)
    if raw is None:
        return text or ""
    try:
        bytes(raw).decode("utf-8")
        return text or ""
    except UnicodeDecodeError:
        return bytes(raw).decode("latin-1")


def completion_logprobs(tok: TextTokenizer, token_logprobs: list, top_logprobs: list | None,
                        input_logprobs: list | None = None,
                        input_top: list | None = None) -> dict[str, Any]:
    """SGLang's ``to_openai_style_logprobs`` (the legacy completions shape)."""
    out: dict[str, Any] = {"text_offset": [], "token_logprobs": [], "tokens": [],
                           "top_logprobs": []}
    for rows in (input_logprobs, token_logprobs):
        for lp, tid, text in rows or []:
            out["tokens"].append(lossless_token_text(tok, tid, text))
            out["token_logprobs"].append(lp)
            out["text_offset"].append(-1)
    for rows in (input_top, top_logprobs):
        for pos in rows or []:
            out["top_logprobs"].append(None if pos is None else {
                lossless_token_text(tok, tid, text): lp for lp, tid, text in pos})
    return out


def chat_logprobs(tok: TextTokenizer, token_logprobs: list, top_logprobs: list | None) -> dict:
    """SGLang's ``ChoiceLogprobs``: per token its text, raw bytes, logprob and top candidates."""

    def entry(lp, tid, text):
        raw = tok.token_bytes(tid)
        return {"token": text or "", "bytes": raw if raw is not None
                else list((text or "").encode()), "logprob": lp}

    content = []
    for k, (lp, tid, text) in enumerate(token_logprobs):
        tops = top_logprobs[k] if top_logprobs and k < len(top_logprobs) else None
        content.append({**entry(lp, tid, text),
                        "top_logprobs": [entry(*t) for t in tops] if tops else []})
    return {"content": content}


def _finish(meta: dict) -> tuple[str | None, Any]:
    reason = meta.get("finish_reason")
    if not reason:
        return None, None
    return reason["type"], reason.get("matched")


def add_openai_routes(app: FastAPI, engine, not_ready: Callable[[], Response | None]) -> None:

    def cache_report(meta: dict) -> int | None:
        return meta.get("cached_tokens", 0) if engine.args.enable_cache_report else None

    def sglext(req: _Request, metas: list[dict]) -> dict[str, Any] | None:
        ext: dict[str, Any] = {}
        details = metas[0].get("cached_tokens_details")
        if req.return_cached_tokens_details and details:
            ext["cached_tokens_details"] = {"device": details.get("device", 0),
                                            "host": details.get("host", 0)}
        if req.return_spec_tokens_details:
            spec = [_spec_details(m) for m in metas]
            spec = [s for s in spec if s is not None]
            if spec:
                ext["spec_tokens_details"] = spec if req.n > 1 else spec[0]
        return ext or None

    @app.get("/v1/models")
    async def list_models():
        """The served model, OpenAI-style."""
        return {"object": "list", "data": [model_card(engine.served_model_name)]}

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str):
        """One model, if it is the served one."""
        if model != engine.served_model_name:
            return JSONResponse({"error": {"message": f"The model '{model}' does not exist",
                                           "type": "invalid_request_error", "param": "model",
                                           "code": "model_not_found"}}, status_code=404)
        return model_card(model)

    def model_card(name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": int(engine.started), "owned_by": "sglang",
                "root": name, "parent": None, "max_model_len": engine.args.context_length}

    @app.post("/v1/completions")
    async def completions(request: Request):
        """OpenAI-compatible text completion, streamed or not."""
        if (resp := not_ready()) is not None:
            return resp
        try:
            req = _body(await read_json(request), CompletionIn)
            prompt = req.prompt
            if not prompt or (isinstance(prompt, list) and all(not p for p in prompt)):
                raise RequestError("Prompt cannot be empty")
            texts = isinstance(prompt, str) or isinstance(prompt[0], str)
            body = {
                ("text" if texts else "input_ids"): prompt,
                "sampling_params": sampling_params(
                    req, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                    min_p=req.min_p, repetition_penalty=req.repetition_penalty,
                    max_new_tokens=req.max_tokens),
                "return_logprob": req.logprobs is not None,
                "top_logprobs_num": req.logprobs or 0,
                "logprob_start_len": 0 if req.echo and req.logprobs else -1,
                "return_text_in_logprobs": True, "stream": req.stream,
                "return_hidden_states": req.return_hidden_states,
                "return_routed_experts": req.return_routed_experts,
                "routed_experts_start_len": req.routed_experts_start_len,
                "return_prompt_token_ids": req.return_token_ids, **req._passthrough,
            }
            inputs, _ = native_inputs(engine, body)
        except ValidationError as exc:
            return openai_error(describe(exc))
        except RequestError as exc:
            return openai_error(str(exc))
        tok = engine.scheduler.tokenizer
        echoes = [tok.decode(inp.input_ids, skip_special_tokens=True) if not texts
                  else (prompt if isinstance(prompt, str) else prompt[i])
                  for i, inp in enumerate(inputs)] if req.echo else None
        created = int(time.time())
        if req.stream:
            return await _stream(engine, inputs, lambda chunks: completion_stream(
                req, chunks, created, echoes), StreamRefused, openai_error)
        reqs = await engine.generate(inputs)
        for r in reqs:
            if r.error is not None:
                return openai_error(r.error, (r.finished_reason or {}).get("status_code", 400))
        outs = [build_output(r, engine.scheduler, req.return_token_ids) for r in reqs]
        choices = []
        for i, out in enumerate(outs):
            meta = out["meta_info"]
            logprobs = None
            if req.logprobs is not None:
                echo_lp = req.echo and req.logprobs
                logprobs = completion_logprobs(
                    tok, meta.get("output_token_logprobs", []), meta.get("output_top_logprobs", []),
                    meta.get("input_token_logprobs") if echo_lp else None,
                    meta.get("input_top_logprobs") if echo_lp else None)
            reason, matched = _finish(meta)
            choice = {"index": i, "text": (echoes[i] if echoes else "") + out["text"],
                      "logprobs": logprobs, "finish_reason": reason, "matched_stop": matched}
            if req.return_token_ids:
                choice["token_ids"] = out["output_ids"]
                choice["prompt_token_ids"] = out.get("prompt_token_ids")
            choices.append(choice)
        metas = [o["meta_info"] for o in outs]
        response = {
            "id": metas[0]["id"], "object": "text_completion", "created": created,
            "model": req.model, "choices": choices,
            "usage": usage(sum(m["prompt_tokens"] for m in metas),
                           sum(m["completion_tokens"] for m in metas),
                           None if cache_report(metas[0]) is None
                           else sum(m["cached_tokens"] for m in metas)),
            "metadata": {"weight_version": metas[0]["weight_version"]},
        }
        if (ext := sglext(req, metas)) is not None:
            response["sglext"] = ext
        return response

    async def completion_stream(req: CompletionIn, chunks: AsyncIterator[tuple[int, dict]],
                                created: int, echoes: list[str] | None) -> AsyncIterator[bytes]:
        """SGLang's ``_generate_completion_stream``."""
        tok = engine.scheduler.tokenizer
        incremental = engine.args.incremental_streaming_output
        include_usage, continuous = _usage_flags(req, engine)
        offsets: dict[int, int] = {}
        n_prev: dict[int, int] = {}
        n_prev_ids: dict[int, int] = {}
        last: dict[int, dict] = {}
        rid = None
        async for index, content in chunks:
            if "error" in content:
                yield sse(content)
                break
            meta = content["meta_info"]
            rid = meta["id"]
            last[index] = meta
            first = index not in offsets
            text = content["text"]
            delta = text if incremental else text[offsets.get(index, 0):]
            offsets[index] = len(text) if not incremental else offsets.get(index, 0) + len(text)
            if first and echoes:
                delta = echoes[index] + delta
            logprobs = None
            if req.logprobs is not None:
                echo_lp = first and req.echo and req.logprobs
                prev, total = n_prev.get(index, 0), meta["output_token_logprobs_length"]
                if prev < total or echo_lp:
                    out_lp = meta["output_token_logprobs"]
                    out_top = meta.get("output_top_logprobs", [])
                    if not incremental:
                        out_lp, out_top = out_lp[prev:total], out_top[prev:total]
                    logprobs = completion_logprobs(
                        tok, out_lp, out_top, meta.get("input_token_logprobs") if echo_lp else None,
                        meta.get("input_top_logprobs") if echo_lp else None)
                n_prev[index] = total
            reason, matched = _finish(meta)
            choice: dict[str, Any] = {"index": index, "text": delta, "logprobs": logprobs,
                                      "finish_reason": reason, "matched_stop": matched}
            if req.return_token_ids:
                ids = content["output_ids"]
                if not incremental:
                    ids, n_prev_ids[index] = ids[n_prev_ids.get(index, 0):], len(ids)
                choice["token_ids"] = ids
                if first:
                    choice["prompt_token_ids"] = content.get("prompt_token_ids")
            chunk: dict[str, Any] = {"id": rid, "object": "text_completion", "created": created,
                                     "choices": [choice], "model": req.model, "usage": None}
            if continuous:
                chunk["usage"] = usage(meta["prompt_tokens"], meta["completion_tokens"], None)
            yield sse(chunk)
        if rid is not None and (ext := sglext(req, [last[i] for i in sorted(last)])) is not None:
            yield sse({"id": rid, "object": "text_completion", "created": created, "choices": [],
                       "model": req.model, "usage": None, "sglext": ext})
        if rid is not None and include_usage:
            metas = [last[i] for i in sorted(last)]
            yield sse({"id": rid, "object": "text_completion", "created": created, "model": req.model,
                       "choices": [], "usage": usage(
                           sum(m["prompt_tokens"] for m in metas),
                           sum(m["completion_tokens"] for m in metas),
                           None if cache_report(metas[0]) is None
                           else sum(m["cached_tokens"] for m in metas))})
        yield sse("[DONE]")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        """OpenAI-compatible chat completion, streamed or not."""
        if (resp := not_ready()) is not None:
            return resp
        tok = engine.scheduler.tokenizer
        try:
            req = _body(await read_json(request), ChatIn)
            if not req.messages:
                raise RequestError("Messages cannot be empty.")
            if req.tools:
                raise RequestError("tools: tool calling is not supported by the embedded engine "
                                   "(no tool-call parser, and the chat template renders no tools)")
            if isinstance(req.tool_choice, dict) or req.tool_choice == "required":
                raise RequestError("tool_choice: tool calling is not supported by the embedded "
                                   "engine")
            if req.continue_final_message:
                raise RequestError("continue_final_message: not supported by the embedded engine")
            kwargs = dict(req.chat_template_kwargs or {})
            if "chat_template" in kwargs:
                raise RequestError("Request-supplied chat_template is not allowed. Start the "
                                   "server with --trust-request-chat-template to permit it.")
            if req.stream and (req.return_prompt_token_ids or req.return_token_ids
                               or req.return_meta_info):
                name = next(n for n in ("return_prompt_token_ids", "return_token_ids",
                                        "return_meta_info") if getattr(req, n))
                raise RequestError(f"{name} is not supported with streaming. Please set "
                                   f"stream=false when using {name}=true.")
            ids = req.input_ids if req.input_ids is not None else tok.encode(
                render_chat(tok, req.messages, **kwargs))
            max_new = req.max_completion_tokens or req.max_tokens
            if max_new is None:  # SGLang: as many as the context leaves
                max_new = max(1, min(engine.args.context_length, engine.args.max_total_tokens
                                     - engine.scheduler.spec_steps - 1) - len(ids))
            body = {
                "input_ids": ids,
                "sampling_params": sampling_params(
                    req, temperature=_or(req.temperature, 1.0), top_p=_or(req.top_p, 1.0),
                    top_k=_or(req.top_k, -1), min_p=_or(req.min_p, 0.0),
                    repetition_penalty=_or(req.repetition_penalty, 1.0), max_new_tokens=max_new),
                "return_logprob": req.logprobs, "logprob_start_len": -1,
                "top_logprobs_num": req.top_logprobs or 0, "stream": req.stream,
                "return_text_in_logprobs": True,
                "return_hidden_states": req.return_hidden_states,
                "return_routed_experts": req.return_routed_experts,
                "routed_experts_start_len": req.routed_experts_start_len,
                "return_prompt_token_ids": req.return_prompt_token_ids or req.return_token_ids
                or req.return_input_ids_in_sglext,
                "return_flat_raw_output_top_logprobs": req.return_flat_raw_output_top_logprobs,
                "return_flat_raw_top_logprobs_b64": req.return_flat_raw_output_top_logprobs
                and req.return_flat_raw_top_logprobs_b64, **req._passthrough,
            }
            inputs, _ = native_inputs(engine, body)
        except ValidationError as exc:
            return openai_error(describe(exc))
        except RequestError as exc:
            return openai_error(str(exc))
        created = int(time.time())
        if req.stream:
            return await _stream(engine, inputs, lambda chunks: chat_stream(req, chunks, created),
                                 StreamRefused, openai_error)
        reqs = await engine.generate(inputs)
        for r in reqs:
            if r.error is not None:
                return openai_error(r.error, (r.finished_reason or {}).get("status_code", 400))
        outs = [build_output(r, engine.scheduler, True) for r in reqs]
        choices = []
        for i, out in enumerate(outs):
            meta = out["meta_info"]
            reason, matched = _finish(meta)
            choice: dict[str, Any] = {
                "index": i,
                "message": {"role": "assistant", "content": out["text"] or "",
                            "reasoning_content": None},
                "logprobs": chat_logprobs(tok, meta["output_token_logprobs"],
                                          meta.get("output_top_logprobs"))
                if req.logprobs else None,
                "finish_reason": reason, "matched_stop": matched}
            if req.return_prompt_token_ids or req.return_token_ids:
                choice["prompt_token_ids"] = out["prompt_token_ids"]
            if req.return_token_ids:
                choice["response_token_ids"] = out["output_ids"]
            if req.return_meta_info:
                choice["meta_info"] = meta
            choices.append(choice)
        metas = [o["meta_info"] for o in outs]
        response = {
            "id": metas[0]["id"], "object": "chat.completion", "created": created,
            "model": req.model, "choices": choices,
            "usage": usage(metas[0]["prompt_tokens"], sum(m["completion_tokens"] for m in metas),
                           cache_report(metas[0])),
            "metadata": {"weight_version": metas[0]["weight_version"]},
        }
        ext = sglext(req, metas) or {}
        if req.return_input_ids_in_sglext:
            ext["input_ids"] = outs[0]["prompt_token_ids"]
        if req.return_output_ids_in_sglext:
            ext["output_ids"] = [o["output_ids"] for o in outs]
        if ext:
            response["sglext"] = ext
        return response

    async def chat_stream(req: ChatIn, chunks: AsyncIterator[tuple[int, dict]],
                          created: int) -> AsyncIterator[bytes]:
        """SGLang's ``_generate_chat_stream`` (no reasoning or tool-call parser)."""
        tok = engine.scheduler.tokenizer
        incremental = engine.args.incremental_streaming_output
        include_usage, continuous = _usage_flags(req, engine)
        offsets: dict[int, int] = {}
        n_prev: dict[int, int] = {}
        finished: dict[int, dict] = {}
        last: dict[int, dict] = {}
        output_ids: dict[int, list[int]] = {}
        rid = None

        def chunk(index, delta, logprobs=None, reason=None, matched=None, use=None) -> bytes:
            c: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": created,
                                 "model": req.model, "choices": [{
                                     "index": index, "delta": delta, "logprobs": logprobs,
                                     "finish_reason": reason, "matched_stop": matched}]}
            if use is not None:
                c["usage"] = use
            return sse(c)

        async for index, content in chunks:
            if "error" in content:
                yield sse(content)
                break
            meta = content["meta_info"]
            rid = meta["id"]
            last[index] = meta
            if req.return_output_ids_in_sglext:
                ids = content["output_ids"]
                output_ids[index] = output_ids.get(index, []) + ids if incremental else list(ids)
            logprobs = None
            if req.logprobs:
                prev, total = n_prev.get(index, 0), meta["output_token_logprobs_length"]
                if prev < total:
                    out_lp = meta["output_token_logprobs"]
                    out_top = meta.get("output_top_logprobs", [])
                    if not incremental:
                        out_lp, out_top = out_lp[prev:total], out_top[prev:total]
                    logprobs = chat_logprobs(tok, out_lp, out_top)
                n_prev[index] = total
            if meta.get("finish_reason"):
                finished[index] = meta["finish_reason"]
            if index not in offsets:
                offsets[index] = 0
                yield chunk(index, {"reasoning_content": None, "role": "assistant", "content": ""})
            text = content["text"]
            delta = text if incremental else text[offsets[index]:]
            offsets[index] = offsets[index] + len(text) if incremental else len(text)
            if delta:
                use = (usage(meta["prompt_tokens"], meta["completion_tokens"], None)
                       if continuous else None)
                yield chunk(index, {"reasoning_content": None, "content": delta}, logprobs,
                            use=use)
        for index, reason in finished.items():
            yield chunk(index, {"reasoning_content": None}, None, reason["type"],
                        reason.get("matched"))
        metas = [last[i] for i in sorted(last)]
        ext = (sglext(req, metas) or {}) if metas else {}
        if metas and req.return_output_ids_in_sglext:
            ext["output_ids"] = [output_ids.get(i, []) for i in sorted(last)]
        if ext:
            yield sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                       "model": req.model, "choices": [], "usage": None, "sglext": ext})
        if metas and include_usage:
            yield sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                       "model": req.model, "choices": [], "usage": usage(
                           metas[0]["prompt_tokens"], sum(m["completion_tokens"] for m in metas),
                           cache_report(metas[0]))})
        yield sse("[DONE]")


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def _usage_flags(req: _Request, engine) -> tuple[bool, bool]:
    """SGLang's ``should_include_usage``."""
    default = engine.args.stream_response_default_include_usage
    if req.stream_options is not None:
        return (bool(req.stream_options.include_usage) or default,
                bool(req.stream_options.continuous_usage_stats))
    return default, False


def _spec_details(meta: dict) -> dict[str, Any] | None:
    keys = ("spec_accept_rate", "spec_accept_length", "spec_num_correct_drafts",
            "spec_num_proposed_drafts", "spec_verify_ct", "spec_correct_drafts_histogram")
    if not any(k in meta for k in keys):
        return None
    return {"spec_accept_rate": meta.get("spec_accept_rate") or 0.0,
            "spec_accept_length": meta.get("spec_accept_length") or 0.0,
            "spec_cap_length": 0.0, "spec_block_accept_length": 0.0,
            "spec_num_correct_drafts": meta.get("spec_num_correct_drafts") or 0,
            "spec_num_proposed_drafts": meta.get("spec_num_proposed_drafts") or 0,
            "spec_verify_ct": meta.get("spec_verify_ct") or 0,
            "spec_correct_drafts_histogram": meta.get("spec_correct_drafts_histogram") or [],
            "spec_cap_lens_histogram": []}


async def _stream(engine, inputs, render, refused_type, error) -> Response:
    """Kick-start the engine's stream (a refusal before the first chunk is a plain 400, as
    SGLang's ``_handle_streaming_request`` does), then send ``render``'s events."""
    chunks = engine.stream(inputs, prompt_token_ids=True)
    try:
        first = await chunks.__anext__()
    except refused_type as exc:
        return error(str(exc), exc.status)

    async def replay() -> AsyncIterator[tuple[int, dict]]:
        yield first
        async for item in chunks:
            yield item

    async def body() -> AsyncIterator[bytes]:
        try:
            async for data in render(replay()):
                yield data
        finally:
            await chunks.aclose()

    return StreamingResponse(body(), media_type="text/event-stream")
