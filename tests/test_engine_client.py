"""The scenario client (``engines.client.EngineClient``) on a server of the test's own: a batch goes out
with the workload's concurrency, in order; answers come back in order; the first failure in order
is raised once every request is answered; a request past its time is an EngineTimeout the client
remembers. And the setting: the default leaves the workload version as it was."""

from __future__ import annotations

import hashlib
import json
import socket
import struct
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from evalsvc.engines.client import (
    EngineClient,
    EngineTimeout,
    ScenarioError,
    run_async,
    work_seconds,
)
from evalsvc.matrix import DEFAULT_CONCURRENCY, WorkloadSpec, load_matrix
from evalsvc.workloads import load_prompts, workload_version
from tests.oracles.responses import response_body


class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128  # every connection of a batch accepted at once

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.lock = threading.Lock()
        self.arrived: list[int] = []
        self.in_flight = self.most_in_flight = 0
        self.answered = 0
        self.delay = 0.05  # s per request


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def do_POST(self) -> None:
        server: Server = self.server  # type: ignore[assignment]
        payload = json.loads(self.rfile.read(int(self.headers["content-length"])))
        seed = payload["sampling_params"]["sampling_seed"]
        with server.lock:
            server.arrived.append(seed)
            server.in_flight += 1
            server.most_in_flight = max(server.most_in_flight, server.in_flight)
        time.sleep({7: 3.0}.get(seed, server.delay))  # seed 7 hangs past its time
        with server.lock:
            server.in_flight -= 1
            server.answered += 1
        status, body = (500, b"no") if seed in (3, 5) else (200, response_body(2))
        # one write: headers and body apart would wait out the client's delayed ACK
        self.wfile.write(b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n%s" % (status, len(body), body))


@pytest.fixture
def server() -> Iterator[Server]:
    srv = Server()
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def payload(seed: int) -> dict:
    return {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, "sampling_seed": seed},
            "return_logprob": True}


@pytest.mark.parametrize("concurrency", [1, 4, 16])
def test_a_batch_goes_out_in_order_with_its_concurrency(server: Server, concurrency: int) -> None:
    client = EngineClient(f"http://127.0.0.1:{server.server_port}", concurrency=concurrency)
    server.delay = {1: 0.01, 4: 0.1}.get(concurrency, 0.4)  # all in flight at once, s
    seeds = [s for s in range(40) if s not in (3, 5, 7)]
    try:
        out = client.generate_many([payload(s) for s in seeds])
    finally:
        client.close()
    assert len(out) == len(seeds) and all(c.token_ids == [100, 101] for c in out)
    assert server.most_in_flight == min(concurrency, len(seeds))
    if concurrency == 1:
        assert server.arrived == seeds
    # started in order: each request arrives before any that starts `concurrency` later
    position = {s: i for i, s in enumerate(server.arrived)}
    assert all(position[a] < position[b] for a, b in zip(seeds, seeds[concurrency:], strict=False))


def test_the_first_failure_in_order_is_raised_after_all_are_answered(server: Server) -> None:
    client = EngineClient(f"http://127.0.0.1:{server.server_port}", concurrency=4)
    try:
        with pytest.raises(ScenarioError, match="/generate answered 500: no"):
            client.generate_many([payload(s) for s in (0, 1, 5, 2, 3, 4, 6)])
    finally:
        client.close()
    assert server.answered == 7


