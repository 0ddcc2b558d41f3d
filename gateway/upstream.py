"""Calls to replicas: one pooled HTTP client, explicit per-phase timeouts.

The body sent upstream is rebuilt from validated fields only, and always streams with
``include_usage`` so tokens are counted exactly whatever the client asked for. The gateway
sets ``cache_salt`` (R3: a keyed hash of the tenant, so tenants never share prefix-cache
entries and cannot probe each other's prompts through cache timing) and ``priority`` (the
admission class, so the replica's scheduler agrees with the gateway).
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any

import httpx
import orjson

from gateway import schema
from gateway.config import GatewayConfig
from gateway.validation import ChatRequest

MAX_ERROR_BODY = 16 * 1024


class UpstreamStatusError(Exception):
    """The replica answered with a non-200 status before streaming."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


class UpstreamClient:
    def __init__(self, config: GatewayConfig) -> None:
        t = config.upstream
        limits = config.pool
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(connect=t.connect, read=t.read, write=t.write, pool=t.pool),
            limits=httpx.Limits(
                max_connections=limits.max_connections,
                max_keepalive_connections=limits.max_keepalive,
                keepalive_expiry=limits.keepalive_expiry_s,
            ),
            trust_env=False,
        )
        self._salt_key = config.cache_salt_key
        self._salts: dict[str, str] = {}

    async def aclose(self) -> None:
        await self._client.aclose()

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
    ) -> httpx.Response:
        """Send the request; return the streaming response once its status is 200.

        Raises ``UpstreamStatusError`` for any other status, or httpx's transport errors.
        The caller must ``aclose()`` the response; closing it early closes the connection,
        which is how the replica learns that the client went away.
        """
        request = self._client.build_request(
            "POST",
            replica.base_url.rstrip("/") + "/v1/chat/completions",
            content=body,
            headers={
                "content-type": "application/json",
                "x-request-id": request_id,
                "accept": "text/event-stream",
            },
        )
        response = await self._client.send(request, stream=True)
        if response.status_code == 200:
            return response
        try:
            raw = b""
            async for chunk in response.aiter_bytes():
                raw += chunk
                if len(raw) > MAX_ERROR_BODY:
                    break
        finally:
            await response.aclose()
        raise UpstreamStatusError(response.status_code, _error_message(raw))


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
