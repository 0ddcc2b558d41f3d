"""Calls to replicas: pooled keep-alive HTTP/1.1 (``gateway.serving.h1``), explicit timeouts.

The body sent upstream is rebuilt from validated fields only, and always streams with
``include_usage`` so tokens are counted exactly whatever the client asked for; a streaming
request also asks for ``continuous_usage_stats`` (``GatewayConfig.continuous_usage``), whose
per-chunk counts the relay keeps and strips (``gateway.upstream.relay``). The gateway
sets ``cache_salt`` (docs/design.md R3: a keyed hash of the tenant, so tenants never share
prefix-cache entries and cannot probe each other's prompts through cache timing) and ``priority``
(the admission class, so the replica's scheduler agrees with the gateway).

``send`` writes the request at once on a pooled connection (or starts connecting) and
returns a ``Dispatch``; ``Dispatch.response()`` waits for the status. Splitting the two
lets the caller overlap the replica's round trip with its own (early dispatch,
``gateway.admission.controller``), and ``Dispatch.discard()`` withdraws a request nobody will relay.
Timeouts: ``connect`` for the TCP (and TLS) handshake, ``pool`` for a free connection
under ``max_connections``, ``read`` for the longest silence between two bytes of a
response, which is both the first-token ceiling and the inter-token stall limit. The
request is one small write, covered by ``read`` (a replica that does not take the body
does not answer either). Errors leave this module as the exceptions of ``gateway.serving.h1``.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import re
from collections.abc import AsyncIterator
from typing import Any

import orjson

from contracts import schema
from gateway.config import GatewayConfig
from gateway.endpoints.validation import GenerationRequest
from gateway.serving.h1 import (
    Connection,
    Pool,
    ReplicaBroken,
    ReplicaStalled,
    ReplicaUnreachable,
    Target,
    UpstreamFailure,
)

__all__ = [
    "Dispatch",
    "ReplicaBroken",
    "ReplicaStalled",
    "ReplicaUnreachable",
    "UpstreamClient",
    "UpstreamFailure",
    "UpstreamResponse",
    "UpstreamStatusError",
]

MAX_ERROR_BODY = 16 * 1024
CHAT_PATH = b"/v1/chat/completions"


class UpstreamStatusError(UpstreamFailure):
    """The replica answered with a non-200 status before streaming."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message
        self.param = param  # the request field it named, if it looked like one


class UpstreamResponse:
    """A streaming 200 from a replica."""

    __slots__ = ("_conn",)

    def __init__(self, conn: Connection) -> None:
        self._conn = conn

    async def read(self) -> bytes:
        """The bytes that arrived since the last read (b"" at the end of the body). The
        caller reads again only once it has relayed the previous bytes, so a slow client
        slows the upstream read (the connection stops reading past its buffer)."""
        return await self._conn.read()

    async def chunks(self) -> AsyncIterator[bytes]:
        """``read`` as an async iterator."""
        while data := await self.read():
            yield data

    def close(self) -> None:
        """Return the connection to the pool if the body was read to the end; otherwise
        drop it, which is how the replica learns the client went away (it aborts and frees
        the KV)."""
        self._conn.finish()


class Dispatch:
    """A request sent to a replica, or on its way (connecting); see ``UpstreamClient.send``."""

    __slots__ = ("_pool", "_target", "_head", "_body", "_conn", "_task", "_reused")

    def __init__(self, pool: Pool, target: Target, head: bytes, body: bytes) -> None:
        self._pool = pool
        self._target = target
        self._head = head
        self._body = body
        self._conn = pool.take_idle(target)
        self._reused = self._conn is not None
        self._task: asyncio.Task[Connection] | None = None
        if self._conn is not None:
            self._conn.send(head, body)
        else:
            self._task = asyncio.ensure_future(self._connect_and_send())

    async def _connect_and_send(self) -> Connection:
        conn = await self._pool.connect(self._target)
        conn.send(self._head, self._body)
        return conn

    async def response(self) -> UpstreamResponse:
        """The streaming response once its status is 200. Raises ``UpstreamStatusError`` for
        any other status, or another ``UpstreamFailure``. The caller must ``close()`` it."""
        try:
            if self._task is not None:
                self._conn = await self._task
                self._task = None
            conn = self._conn
            assert conn is not None
            try:
                await conn.wait_headers()
            except ReplicaBroken as exc:
                if not (self._reused and exc.before_response):
                    raise
                # A pooled connection the replica closed as we reused it: the engine never
                # saw the request, so it is sent again, once, on a new connection. (A
                # replica that read it and died without answering fails the retry too.)
                self._reused = False
                conn = self._conn = await self._connect_and_send()
                await conn.wait_headers()
            if conn.status == 200:
                self._conn = None  # the response owns the connection now
                return UpstreamResponse(conn)
            raw = await _error_body(conn)
            raise UpstreamStatusError(conn.status, _error_message(raw), _error_param(raw))
        finally:
            self.discard()

    def discard(self) -> None:
        """Withdraw the request: a connecting one is abandoned, a sent one is closed
        mid-exchange; either way the replica never starts it or aborts it (frees its KV)."""
        if self._task is not None:
            self._task.cancel()
            self._task.add_done_callback(_abort_connected)
            self._task = None
        if self._conn is not None:
            self._conn.finish()
            self._conn = None


