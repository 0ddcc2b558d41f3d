"""Gateway test fixtures: real Redis, real emulated replicas, real gateway processes, real Kafka.

The read model is seeded by writing ``contracts.schema`` records straight into Redis with
``contracts.readmodel_writer`` (as the control plane does, without Django). Each test that
needs a tenant makes its own, so the module-scoped gateway and replica can be shared and the
usage events of one test are told apart by tenant id.
"""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import redis

from bench import prom_parse
from contracts import schema
from contracts.readmodel_writer import ReadModelWriter
from emulator.testing import SpawnedEmulator, spawn_emulator
from tests.support import LaunchedGateway, launch_gateway, wait_until

FAMILY = "llama-8b"
VERSION = "llama-8b-2026-05"
PROFILE = "llama-8b-tp1-h100"
# Replicas run the model clock this much faster than wall time, so generations are short.
SPEED = 20.0
USAGE_TOPIC = "usage.v1"


# -- read model seeding ---------------------------------------------------------------------


@dataclass
class Tenant:
    tenant_id: str
    secret: str
    key_hash: str
    key_id: str


@dataclass
class ReadModelSeeder:
    """Writes read-model records and announces them the way the control plane does:
    write, bump the version, publish a Change."""

    client: redis.Redis
    versions: dict[str, schema.ModelVersionRecord] = field(default_factory=dict)
    families: dict[str, str] = field(default_factory=dict)
    writer: ReadModelWriter = field(init=False)

    def __post_init__(self) -> None:
        self.writer = ReadModelWriter(self.client)

    def _announce(self, kind: schema.ChangeKind, ident: str) -> None:
        self.writer.mark_loaded()
        self.writer.announce(kind, ident)

    def set_replicas(
        self,
        replicas: list[tuple[str, str]],
        *,
        version: str = VERSION,
        family: str = FAMILY,
        context_length: int = 131_072,
        **capabilities: Any,
    ) -> None:
        """``capabilities``: the version's ``supports_tools``, ``max_n`` … (default off)."""
        self.versions[version] = schema.ModelVersionRecord(
            version=version,
            family=family,
            context_length=context_length,
            kv_bytes_per_token=128 * 1024,
            tpot_target_ms=50,
            kv_capacity_tokens=440_000,
            replicas=tuple(
                schema.ReplicaRecord(replica_id=rid, base_url=url, pool="shared")
                for rid, url in replicas
            ),
            **capabilities,
        )
        self.families[family] = version
        catalog = schema.Catalog(families=dict(self.families), versions=dict(self.versions))
        self.writer.put_catalog(catalog)
        self._announce("catalog", "")

    def tenant(
        self,
        *,
        max_context: int = 8192,
        max_output: int = 512,
        scopes: tuple[str, ...] = ("chat", "models:read"),
        suspended: bool = False,
        families: tuple[str, ...] = (FAMILY,),
        expires_at: int | None = None,
        admission_class: schema.AdmissionClass = "standard",
        rpm: int = 100_000,
    ) -> Tenant:
        tenant_id = "t-" + secrets.token_hex(6)
        secret = schema.API_KEY_PREFIX + secrets.token_urlsafe(32)
        key_id = "k-" + secrets.token_hex(6)
        limit = schema.LimitRecord(
            rpm=rpm,
            tpm=100_000_000,
            max_context=max_context,
            max_output=max_output,
            kv_seconds_cap=1_000_000,
            reserved_kv=0,
        )
        record = schema.TenantRecord(
            tenant_id=tenant_id,
            name=tenant_id,
            plan="standard",
            admission_class=admission_class,
            suspended=suspended,
            limits={f: limit for f in families},
        )
        self.writer.put_tenant(record)
        key_hash = self.writer.put_key(
            secret,
            schema.KeyRecord(
                key_id=key_id, tenant_id=tenant_id, scopes=scopes, expires_at=expires_at
            ),
        )
        self._announce("tenant", tenant_id)
        self._announce("key", key_hash)
        return Tenant(tenant_id=tenant_id, secret=secret, key_hash=key_hash, key_id=key_id)

    def revoke(self, tenant: Tenant) -> None:
        """What the control plane does on revocation: delete, bump the version, publish."""
        self.writer.delete_key(tenant.key_hash)
        self._announce("key", tenant.key_hash)


@pytest.fixture(scope="module")
def seeder(rdb: redis.Redis) -> ReadModelSeeder:
    return ReadModelSeeder(rdb)


# -- replicas -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def replica(request: pytest.FixtureRequest) -> Iterator[SpawnedEmulator]:
    """The module's replica; a module's ``REPLICA_OPTIONS`` add emulator flags (tool calling)."""
    options = getattr(request.module, "REPLICA_OPTIONS", {})
    with spawn_emulator(PROFILE, VERSION, SPEED, **options) as emu:
        yield emu


def set_faults(emu: SpawnedEmulator, **knobs: Any) -> None:
    response = httpx.post(emu.base_url + "/_emulator/faults", json=knobs, timeout=5)
    response.raise_for_status()


