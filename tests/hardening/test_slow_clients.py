"""A slow or greedy client must not hold what others need: deadlines for the request head
and body, a cap on a response's duration, a per-tenant concurrency cap, and 429s answered
from memory (before the body is parsed) while the Retry-After a tenant was given runs.
Real gateway processes over loopback, a real emulated replica."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable

import httpx
import pytest

from emulator.testing import SpawnedEmulator
from gateway.config import GatewayConfig
from gateway.serving.server import GatewayServer
from tests.gateway.conftest import (
    VERSION,
    GatewayProcess,
    ReadModelSeeder,
    metric_sum,
    set_faults,
)
from tests.support import wait_until

BODY = {"model": VERSION, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.fixture
def gateway_with(
    gateways: Callable[..., GatewayProcess], seeder: ReadModelSeeder, replica: SpawnedEmulator
) -> Callable[..., GatewayProcess]:
    seeder.set_replicas([("r1", replica.base_url)])

    def start(**env: str) -> GatewayProcess:
        return gateways(None, extra_env=env)

    return start


def _connect(gw: GatewayProcess) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", gw.port), timeout=10)
    sock.settimeout(10)
    return sock


def _read_all(sock: socket.socket) -> bytes:
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def test_a_trickled_request_head_or_body_is_cut_off(
    gateway_with: Callable[..., GatewayProcess], seeder: ReadModelSeeder
) -> None:
    gw = gateway_with(GATEWAY_HEADER_TIMEOUT_S="0.5", GATEWAY_BODY_TIMEOUT_S="0.5")
    tenant = seeder.tenant()
    # The head never completes: the connection is closed, not held.
    with _connect(gw) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")
        started = time.monotonic()
        assert _read_all(sock) == b""
        assert time.monotonic() - started < 5
    # An idle connection that never sends a byte is closed too.
    with _connect(gw) as sock:
        assert _read_all(sock) == b""
    # The body stops short of its length: 408.
    with _connect(gw) as sock:
        head = (
            "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
            f"authorization: Bearer {tenant.secret}\r\n"
            "content-type: application/json\r\ncontent-length: 200\r\n\r\n"
        )
        sock.sendall(head.encode() + b'{"model": ')
        answer = _read_all(sock)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b'"request_timeout"' in answer


def _healthz(sock: socket.socket) -> None:
    """One keep-alive request on ``sock``, its whole response read."""
    sock.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
    seen = b""
    while b'{"status":"ok"}' not in seen:
        chunk = sock.recv(65536)
        assert chunk, seen
        seen += chunk
    assert seen.startswith(b"HTTP/1.1 200"), seen[:200]


def test_each_head_on_a_kept_alive_connection_gets_the_whole_deadline(
    gateway_with: Callable[..., GatewayProcess],
) -> None:
    """The deadline runs from each head's first byte: heads completed in time leave the
    connection open past the first deadline, and a head begun just before a deadline set
    for an earlier one is cut off a whole deadline after it began, not at that one."""
    gw = gateway_with(GATEWAY_HEADER_TIMEOUT_S="0.5")
    with _connect(gw) as sock:
        _healthz(sock)
        time.sleep(0.35)
        _healthz(sock)  # inside the connection's first deadline
        time.sleep(0.05)
        sock.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\n")  # never completed
        began = time.monotonic()
        assert _read_all(sock) == b""
        waited = time.monotonic() - began
    assert 0.4 <= waited < 5, waited


def test_no_response_outlives_the_maximum_duration(
    gateway_with: Callable[..., GatewayProcess],
    seeder: ReadModelSeeder,
    replica: SpawnedEmulator,
) -> None:
    gw = gateway_with(GATEWAY_MAX_STREAM_S="1")
    tenant = seeder.tenant()
    auth = {"authorization": f"Bearer {tenant.secret}"}
    try:
        set_faults(replica, extra_latency_ms=4000)
        started = time.monotonic()
        with httpx.Client(base_url=gw.base_url, headers=auth, timeout=30) as client:
            cut = client.post("/v1/chat/completions", json=BODY)
        elapsed = time.monotonic() - started
    finally:
        set_faults(replica, extra_latency_ms=0)
    assert cut.status_code == 504, cut.text
    assert cut.json()["error"]["code"] == "max_duration_exceeded"
    assert elapsed < 3.5


def test_one_tenant_cannot_hold_every_slot(
    gateway_with: Callable[..., GatewayProcess],
    seeder: ReadModelSeeder,
    replica: SpawnedEmulator,
) -> None:
    gw = gateway_with(GATEWAY_TENANT_MAX_CONCURRENT="2")
    greedy, other = seeder.tenant(), seeder.tenant()
    results: list[int] = []

    def slow_call() -> None:
        with httpx.Client(base_url=gw.base_url, timeout=30) as client:
            response = client.post(
                "/v1/chat/completions",
                json=BODY,
                headers={"authorization": f"Bearer {greedy.secret}"},
            )
            results.append(response.status_code)

    try:
        set_faults(replica, extra_latency_ms=2500)
        threads = [threading.Thread(target=slow_call) for _ in range(2)]
        for thread in threads:
            thread.start()
        # Both slow calls are being relayed (the replica holds them) before the third.
        wait_until(
            lambda: metric_sum(gw.base_url, "fairway_gateway_inflight_requests") >= 2,
            timeout=10,
        )
        with httpx.Client(base_url=gw.base_url, timeout=30) as client:
            third = client.post(
                "/v1/chat/completions",
                json=BODY,
                headers={"authorization": f"Bearer {greedy.secret}"},
            )
            set_faults(replica, extra_latency_ms=0)
            served = client.post(
                "/v1/chat/completions",
                json=BODY,
                headers={"authorization": f"Bearer {other.secret}"},
            )
        for thread in threads:
            thread.join(30)
    finally:
        set_faults(replica, extra_latency_ms=0)
    assert third.status_code == 429, third.text
    assert third.json()["error"]["code"] == "too_many_concurrent_requests"
    assert served.status_code == 200
    assert results == [200, 200]


def test_a_refused_tenant_is_answered_from_memory_before_its_body_is_parsed(
    gateway_with: Callable[..., GatewayProcess], seeder: ReadModelSeeder
) -> None:
    gw = gateway_with(GATEWAY_REFUSAL_MEMORY="1")
    tenant = seeder.tenant(rpm=1)
    auth = {"authorization": f"Bearer {tenant.secret}"}
    with httpx.Client(base_url=gw.base_url, headers=auth, timeout=30) as client:
        assert client.post("/v1/chat/completions", json=BODY).status_code == 200
        refused = client.post("/v1/chat/completions", json=BODY)
        assert refused.status_code == 429
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"
        # Not valid JSON past the model: a parsed body would be a 400. Answered 429 from
        # the refusal just given, with its Retry-After.
        broken = f'{{"model": "{VERSION}", "messages": [oops'
        again = client.post(
            "/v1/chat/completions",
            content=broken.encode(),
            headers={"content-type": "application/json"},
        )
    assert again.status_code == 429, again.text
    assert int(again.headers["retry-after"]) >= 1


def test_uvicorn_limits_concurrency() -> None:
    server = GatewayServer(GatewayConfig(limit_concurrency=123))
    assert server.uvicorn_config().limit_concurrency == 123
