"""Calls to replicas: one pooled HTTP client, explicit per-phase timeouts.

The body sent upstream is rebuilt from validated fields only, and always streams with
``include_usage`` so tokens are counted exactly whatever the client asked for. The gateway
sets ``cache_salt`` (R3: a keyed hash of the tenant, so tenants never share prefix-cache
entries and cannot probe each other's prompts through cache timing) and ``priority`` (the
admission class, so the replica's scheduler agrees with the gateway).

The client is aiohttp's, not httpx's. Measured with bench/gateway_overhead.py on this
machine: httpcore's pool re-scans every pooled connection (with a ``poll`` syscall each) on
every request, so at 150 streaming req/s the gateway spent over half its CPU choosing a
connection, ~15 ms per request; aiohttp's connector and C parser make that cost flat.
Timeouts map as: ``connect`` → ``sock_connect``; ``pool`` + ``connect`` → ``connect`` (aiohttp's
pool wait includes the connection's setup); ``read`` → ``sock_read``, the longest silence
between two reads, which is both the first-token ceiling and the inter-token stall limit.
The request body is one small write, so aiohttp's lack of a write timeout is covered by
``sock_read`` (a replica that does not take the body does not answer either).

Errors leave this module as the library-neutral exceptions below.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson

from gateway import schema
from gateway.config import GatewayConfig
from gateway.validation import ChatRequest

MAX_ERROR_BODY = 16 * 1024


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


class UpstreamStatusError(UpstreamFailure):
    """The replica answered with a non-200 status before streaming."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


def _translate(exc: BaseException) -> UpstreamFailure:
    if isinstance(exc, aiohttp.ClientConnectorError):
        return ReplicaUnreachable(str(exc), refused=True)
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return ReplicaUnreachable(str(exc) or "connect timeout", refused=False)
    if isinstance(exc, TimeoutError):
        return ReplicaStalled(str(exc) or "read timeout")
    return ReplicaBroken(repr(exc))


class UpstreamResponse:
    """A streaming 200 from a replica."""

    __slots__ = ("_response",)

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response

    async def read(self) -> bytes:
        """The bytes that arrived since the last read (b"" at the end of the body). The
        caller reads again only once it has relayed the previous bytes, so a slow client
        slows the upstream read (aiohttp pauses the socket past its buffer)."""
        try:
            return await self._response.content.readany()
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise _translate(exc) from exc

    async def chunks(self) -> AsyncIterator[bytes]:
        """``read`` as an async iterator."""
        while data := await self.read():
            yield data

    def close(self) -> None:
        """Return the connection to the pool if the body was read to the end; otherwise
        drop it, which is how the replica learns the client went away (it aborts and frees
        the KV)."""
        if self._response.content.at_eof():
            self._response.release()
        else:
            self._response.close()


class UpstreamClient:
    def __init__(self, config: GatewayConfig) -> None:
        self._config = config
        self._salt_key = config.cache_salt_key
        self._salts: dict[str, str] = {}
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        t, pool = self._config.upstream, self._config.pool
        connector = aiohttp.TCPConnector(
            limit=pool.max_connections,
            limit_per_host=0,
            keepalive_timeout=pool.keepalive_expiry_s,
            ttl_dns_cache=300,
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            auto_decompress=False,
            trust_env=False,
            timeout=aiohttp.ClientTimeout(
                total=None, connect=t.pool + t.connect, sock_connect=t.connect, sock_read=t.read
            ),
        )

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

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
        req: ChatRequest,
        version: schema.ModelVersionRecord,
        *,
        max_tokens: int,
        priority: int,
        tenant_id: str,
    ) -> bytes:
        body: dict[str, Any] = {
            "model": version.version,
            "messages": req.messages,
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            "priority": priority,
            "cache_salt": self.cache_salt(tenant_id),
        }
        body.update(req.sampling)
        return orjson.dumps(body)

    async def open(
        self, replica: schema.ReplicaRecord, body: bytes, request_id: str
    ) -> UpstreamResponse:
        """Send the request; return the streaming response once its status is 200.

        Raises ``UpstreamStatusError`` for any other status, or another ``UpstreamFailure``.
        The caller must ``close()`` the response.
        """
        if self._session is None:
            raise ReplicaBroken("the upstream client is not started")
        url = replica.base_url.rstrip("/") + "/v1/chat/completions"
        headers = {
            "content-type": "application/json",
            "x-request-id": request_id,
            "accept": "text/event-stream",
        }
        try:
            try:
                response = await self._session.post(url, data=body, headers=headers)
            except aiohttp.ServerDisconnectedError:
                # Almost always a pooled keep-alive connection the replica closed as we
                # reused it, so the engine never saw the request: retry once on a fresh
                # connection. (A replica that read it and dropped the connection without
                # answering has died; the retry then fails to connect.)
                response = await self._session.post(url, data=body, headers=headers)
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise _translate(exc) from exc
        if response.status == 200:
            return UpstreamResponse(response)
        try:
            raw = await response.content.read(MAX_ERROR_BODY)
        except (aiohttp.ClientError, TimeoutError, OSError):
            raw = b""
        finally:
            response.close()
        raise UpstreamStatusError(response.status, _error_message(raw))


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