def _abort_connected(task: asyncio.Task[Connection]) -> None:
    if not task.cancelled() and task.exception() is None:
        task.result().abort()


async def _error_body(conn: Connection) -> bytes:
    parts: list[bytes] = []
    size = 0
    try:
        while size < MAX_ERROR_BODY and (data := await conn.read()):
            parts.append(data)
            size += len(data)
    except UpstreamFailure:
        pass
    return b"".join(parts)[:MAX_ERROR_BODY]


class UpstreamClient:
    def __init__(self, config: GatewayConfig) -> None:
        self._config = config
        self._salt_key = config.cache_salt_key
        self._salts: dict[str, str] = {}
        self._targets: dict[tuple[str, bytes], tuple[Target, bytes]] = {}
        self._pool: Pool | None = None

    async def start(self) -> None:
        t, pool = self._config.upstream, self._config.pool
        self._pool = Pool(
            max_connections=pool.max_connections,
            max_keepalive=pool.max_keepalive,
            keepalive_expiry_s=pool.keepalive_expiry_s,
            connect_timeout_s=t.connect,
            pool_timeout_s=t.pool,
            read_timeout_s=t.read,
        )

    async def aclose(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    @property
    def open_connections(self) -> int:
        """Connections to replicas open or opening (in use or idle in the pool)."""
        return self._pool.open_connections if self._pool is not None else 0

    def cache_salt(self, tenant_id: str) -> str:
        """HMAC-SHA256(tenant) in hex: 64 chars, no ``/ @ \\`` (vLLM's cache_salt rules)."""
        salt = self._salts.get(tenant_id)
        if salt is None:
            salt = hmac.new(self._salt_key, tenant_id.encode(), hashlib.sha256).hexdigest()
            if len(self._salts) > 100_000:
                self._salts.clear()
            self._salts[tenant_id] = salt
        return salt

    def build_body(
        self,
        req: GenerationRequest,
        version: schema.ModelVersionRecord,
        *,
        max_tokens: int,
        priority: int,
        tenant_id: str,
    ) -> bytes:
        body: dict[str, Any] = {
            "model": version.version,
            **req.upstream_inputs(),
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}
            if req.stream and self._config.continuous_usage
            else {"include_usage": True},
            "priority": priority,
            "cache_salt": self.cache_salt(tenant_id),
        }
        body.update(req.sampling)
        return orjson.dumps(body)

    def send(
        self,
        replica: schema.ReplicaRecord,
        body: bytes,
        request_id: str,
        path: bytes = CHAT_PATH,
    ) -> Dispatch:
        """Send the request now (on a pooled connection; or start connecting): the caller
        awaits ``response()`` when it is ready to relay, or ``discard()``s it."""
        if self._pool is None:
            raise ReplicaBroken("the upstream client is not started")
        target, head = self._request_head(replica.base_url, path)
        # request_id is the gateway's own hex, or a client id checked against
        # [A-Za-z0-9._:-] (gateway.serving.http), so it cannot break the header block.
        return Dispatch(
            self._pool,
            target,
            head
            + b"x-request-id: %s\r\ncontent-length: %d\r\n\r\n" % (request_id.encode(), len(body)),
            body,
        )

    async def open(
        self, replica: schema.ReplicaRecord, body: bytes, request_id: str
    ) -> UpstreamResponse:
        """``send`` then ``response()``: the streaming 200, or an ``UpstreamFailure``."""
        return await self.send(replica, body, request_id).response()

    def _request_head(self, base_url: str, path: bytes) -> tuple[Target, bytes]:
        cached = self._targets.get((base_url, path))
        if cached is None:
            try:
                target = Target.parse(base_url)
            except ValueError as exc:
                raise ReplicaUnreachable(str(exc), refused=True) from None
            head = (
                b"POST " + target.path_prefix + path + b" HTTP/1.1\r\n"
                b"host: " + target.host_header + b"\r\n"
                b"content-type: application/json\r\n"
                b"accept: text/event-stream\r\n"
            )
            if target.authorization is not None:
                head += b"authorization: " + target.authorization + b"\r\n"
            cached = self._targets[(base_url, path)] = (target, head)
        return cached


def _error_message(raw: bytes) -> str:
    try:
        data = orjson.loads(raw)
        error = data.get("error") if isinstance(data, dict) else None
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return str(error["message"])
        if isinstance(error, str):
            return error
    except orjson.JSONDecodeError:
        pass
    return raw[:512].decode("utf-8", "replace") or "no body"


# A field name as replicas report it ("logit_bias", "tools.0.function"): nothing else of
# the replica's error reaches the client.
_PARAM = re.compile(r"[A-Za-z_][A-Za-z0-9_.\[\]]{0,127}")


def _error_param(raw: bytes) -> str | None:
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    error = data.get("error") if isinstance(data, dict) else None
    param = error.get("param") if isinstance(error, dict) else None
    return param if isinstance(param, str) and _PARAM.fullmatch(param) else None
