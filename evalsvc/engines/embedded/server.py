"""SGLang's native HTTP API over the embedded engine.

Endpoints: ``POST /generate``, ``GET /health``, ``GET /health_generate``, ``GET /server_info`` (and
the deprecated ``/get_server_info``), ``GET|POST /flush_cache``, ``GET /metrics``,
``GET /get_model_info``. Request and response shapes are SGLang's (``io_struct.GenerateReqInput``
and the tokenizer manager's ``meta_info``); a malformed request gets a 400 whose message names the
field, and the server keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, field_validator

from .args import EngineArgs
from .deps import missing_dependency
from .scheduler import GenerateInput, Req, SamplingParams, Scheduler

log = logging.getLogger("evalsvc.engine")

VERSION = "0.1.0"
FLUSH_OK = ("Cache flushed.\nPlease check backend logs for more details. (When there are running "
            "or waiting requests, the operation will not be performed.)\n")
FLUSH_FAILED = "Flush cache failed.\n"
HEALTH_TIMEOUT_S = 20.0



def engine_threads() -> int:
    """Torch threads of the engine: ``EVALSVC_ENGINE_THREADS``, default 1."""
    value = os.environ.get("EVALSVC_ENGINE_THREADS", "1")
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"EVALSVC_ENGINE_THREADS={value!r}: give a positive integer")
    return int(value)

MAX_BODY_DEPTH = 32  # JSON nesting of a request body (a /generate body needs 4 levels)
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes


class SamplingParamsIn(BaseModel):
    """SGLang's sampling parameters; unknown keys are refused by name, NaN and infinities too."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = -1
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    max_new_tokens: int = Field(128, ge=0)
    min_new_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None
    sampling_seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = Field(1, ge=1, le=1)
    frequency_penalty: float = Field(0.0, ge=0.0, le=0.0)
    presence_penalty: float = Field(0.0, ge=0.0, le=0.0)
    repetition_penalty: float = Field(1.0, ge=1.0, le=1.0)
    json_schema: None = None
    regex: None = None
    ebnf: None = None
    structural_tag: None = None
    custom_params: dict | None = None
    logit_bias: None = None
    stream_interval: int | None = None

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
            no_stop_trim=self.no_stop_trim)


class GenerateReqIn(BaseModel):
    """``POST /generate`` body (SGLang's GenerateReqInput, the fields a text model uses)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    text: str | list[str] | None = None
    input_ids: list[StrictInt] | list[list[StrictInt]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int] = -1
    top_logprobs_num: int | list[int] = 0
    token_ids_logprob: list[StrictInt] | list[list[StrictInt]] | None = None
    return_text_in_logprobs: bool = False
    stream: bool = Field(False, description="streaming is not supported by the embedded engine")
    log_metrics: bool = True
    return_hidden_states: bool = False
    lora_path: None = None
    input_embeds: None = None
    image_data: None = None
    custom_logit_processor: None = None
    session_params: None = None
    extra_key: str | None = None
    cache_salt: None = None
    priority: int | None = None
    no_logs: bool = False
    routed_dp_rank: int | None = None
    data_parallel_rank: int | None = None

    @field_validator("stream", "return_hidden_states")
    @classmethod
    def _unsupported_true(cls, v: bool, info) -> bool:
        if v:
            raise ValueError(f"{info.field_name}=true is not supported by the embedded engine")
        return v


class RequestError(ValueError):
    pass


def _item(value: Any, i: int, n: int, batch: bool, name: str) -> Any:
    """The i-th request's value of a field that is either one value or one per batch item."""
    if not isinstance(value, list):
        return value
    if not batch or len(value) != n:
        raise RequestError(f"{name}: {len(value)} values for "
                           + (f"a batch of {n}" if batch else "a single request"))
    return value[i]


