"""What a replica (or whatever answers at its address) sends must not reach past the
gateway: SSE events are bounded, bytes after a complete response retire the connection,
URL credentials never go out in the Host header, and replica error text stays in our log.

The wire-level cases use a scripted loopback server (our own fake: it sends exactly the
bytes a misbehaving peer would, which the emulator never does); the error-text case uses
the real emulator's fault injection through a real gateway process."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import httpx
import pytest

from emulator.testing import SpawnedEmulator
from gateway.serving.h1 import Pool, Target
from gateway.upstream.client import CHAT_PATH, Dispatch
from gateway.upstream.relay import EventTooLarge, SSEEvents
from tests.gateway.conftest import VERSION, GatewayProcess, ReadModelSeeder, set_faults

# -- SSE events ------------------------------------------------------------------------------


def test_an_event_past_the_cap_fails_the_stream_instead_of_buffering() -> None:
    events = SSEEvents(max_event_bytes=64 * 1024)
    assert events.feed(b"data: {}\n\n") == [b"{}"]
    with pytest.raises(EventTooLarge):
        for _ in range(200):  # 200 KiB of one event, never terminated
            events.feed(b"data: " + b"x" * 1024)


def test_a_large_event_in_many_reads_is_assembled_once() -> None:
    events = SSEEvents()
    payload = b"y" * 100_000
    wire = b"data: " + payload + b"\n\n" + b"data: [DONE]\n\n"
    out: list[bytes] = []
    for i in range(0, len(wire), 97):  # odd-sized reads, separators split across them
        out += events.feed(wire[i : i + 97])
    assert out == [payload, b"[DONE]"]
    # CRLF line ends split across reads.
    crlf = SSEEvents()
    got = crlf.feed(b"data: a\r") + crlf.feed(b"\n\r") + crlf.feed(b"\ndata: b\r\n\r\n")
    assert got == [b"a", b"b"]


# -- a scripted peer -------------------------------------------------------------------------


@asynccontextmanager
async def scripted(answer: bytes) -> AsyncIterator[tuple[str, list[bytes]]]:
    """A loopback server that answers every request with ``answer`` in one write and
    records the request heads it received."""
    heads: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                heads.append(head)
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                await reader.readexactly(length)
                writer.write(answer)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"127.0.0.1:{port}", heads
    finally:
        server.close()
        await server.wait_closed()


def _pool() -> Pool:
    return Pool(
        max_connections=10,
        max_keepalive=10,
        keepalive_expiry_s=30,
        connect_timeout_s=2,
        pool_timeout_s=2,
        read_timeout_s=5,
    )


def _head(target: Target) -> bytes:
    head = b"POST " + CHAT_PATH + b" HTTP/1.1\r\nhost: " + target.host_header + b"\r\n"
    if target.authorization is not None:
        head += b"authorization: " + target.authorization + b"\r\n"
    return head + b"content-length: 2\r\n\r\n"


def _response(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)


async def _exchange(pool: Pool, target: Target) -> bytes:
    response = await Dispatch(pool, target, _head(target), b"{}").response()
    body = b""
    while data := await response.read():
        body += data
    response.close()
    return body


async def test_bytes_after_a_complete_response_retire_the_connection() -> None:
    injected = _response(b"INJECTED")
    async with scripted(_response(b"first") + injected) as (address, _):
        pool = _pool()
        target = Target.parse(f"http://{address}")
        assert await _exchange(pool, target) == b"first"
        # Not pooled: the next exchange opens a new connection and gets its own answer.
        assert pool.open_connections == 0
        assert pool.take_idle(target) is None
        pool.close()


async def test_url_credentials_go_as_basic_auth_not_in_the_host_header() -> None:
    async with scripted(_response(b"ok")) as (address, heads):
        pool = _pool()
        target = Target.parse(f"http://svc%40corp:s3cret@{address}/")
        assert await _exchange(pool, target) == b"ok"
        pool.close()
    head = heads[0].decode("latin-1").lower()
    assert f"host: {address}\r\n" in head
    assert "s3cret" not in head.replace(_basic("svc@corp:s3cret"), "")
    assert f"authorization: {_basic('svc@corp:s3cret')}" in head


def _basic(userinfo: str) -> str:
    return "basic " + base64.b64encode(userinfo.encode()).decode().lower()


# -- replica error text ----------------------------------------------------------------------


def test_replica_error_text_does_not_reach_the_client(
    gateways: Callable[..., GatewayProcess],
    seeder: ReadModelSeeder,
    replica: SpawnedEmulator,
) -> None:
    seeder.set_replicas([("r1", replica.base_url)])
    gw = gateways(None)
    tenant = seeder.tenant()
    # ignore_eos: a natural end drawn at 2 tokens or fewer would finish before the fault.
    body = {
        "model": VERSION,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 32,
        "ignore_eos": True,
    }
    auth = {"authorization": f"Bearer {tenant.secret}"}
    try:
        set_faults(replica, fail_after_tokens=2)
        with httpx.Client(base_url=gw.base_url, headers=auth, timeout=30) as client:
            streamed = client.post("/v1/chat/completions", json={**body, "stream": True})
            plain = client.post("/v1/chat/completions", json=body)
        set_faults(replica, fail_after_tokens=None, refuse_503=True)
        with httpx.Client(base_url=gw.base_url, headers=auth, timeout=30) as client:
            busy = client.post("/v1/chat/completions", json=body)
    finally:
        set_faults(replica, fail_after_tokens=None, refuse_503=False)
    assert streamed.status_code == 200 and '"upstream_error"' in streamed.text
    assert plain.status_code == 502 and plain.json()["error"]["code"] == "upstream_error"
    assert busy.status_code == 503
    for response in (streamed, plain, busy):
        assert "Internal server error during generation" not in response.text
        assert "Service Unavailable" not in response.text
    # The replica's text is in the gateway's log instead.
    assert "Internal server error during generation" in gw.log()
