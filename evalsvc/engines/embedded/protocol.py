"""The request side of the native API: SGLang's ``GenerateReqInput`` and ``SamplingParams`` fields.

Every field of SGLang 0.5.23's ``GenerateReqInput`` (72) and of its public ``SamplingParams`` is a
field here, so a client that sends the release's fields with their defaults (bench_serving sends
``return_routed_experts: false`` and ``lora_path: null`` with every request) is served. A field the
engine can honour is honoured; one whose value it cannot honour (images, LoRA, hidden states,
disaggregation, constrained decoding) is accepted at its default or null and otherwise refused
with a 400 that names it. Names outside the release's are refused as unknown, as before.
``tests/engines/test_sglang_api_surface.py`` reads the field lists from SGLang's own code, so a
release that adds a field fails until the engine knows it.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    ValidationError,
    field_validator,
    model_validator,
)

from .scheduler import GenerateInput, SamplingParams

MAX_BODY_DEPTH = 32  # JSON nesting of a request body (a /generate body needs 4 levels)
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes
INT64 = (-(2**63), 2**63 - 1)

MULTIMODAL = "multimodal input (the shipped models are text-only)"
DISAGG = "prefill/decode disaggregation"

# GenerateReqInput fields the engine cannot honour: field -> (SGLang's default, what it is)
UNSUPPORTED_FIELDS: dict[str, tuple[Any, str]] = {
    "input_embeds": (None, "input embeddings"),
    "image_data": (None, MULTIMODAL), "video_data": (None, MULTIMODAL),
    "audio_data": (None, MULTIMODAL), "mm_hashes": (None, MULTIMODAL),
    "mm_content_hashes": (None, MULTIMODAL), "use_audio_in_video": (False, MULTIMODAL),
    "video_config": (None, MULTIMODAL), "modalities": (None, MULTIMODAL),
    "need_wait_for_mm_inputs": (None, MULTIMODAL), "num_items_assigned": (None, MULTIMODAL),
    "encoder_urls": (None, MULTIMODAL), "max_dynamic_patch": (None, MULTIMODAL),
    "min_dynamic_patch": (None, MULTIMODAL), "image_max_dynamic_patch": (None, MULTIMODAL),
    "video_max_dynamic_patch": (None, MULTIMODAL), "images_config": (None, MULTIMODAL),
    "mm_processor_kwargs": (None, MULTIMODAL),
    "watermark": (None, "watermarking"),
    "return_sampling_mask": (False, "returning the sampling support mask"),
    "sampling_logprobs_mode": (None, "returning the sampling support mask"),
    "return_flat_raw_top_logprobs": (False, "flat top-logprob arrays"),
    "return_flat_raw_output_top_logprobs": (False, "flat top-logprob arrays"),
    "return_flat_raw_top_logprobs_b64": (False, "flat top-logprob arrays"),
    "return_hidden_states": (False, "returning hidden states"),
    "return_routed_experts": (False, "returning routed experts (the shipped models are dense)"),
    "routed_experts_start_len": (0, "returning routed experts (the shipped models are dense)"),
    "return_indexer_topk": (False, "returning indexer top-k (no sparse attention here)"),
    "session_params": (None, "session continuation (it rewrites the prompt)"),
    "lora_path": (None, "LoRA adapters"), "lora_id": (None, "LoRA adapters"),
    "custom_logit_processor": (None, "custom logit processors"),
    "positional_embed_overrides": (None, "embedding overrides"),
    "bootstrap_host": (None, DISAGG), "bootstrap_port": (None, DISAGG),
    "bootstrap_room": (None, DISAGG), "bootstrap_pair_key": (None, DISAGG),
    "decode_tp_size": (None, DISAGG), "disagg_prefill_dp_rank": (None, DISAGG),
    "http_worker_ipc": (None, "multi-tokenizer routing (one HTTP worker here)"),
    "require_reasoning": (False, "reasoning (the shipped models are not reasoning models)"),
    "max_thinking_tokens": (None, "reasoning (the shipped models are not reasoning models)"),
    "return_bytes": (False, "returning image bytes"),
    "multi_item_delimiter_indices": (None, "multi-item scoring"),
    "token_indices_to_pool": (None, "pooled readout"),
}

# SamplingParams fields the engine cannot honour: field -> (default, what it is)
UNSUPPORTED_SAMPLING: dict[str, tuple[Any, str]] = {
    "stop_regex": (None, "stop regular expressions"),
    "beam_width": (None, "beam search"),
    "json_schema": (None, "constrained decoding"), "regex": (None, "constrained decoding"),
    "ebnf": (None, "constrained decoding"), "structural_tag": (None, "constrained decoding"),
    "logit_bias": (None, "logit bias"), "watermark": (None, "watermarking"),
}


def at_default(value: Any, default: Any) -> bool:
    """Whether a field's value means "not asked for": the default, null, or an empty or all-default
    batch list (SGLang normalises a single value to one per batch item)."""
    if value is None or value == default:
        return True
    if isinstance(value, list):
        return all(at_default(v, default) for v in value)
    return isinstance(value, dict) and not value and default is None


def refusals(values: dict[str, Any], table: dict[str, tuple[Any, str]]) -> list[str]:
    """One message per field of ``table`` whose value is not its default, naming the field."""
    return [f"{name}: {what} is not supported by the embedded engine (got "
            f"{_short(values[name])})"
            for name, (default, what) in table.items()
            if name in values and not at_default(values[name], default)]


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class RequestError(ValueError):
    """A request the engine refuses; the message names the field."""


class SamplingParamsIn(BaseModel):
    """SGLang's sampling parameters; unknown keys are refused by name, NaN and infinities too. A
    null is the default, as in SGLang (``SamplingParams.__post_init__``)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    max_new_tokens: int = Field(128, ge=0)
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = -1
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    frequency_penalty: float = Field(0.0, ge=0.0, le=0.0)
    presence_penalty: float = Field(0.0, ge=0.0, le=0.0)
    repetition_penalty: float = Field(1.0, ge=1.0, le=1.0)
    min_new_tokens: int = Field(0, ge=0)
    n: int = Field(1, ge=1, le=1)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # byte-level BPE decodes without spaces anyway
    no_stop_trim: bool = False
    stream_interval: int | None = Field(None, ge=1)
    sampling_seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    custom_params: dict | None = None  # read by custom logit processors only (none here)
    stop_regex: Any = None
    beam_width: Any = None
    json_schema: Any = None
    regex: Any = None
    ebnf: Any = None
    structural_tag: Any = None
    logit_bias: Any = None
    watermark: Any = None

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None or k not in cls.model_fields}
        return data

    @model_validator(mode="after")
    def _unsupported(self) -> SamplingParamsIn:
        values = dict(self)
        if values["beam_width"] == 1:
            values["beam_width"] = None
        found = refusals(values, UNSUPPORTED_SAMPLING)
        if found:
            raise ValueError("; ".join(found))
        return self

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v == 0 or v < -1:
            raise ValueError("top_k must be -1 (disabled) or at least 1")
        return v

    def to_params(self) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(f"min_new_tokens ({self.min_new_tokens}) must be <= max_new_tokens "
                             f"({self.max_new_tokens})")
        return SamplingParams(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            max_new_tokens=self.max_new_tokens, min_new_tokens=self.min_new_tokens,
            ignore_eos=self.ignore_eos, stop=stop, stop_token_ids=list(self.stop_token_ids or []),
            sampling_seed=self.sampling_seed, skip_special_tokens=self.skip_special_tokens,
            no_stop_trim=self.no_stop_trim, stream_interval=self.stream_interval)


