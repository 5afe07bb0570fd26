"""SGLang's HTTP API over the embedded engine.

Native endpoints, as SGLang 0.5.23 serves them: ``POST /generate`` (also streamed, see
``outputs.py``), ``GET /health``, ``/health_generate``, ``/ping``, ``/server_info`` (and the
deprecated ``/get_server_info``), ``/model_info`` (and ``/get_model_info``), ``GET|POST
/flush_cache``, ``POST /abort_request``, ``POST /tokenize``, ``/detokenize`` (also under ``/v1/``),
``GET /metrics``; the OpenAI-compatible ones are in ``openai_api.py``. Request and response shapes
are SGLang's (``io_struct.GenerateReqInput``, the tokenizer manager's ``meta_info``); a malformed
request gets a 400 whose message names the field, and the server keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, StrictInt, ValidationError

from .args import EngineArgs
from .deps import missing_dependency
from .outputs import StreamState, build_output, sse
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
from .scheduler import GenerateInput, Req, SamplingParams, Scheduler, rid_key

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

    @property
    def served_model_name(self) -> str:
        """The model's name in the OpenAI-compatible API: --served-model-name, else the path."""
        return self.args.served_model_name or self.args.model_path

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

    async def stream(self, inputs: list[GenerateInput], prompt_token_ids: bool = False
                     ) -> AsyncIterator[tuple[int, dict]]:
        """(index, chunk) for each request of a batch, interleaved as they come; the finished
        chunk of each comes last. A request refused before anything was sent raises
        ``StreamRefused``. Closing the iterator early aborts what is still running."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        sched = self.scheduler
        states = [StreamState(i, self.args.incremental_streaming_output,
                              self.args.stream_interval, prompt_token_ids)
                  for i in range(len(inputs))]
        for i, inp in enumerate(inputs):
            inp.key = rid_key(inp.rid)
            # on the scheduler's thread: report a snapshot (the request and its output length)
            # and build nothing there
            sched.submit(inp,
                         lambda req, i=i: loop.call_soon_threadsafe(queue.put_nowait,
                                                                    (i, None, req)),
                         lambda req, i=i: loop.call_soon_threadsafe(
                             queue.put_nowait, (i, len(req.output_ids), req)))
        open_reqs = set(range(len(inputs)))
        sent = False
        try:
            while open_reqs:
                items = [await queue.get()]
                while not queue.empty():
                    items.append(queue.get_nowait())
                newest: dict[int, tuple[int, Req]] = {}
                finished: dict[int, Req] = {}
                for i, n, req in items:
                    if n is None:
                        finished[i] = req
                    elif states[i].admit(req, sched, n):
                        newest[i] = (n, req)
                for i, (n, req) in newest.items():
                    if i not in finished:  # else its finished chunk has these tokens too
                        sent = True
                        yield i, states[i].progress(req, sched, n)
                for i, req in finished.items():
                    open_reqs.discard(i)
                    if req.error is not None and not states[i].first_sent:
                        status = (req.finished_reason or {}).get("status_code", 400)
                        if not sent:
                            raise StreamRefused(req.error, status)
                        # SGLang's stream error chunk, then the stream ends
                        yield i, {"error": {"message": req.error, "type": "invalid_request_error",
                                            "code": status, "retryable": False}}
                        return
                    sent = True
                    yield i, states[i].final(req, sched)
        finally:
            for i in open_reqs:
                sched.abort(None, key=inputs[i].key)

    def close(self) -> None:
        if self.scheduler is not None and not self.closed:
            self.closed = True
            self.scheduler.stop()


def _resolve(fut: asyncio.Future, req: Req) -> None:
    if not fut.done():
        fut.set_result(req)


def _error(message: str, status: int = 400) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=status)


async def stream_response(engine: Engine, inputs: list[GenerateInput], batch: bool,
                          prompt_token_ids: bool) -> Response:
    """SGLang's ``/generate`` stream: ``data:`` chunks, then ``data: [DONE]``. The first chunk is
    awaited before the response starts, so a request refused by the scheduler is a plain 400."""
    chunks = engine.stream(inputs, prompt_token_ids)
    try:
        first = await chunks.__anext__()
    except StreamRefused as exc:
        return _error(str(exc), exc.status)

    async def body() -> AsyncIterator[bytes]:
        try:
            item = first
            while True:
                i, chunk = item
                if batch and "error" not in chunk:
                    chunk["index"] = i
                yield sse(chunk)
                try:
                    item = await chunks.__anext__()
                except StopAsyncIteration:
                    break
            yield sse("[DONE]")
        finally:
            with suppress(Exception):
                await chunks.aclose()

    return StreamingResponse(body(), media_type="text/event-stream")


class AbortIn(BaseModel):
    """``POST /abort_request`` (SGLang's AbortReq)."""

    model_config = ConfigDict(extra="ignore")

    rid: str = ""
    abort_all: bool = False


class TokenizeIn(BaseModel):
    """``POST /tokenize`` (SGLang's TokenizeRequest); other fields are kept for the chat template."""

    model_config = ConfigDict(extra="allow")

    model: str = "default"
    prompt: str | list[str] | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool | None = None


class DetokenizeIn(BaseModel):
    """``POST /detokenize`` (SGLang's DetokenizeRequest)."""

    model_config = ConfigDict(extra="ignore")

    model: str = "default"
    tokens: list[StrictInt] | list[list[StrictInt]]
    skip_special_tokens: bool = True


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

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request):
        """Generate text or token ids, streamed or not; SGLang's native API."""
        if (resp := not_ready()) is not None:
            return resp
        try:
            raw = await read_json(request)
            if not isinstance(raw, dict):
                raise RequestError("the request body must be a JSON object")
            check_body(raw)
            body = GenerateReqIn.model_validate(raw)
            inputs, batch = normalize(body, engine.scheduler.model.cfg.vocab_size,
                                      engine.scheduler.tokenizer.encode)
        except ValidationError as exc:
            return _error(describe(exc))
        except RequestError as exc:
            return _error(str(exc))
        if body.stream:
            return await stream_response(engine, inputs, batch, body.return_prompt_token_ids)
        reqs = await engine.generate(inputs)
        for req in reqs:
            if req.error is not None:
                status = (req.finished_reason or {}).get("status_code", 400)
                return _error(req.error, status)
        outs = [build_output(r, engine.scheduler, body.return_prompt_token_ids) for r in reqs]
        sent = time.time()
        for out in outs:
            out["meta_info"]["response_sent_to_client_ts"] = sent
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

    @app.get("/ping")
    async def ping():
        """SageMaker's health check: 200 once the engine is up, without generating."""
        return Response(status_code=503 if not_ready() is not None else 200)

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

    @app.post("/abort_request")
    async def abort_request(request: Request):
        """Abort the requests with a rid (or every request, ``abort_all``), as SGLang does."""
        if (resp := not_ready()) is not None:
            return resp
        try:
            body = AbortIn.model_validate(await read_json(request))
        except ValidationError as exc:
            return _error(describe(exc))
        except RequestError as exc:
            return _error(str(exc))
        if body.abort_all:
            engine.scheduler.abort(None)
        elif body.rid:  # SGLang ignores an empty rid without abort_all
            engine.scheduler.abort(body.rid)
        return Response(status_code=200)

    @app.post("/tokenize")
    @app.post("/v1/tokenize")
    async def tokenize(request: Request):
        """Token ids of a prompt, a list of prompts, or chat messages (rendered by the template)."""
        if (resp := not_ready()) is not None:
            return resp
        tok = engine.scheduler.tokenizer
        try:
            raw = await read_json(request)
            check_body(raw)
            body = TokenizeIn.model_validate(raw)
            if (body.prompt is None) == (body.messages is None):
                raise RequestError("Exactly one of 'prompt' or 'messages' must be provided.")
            if body.messages is not None:
                from .openai_api import render_chat

                tokens: Any = tok.encode(render_chat(
                    tok, body.messages, add_generation_prompt=body.add_generation_prompt
                    if body.add_generation_prompt is not None else True))
                count: Any = len(tokens)
            elif isinstance(body.prompt, str):
                tokens = tok.encode(body.prompt)
                count = len(tokens)
            else:
                tokens = [tok.encode(p) for p in body.prompt]
                count = [len(t) for t in tokens]
        except ValidationError as exc:
            return openai_error(describe(exc))
        except (RequestError, ValueError) as exc:
            return openai_error(str(exc))
        return {"tokens": tokens, "count": count,
                "max_model_len": tok.model_max_length or args.context_length}

    @app.post("/detokenize")
    @app.post("/v1/detokenize")
    async def detokenize(request: Request):
        """The text of token ids, or of a list of token id lists."""
        if (resp := not_ready()) is not None:
            return resp
        tok = engine.scheduler.tokenizer
        try:
            body = DetokenizeIn.model_validate(await read_json(request))
        except ValidationError as exc:
            return openai_error(describe(exc))
        except RequestError as exc:
            return openai_error(str(exc))
        lists = body.tokens if body.tokens and isinstance(body.tokens[0], list) else [body.tokens]
        vocab = engine.scheduler.model.cfg.vocab_size
        for ids in lists:
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                return openai_error(f"tokens: token id {bad[0]} is outside the model's vocabulary "
                                    f"(size {vocab})")
        texts = [tok.decode(ids, skip_special_tokens=body.skip_special_tokens) for ids in lists]
        return {"text": texts if lists is body.tokens else texts[0]}

    @app.get("/metrics")
    async def metrics():
        """Prometheus text exposition."""
        from .metrics import render

        return Response(render(engine), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info():
        """Model path, name and kind."""
        cfg = engine.scheduler.model.cfg if engine.scheduler is not None else None
        return {"model_path": args.model_path, "served_model_name": engine.served_model_name,
                "tokenizer_path": args.model_path, "is_generation": True,
                "preferred_sampling_params": None, "weight_version": "default",
                "load_format": args.load_format, "reasoning_parser": None,
                "tool_call_parser": None, "disaggregation_mode": "null",
                "has_image_understanding": False, "has_audio_understanding": False,
                "model_type": "evalsvc_hybrid",
                "architectures": [cfg.architecture] if cfg is not None else None}

    from .openai_api import add_openai_routes

    add_openai_routes(app, engine, not_ready)
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
