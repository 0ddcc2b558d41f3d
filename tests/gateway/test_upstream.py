"""The gateway's HTTP/1.1 client to replicas (gateway/serving/h1.py, gateway/upstream/client.py)
against scripted replicas: real asyncio servers on loopback that misbehave on cue."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from contracts import schema
from gateway.config import GatewayConfig, PoolLimits, UpstreamTimeouts
from gateway.serving.h1 import HIGH_WATER
from gateway.upstream.client import (
    ReplicaBroken,
    ReplicaStalled,
    ReplicaUnreachable,
    UpstreamClient,
    UpstreamStatusError,
)
from tests.support import free_port, wait_until_async

SSE_BODY = [b'data: {"a":1}\n\n', b'data: {"b":2}\n\n', b"data: [DONE]\n\n"]
Handler = Callable[["Exchange"], Awaitable[bool]]  # returns False to close the connection


@dataclasses.dataclass
class Exchange:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    connection: int  # which connection (0, 1, ...)
    index: int  # which request on that connection (0, 1, ...)
    body: bytes = b""

    async def ok(self, events: list[bytes] = SSE_BODY) -> bool:
        self.writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        for event in events:
            self.writer.write(b"%x\r\n%s\r\n" % (len(event), event))
        self.writer.write(b"0\r\n\r\n")
        await self.writer.drain()
        return True


class ScriptedReplica:
    """Reads HTTP/1.1 requests and answers each with ``handler``."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.requests: list[tuple[int, int, bytes]] = []
        self.connections = 0
        self.disconnects = 0
        self.server: asyncio.Server | None = None
        self.port = 0

    @property
    def record(self) -> schema.ReplicaRecord:
        return schema.ReplicaRecord("scripted", f"http://127.0.0.1:{self.port}", "shared")

    async def __aenter__(self) -> ScriptedReplica:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connection = self.connections
        self.connections += 1
        index = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                body = await reader.readexactly(length)
                self.requests.append((connection, index, head))
                if not await self.handler(Exchange(reader, writer, connection, index, body)):
                    break
                index += 1
        except (asyncio.IncompleteReadError, ConnectionError):
            self.disconnects += 1
        finally:
            writer.close()


def waiting_for_a_slot(client: UpstreamClient) -> int:
    """Callers queued for a connection slot (the pool's own queue: nothing outside shows it)."""
    return len(client._pool._slot_waiters) if client._pool is not None else 0


def client_config(read: float = 0.3, pool: PoolLimits | None = None) -> GatewayConfig:
    return dataclasses.replace(
        GatewayConfig(),
        upstream=UpstreamTimeouts(connect=1.0, read=read, write=1.0, pool=0.3),
        pool=pool or PoolLimits(),
    )


@contextlib.asynccontextmanager
async def started(config: GatewayConfig | None = None) -> AsyncIterator[UpstreamClient]:
    client = UpstreamClient(config or client_config())
    await client.start()
    try:
        yield client
    finally:
        await client.aclose()


async def read_all(client: UpstreamClient, replica: ScriptedReplica) -> bytes:
    response = await client.open(replica.record, b"{}", "req-1")
    data = b""
    while chunk := await response.read():
        data += chunk
    response.close()
    return data


async def test_keep_alive_reuses_one_connection_and_sends_the_request_whole() -> None:
    async with ScriptedReplica(lambda ex: ex.ok()) as replica, started() as client:
        for _ in range(3):
            assert await read_all(client, replica) == b"".join(SSE_BODY)
        assert replica.connections == 1 and client.open_connections == 1
        assert [index for _, index, _ in replica.requests] == [0, 1, 2]
        head = replica.requests[0][2].lower()
        assert head.startswith(b"post /v1/chat/completions http/1.1\r\n")
        assert b"x-request-id: req-1\r\n" in head and b"content-length: 2\r\n" in head
        assert f"host: 127.0.0.1:{replica.port}".encode() in head


async def test_a_pooled_connection_closed_under_us_is_retried_once_on_a_new_one() -> None:
    async def second_request_dropped(ex: Exchange) -> bool:
        if ex.index == 1:
            return False  # close without answering, as an idle-timeout close racing a reuse
        return await ex.ok()

    async with ScriptedReplica(second_request_dropped) as replica, started() as client:
        assert await read_all(client, replica) == b"".join(SSE_BODY)
        assert await read_all(client, replica) == b"".join(SSE_BODY)
        assert replica.connections == 2 and len(replica.requests) == 3


async def test_a_fresh_connection_closed_without_an_answer_is_not_retried() -> None:
    async def drop(ex: Exchange) -> bool:
        return False

    async with ScriptedReplica(drop) as replica, started() as client:
        with pytest.raises(ReplicaBroken):
            await client.open(replica.record, b"{}", "req-1")
        assert len(replica.requests) == 1


async def test_silence_before_headers_and_mid_body_is_a_stall() -> None:
    async def silent(ex: Exchange) -> bool:
        if ex.connection == 1:  # headers and one event, then nothing
            ex.writer.write(
                b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
                b"%x\r\n%s\r\n" % (len(SSE_BODY[0]), SSE_BODY[0])
            )
        await asyncio.sleep(5)
        return False

    async with ScriptedReplica(silent) as replica, started() as client:
        loop = asyncio.get_running_loop()
        started_at = loop.time()
        with pytest.raises(ReplicaStalled):
            await client.open(replica.record, b"{}", "req-1")
        assert 0.25 <= loop.time() - started_at < 2.0
        response = await client.open(replica.record, b"{}", "req-2")
        assert await response.read() == SSE_BODY[0]
        with pytest.raises(ReplicaStalled):
            await response.read()
        response.close()