class GenerateReqIn(BaseModel):
    """``POST /generate`` body: SGLang's GenerateReqInput, every field of release 0.5.23."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    # honoured
    rid: str | list[str] | None = None
    text: str | list[str] | None = None
    input_ids: list[StrictInt] | list[list[StrictInt]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    token_ids_logprob: list[StrictInt] | list[list[StrictInt]] | None = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    return_prompt_token_ids: bool = False
    # prefix-cache namespaces: requests share cached prefixes only with equal keys and salts
    extra_key: str | list[str] | None = None
    cache_salt: str | list[str] | None = None
    # accepted and honoured by having nothing to do on one CPU engine (SGLang ignores them
    # the same way without the feature they steer: priority scheduling, DP routing, metrics
    # labels, tracing; return_entropy returns nothing in SGLang 0.5.23 either)
    session_id: str | None = None
    log_metrics: bool = True
    return_entropy: bool = False
    routed_dp_rank: int | None = None
    data_parallel_rank: int | None = None
    routing_key: str | None = None
    conversation_id: str | None = None
    background: bool = False
    priority: int | None = Field(None, ge=INT64[0], le=INT64[1])
    no_logs: bool = False
    custom_labels: dict[str, str] | None = None
    external_trace_header: dict[str, Any] | None = None
    received_time: float | None = None
    kv_hints: dict[str, Any] | list[dict[str, Any] | None] | None = None  # no storage backend
    # not honoured: the default or null only (UNSUPPORTED_FIELDS)
    input_embeds: Any = None
    image_data: Any = None
    video_data: Any = None
    audio_data: Any = None
    mm_hashes: Any = None
    mm_content_hashes: Any = None
    use_audio_in_video: Any = False
    video_config: Any = None
    modalities: Any = None
    need_wait_for_mm_inputs: Any = None
    num_items_assigned: Any = None
    encoder_urls: Any = None
    max_dynamic_patch: Any = None
    min_dynamic_patch: Any = None
    image_max_dynamic_patch: Any = None
    video_max_dynamic_patch: Any = None
    images_config: Any = None
    mm_processor_kwargs: Any = None
    watermark: Any = None
    return_sampling_mask: Any = None
    sampling_logprobs_mode: Any = None
    return_flat_raw_top_logprobs: Any = False
    return_flat_raw_output_top_logprobs: Any = False
    return_flat_raw_top_logprobs_b64: Any = False
    return_hidden_states: Any = False
    return_routed_experts: Any = False
    routed_experts_start_len: Any = 0
    return_indexer_topk: Any = False
    session_params: Any = None
    lora_path: Any = None
    lora_id: Any = None
    custom_logit_processor: Any = None
    positional_embed_overrides: Any = None
    bootstrap_host: Any = None
    bootstrap_port: Any = None
    bootstrap_room: Any = None
    bootstrap_pair_key: Any = None
    decode_tp_size: Any = None
    disagg_prefill_dp_rank: Any = None
    http_worker_ipc: Any = None
    require_reasoning: Any = False
    max_thinking_tokens: Any = None
    return_bytes: Any = False
    multi_item_delimiter_indices: Any = None
    token_indices_to_pool: Any = None

    @model_validator(mode="after")
    def _unsupported(self) -> GenerateReqIn:
        found = refusals(dict(self), UNSUPPORTED_FIELDS)
        for name in ("routed_dp_rank", "data_parallel_rank"):
            rank = getattr(self, name)
            if rank not in (None, 0):
                found.append(f"{name}: {rank} is not a data-parallel rank of this server (it has "
                             "one, rank 0)")
        if found:
            raise ValueError("; ".join(found))
        return self


def namespace_of(salt: str | None, key: str | None) -> tuple[str, str] | None:
    """The prefix-cache namespace of a request; None (the shared one) when neither is set.
    Empty strings count as unset, as SGLang normalises them."""
    salt, key = salt or None, key or None
    return None if salt is None and key is None else (salt or "", key or "")


def _item(value: Any, i: int, n: int, batch: bool, name: str, default: Any = None) -> Any:
    """The i-th request's value of a field that is either one value or one per batch item."""
    if value is None:
        return default
    if not isinstance(value, list):
        return value
    if not batch or len(value) != n:
        raise RequestError(f"{name}: {len(value)} values for "
                           + (f"a batch of {n}" if batch else "a single request"))
    return default if value[i] is None else value[i]


