"""API-key authentication: ``Authorization: Bearer fw-…`` → KeyRecord → TenantRecord."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

from redis.asyncio import Redis

from gateway import schema
from gateway.errors import Forbidden, Unauthorized
from gateway.readmodel import ReadModel

log = logging.getLogger("gateway.auth")

# Longer secrets are not ours; refusing them early keeps HMAC input bounded.
MAX_SECRET_LEN = 256


@dataclass(frozen=True, slots=True)
class Principal:
    key: schema.KeyRecord
    tenant: schema.TenantRecord


class Authenticator:
    def __init__(self, readmodel: ReadModel, pepper: bytes, last_used: LastUsedRecorder) -> None:
        self._readmodel = readmodel
        self._pepper = pepper
        self._last_used = last_used

    async def authenticate(self, authorization: bytes | None, scope: str) -> Principal:
        secret = _bearer_secret(authorization)
        key = await self._readmodel.key(schema.hash_api_key(secret, self._pepper))
        now = time.time()
        if key is None:
            raise Unauthorized("Incorrect API key provided.")
        if key.is_expired(now):
            raise Unauthorized("The API key has expired.")
        tenant = await self._readmodel.tenant(key.tenant_id)
        if tenant is None:
            raise Unauthorized("The API key's organization no longer exists.")
        if tenant.suspended:
            raise Forbidden("The organization is suspended.", code="organization_suspended")
        if scope not in key.scopes:
            raise Forbidden(f"The API key lacks the '{scope}' scope.", code="insufficient_scope")
        self._last_used.touch(key.key_id, now)
        return Principal(key=key, tenant=tenant)


def _bearer_secret(authorization: bytes | None) -> str:
    if not authorization:
        raise Unauthorized(
            "You didn't provide an API key. Send it as 'Authorization: Bearer fw-...'."
        )
    try:
        text = authorization.decode("ascii")
    except UnicodeDecodeError:
        raise Unauthorized("Malformed Authorization header.") from None
    scheme, _, secret = text.strip().partition(" ")
    secret = secret.strip()
    if scheme.lower() != "bearer" or not secret:
        raise Unauthorized("Malformed Authorization header; expected 'Bearer fw-...'.")
    if not secret.startswith(schema.API_KEY_PREFIX) or len(secret) > MAX_SECRET_LEN:
        raise Unauthorized("Incorrect API key provided.")
    return secret


class LastUsedRecorder:
    """Batches key last-use stamps in memory and flushes them off the hot path.

    One ``HSET`` every few seconds per process instead of one write per request. The
    control plane reads the hash into ``ApiKey.last_used_at``; a lost flush only makes
    the stamp a few seconds older.
    """

    def __init__(self, redis: Redis, interval_s: float) -> None:
        self._redis = redis
        self._interval_s = interval_s
        self._pending: dict[str, int] = {}
        self._task: asyncio.Task[None] | None = None

    def touch(self, key_id: str, now: float) -> None:
        self._pending[key_id] = int(now)

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="last-used-flush")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        with contextlib.suppress(Exception):
            await self.flush()

    async def flush(self) -> None:
        if not self._pending:
            return
        batch, self._pending = self._pending, {}
        try:
            await self._redis.hset(schema.KEY_LAST_USED_HASH, mapping=batch)  # type: ignore[arg-type]
        except Exception:
            # Keep the newest stamps for the next attempt.
            for key_id, ts in batch.items():
                self._pending[key_id] = max(ts, self._pending.get(key_id, 0))
            raise

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                await self.flush()
            except Exception as exc:  # noqa: BLE001
                log.warning("last-used flush failed: %r", exc)
