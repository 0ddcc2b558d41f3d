"""One multiplexed Redis connection for the admission scripts on the request path.

Every admitted request makes exactly two Redis calls: one ``EVALSHA`` to admit,
one to settle. Through redis-py's asyncio client each call also paid a blocking-pool
checkout (an ``asyncio.Condition``, a timeout scope, a connection health check), its
generic argument encoder and its retry wrapper: measured on the benchmark machine that was
~100-130 µs of CPU per call and, under load, a queue of tasks handing the pool's lock to
each other — the largest single piece of the gateway's own time before the upstream call.

Redis answers the commands of one connection in the order they were sent, so concurrent
callers can share one connection: each call writes its command and appends a future to a
FIFO; the protocol resolves the futures in order as replies arrive (hiredis parses them).
A call that times out leaves its slot in the FIFO (the late reply is matched and dropped)
and closes the connection, since a store that stopped answering is treated as down (the
fallbacks of docs/design.md §8 are then decided by the caller); the next call reconnects.
Cancellation of a caller likewise only abandons its slot.

The channel speaks RESP2 over TCP, TLS or a unix socket, with ``AUTH`` and ``SELECT`` from
the URL. For a ``rediss://`` URL it uses the very SSL context redis-py builds from the
client's settings (CA file, client certificate, verification on by default, hostname
checked), so both paths trust the same certificates; the handshake happens once per
connection and a reply costs the same parse as over TCP. On a Redis Cluster over TLS each
node's channel takes that same context (``ClusterScriptChannel.for_cluster``), the name
checked being the node's address as ``CLUSTER SLOTS`` gives it.
"""

from __future__ import annotations

import asyncio
import hashlib
import ssl
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import hiredis
import redis.asyncio as aioredis
from redis.crc import key_slot
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
        ssl_context: ssl.SSLContext | None = None,
        server_hostname: str | None = None,
    ) -> None:
        self._host, self._port, self._path = host, port, path
        self._ssl = ssl_context
        # The name the certificate is checked against (the URL's host).
        self._server_hostname = server_hostname or (host if ssl_context is not None else None)
        self._db, self._username, self._password = db, username, password
        self._timeout_s = timeout_s
        self._connect_timeout_s = connect_timeout_s or timeout_s
        self._protocol: _Protocol | None = None
        self._connecting: asyncio.Future[_Protocol] | None = None
        self._closed = False

    @classmethod
    def for_client(cls, client: aioredis.Redis) -> ScriptChannel:
        """A channel to the same server, database and credentials as ``client``, with its
        timeouts and TLS settings; ``ValueError`` for a connection class it does not know
        (no ``redis://``, ``rediss://`` or ``unix://`` URL makes one)."""
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
        host, port = kw.get("host") or "127.0.0.1", int(kw.get("port") or 6379)
        if pool.connection_class is aioredis.Connection:
            return cls(host=host, port=port, **common)
        if pool.connection_class is aioredis.SSLConnection:
            return cls(host=host, port=port, ssl_context=_ssl_context(kw), **common)
        raise ValueError(f"the script channel does not speak {pool.connection_class.__name__}")

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
                elif self._ssl is not None:
                    _, protocol = await loop.create_connection(
                        _Protocol,
                        self._host,
                        self._port,
                        ssl=self._ssl,
                        server_hostname=self._server_hostname,
                        ssl_handshake_timeout=self._connect_timeout_s,
                    )
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


def _ssl_context(kw: dict[str, Any]) -> ssl.SSLContext:
    """redis-py's own SSL context for a client's ``ssl_*`` settings (building a connection
    object connects nothing): the same CA, client certificate and verification."""
    ssl_kw = {k: v for k, v in kw.items() if k.startswith("ssl_")}
    return aioredis.SSLConnection(**ssl_kw).ssl_context.get()


# -- Redis Cluster -------------------------------------------------------------------------


def _text(raw: Any) -> str:
    return raw.decode() if isinstance(raw, bytes) else str(raw)


_UNAVAILABLE = ("CLUSTERDOWN", "TRYAGAIN", "MASTERDOWN", "LOADING")


def _redirect(exc: ResponseError) -> tuple[str, tuple[str, int]] | None:
    """``MOVED 3999 10.0.0.2:6381`` / ``ASK ...`` -> (kind, (host, port))."""
    parts = str(exc).split()
    if len(parts) == 3 and parts[0] in ("MOVED", "ASK"):
        host, _, port = parts[2].rpartition(":")
        return parts[0], (host, int(port))
    return None