def normalize(body: GenerateReqIn, vocab_size: int, encode) -> tuple[list[GenerateInput], bool]:
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
        if not ids or isinstance(ids[0], int) or len(ids) != n:
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
            raise RequestError(_describe(exc, "sampling_params")) from None
        except ValueError as exc:
            raise RequestError(f"sampling_params: {exc}") from None
        bad = [t for t in sp.stop_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise RequestError(f"sampling_params.stop_token_ids: token id {bad[0]} is outside the "
                               f"model's vocabulary (size {vocab_size})")
        if rids is not None:
            rid = rids[i]
        elif isinstance(body.rid, str) and not batch:
            rid = body.rid
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
        start = _item(body.logprob_start_len, i, n, batch, "logprob_start_len")
        if start < -1:
            raise RequestError(f"logprob_start_len: {start} must be -1 or a position >= 0")
        top = _item(body.top_logprobs_num, i, n, batch, "top_logprobs_num")
        if top < 0:
            raise RequestError(f"top_logprobs_num: {top} must not be negative")
        if top > vocab_size:
            raise RequestError(f"top_logprobs_num: {top} is more than the model's vocabulary "
                               f"(size {vocab_size})")
        out.append(GenerateInput(
            rid=rid, input_ids=toks, sampling=sp,
            return_logprob=bool(_item(body.return_logprob, i, n, batch, "return_logprob")),
            logprob_start_len=start, top_logprobs_num=top, token_ids_logprob=tids or None,
            return_text_in_logprobs=body.return_text_in_logprobs))
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


def _describe(exc: ValidationError, prefix: str = "") -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err["loc"])
        where = f"{prefix}.{loc}" if prefix and loc else (prefix or loc)
        msg = "unknown field" if err["type"] == "extra_forbidden" else err["msg"]
        parts.append(f"{where}: {msg}")
    return "; ".join(parts)


def build_meta(req: Req, scheduler: Scheduler) -> dict:
    """SGLang's ``meta_info`` for a finished request."""
    tok = scheduler.tokenizer
    text_on = req.inp.return_text_in_logprobs

    def triple(lp, tid):
        return [lp, tid, tok.token_text(tid) if text_on else None]

    meta: dict[str, Any] = {
        "id": req.rid,
        "finish_reason": req.finished_reason,
        "prompt_tokens": req.prompt_len,
        "weight_version": "default",
        "completion_tokens": len(req.output_ids),
        "cached_tokens": req.cached_tokens,
        "cached_tokens_details": (
            {"device": req.cached_tokens - req.host_cached_tokens, "host": req.host_cached_tokens}
            if req.cached_tokens else None),
    }
    if req.inp.return_logprob:
        k = req.logprob_start_len
        ins = req.origin[k:]
        meta["input_token_logprobs"] = (
            [triple(None, ins[0])] + [triple(lp, t) for lp, t in
                                      zip(req.input_logprobs, ins[1:], strict=False)]
            if ins else [])
        meta["output_token_logprobs"] = [triple(lp, t) for lp, t in
                                         zip(req.output_logprobs, req.output_ids, strict=False)]
        if req.inp.top_logprobs_num:
            meta["input_top_logprobs"] = ([None] + [[triple(lp, t) for lp, t in pos]
                                                    for pos in req.input_top_logprobs]
                                          if ins else [])
            meta["output_top_logprobs"] = [[triple(lp, t) for lp, t in pos]
                                           for pos in req.output_top_logprobs]
        if req.inp.token_ids_logprob:
            meta["input_token_ids_logprobs"] = ([None] + [[triple(lp, t) for lp, t in pos]
                                                          for pos in req.input_ids_logprobs]
                                                if ins else [])
            meta["output_token_ids_logprobs"] = [[triple(lp, t) for lp, t in pos]
                                                 for pos in req.output_ids_logprobs]
    end = req.finished_at or time.perf_counter()
    meta["e2e_latency"] = end - req.created
    if scheduler.spec_steps and req.spec_verify_ct:
        proposed = req.spec_verify_ct * scheduler.spec_steps
        meta.update({
            "spec_verify_ct": req.spec_verify_ct,
            "spec_accept_length": len(req.output_ids) / req.spec_verify_ct,
            "spec_accept_rate": req.spec_correct_drafts / proposed,
            "spec_num_correct_drafts": req.spec_correct_drafts,
            "spec_num_proposed_drafts": proposed,
            "spec_correct_drafts_histogram": list(req.spec_histogram),
            "spec_accept_histogram": list(req.spec_histogram),
        })
    return meta