async def test_error_status_carries_the_message_and_keeps_the_connection() -> None:
    async def busy(ex: Exchange) -> bool:
        if ex.index > 0:
            return await ex.ok()
        body = b'{"error": {"message": "engine is full", "code": 503}}'
        ex.writer.write(
            b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: %d\r\n\r\n" % len(body)
        )
        ex.writer.write(body)
        await ex.writer.drain()
        return True

    async with ScriptedReplica(busy) as replica, started() as client:
        with pytest.raises(UpstreamStatusError) as info:
            await client.open(replica.record, b"{}", "req-1")
        assert info.value.status == 503 and info.value.message == "engine is full"
        assert await read_all(client, replica) == b"".join(SSE_BODY)
        assert replica.connections == 1


async def test_refused_and_malformed_replicas() -> None:
    async with started() as client:
        nobody = schema.ReplicaRecord("gone", f"http://127.0.0.1:{free_port()}", "shared")
        with pytest.raises(ReplicaUnreachable) as info:
            await client.open(nobody, b"{}", "req-1")
        assert info.value.refused and client.open_connections == 0

    async with ScriptedReplica(lambda ex: ex.ok()) as plain, started() as client:
        tls = schema.ReplicaRecord("tls", f"https://127.0.0.1:{plain.port}", "shared")
        with pytest.raises(ReplicaUnreachable):  # a TLS handshake with a plain-HTTP server
            await client.open(tls, b"{}", "req-1")
        assert client.open_connections == 0  # the failed handshake holds no pool slot

    async def garbage(ex: Exchange) -> bool:
        ex.writer.write(b"SPDY/9 banana\r\n\r\n")
        await ex.writer.drain()
        await asyncio.sleep(1)
        return False

    async with ScriptedReplica(garbage) as replica, started() as client:
        with pytest.raises(ReplicaBroken):
            await client.open(replica.record, b"{}", "req-1")


async def test_a_reader_that_stops_reading_stops_the_replica_too() -> None:
    written = 0
    chunk = b"data: " + b"x" * 16_000 + b"\n\n"

    async def flood(ex: Exchange) -> bool:
        nonlocal written
        ex.writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        while written < 64 * 1024 * 1024:
            ex.writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            await ex.writer.drain()  # blocks once the client stops reading
            written += len(chunk)
        return False

    async with ScriptedReplica(flood) as replica, started() as client:
        response = await client.open(replica.record, b"{}", "req-1")
        # Nobody reads: wait until the replica's writes stop (no progress over 0.1 s)...
        seen = [-1]

        def stopped() -> bool:
            progressed, seen[0] = written != seen[0], written
            return not progressed

        await wait_until_async(stopped, 5, 0.1, "the replica's writes to stop")
        stuck_at = written
        await asyncio.sleep(0.2)  # ...and stay stopped (the check is that nothing happens)
        assert written == stuck_at < 16 * 1024 * 1024  # the replica is held back
        buffered = len(await response.read())
        # Bounded: the buffer may pass the high-water mark by at most one socket read.
        assert HIGH_WATER <= buffered <= HIGH_WATER + 256 * 1024 + len(chunk)
        # Reading again resumes the flow.
        for _ in range(50):
            assert await response.read()
        assert written > stuck_at
        response.close()
        # closed mid-body: the replica sees the client leave
        await wait_until_async(lambda: replica.disconnects, 1, 0.01, "the replica to see it")
        assert replica.disconnects == 1


async def test_the_connection_cap_waits_for_the_pool_timeout_then_refuses() -> None:
    release = asyncio.Event()

    async def held(ex: Exchange) -> bool:
        if ex.connection == 0 and ex.index == 0:
            await release.wait()
        return await ex.ok()

    async with (
        ScriptedReplica(held) as replica,
        started(client_config(read=5.0, pool=PoolLimits(max_connections=1))) as client,
    ):
        first = asyncio.ensure_future(read_all(client, replica))
        await wait_until_async(lambda: replica.requests, 2, 0.005, "the first request held")
        with pytest.raises(ReplicaUnreachable) as info:
            await client.open(replica.record, b"{}", "req-2")
        assert not info.value.refused
        leaver = asyncio.ensure_future(client.open(replica.record, b"{}", "req-3"))
        await wait_until_async(lambda: waiting_for_a_slot(client), 2, 0.005, "a slot waiter")
        leaver.cancel()  # a caller that leaves while waiting for a slot takes none with it
        with contextlib.suppress(asyncio.CancelledError):
            await leaver
        release.set()
        assert await first == b"".join(SSE_BODY)
        assert await read_all(client, replica) == b"".join(SSE_BODY)
        assert replica.connections == 1 and client.open_connections == 1


async def test_a_discarded_dispatch_closes_its_connection() -> None:
    answered = asyncio.Event()

    async def slow(ex: Exchange) -> bool:
        await asyncio.sleep(0.1)
        answered.set()
        return await ex.ok()

    async with ScriptedReplica(slow) as replica, started() as client:
        dispatch = client.send(replica.record, b"{}", "req-1")
        await wait_until_async(lambda: replica.requests, 2, 0.005, "the request sent")
        dispatch.discard()
        await asyncio.wait_for(answered.wait(), 2)
        await wait_until_async(lambda: replica.disconnects, 2, 0.005, "the connection closed")
        assert replica.disconnects == 1 and len(replica.requests) == 1
        assert client.open_connections == 0