class ClusterScriptChannel:
    """The same calls as :class:`ScriptChannel`, routed by hash slot over a Redis Cluster.

    One multiplexed :class:`ScriptChannel` per master, and this process's own copy of the
    slot map (``CLUSTER SLOTS``), taken on first use and again after any ``MOVED`` reply or a
    lost node (a failover moves slots). Every script's keys must share one slot — the key
    layout in ``gateway.admission.quota`` guarantees it with hash tags — so a call goes to exactly
    one node: the cluster costs no extra round trip over a single Redis. A ``MOVED`` reply
    refreshes the map and the call is sent once more; an ``ASK`` (a slot being migrated) is
    answered by sending ``ASKING`` and the call to the named node on one connection.
    """

    def __init__(
        self,
        seeds: Sequence[tuple[str, int]],
        *,
        username: str | None = None,
        password: str | None = None,
        timeout_s: float = 0.5,
        connect_timeout_s: float | None = None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        if not seeds:
            raise ValueError("a cluster channel needs at least one seed node")
        self._seeds = list(seeds)
        self._kw: dict[str, Any] = {
            "username": username,
            "password": password,
            "timeout_s": timeout_s,
            "connect_timeout_s": connect_timeout_s,
            "ssl_context": ssl_context,
        }
        self._nodes: dict[tuple[str, int], ScriptChannel] = {}
        self._slots: list[tuple[str, int] | None] = [None] * 16384
        self._mapped = False
        self._suspect: set[tuple[str, int]] = set()  # nodes whose last call failed
        self._refreshing: asyncio.Future[None] | None = None
        self._closed = False

    @classmethod
    def for_cluster(cls, client: Any) -> ClusterScriptChannel:
        """A channel to the cluster of a ``redis.asyncio.RedisCluster`` client, with its
        credentials, timeouts and TLS settings (every node's channel takes redis-py's SSL
        context for them, as a single node's does); ``ValueError`` for a connection class it
        does not know."""
        kw = client.connection_kwargs
        connection_class = kw.get("connection_class")
        if connection_class in (None, aioredis.Connection):
            context = None
        elif connection_class is aioredis.SSLConnection:
            context = _ssl_context(kw)
        else:
            raise ValueError(f"the script channel does not speak {connection_class.__name__}")
        timeout = kw.get("socket_timeout") or 5.0
        return cls(
            [(n.host, int(n.port)) for n in client.startup_nodes],
            username=kw.get("username"),
            password=kw.get("password"),
            timeout_s=float(timeout),
            connect_timeout_s=float(kw.get("socket_connect_timeout") or timeout),
            ssl_context=context,
        )

    # -- routing --------------------------------------------------------------------------
    def _node(self, addr: tuple[str, int]) -> ScriptChannel:
        channel = self._nodes.get(addr)
        if channel is None:
            channel = ScriptChannel(host=addr[0], port=addr[1], **self._kw)
            self._nodes[addr] = channel
        return channel

    async def _refresh(self) -> None:
        if self._refreshing is None:
            self._refreshing = asyncio.ensure_future(self._load_slots())
        refreshing = self._refreshing
        try:
            await asyncio.shield(refreshing)
        finally:
            if refreshing.done() and self._refreshing is refreshing:
                self._refreshing = None

    async def _load_slots(self) -> None:
        if self._closed:
            raise RedisConnectionError("the script channel is closed")
        known = [*self._nodes, *(s for s in self._seeds if s not in self._nodes)]
        # Ask nodes that failed lately last: a dead master must not delay the map for all.
        known.sort(key=lambda addr: addr in self._suspect)
        last: BaseException | None = None
        for addr in known:
            try:
                ranges = await self._node(addr).call(b"CLUSTER", b"SLOTS")
            except (RedisConnectionError, RedisTimeoutError) as exc:
                last = exc
                continue
            slots: list[tuple[str, int] | None] = [None] * 16384
            for entry in ranges:
                start, end, master = int(entry[0]), int(entry[1]), entry[2]
                # An empty host means "the address you reached me at".
                host = _text(master[0]) or addr[0]
                owner = (host, int(master[1]))
                for slot in range(start, end + 1):
                    slots[slot] = owner
            self._slots, self._mapped = slots, True
            return
        raise RedisConnectionError(f"no cluster node answered CLUSTER SLOTS: {last}")

    async def _owner(self, keys: Sequence[Arg]) -> tuple[str, int]:
        if not keys:
            raise ValueError("a cluster script call needs at least one key")
        slot = key_slot(_encode(keys[0]))
        for key in keys[1:]:
            if key_slot(_encode(key)) != slot:
                raise ResponseError("CROSSSLOT Keys in request don't hash to the same slot")
        owner = self._slots[slot]
        if not self._mapped:
            try:
                await self._refresh()
                owner = self._slots[slot]
            except RedisConnectionError:
                if owner is None:  # a node down: keep routing the slots still known
                    raise
        if owner is None:
            await self._refresh()
            owner = self._slots[slot]
            if owner is None:
                raise RedisConnectionError(f"no cluster node serves slot {slot}")
        return owner

    async def _routed(self, keys: Sequence[Arg], run: Any) -> Any:
        """``run(channel)`` on the owner of ``keys``; once more after a redirect."""
        owner = await self._owner(keys)
        try:
            result = await run(self._node(owner))
        except (RedisConnectionError, RedisTimeoutError):
            self._mapped = False  # maybe a failover: ask again on the next call
            self._suspect.add(owner)
            raise
        except ResponseError as exc:
            if str(exc).startswith(_UNAVAILABLE):
                # The cluster cannot serve the slot now (a master lost, a failover under
                # way): for the caller that is the store being unreachable, not a bug.
                self._mapped = False
                raise RedisConnectionError(f"cluster unavailable: {exc}") from exc
            redirect = _redirect(exc)
            if redirect is None:
                raise
            kind, target = redirect
            if kind == "MOVED":
                # The reply names the slot's owner now (the node asked first for the whole
                # map may not have heard yet): take it, and reload the rest on the next call.
                self._slots[key_slot(_encode(keys[0]))] = target
                self._mapped = False
                return await run(self._node(target))
            return await run(_Asking(self._node(target)))
        self._suspect.discard(owner)
        return result

    def owner_of(self, key: Arg) -> tuple[str, int] | None:
        """The master that serves ``key``'s slot as last mapped (None before the first map)."""
        return self._slots[key_slot(_encode(key))]

    # -- calls ----------------------------------------------------------------------------
    async def evalsha(self, script: LuaScript, keys: Sequence[Arg], args: Sequence[Arg]) -> Any:
        return await self._routed(keys, lambda ch: ch.evalsha(script, keys, args))

    async def evalsha_many(
        self, script: LuaScript, calls: Sequence[tuple[Sequence[Arg], Sequence[Arg]]]
    ) -> list[Any]:
        """Each call's keys share one slot; calls are grouped by node and the groups sent
        concurrently (one round trip per node, all in parallel)."""
        if not calls:
            return []
        groups: dict[tuple[str, int], list[int]] = {}
        for i, (keys, _args) in enumerate(calls):
            groups.setdefault(await self._owner(keys), []).append(i)
        results: list[Any] = [None] * len(calls)

        async def one(indexes: list[int]) -> None:
            batch = [calls[i] for i in indexes]
            replies = await self._routed(batch[0][0], lambda ch: ch.evalsha_many(script, batch))
            for i, reply in zip(indexes, replies, strict=True):
                results[i] = reply

        await asyncio.gather(*(one(ix) for ix in groups.values()))
        return results

    def send_nowait(self, script: LuaScript, keys: Sequence[Arg], args: Sequence[Arg]) -> None:
        """Fire a script whose reply nobody waits for, written at once when the owner's
        connection is up (so a later call to that node is answered after it)."""
        slot = key_slot(_encode(keys[0]))
        owner = self._slots[slot] if self._mapped else None
        channel = self._nodes.get(owner) if owner is not None else None
        protocol = channel._protocol if channel is not None else None
        if channel is not None and protocol is not None and protocol.lost is None:
            future = channel._enqueue(
                protocol, pack(b"EVALSHA", script.sha, len(keys), *keys, *args)
            )
            future.add_done_callback(lambda f: self._after_nowait(f, script, keys, args))
            return
        task = asyncio.ensure_future(self.evalsha(script, keys, args))
        task.add_done_callback(_swallow)

    def _after_nowait(
        self,
        future: asyncio.Future[Any],
        script: LuaScript,
        keys: Sequence[Arg],
        args: Sequence[Arg],
    ) -> None:
        if future.cancelled():
            return
        exc = future.exception()
        if isinstance(exc, ResponseError) and (
            str(exc).startswith("NOSCRIPT") or _redirect(exc) is not None
        ):
            task = asyncio.ensure_future(self.evalsha(script, keys, args))
            task.add_done_callback(_swallow)

    async def aclose(self) -> None:
        self._closed = True
        nodes, self._nodes = list(self._nodes.values()), {}
        for channel in nodes:
            await channel.aclose()


class _Asking:
    """A node channel that prefixes each call with ``ASKING`` on the same connection."""

    def __init__(self, channel: ScriptChannel) -> None:
        self._channel = channel

    async def evalsha(self, script: LuaScript, keys: Sequence[Arg], args: Sequence[Arg]) -> Any:
        replies = await self._channel._pipeline(
            [pack(b"ASKING"), pack(b"EVAL", script.source, len(keys), *keys, *args)]
        )
        return replies[1]

    async def evalsha_many(
        self, script: LuaScript, calls: Sequence[tuple[Sequence[Arg], Sequence[Arg]]]
    ) -> list[Any]:
        commands: list[bytes] = []
        for keys, args in calls:
            commands += [pack(b"ASKING"), pack(b"EVAL", script.source, len(keys), *keys, *args)]
        replies = await self._channel._pipeline(commands)
        return replies[1::2]


def _encode(key: Arg) -> bytes:
    if isinstance(key, bytes):
        return key
    return str(key).encode()


def _swallow(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()
