"""HTTP/1.1 to replicas: pooled keep-alive connections as asyncio protocols, parsed by
httptools (llhttp, the parser uvicorn itself uses).

This replaced aiohttp's client on the relay path, for two measured reasons
(bench/gateway_overhead.py):

- ``send`` writes the request synchronously on a pooled connection and returns at once,
  so the caller can send it and then wait for admission's answer (early dispatch): with
  aiohttp the write only happened in a task queued behind whatever the event loop had
  ready, which under load (a replica step's burst of chunks) took as long as the wait it
  was meant to overlap.
- Per streamed chunk aiohttp ran its StreamReader, re-armed a timer and resolved two
  futures. Here ``data_received`` hands the parser the bytes, the body callback appends
  them and wakes the one reader; the stall timer is lazy (reads stamp the time, the timer
  re-arms itself until a silence outlasts the read timeout).

What a relay needs and nothing more: one request at a time per connection, bounded
buffering (past ``HIGH_WATER`` buffered bytes the socket stops reading, so a slow client
slows the replica), connect/pool/read timeouts, keep-alive expiry below the replicas' own
idle timeout, and no response headers kept (the relay needs the status only).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import socket
import ssl
import time
from collections import deque
from dataclasses import dataclass
from typing import cast
from urllib.parse import unquote, urlsplit

import httptools

HIGH_WATER = 256 * 1024  # buffered body bytes that pause reading from the replica
_ASCII_SAFE = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._:-/")


class _TrailingBytes(Exception):
    """Raised from a parser callback to stop at the end of the current response."""


class UpstreamFailure(Exception):
    """Base of everything that can go wrong talking to a replica."""


class ReplicaUnreachable(UpstreamFailure):
    """No connection could be made (refused, or connect/pool timeout)."""

    def __init__(self, message: str, *, refused: bool) -> None:
        super().__init__(message)
        self.refused = refused


class ReplicaStalled(UpstreamFailure):
    """Nothing arrived for longer than the read timeout."""


class ReplicaBroken(UpstreamFailure):
    """The connection failed or the response was cut short."""

    def __init__(self, message: str, *, before_response: bool = False) -> None:
        super().__init__(message)
        self.before_response = before_response  # not one byte of the response came


@dataclass(frozen=True, slots=True)
class Target:
    """Where one replica base URL points."""

    host: str
    port: int
    tls: bool
    path_prefix: bytes
    host_header: bytes
    # ``user:pass@`` in the base URL, sent as basic auth; never in the Host header (a
    # proxy or the replica's access log would otherwise record the credentials).
    authorization: bytes | None = None

    @classmethod
    def parse(cls, base_url: str) -> Target:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        tls = parts.scheme == "https"
        port = parts.port or (443 if tls else 80)
        prefix = parts.path.rstrip("/").encode()
        if not set(prefix) <= _ASCII_SAFE:
            raise ValueError(f"unsupported characters in the path of {base_url!r}")
        host = parts.netloc.rpartition("@")[2]
        authorization = None
        if parts.username is not None:
            userinfo = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
            authorization = b"Basic " + base64.b64encode(userinfo.encode("utf-8"))
        return cls(parts.hostname, port, tls, prefix, host.encode("idna"), authorization)


class Connection(asyncio.Protocol):
    """One keep-alive connection; one request at a time."""

    def __init__(self, pool: Pool, target: Target, read_timeout_s: float) -> None:
        self.pool = pool
        self.target = target
        self._read_timeout = read_timeout_s
        self._loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        # Bytes after a complete response: not the start of the next exchange (there is
        # none yet) but a replica or intermediary out of step; the connection is not reused.
        self.trailing = False
        self.closed = False
        self.busy = False  # between send() and finish()
        self.idle_since = 0.0
        self._reset_exchange()

    def _reset_exchange(self) -> None:
        self.status = 0
        self.headers_done = False
        self.complete = False
        self.keep_alive = False
        self.got_bytes = False
        self.error: UpstreamFailure | None = None
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._paused = False
        self._waiter: asyncio.Future[None] | None = None
        self._last_io = 0.0
        self._stall_timer: asyncio.TimerHandle | None = None

    # -- asyncio.Protocol -------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but they are one.
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        if not self.busy:
            self.abort()  # bytes nobody asked for: the connection cannot be trusted
            return
        if self.complete:
            self.trailing = True  # finish() closes instead of pooling
            return
        self.got_bytes = True
        self._last_io = self._loop.time()
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserCallbackError:
            if not self.trailing:
                raise
        except httptools.HttpParserError as exc:
            if self.complete:
                self.trailing = True
                return
            self._fail(ReplicaBroken(f"malformed response from the replica: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed:
            self.closed = True
            if self.transport is not None:  # (a TLS handshake that failed was never counted)
                self.pool.forget(self)
        if not self.complete and self.error is None:
            reason = f": {exc!r}" if exc is not None else ""
            self.error = ReplicaBroken(
                f"the replica closed the connection{reason}", before_response=not self.got_bytes
            )
        self._cancel_stall_timer()
        self._wake()

    # -- httptools callbacks ----------------------------------------------------------
    def on_message_begin(self) -> None:
        if self.complete:
            # A second response in the same read: stop parsing it (it must not be read as
            # this exchange's body, nor as the next one's answer).
            self.trailing = True
            raise _TrailingBytes

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        self.headers_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)
        self._buffered += len(body)
        if self._buffered > HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        self.keep_alive = self._parser.should_keep_alive()
        self._cancel_stall_timer()
        self._wake()

    # -- the exchange -----------------------------------------------------------------
    def send(self, head: bytes, body: bytes) -> None:
        assert self.transport is not None
        self.busy = True
        self._last_io = self._loop.time()
        self._arm_stall_timer(self._last_io + self._read_timeout)
        self.transport.write(head + body)

    async def wait_headers(self) -> None:
        while not self.headers_done:
            if self.error is not None:
                raise self.error
            await self._wait()

    async def read(self) -> bytes:
        """The body bytes buffered since the last read; b"" once the body is complete."""
        while True:
            chunks = self._chunks
            if chunks:
                data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
                chunks.clear()
                self._buffered = 0
                if self._paused and self.transport is not None:
                    self._paused = False
                    self._last_io = self._loop.time()  # our pause was no silence of theirs
                    self.transport.resume_reading()
                return data
            if self.complete:
                return b""
            if self.error is not None:
                raise self.error
            await self._wait()

    def finish(self) -> None:
        """Back to the pool if the response was read to its end on a keep-alive connection;
        closed otherwise, which is how the replica learns the client went away."""
        self._cancel_stall_timer()
        if (
            self.complete
            and self.keep_alive
            and self.error is None
            and not self.closed
            and not self.trailing
        ):
            self.busy = False
            self._reset_exchange()
            self.pool.release(self)
        else:
            self.abort()

    def abort(self) -> None:
        self._cancel_stall_timer()
        if not self.closed:
            self.closed = True
            self.pool.forget(self)
            if self.transport is not None:
                self.transport.abort()

    # -- waiting ----------------------------------------------------------------------
    async def _wait(self) -> None:
        waiter = self._loop.create_future()
        self._waiter = waiter
        try:
            await waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, error: UpstreamFailure) -> None:
        if self.error is None:
            self.error = error
        self.abort()
        self._wake()

    def _arm_stall_timer(self, when: float) -> None:
        self._cancel_stall_timer()
        self._stall_timer = self._loop.call_at(when, self._check_stall)

    def _cancel_stall_timer(self) -> None:
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None

    def _check_stall(self) -> None:
        # Reads only stamp ``_last_io``; the timer re-arms itself while bytes keep coming.
        self._stall_timer = None
        if self.complete or self.closed:
            return
        if self._paused:  # the client is slow, not the replica: wait for the client
            self._last_io = self._loop.time()
        deadline = self._last_io + self._read_timeout
        if self._loop.time() < deadline:
            self._stall_timer = self._loop.call_at(deadline, self._check_stall)
            return
        self._fail(ReplicaStalled(f"no bytes from the replica for {self._read_timeout:g} s"))


class Pool:
    """Keep-alive connections per target, most recently used first, with a total cap."""

    def __init__(
        self,
        *,
        max_connections: int,
        max_keepalive: int,
        keepalive_expiry_s: float,
        connect_timeout_s: float,
        pool_timeout_s: float,
        read_timeout_s: float,
    ) -> None:
        self._max_connections = max_connections
        self._max_keepalive = max_keepalive
        self._expiry = keepalive_expiry_s
        self._connect_timeout = connect_timeout_s
        self._pool_timeout = pool_timeout_s
        self._read_timeout = read_timeout_s
        self._idle: dict[Target, list[Connection]] = {}
        self._idle_count = 0
        self._open = 0  # connections open or opening
        self._slot_waiters: deque[asyncio.Future[None]] = deque()
        self._tls: ssl.SSLContext | None = None

    @property
    def open_connections(self) -> int:
        return self._open

    def take_idle(self, target: Target) -> Connection | None:
        idle = self._idle.get(target)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            self._idle_count -= 1
            if not conn.closed and now - conn.idle_since < self._expiry:
                return conn
            conn.abort()
        return None

    async def connect(self, target: Target) -> Connection:
        await self._slot()
        loop = asyncio.get_running_loop()
        tls: ssl.SSLContext | None = None
        if target.tls:
            self._tls = self._tls or ssl.create_default_context()
            tls = self._tls
        try:
            async with asyncio.timeout(self._connect_timeout):
                _, protocol = await loop.create_connection(
                    lambda: Connection(self, target, self._read_timeout),
                    target.host,
                    target.port,
                    ssl=tls,
                    server_hostname=target.host if tls else None,
                )
        except TimeoutError:
            self._closed_one()
            raise ReplicaUnreachable(
                f"connect to {target.host}:{target.port} timed out", refused=False
            ) from None
        except (OSError, ssl.SSLError) as exc:
            self._closed_one()
            raise ReplicaUnreachable(
                f"cannot connect to {target.host}:{target.port}: {exc}", refused=True
            ) from None
        except BaseException:
            self._closed_one()
            raise
        return protocol

    def release(self, conn: Connection) -> None:
        if self._slot_waiters or self._idle_count >= self._max_keepalive:
            conn.abort()  # a waiter needs the slot more than the pool needs the connection
            return
        conn.idle_since = time.monotonic()
        self._idle.setdefault(conn.target, []).append(conn)
        self._idle_count += 1

    def forget(self, conn: Connection) -> None:
        """A connection closed: called exactly once per connection (its ``closed`` flag)."""
        idle = self._idle.get(conn.target)
        if idle and conn in idle:
            idle.remove(conn)
            self._idle_count -= 1
        self._closed_one()

    def close(self) -> None:
        for idle in self._idle.values():
            for conn in list(idle):
                conn.abort()
        self._idle.clear()
        self._idle_count = 0

    # -- the connection cap -----------------------------------------------------------
    async def _slot(self) -> None:
        if self._open >= self._max_connections:
            self._evict_one_idle()
        if self._open < self._max_connections:
            self._open += 1
            return
        waiter = asyncio.get_running_loop().create_future()
        self._slot_waiters.append(waiter)
        taken = False
        try:
            async with asyncio.timeout(self._pool_timeout):
                await waiter  # the slot is handed over already counted
            taken = True
        except TimeoutError:
            if not waiter.done() or waiter.cancelled():
                raise ReplicaUnreachable(
                    f"no upstream connection free within {self._pool_timeout:g} s",
                    refused=False,
                ) from None
            taken = True  # handed over just as the timeout fired: the slot is ours
        finally:
            if not waiter.done():
                waiter.cancel()
            elif not taken and not waiter.cancelled():
                self._closed_one()  # handed over to a caller that left: pass it on
            with contextlib.suppress(ValueError):
                self._slot_waiters.remove(waiter)

    def _closed_one(self) -> None:
        while self._slot_waiters:
            waiter = self._slot_waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot passes on, still counted
                return
        self._open -= 1

    def _evict_one_idle(self) -> None:
        for idle in self._idle.values():
            if idle:
                idle[0].abort()  # the least recently used
                return