def normalize(body: GenerateReqIn, vocab_size: int,
              encode: Callable[[str], list[int]]) -> tuple[list[GenerateInput], bool]:
    """Split a (possibly batched) request into per-prompt inputs, as SGLang normalises them."""
    if body.text is None and body.input_ids is None:
        raise RequestError("Either text, input_ids or input_embeds should be provided.")
    if body.text is not None:
        batch = isinstance(body.text, list)
        n = len(body.text) if batch else 1
    else:
        batch = bool(body.input_ids) and isinstance(body.input_ids[0], list)
        n = len(body.input_ids) if batch else 1
    if batch and n == 0:
        raise RequestError("text/input_ids: an empty batch")
    if body.input_ids is not None:
        ids = body.input_ids if batch else [body.input_ids]
        if (not ids or len(ids) != n
                or not all(isinstance(seq, list) and all(isinstance(t, int) for t in seq)
                           for seq in ids)):
            raise RequestError(f"input_ids: expected {n} lists of token ids to match text")
    else:
        texts = body.text if batch else [body.text]
        ids = [encode(t) for t in texts]
    sp_raw = body.sampling_params if body.sampling_params is not None else {}
    if isinstance(sp_raw, list) and len(sp_raw) != n:
        raise RequestError(f"sampling_params: {len(sp_raw)} entries for a batch of {n}")
    rids = body.rid if isinstance(body.rid, list) else None
    if rids is not None and (not batch or len(rids) != n):
        raise RequestError(f"rid: {len(rids)} ids for a batch of {n}")
    if rids is not None and len(set(rids)) != len(rids):
        raise RequestError(f"Duplicate request IDs detected within the request: {rids}")
    for name in ("extra_key", "cache_salt"):
        value = getattr(body, name)
        if isinstance(value, list) and (not batch or len(value) != n):
            raise RequestError(f"The length of {name} should be equal to the batch size.")
    out = []
    for i in range(n):
        toks = list(ids[i])
        if not toks:
            raise RequestError("text/input_ids: the prompt is empty (input_ids cannot be empty)")
        bad = [t for t in toks if not 0 <= t < vocab_size]
        if bad:
            raise RequestError(f"input_ids: token id {bad[0]} is outside the model's vocabulary "
                               f"(size {vocab_size})")
        raw = sp_raw[i] if isinstance(sp_raw, list) else sp_raw
        try:
            sp = SamplingParamsIn.model_validate(raw).to_params()
        except ValidationError as exc:
            raise RequestError(describe(exc, "sampling_params")) from None
        except ValueError as exc:
            raise RequestError(f"sampling_params: {exc}") from None
        bad = [t for t in sp.stop_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise RequestError(f"sampling_params.stop_token_ids: token id {bad[0]} is outside the "
                               f"model's vocabulary (size {vocab_size})")
        if rids is not None:
            rid = rids[i]
        elif isinstance(body.rid, str):
            rid = f"{body.rid}_{i}" if batch else body.rid  # as SGLang expands a batch's rid
        else:
            rid = uuid.uuid4().hex
        tids = body.token_ids_logprob
        if tids is not None and tids and isinstance(tids[0], list):
            if len(tids) != n:
                raise RequestError(f"token_ids_logprob: {len(tids)} lists for a batch of {n}")
            tids = tids[i]
        bad = [t for t in tids or [] if not 0 <= t < vocab_size]
        if bad:
            raise RequestError(f"token_ids_logprob: token id {bad[0]} is outside the model's "
                               f"vocabulary (size {vocab_size})")
        start = _item(body.logprob_start_len, i, n, batch, "logprob_start_len", -1)
        if start < -1:
            raise RequestError(f"logprob_start_len: {start} must be -1 or a position >= 0")
        top = _item(body.top_logprobs_num, i, n, batch, "top_logprobs_num", 0)
        if top < 0:
            raise RequestError(f"top_logprobs_num: {top} must not be negative")
        if top > vocab_size:
            raise RequestError(f"top_logprobs_num: {top} is more than the model's vocabulary "
                               f"(size {vocab_size})")
        namespace = namespace_of(_item(body.cache_salt, i, n, batch, "cache_salt"),
                                 _item(body.extra_key, i, n, batch, "extra_key"))
        out.append(GenerateInput(
            rid=rid, input_ids=toks, sampling=sp,
            return_logprob=bool(_item(body.return_logprob, i, n, batch, "return_logprob", False)),
            logprob_start_len=start, top_logprobs_num=top, token_ids_logprob=tids or None,
            return_text_in_logprobs=body.return_text_in_logprobs, stream=body.stream,
            namespace=namespace))
    return out, batch


def check_body(raw: Any) -> None:
    """What the models cannot check: nesting depth, and strings that are not Unicode text (a lone
    surrogate, which JSON's \\uD800 escapes can carry, cannot be tokenized or echoed back)."""
    stack = [(raw, "", 1)]
    while stack:
        value, where, depth = stack.pop()
        if depth > MAX_BODY_DEPTH:
            raise RequestError(f"{where or 'the request body'}: nested deeper than "
                               f"{MAX_BODY_DEPTH} levels")
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise RequestError(f"{where}: a lone surrogate (U+{ord(value[exc.start]):04X}) "
                                   f"at character {exc.start} is not text") from None
        elif isinstance(value, dict):
            for k, v in value.items():
                if isinstance(k, str):
                    stack.append((k, f"{where}.<key>" if where else "<key>", depth + 1))
                stack.append((v, f"{where}.{k}" if where else str(k), depth + 1))
        elif isinstance(value, list):
            stack.extend((v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value))


def describe(exc: ValidationError, prefix: str = "") -> str:
    """A pydantic error as one line per problem, each starting with the field's path."""
    parts = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err["loc"])
        where = f"{prefix}.{loc}" if prefix and loc else (prefix or loc)
        msg = "unknown field" if err["type"] == "extra_forbidden" else err["msg"]
        msg = msg.removeprefix("Value error, ")
        if err["type"] == "value_error" and not loc:
            # a model-level check: each of its messages names its field
            parts += [f"{prefix}.{m}" if prefix else m for m in msg.split("; ")]
        else:
            parts.append(f"{where}: {msg}")
    return "; ".join(parts)


class StreamRefused(Exception):
    """A streamed request refused before its first chunk (answered as a plain 400)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


async def read_json(request: Any) -> Any:
    """The body as JSON; RequestError (naming the problem) if it is not."""
    try:
        return await request.json()
    except ValueError:
        raise RequestError("the request body is not valid JSON") from None
    except RecursionError:
        raise RequestError(f"the request body: nested deeper than {MAX_BODY_DEPTH} levels") from None


def openai_error(message: str, status: int = 400, err_type: str = "BadRequest") -> JSONResponse:
    """SGLang's ErrorResponse for the OpenAI-compatible and tokenizer endpoints."""
    return JSONResponse({"object": "error", "message": message, "type": err_type, "param": None,
                         "code": status}, status_code=status)
