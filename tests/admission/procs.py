"""Processes and read-model seeding for the admission integration tests.

Real everything: gateway processes (``python -m gateway``), emulated replicas
(``emulator.testing``), Redis. The read model is written straight into Redis with
``contracts.readmodel_writer`` (as the control plane does), so these tests need no Django.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis

from bench.prom_parse import metric_sum, samples
from contracts import schema
from contracts.readmodel_writer import ReadModelWriter
from emulator.testing import SpawnedEmulator
from tests.support import LaunchedGateway, launch_gateway, wait_until, wait_until_async


@dataclass
class Tenant:
    """A tenant as one of its API keys presents it."""

    tenant_id: str
    secret: str
    key_id: str = ""

    @property
    def auth(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.secret}"}


@dataclass
class Seeder:
    """Writes catalog, tenants and keys, announcing each change like the control plane."""

    client: redis.Redis
    versions: dict[str, schema.ModelVersionRecord] = field(default_factory=dict)
    writer: ReadModelWriter = field(init=False)

    def __post_init__(self) -> None:
        self.writer = ReadModelWriter(self.client)

    def add_version(self, version: schema.ModelVersionRecord) -> None:
        self.versions[version.version] = version
        catalog = schema.Catalog(
            families={v.family: v.version for v in self.versions.values()},
            versions=dict(self.versions),
        )
        self.writer.put_catalog(catalog)
        self.writer.mark_loaded()
        self.writer.announce("catalog", "")

    def tenant(self, cls: schema.AdmissionClass, limits: dict[str, schema.LimitRecord]) -> Tenant:
        tenant_id = "t-" + secrets.token_hex(6)
        plan = {"reserved": "enterprise", "standard": "standard", "best_effort": "free"}[cls]
        self.writer.put_tenant(
            schema.TenantRecord(
                tenant_id=tenant_id,
                name=tenant_id,
                plan=plan,
                admission_class=cls,
                suspended=False,
                limits=limits,
            )
        )
        self.writer.announce("tenant", tenant_id)
        return self.key(tenant_id)

    def key(self, tenant_id: str, limits: dict[str, schema.KeyLimitRecord] | None = None) -> Tenant:
        """A new API key of ``tenant_id``, with its own per-family limits if given."""
        secret = schema.API_KEY_PREFIX + secrets.token_urlsafe(32)
        found = Tenant(tenant_id, secret, "k-" + secrets.token_hex(6))
        self.edit_key(found, limits or {})
        return found

    def edit_key(self, key: Tenant, limits: dict[str, schema.KeyLimitRecord]) -> None:
        """Rewrite the key's record with these limits and announce it (an edit's push)."""
        record = schema.KeyRecord(
            key_id=key.key_id, tenant_id=key.tenant_id, scopes=("chat",), limits=limits
        )
        self.writer.announce("key", self.writer.put_key(key.secret, record))


# A gateway process of these tests (``launch_gateway``'s handle).
GatewayProc = LaunchedGateway


def spawn_gateway(
    tmp: Path, redis_url: str, env: dict[str, str] | None = None, ready_timeout: float = 40.0
) -> GatewayProc:
    """One single-process gateway (``--workers 1``: a kill -9 kills all of it)."""
    launched = launch_gateway(
        tmp,
        redis_url,
        env={"GATEWAY_DRAIN_DEADLINE_S": "5", **(env or {})},
        ready_timeout=ready_timeout,
    )
    return launched


def chat_body(model: str, prompt_words: int, max_tokens: int, **extra: Any) -> dict[str, Any]:
    """A chat request whose prompt is ``prompt_words + 7`` tokens for the emulator and the
    gateway's estimate alike (one token per short word, plus template overhead)."""
    return {
        "model": model,
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": " ".join(["tok"] * prompt_words)}],
        **extra,
    }


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels`` (0 when none)."""
    return metric_sum(text, name, **labels) or 0.0


def replica_gauge(emu: SpawnedEmulator, name: str) -> float:
    return metric(httpx.get(emu.base_url + "/metrics", timeout=5).text, name)


def wait_replica_idle(emu: SpawnedEmulator) -> None:
    """Until the replica runs and queues nothing (an earlier test's streams, closed by their
    client, end there only once the gateway has aborted them upstream)."""
    wait_until(
        lambda: (
            replica_gauge(emu, "vllm:num_requests_running") == 0
            and replica_gauge(emu, "vllm:num_requests_waiting") == 0
        ),
        30,
        interval=0.2,
        what="replica idle",
    )


def replica_scrapes(gw: LaunchedGateway) -> dict[str, float]:
    """The gateway's successful scrapes so far, by replica."""
    text = httpx.get(gw.base_url + "/metrics", timeout=5).text
    return {
        s.labels["replica"]: s.value
        for s in samples(text)
        if s.name == "fairway_gateway_replica_scrapes_total"
    }


async def after_scrapes(gw: LaunchedGateway, n: int = 2) -> None:
    """Wait until the gateway has scraped every replica ``n`` more times: routing then
    sees what the replicas report now (instead of sleeping for some scrape periods)."""
    start = await asyncio.to_thread(replica_scrapes, gw)
    assert start, "the gateway reports no replica scrapes"

    async def scraped() -> bool:
        now = await asyncio.to_thread(replica_scrapes, gw)
        return all(now.get(rid, 0.0) >= count + n for rid, count in start.items())

    await wait_until_async(scraped, 10, 0.05, f"{n} fresh scrapes of every replica")


@contextlib.contextmanager
def two_gateways(
    tmp: Path, redis_url: str, env: dict[str, str], env_b: dict[str, str] | None = None
) -> Iterator[tuple[GatewayProc, GatewayProc]]:
    """Two gateway processes on one Redis (stopped on exit, also when the second fails);
    the second with ``env_b`` when given."""
    a = spawn_gateway(tmp, redis_url, env)
    try:
        b = spawn_gateway(tmp, redis_url, env if env_b is None else env_b)
    except BaseException:
        a.terminate(20)
        raise
    try:
        yield a, b
    finally:
        a.terminate(20)
        b.terminate(20)


async def open_stream(
    client: httpx.AsyncClient,
    held: list[httpx.Response],
    gw: LaunchedGateway,
    tenant: Tenant,
    body: dict[str, object],
) -> httpx.Response:
    """Start a streaming chat; a 200 means admitted and generating (the gateway sends its
    headers after the replica's first chunk) and the response joins ``held``. Refusals are
    read and returned."""
    request = client.build_request(
        "POST",
        gw.base_url + "/v1/chat/completions",
        json={**body, "stream": True},
        headers=tenant.auth,
    )
    response = await client.send(request, stream=True)
    if response.status_code == 200:
        held.append(response)
    else:
        await response.aread()
        await response.aclose()
    return response


@contextlib.asynccontextmanager
async def held_streams() -> AsyncIterator[tuple[httpx.AsyncClient, list[httpx.Response]]]:
    """An async client whose held streaming responses are all closed (cancelled) on exit."""
    held: list[httpx.Response] = []
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=400)) as c:
        try:
            yield c, held
        finally:
            for r in held:
                await r.aclose()
