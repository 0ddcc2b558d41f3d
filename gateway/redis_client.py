"""The gateway's Redis clients: one factory for every async client the gateway opens (the
shared one of the process, admission's own with shorter timeouts)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import parse_qsl, urlsplit

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """TLS material for a ``rediss://`` URL kept out of the URL (``REDIS_TLS_*``): the CA
    that signed the server's certificate, and the client's certificate and key when the
    server asks for one. Settings in the URL's query (redis-py's ``ssl_ca_certs``,
    ``ssl_certfile``, ``ssl_keyfile``, ``ssl_cert_reqs``, ``ssl_check_hostname``) win.
    Verification is on unless the URL says ``ssl_cert_reqs=none``."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None

    def kwargs(self, url: str) -> dict[str, Any]:
        if not url.startswith("rediss://"):
            return {}
        given = {k: v for k, v in parse_qsl(urlsplit(url).query)}
        pairs = (
            ("ssl_ca_certs", self.ca_file),
            ("ssl_certfile", self.cert_file),
            ("ssl_keyfile", self.key_file),
        )
        return {k: v for k, v in pairs if v and k not in given}


def connect(
    url: str,
    *,
    timeout_s: float = 0.5,
    max_connections: int = 512,
    health_check_interval: int = 0,
    cluster: bool = False,
    tls: TlsFiles | None = None,
) -> aioredis.Redis:
    """A client that fails fast: explicit timeouts, and one immediate retry only for a
    broken connection (a stale pooled one), never a backoff, and never a retry after a
    timeout (a hung store would cost every request twice the timeout before the fallbacks of
    docs/design.md §8 answer). The pool blocks (up to ``timeout_s``) for a free connection:
    a burst of concurrent calls must queue, not read as "the store is down"."""
    extra = tls.kwargs(url) if tls is not None else {}
    if cluster:
        # Per-node pools; the same fail-fast timeouts. The client's type is RedisCluster,
        # which answers the commands the gateway uses with the same signatures.
        client: Any = RedisCluster.from_url(
            url,
            max_connections=max_connections,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            health_check_interval=health_check_interval,
            retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
            **extra,
        )
        return cast(aioredis.Redis, client)
    pool = aioredis.BlockingConnectionPool.from_url(
        url,
        max_connections=max_connections,
        timeout=timeout_s,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        health_check_interval=health_check_interval,
        retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
        **extra,
    )
    return aioredis.Redis(connection_pool=pool)