def build_output(req: Req, scheduler: Scheduler) -> dict:
    tok = scheduler.tokenizer
    ids = req.output_ids
    if req.sp.skip_special_tokens and ids and ids[-1] == tok.eos_token_id:
        text = tok.decode(ids[:-1])
    else:
        text = tok.decode(ids)
    reason = req.finished_reason or {}
    if reason.get("type") == "stop" and isinstance(reason.get("matched"), str) \
            and not req.sp.no_stop_trim:
        cut = text.find(reason["matched"])
        if cut >= 0:
            text = text[:cut]
    return {"text": text, "output_ids": list(ids), "meta_info": build_meta(req, scheduler)}


class Engine:
    """The model, tokenizer and scheduler behind the HTTP app; loaded off the event loop. A load
    that fails calls ``on_failed`` (the server exits, as SGLang's launcher does)."""

    def __init__(self, args: EngineArgs, started: float) -> None:
        self.on_failed = None
        self.args = args
        self.started = started
        self.ready = threading.Event()
        self.failed: str | None = None
        self.scheduler: Scheduler | None = None
        self.startup_time: float | None = None
        self.closed = False

    def load(self) -> None:
        try:
            import torch

            from .model import Numerics, load_model
            from .tokenizer import TextTokenizer

            # one thread by default: the model is small and the engine overhead-bound, and with
            # several engines (or the harness) on the same cores, OpenMP's spinning threads are
            # an order of magnitude slower than one
            torch.set_num_threads(engine_threads())
            model = load_model(self.args.model_path,
                               Numerics.from_args(self.args.dtype, self.args.mamba_ssm_dtype))
            tokenizer = TextTokenizer(self.args.model_path)
            self.scheduler = Scheduler(self.args, model, tokenizer)
            self.scheduler.start()
            if not self.args.skip_server_warmup:
                self.warmup()
            self.startup_time = time.time() - self.started
            self.ready.set()
            log.info("The server is fired up and ready to roll! (port %d, %.2f s)",
                     self.args.port, self.startup_time)
        except Exception as exc:
            missing = missing_dependency(exc) if isinstance(exc, ImportError) else None
            self.failed = missing or f"{type(exc).__name__}: {exc}"
            if missing is None:
                log.error("engine load failed", exc_info=True)
            log.error("engine failed to start: %s", self.failed)  # the last line of the log tail
            if self.on_failed is not None:
                self.on_failed()

    def warmup(self) -> None:
        done = threading.Event()
        self.scheduler.submit(GenerateInput(rid="warmup", input_ids=[0, 1, 2, 3],
                                            sampling=SamplingParams(max_new_tokens=2,
                                                                    temperature=0.0)),
                              lambda _req: done.set())
        done.wait(60)
        self.scheduler.flush_cache()

    async def generate(self, inputs: list[GenerateInput]) -> list[Req]:
        loop = asyncio.get_running_loop()
        futures = []
        for inp in inputs:
            fut = loop.create_future()
            futures.append(fut)
            self.scheduler.submit(inp, lambda req, f=fut: loop.call_soon_threadsafe(
                _resolve, f, req))
        return list(await asyncio.gather(*futures))

    def close(self) -> None:
        if self.scheduler is not None and not self.closed:
            self.closed = True
            self.scheduler.stop()


def _resolve(fut: asyncio.Future, req: Req) -> None:
    if not fut.done():
        fut.set_result(req)


def _error(message: str, status: int = 400) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=status)


