"""HTTP to one engine server (SGLang's native API): ``EngineClient``, with request timeouts sized
to the work in flight (``work_seconds``) and the errors a scenario reports (``ScenarioError``,
``EngineTimeout``)."""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import aiohttp
import httpx

from evalsvc.engines.sglang_server import ResponseError, parse_completion
from evalsvc.matrix import DEFAULT_CONCURRENCY
from evalsvc.tls import tls_context
from evalsvc.types import Completion

MAX_CONCURRENCY = DEFAULT_CONCURRENCY  # requests in flight unless the workload says otherwise
# How long a request may take, sized to the work in flight with it: a base, plus an allowance per
# prompt token and per token to generate of the requests that share the engine (the embedded CPU
# engine, measured on two loaded cores: about 1 ms a prompt token and 30 ms a decode step; a smoke
# scenario's batch gets about two minutes, tens of times what it needs)
REQUEST_BASE_S = 30.0
PROMPT_TOKEN_S = 0.02
NEW_TOKEN_S = 0.25
CONTROL_TIMEOUT_S = 30.0  # /flush_cache, /server_info: no model work


class ScenarioError(RuntimeError):
    """A scenario could not run (the server refused a request, or answered nonsense)."""


class EngineTimeout(ScenarioError):
    """The engine did not answer a request in the time its work allows: it hangs (or is stopped)."""

    def __init__(self, what: str, seconds: float) -> None:
        self.seconds = seconds
        super().__init__(f"the engine did not answer {what} in {seconds:.0f} s")


def work_seconds(payloads: list[dict], concurrency: int = MAX_CONCURRENCY) -> float:
    """The time allowed for a request among ``payloads`` sent together (at most ``concurrency`` of
    them in flight at once): the base plus the allowance for the largest of them."""
    def cost(p: dict) -> float:
        sp = p.get("sampling_params")
        new = sp.get("max_new_tokens", 128) if isinstance(sp, dict) else 128
        prompt = p.get("input_ids")
        n = len(prompt) if isinstance(prompt, list) else len(str(p.get("text", "")))
        return PROMPT_TOKEN_S * n + NEW_TOKEN_S * int(new)

    costs = sorted((cost(p) for p in payloads), reverse=True)[:concurrency]
    return REQUEST_BASE_S + sum(costs)


