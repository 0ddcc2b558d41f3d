"""One multiplexed Redis connection for the admission scripts on the request path.

Every admitted request makes exactly two Redis calls (issue 5): one ``EVALSHA`` to admit,
one to settle. Through redis-py's asyncio client each call also paid a blocking-pool
checkout (an ``asyncio.Condition``, a timeout scope, a connection health check), its
generic argument encoder and its retry wrapper: measured on the benchmark machine that was
~100-130 µs of CPU per call and, under load, a queue of tasks handing the pool's lock to
each other — the largest single piece of the gateway's own time before the upstream call.

Redis answers the commands of one connection in the order they were sent, so concurrent
callers can share one connection: each call writes its command and appends a future to a
FIFO; the protocol resolves the futures in order as replies arrive (hiredis parses them).
A call that times out leaves its slot in the FIFO (the late reply is matched and dropped)
and closes the connection, since a store that stopped answering is treated as down (§8 is
then decided by the caller); the next call reconnects. Cancellation of a caller likewise
only abandons its slot.

The channel speaks RESP2 over TCP or a unix socket, with ``AUTH`` and ``SELECT`` from the
URL. TLS is not implemented here: ``for_client`` returns None for it and the limiter keeps
redis-py's own script calls.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import hiredis
import redis.asyncio as aioredis
from redis.exceptions import AuthenticationError, InvalidResponse, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

Arg = str | int | float | bytes


def pack(*args: Arg) -> bytes:
    """RESP2 encoding of one command (every argument as a bulk string)."""
    out = [b"*%d\r\n" % len(args)]
    for arg in args:
        if isinstance(arg, bytes):
            raw = arg
        elif isinstance(arg, str):
            raw = arg.encode()
        elif isinstance(arg, int):
            raw = b"%d" % arg
        else:
            raw = repr(arg).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(raw), raw))
    return b"".join(out)


@dataclass(frozen=True, slots=True)
class LuaScript:
    source: str
    sha: bytes

    @classmethod
    def of(cls, source: str) -> LuaScript:
        return cls(source, hashlib.sha1(source.encode()).hexdigest().encode())  # noqa: S324


class _Protocol(asyncio.Protocol):
    def __init__(self) -> None:
        self.reader = hiredis.Reader(protocolError=InvalidResponse, replyError=ResponseError)
        self.pending: deque[asyncio.Future[Any]] = deque()
        self.transport: asyncio.Transport | None = None
        self.lost: BaseException | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but they are one.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        reader, pending = self.reader, self.pending
        reader.feed(data)
        while True:
            try:
                reply = reader.gets()
            except InvalidResponse as exc:
                self._fail(RedisConnectionError(f"protocol error from Redis: {exc}"))
                assert self.transport is not None
                self.transport.close()
                return
            if reply is False:
                return
            if not pending:  # a reply nobody asked for: the stream is out of step
                self._fail(RedisConnectionError("unexpected reply from Redis"))
                assert self.transport is not None
                self.transport.close()
                return
            future = pending.popleft()
            if not future.done():
                if isinstance(reply, ResponseError):
                    future.set_exception(reply)
                else:
                    future.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(RedisConnectionError(f"connection to Redis lost: {exc or 'closed'}"))

    def _fail(self, exc: BaseException) -> None:
        self.lost = exc
        while self.pending:
            future = self.pending.popleft()
            if not future.done():
                future.set_exception(exc)


class ScriptChannel:
    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 6379,
        path: str | None = None,
        db: int = 0,
        username: str | None = None,
        password: str | None = None,
        timeout_s: float = 0.5,
        connect_timeout_s: float | None = None,
    ) -> None:
        self._host, self._port, self._path = host, port, path
        self._db, self._username, self._password = db, username, password
        self._timeout_s = timeout_s
        self._connect_timeout_s = connect_timeout_s or timeout_s
        self._protocol: _Protocol | None = None
        self._connecting: asyncio.Future[_Protocol] | None = None
        self._closed = False

    @classmethod
    def for_client(cls, client: aioredis.Redis) -> ScriptChannel | None:
        """A channel to the same server, database and credentials as ``client``, with its
        timeouts; None when the client talks TLS (left to redis-py)."""
        pool = client.connection_pool
        kw = pool.connection_kwargs
        timeout = kw.get("socket_timeout") or 5.0
        connect_timeout = kw.get("socket_connect_timeout") or timeout
        common: dict[str, Any] = {
            "db": int(kw.get("db") or 0),
            "username": kw.get("username"),
            "password": kw.get("password"),
            "timeout_s": float(timeout),
            "connect_timeout_s": float(connect_timeout),
        }
        if pool.connection_class is aioredis.UnixDomainSocketConnection:
            return cls(path=kw["path"], **common)
        if pool.connection_class is aioredis.Connection:
            return cls(
                host=kw.get("host") or "127.0.0.1", port=int(kw.get("port") or 6379), **common
            )
        return None

    # -- calls ----------------------------------------------------------------------------
    async def evalsha(self, script: LuaScript, keys: Sequence[Arg], args: Sequence[Arg]) -> Any:
        """Run ``script``; load it with ``EVAL`` if the server does not know it yet (a
        restarted or flushed Redis)."""
        try:
            return await self.call(b"EVALSHA", script.sha, len(keys), *keys, *args)
        except ResponseError as exc:
            if not str(exc).startswith("NOSCRIPT"):
                raise
        return await self.call(b"EVAL", script.source, len(keys), *keys, *args)

    async def evalsha_many(
        self, script: LuaScript, calls: Sequence[tuple[Sequence[Arg], Sequence[Arg]]]
    ) -> list[Any]:
        """Several runs of ``script`` written back to back: one round trip."""
        if not calls:
            return []
        try:
            return await self._pipeline(
                [pack(b"EVALSHA", script.sha, len(k), *k, *a) for k, a in calls]
            )
        except ResponseError as exc:
            if not str(exc).startswith("NOSCRIPT"):
                raise
        await self.call(b"SCRIPT", b"LOAD", script.source)
        return await self._pipeline(
            [pack(b"EVALSHA", script.sha, len(k), *k, *a) for k, a in calls]
        )

    async def call(self, *args: Arg) -> Any:
        protocol = self._protocol
        if protocol is None or protocol.lost is not None:
            protocol = await self._connect()
        return await self._send(protocol, pack(*args))

    async def _pipeline(self, commands: list[bytes]) -> list[Any]:
        protocol = self._protocol
        if protocol is None or protocol.lost is not None:
            protocol = await self._connect()
        futures = [self._enqueue(protocol, cmd) for cmd in commands]
        # Every reply retrieved (no "exception never retrieved"), the first error raised.
        replies = await self._wait(protocol, asyncio.gather(*futures, return_exceptions=True))
        for reply in replies:
            if isinstance(reply, BaseException):
                raise reply
        return list(replies)

    def _enqueue(self, protocol: _Protocol, command: bytes) -> asyncio.Future[Any]:
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        protocol.pending.append(future)
        assert protocol.transport is not None
        protocol.transport.write(command)
        return future

    async def _send(self, protocol: _Protocol, command: bytes) -> Any:
        return await self._wait(protocol, self._enqueue(protocol, command))

    async def _wait(self, protocol: _Protocol, future: asyncio.Future[Any]) -> Any:
        expired: list[bool] = []
        timer = asyncio.get_running_loop().call_later(
            self._timeout_s, self._expire, protocol, future, expired
        )
        try:
            return await future
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if expired and (task is None or not task.cancelling()):
                raise RedisTimeoutError(f"no reply from Redis in {self._timeout_s} s") from None
            raise
        finally:
            timer.cancel()

    def _expire(
        self, protocol: _Protocol, future: asyncio.Future[Any], expired: list[bool]
    ) -> None:
        if future.done():
            return
        # Cancelling marks the FIFO slot(s) done: a late reply is matched and dropped.
        expired.append(True)
        future.cancel()
        # A store that stopped answering is treated as down: start afresh next time.
        if self._protocol is protocol:
            self._protocol = None
        if protocol.transport is not None:
            protocol.transport.close()

    # -- connection -----------------------------------------------------------------------
    async def _connect(self) -> _Protocol:
        if self._closed:
            raise RedisConnectionError("the script channel is closed")
        if self._connecting is None:
            # Concurrent first callers share one connection attempt.
            self._connecting = asyncio.ensure_future(self._open())
        connecting = self._connecting
        try:
            return await asyncio.shield(connecting)
        finally:
            if connecting.done() and self._connecting is connecting:
                self._connecting = None

    async def _open(self) -> _Protocol:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                if self._path is not None:
                    _, protocol = await loop.create_unix_connection(_Protocol, self._path)
                else:
                    _, protocol = await loop.create_connection(_Protocol, self._host, self._port)
        except TimeoutError:
            raise RedisTimeoutError("timed out connecting to Redis") from None
        except OSError as exc:
            raise RedisConnectionError(f"cannot connect to Redis: {exc}") from exc
        try:
            setup = []
            if self._password is not None:
                auth: tuple[Arg, ...] = (b"AUTH", self._password)
                if self._username:
                    auth = (b"AUTH", self._username, self._password)
                setup.append(pack(*auth))
            if self._db:
                setup.append(pack(b"SELECT", self._db))
            if setup:
                replies = await self._wait(
                    protocol,
                    asyncio.gather(
                        *(self._enqueue(protocol, c) for c in setup), return_exceptions=True
                    ),
                )
                for reply in replies:
                    if isinstance(reply, BaseException):
                        raise reply
        except ResponseError as exc:
            assert protocol.transport is not None
            protocol.transport.close()
            raise AuthenticationError(f"Redis refused the connection setup: {exc}") from exc
        except BaseException:
            assert protocol.transport is not None
            protocol.transport.close()
            raise
        self._protocol = protocol
        return protocol

    async def aclose(self) -> None:
        self._closed = True
        protocol, self._protocol = self._protocol, None
        if protocol is not None and protocol.transport is not None:
            protocol.transport.close()