def replica_healthy(gw: GatewayProcess, replica_id: str) -> bool:
    text = httpx.get(gw.base_url + "/metrics", timeout=5).text
    return f'fairway_gateway_replica_healthy{{replica="{replica_id}"}} 1.0' in text


def replica_metric(emu: SpawnedEmulator, name: str) -> float:
    return metric_sum(emu.base_url, name)


def metric_sum(base_url: str, name: str) -> float:
    """The sum of one metric's samples on ``base_url``'s ``/metrics`` (labels ignored)."""
    text = httpx.get(base_url + "/metrics", timeout=5).text
    return prom_parse.metric_sum(text, name) or 0.0


# -- gateway processes ----------------------------------------------------------------------


# A gateway process of these tests (``launch_gateway``'s handle).
GatewayProcess = LaunchedGateway


def start_gateway(
    tmp: Path,
    redis_url: str,
    kafka: str | None,
    *,
    workers: int = 1,
    extra_env: dict[str, str] | None = None,
    spool_dir: Path | None = None,
    ready_timeout: float = 30.0,
) -> GatewayProcess:
    env = {"GATEWAY_DRAIN_DEADLINE_S": "20", "GATEWAY_LAST_USED_FLUSH_S": "0.2"}
    if kafka:
        env["KAFKA_BOOTSTRAP"] = kafka
    env.update(extra_env or {})
    launched = launch_gateway(
        tmp,
        redis_url,
        workers=workers,
        env=env,
        spool_dir=spool_dir,
        ready_timeout=ready_timeout,
    )
    return launched


@pytest.fixture
def gateways(tmp_path: Path, redis_url: str) -> Iterator[Callable[..., GatewayProcess]]:
    """Start gateway processes for one test; whatever happens, none outlives it."""
    started: list[GatewayProcess] = []

    def start(kafka: str | None, **kwargs: Any) -> GatewayProcess:
        gw = start_gateway(tmp_path, redis_url, kafka, **kwargs)
        started.append(gw)
        return gw

    yield start
    for gw in started:
        gw.terminate(10)


@pytest.fixture(scope="module")
def gateway(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    redis_url: str,
    kafka_bootstrap: str,
    seeder: ReadModelSeeder,
    replica: SpawnedEmulator,
) -> Iterator[GatewayProcess]:
    """The module's gateway; a module's ``CAPABILITIES`` go on the version's record."""
    seeder.set_replicas([("r1", replica.base_url)], **getattr(request.module, "CAPABILITIES", {}))
    gw = start_gateway(tmp_path_factory.mktemp("gw"), redis_url, kafka_bootstrap)
    yield gw
    gw.terminate()


# -- usage events ---------------------------------------------------------------------------


class UsageLog:
    """Reads ``usage.v1`` from the beginning and indexes events by tenant id."""

    def __init__(self, bootstrap: str) -> None:
        from kafka import KafkaConsumer, TopicPartition
        from kafka.admin import KafkaAdminClient, NewTopic

        admin = KafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=10_000)
        with contextlib.suppress(Exception):  # already there
            admin.create_topics([NewTopic(USAGE_TOPIC, num_partitions=1, replication_factor=1)])
        admin.close()
        self.consumer = KafkaConsumer(
            bootstrap_servers=bootstrap,
            group_id=None,
            enable_auto_commit=False,
            request_timeout_ms=10_000,
        )
        partitions = wait_until(
            lambda: self.consumer.partitions_for_topic(USAGE_TOPIC),
            10,
            interval=0.2,
            what="usage.v1 partitions",
        )
        self.consumer.assign([TopicPartition(USAGE_TOPIC, p) for p in partitions])
        self.consumer.seek_to_beginning()
        self.by_tenant: dict[str, list[dict[str, Any]]] = {}

    def poll(self) -> None:
        for records in self.consumer.poll(timeout_ms=200).values():
            for record in records:
                event = orjson.loads(record.value)
                assert record.key == event["tenant_id"].encode()
                self.by_tenant.setdefault(event["tenant_id"], []).append(event)

    def events(self, tenant_id: str, count: int, timeout: float = 20.0) -> list[dict[str, Any]]:
        """At least ``count`` events of the tenant (waiting up to ``timeout``)."""

        def enough() -> list[dict[str, Any]] | None:
            self.poll()  # waits up to 200 ms for records: no sleep between polls
            got = self.by_tenant.get(tenant_id, [])
            return got if len(got) >= count else None

        return wait_until(enough, timeout, 0, f"{count} usage events for {tenant_id}")

    def settle(self, seconds: float = 1.0) -> None:
        """Keep reading for a while (to see that nothing more arrives)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self.poll()

    def close(self) -> None:
        self.consumer.close()


@pytest.fixture(scope="module")
def usage_log(kafka_bootstrap: str) -> Iterator[UsageLog]:
    log = UsageLog(kafka_bootstrap)
    yield log
    log.close()