T = TypeVar("T")


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine to its end from blocking code: on an event loop of its own, in this thread,
    or in a thread of its own when this one already runs a loop."""
    box: list[T] = []

    async def held() -> None:
        # the result reaches the caller through ``box``, not as the task's result: on the main
        # thread ``asyncio.run`` puts its SIGINT handler back at the end, and Python 3.11's
        # ``signal.signal`` formats the handler it replaces, which holds the finished task, into
        # an error message it discards: the repr of the result, here up to six completions with
        # every token and logprob (5 ms a call for 1,000-token completions; 14 % of the harness's
        # CPU in a smoke run)
        box.append(await coro)

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        asyncio.run(held())
    else:
        with ThreadPoolExecutor(1) as pool:
            pool.submit(asyncio.run, held()).result()
    return box[0]


def _body(payload: dict) -> bytes:
    """A JSON request body, as httpx writes one (compact, UTF-8, no NaN)."""
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":"),
                      allow_nan=False).encode()


class EngineClient:
    """HTTP calls to one engine server (SGLang's native API): one request at a time, blocking
    (httpx), and a batch of ``/generate`` requests with ``concurrency`` of them in flight, on an
    event loop (aiohttp: httpx's AsyncClient slows down as requests in flight grow, by an order
    of magnitude at a few hundred; encode/httpx#3215)."""

    def __init__(self, base_url: str, timeout: float = CONTROL_TIMEOUT_S,
                 draft_tokens: int | None = None, concurrency: int = MAX_CONCURRENCY):
        """``timeout``: of the requests without model work; a ``/generate`` gets the time its
        work allows (``work_seconds``). ``concurrency``: the most requests of a batch in flight."""
        self.base_url = base_url
        self.http = httpx.Client(base_url=base_url, timeout=timeout, verify=tls_context())
        self.timeout = timeout
        self.draft_tokens = draft_tokens
        self.concurrency = concurrency
        self.last_answer = time.monotonic()  # when the engine last answered a request
        self.timed_out: EngineTimeout | None = None  # the first request it did not answer in time

    def close(self) -> None:
        self.http.close()

    def _send(self, method: str, path: str, seconds: float, **kw) -> httpx.Response:
        try:
            try:
                resp = self.http.request(method, path, timeout=seconds, **kw)
            except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError):
                # a kept-alive connection the server closed as the request went out (its idle
                # timer fired first, e.g. after the engine was paused): the request never ran,
                # so it goes once more on a new connection (an engine that died refuses that)
                resp = self.http.request(method, path, timeout=seconds, **kw)
        except httpx.TimeoutException:
            raise self._timeout(path, seconds) from None
        self.last_answer = time.monotonic()
        return resp

    def _timeout(self, path: str, seconds: float) -> EngineTimeout:
        exc = EngineTimeout(path, seconds)
        if self.timed_out is None:
            self.timed_out = exc
        return exc

    def generate(self, payload: dict, seconds: float | None = None) -> Completion:
        resp = self._send("POST", "/generate",
                          work_seconds([payload]) if seconds is None else seconds, json=payload)
        return self._completion(resp.status_code, resp.content)

    def _completion(self, status: int, body: bytes) -> Completion:
        if status != 200:
            text = body.decode("utf-8", errors="replace")
            raise ScenarioError(f"/generate answered {status}: {text[:300]}")
        try:
            return parse_completion(json.loads(body), self.draft_tokens)
        except (ResponseError, ValueError) as exc:
            raise ScenarioError(f"/generate: {exc}") from None

    def generate_many(self, payloads: list[dict]) -> list[Completion]:
        """Each payload's completion, in order; the requests start in order, ``concurrency`` at a
        time. All are answered (or time out) before the first failure in order is raised."""
        if not payloads:
            return []
        seconds = work_seconds(payloads, self.concurrency)
        if len(payloads) == 1:
            return [self.generate(payloads[0], seconds)]
        return run_async(self._generate_all(payloads, seconds))

    async def _generate_all(self, payloads: list[dict], seconds: float) -> list[Completion]:
        width = min(self.concurrency, len(payloads))
        gate = asyncio.Semaphore(width)  # FIFO: the requests start in order
        # httpx's timeout: the same limit on connecting and between reads, not on the whole
        timeout = aiohttp.ClientTimeout(sock_connect=seconds, sock_read=seconds)
        headers = {"content-type": "application/json"}
        async with aiohttp.ClientSession(
                self.base_url, connector=aiohttp.TCPConnector(limit=width),
                timeout=timeout) as session:

            async def one(payload: dict) -> Completion:
                async with gate:
                    try:
                        async with session.post("/generate", data=_body(payload),
                                                headers=headers) as resp:
                            status, body = resp.status, await resp.read()
                    except TimeoutError:
                        raise self._timeout("/generate", seconds) from None
                self.last_answer = time.monotonic()
                return self._completion(status, body)

            done = await asyncio.gather(*(one(p) for p in payloads), return_exceptions=True)
        for result in done:
            if isinstance(result, BaseException):
                raise result
        return done

    def flush(self, timeout: float = 30.0) -> None:
        """Flush the cache; retried while the server still winds down earlier requests."""
        deadline = time.monotonic() + timeout
        while True:
            resp = self._send("POST", "/flush_cache", self.timeout)
            if resp.status_code == 200:
                return
            if time.monotonic() > deadline:
                raise ScenarioError(f"/flush_cache kept failing: {resp.status_code} {resp.text!r}")
            time.sleep(0.05)

    def abort(self, rid: str) -> None:
        """Abort a request by its ``rid`` (SGLang's ``/abort_request``)."""
        resp = self._send("POST", "/abort_request", self.timeout, json={"rid": rid})
        if resp.status_code != 200:
            raise ScenarioError(f"/abort_request answered {resp.status_code}: {resp.text[:300]!r}")

    def decoding(self, payloads: list[dict]) -> Background:
        """Background requests that decode while the caller sends others (a context manager; see
        :class:`Background`)."""
        return Background(self, payloads)

    def server_info(self) -> dict:
        for path in ("/server_info", "/get_server_info"):
            resp = self._send("GET", path, self.timeout)
            if resp.status_code == 200:
                return resp.json()
        raise ScenarioError(f"/server_info answered {resp.status_code}")


_background_ids = itertools.count(1)


class Background:
    """Requests kept decoding in the background, each streamed on a thread of its own: on entry
    each is sent and waited for until its first tokens arrive (it is then in the running batch);
    ``keep_decoding`` sends again any that finished and waits the same way; on exit the ones still
    running are aborted (``/abort_request``) and their streams read to the end. Each request gets
    a ``rid`` of its own, and ``stream`` on."""

    def __init__(self, client: EngineClient, payloads: list[dict]) -> None:
        self.client = client
        self.payloads = payloads
        self.threads: list[threading.Thread | None] = [None] * len(payloads)
        self.rids: list[str] = [""] * len(payloads)
        self.started: list[threading.Event] = [threading.Event() for _ in payloads]
        self.errors: list[str] = []

    def __enter__(self) -> Background:
        self.keep_decoding()
        return self

    def __exit__(self, *exc: object) -> None:
        for i, thread in enumerate(self.threads):
            if thread is not None and thread.is_alive():
                self.client.abort(self.rids[i])
        for thread in self.threads:
            if thread is not None:
                thread.join(self.client.timeout)
                if thread.is_alive():
                    raise self.client._timeout("/generate (an aborted background request)",
                                               self.client.timeout)
        if self.errors and exc == (None, None, None):
            raise ScenarioError(self.errors[0])

    def keep_decoding(self) -> None:
        """Make sure each background request is decoding: start again those that ended."""
        for i, thread in enumerate(self.threads):
            if thread is None or not thread.is_alive():
                self._start(i)
        seconds = work_seconds(self.payloads)
        for started in self.started:
            if not started.wait(seconds):
                raise self.client._timeout("/generate (a background request's first tokens)",
                                           seconds)
        if self.errors:
            raise ScenarioError(self.errors[0])

    def _start(self, i: int) -> None:
        rid = f"evalsvc-background-{next(_background_ids)}"
        payload = {**self.payloads[i], "rid": rid, "stream": True}
        started = self.started[i] = threading.Event()
        self.rids[i] = rid
        thread = threading.Thread(target=self._stream, args=(payload, started), daemon=True,
                                  name=f"background-{rid}")
        self.threads[i] = thread
        thread.start()

    def _stream(self, payload: dict, started: threading.Event) -> None:
        seconds = work_seconds([payload])
        try:
            with self.client.http.stream("POST", "/generate", json=payload,
                                         timeout=seconds) as resp:
                if resp.status_code != 200:
                    resp.read()
                    self.errors.append(f"/generate (background) answered {resp.status_code}: "
                                       f"{resp.text[:300]}")
                    return
                for line in resp.iter_lines():
                    if line.startswith("data:") and line[5:].strip() != "[DONE]":
                        started.set()
        except httpx.HTTPError as exc:
            self.errors.append(f"/generate (background): {type(exc).__name__}: {exc}")
        finally:
            started.set()  # ended: keep_decoding starts it again