def test_a_request_past_its_time_is_an_engine_timeout(server: Server,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import evalsvc.engines.client as engine_client

    monkeypatch.setattr(engine_client, "REQUEST_BASE_S", 1.0)
    monkeypatch.setattr(engine_client, "NEW_TOKEN_S", 0.0)
    monkeypatch.setattr(engine_client, "PROMPT_TOKEN_S", 0.0)
    client = EngineClient(f"http://127.0.0.1:{server.server_port}", concurrency=8)
    t0 = time.monotonic()
    try:
        with pytest.raises(EngineTimeout, match="did not answer /generate in 1 s"):
            client.generate_many([payload(s) for s in (0, 1, 7, 2)])
    finally:
        client.close()
    assert time.monotonic() - t0 < 2.5
    assert isinstance(client.timed_out, EngineTimeout) and client.timed_out.seconds == 1.0


def test_timeouts_are_sized_to_the_requests_in_flight() -> None:
    payloads = [{"input_ids": [0] * 10, "sampling_params": {"max_new_tokens": n}}
                for n in range(1, 41)]
    cost = [0.02 * 10 + 0.25 * n for n in range(40, 0, -1)]
    assert work_seconds(payloads) == pytest.approx(30 + sum(cost[:16]))
    assert work_seconds(payloads, 4) == pytest.approx(30 + sum(cost[:4]))
    assert work_seconds(payloads, 1000) == pytest.approx(30 + sum(cost))


def legacy_version(spec: WorkloadSpec, prompts) -> str:
    """``workload_version`` before the setting: the spec's fields then, and the prompts."""
    h = hashlib.sha256(json.dumps(spec.model_dump(exclude={"sampling_seed", "concurrency"}),
                                  sort_keys=True).encode())
    for p in prompts:
        h.update(p.id.encode() + b"\0" + p.text.encode() + b"\0")
    return h.hexdigest()[:12]


def test_the_default_concurrency_leaves_the_workload_version_as_it_was() -> None:
    spec = load_matrix("smoke").workload
    prompts = load_prompts(spec)
    assert spec.concurrency == DEFAULT_CONCURRENCY == 16
    assert workload_version(spec, prompts) == legacy_version(spec, prompts)
    other = spec.model_copy(update={"concurrency": 64})
    assert workload_version(other, prompts) != workload_version(spec, prompts)
    with pytest.raises(ValueError, match="concurrency"):
        WorkloadSpec(concurrency=0)


def test_clients_share_one_tls_context_that_verifies_as_httpx_default(monkeypatch):
    """Each httpx client used to load the CA bundle again (about 20 ms of CPU); evalsvc's clients
    now share one context per process, built as httpx builds its default, so they verify alike."""
    import ssl

    import httpx

    from evalsvc import tls

    built: list[ssl.SSLContext] = []
    create = httpx.create_ssl_context

    def counting(*args, **kwargs) -> ssl.SSLContext:
        built.append(create(*args, **kwargs))
        return built[-1]

    tls.tls_context.cache_clear()
    monkeypatch.setattr(httpx, "create_ssl_context", counting)
    for port in (1, 2, 3):
        EngineClient(f"http://127.0.0.1:{port}").close()
    assert len(built) == 1
    ctx, default = tls.tls_context(), create()
    assert ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname
    assert ctx.cert_store_stats()["x509_ca"] == default.cert_store_stats()["x509_ca"] > 0


def test_run_async_hands_back_the_result_without_formatting_it():
    """A batch's completions go back to the caller unformatted, from this (main) thread and from
    a thread that already runs a loop: Python 3.11's ``signal.signal``, called by ``asyncio.run``
    at its end, formats the task it held, so a task's result would be repr'd at every batch."""
    formatted = []

    class Big:
        def __repr__(self) -> str:
            formatted.append(self)
            return "Big()"

    result = [Big(), Big()]

    async def batch():
        return result

    async def inside_a_loop():
        return run_async(batch())

    assert threading.current_thread() is threading.main_thread()
    assert run_async(batch()) is result
    assert run_async(inside_a_loop()) is result
    assert formatted == []

    async def fails():
        raise ScenarioError("no answer")

    with pytest.raises(ScenarioError, match="no answer"):
        run_async(fails())


def _closing_server(drops: int) -> tuple[socket.socket, list[int], threading.Thread]:
    """A server that reads each request and, for the first ``drops`` connections, closes without
    an answer (as an idle keep-alive connection is closed while a request goes out on it); after
    that it answers each ``/flush_cache`` with a 200."""
    listener = socket.create_server(("127.0.0.1", 0))
    connections: list[int] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                connections.append(1)
                conn.recv(65536)
                if len(connections) <= drops:
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    continue  # closed with the request unread: a reset
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return listener, connections, thread


@pytest.mark.parametrize("drops", [1, 2])
def test_a_connection_closed_under_a_request_is_retried_once(drops: int) -> None:
    """A request on a connection the server closes unanswered goes once more on a new one;
    a second close is the caller's error (not a retry loop)."""
    listener, connections, _ = _closing_server(drops)
    client = EngineClient(f"http://127.0.0.1:{listener.getsockname()[1]}", timeout=5.0)
    try:
        if drops == 1:
            client.flush()
        else:
            with pytest.raises(httpx.TransportError):
                client.flush()
        assert len(connections) == 2
    finally:
        client.close()
        listener.close()