def create_app(args: EngineArgs, started: float | None = None) -> FastAPI:
    engine = Engine(args, started or time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        thread = threading.Thread(target=engine.load, name="engine-load", daemon=True)
        thread.start()
        yield
        thread.join(timeout=60)
        engine.close()

    app = FastAPI(title="evalsvc embedded engine", version=VERSION, lifespan=lifespan)
    app.state.engine = engine

    def not_ready() -> Response | None:
        if engine.failed:
            return _error(f"engine failed to start: {engine.failed}", 503)
        if not engine.ready.is_set():
            return _error("the engine is starting", 503)
        return None

    @app.post("/generate")
    async def generate(request: Request):
        """Generate text or token ids; SGLang's native API."""
        if (resp := not_ready()) is not None:
            return resp
        try:
            raw = await request.json()
        except ValueError:
            return _error("the request body is not valid JSON")
        except RecursionError:
            return _error(f"the request body: nested deeper than {MAX_BODY_DEPTH} levels")
        if not isinstance(raw, dict):
            return _error("the request body must be a JSON object")
        try:
            check_body(raw)
            body = GenerateReqIn.model_validate(raw)
            inputs, batch = normalize(body, engine.scheduler.model.cfg.vocab_size,
                                      engine.scheduler.tokenizer.encode)
        except ValidationError as exc:
            return _error(_describe(exc))
        except RequestError as exc:
            return _error(str(exc))
        reqs = await engine.generate(inputs)
        for req in reqs:
            if req.error is not None:
                status = (req.finished_reason or {}).get("status_code", 400)
                return _error(req.error, status)
        outs = [build_output(r, engine.scheduler) for r in reqs]
        return JSONResponse(outs if batch else outs[0])

    @app.get("/health")
    @app.get("/health_generate")
    async def health():
        """200 once the engine generates; 503 while starting or failing."""
        if not_ready() is not None:
            return Response(status_code=503)
        inp = GenerateInput(rid=f"HEALTH_CHECK_{uuid.uuid4().hex}", input_ids=[0],
                            sampling=SamplingParams(max_new_tokens=1, temperature=0.0))
        try:
            await asyncio.wait_for(engine.generate([inp]), HEALTH_TIMEOUT_S)
        except TimeoutError:
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info():
        """Resolved server arguments, internal states and version."""
        if (resp := not_ready()) is not None:
            return resp
        return JSONResponse(server_info_dict(engine))

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        """Reset the prefix cache; refused (400) while requests are in flight."""
        if (resp := not_ready()) is not None:
            return resp
        ok = await asyncio.to_thread(engine.scheduler.flush_cache)
        if ok:
            return PlainTextResponse(FLUSH_OK)
        return PlainTextResponse(FLUSH_FAILED, status_code=400)

    @app.get("/metrics")
    async def metrics():
        """Prometheus text exposition."""
        from .metrics import render

        return Response(render(engine), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/get_model_info")
    async def model_info():
        """Model path and kind."""
        return {"model_path": args.model_path, "tokenizer_path": args.model_path,
                "is_generation": True, "preferred_sampling_params": None,
                "weight_version": "default"}

    return app


def server_info_dict(engine: Engine) -> dict:
    sched = engine.scheduler
    args = engine.args.to_dict()
    stats = sched.stats
    state = dict(args)
    state.update({
        "effective_max_running_requests_per_dp": engine.args.max_running_requests,
        "last_gen_throughput": 0.0,
        "memory_usage": {"kvcache_tokens": engine.args.max_total_tokens,
                         "mamba_cache_slots": engine.args.max_mamba_cache_size},
        "startup_time": engine.startup_time,
    })
    if sched.spec_steps and stats.avg_spec_accept_length is not None:
        state["avg_spec_accept_length"] = stats.avg_spec_accept_length
    cfg = sched.model.cfg
    return {
        **args,
        "status": "ready",
        "max_total_num_tokens": engine.args.max_total_tokens,
        "max_req_input_len": engine.args.max_total_tokens - 1,
        "startup_time": engine.startup_time,
        "internal_states": [state],
        "version": f"{VERSION}+evalsvc.embedded",
        "frontend": "python",
        "engine": "evalsvc-embedded",
        "model": {"architecture": cfg.architecture, "family": cfg.family,
                  "vocab_size": cfg.vocab_size, "layer_types": cfg.layer_types},
    }
