"""Ingestion fixtures: real PostgreSQL (pytest-django, committed data: the consumer runs on
its own thread or in its own process), a Kafka-protocol broker of this package's own (the
suite's shared one carries the gateway tests' usage.v1 traffic), a fresh topic per test.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis
from django.db import connection

from catalog.models import ModelVersion
from catalog.testing import priced_version
from fairway.embedded import EmbeddedServices
from metering.consumer import ConsumerConfig, UsageConsumer
from metering.models import Usage
from tenants.models import Plan, Tenant
from tests.gateway.conftest import start_gateway
from tests.support import ROOT, LaunchedGateway, wait_until

VERSION = "llama-8b-2026-05"


@pytest.fixture(scope="session")
def ingest_kafka(services: EmbeddedServices) -> str:
    return services.start_kafka()


def create_topic(bootstrap: str, name: str, partitions: int = 3) -> None:
    from kafka.admin import KafkaAdminClient, NewTopic

    admin = KafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=10_000)
    try:
        admin.create_topics([NewTopic(name, num_partitions=partitions, replication_factor=1)])
    finally:
        admin.close()


@pytest.fixture
def topic(ingest_kafka: str) -> str:
    name = f"usage-test-{uuid.uuid4().hex[:10]}"
    create_topic(ingest_kafka, name)
    return name


@dataclass
class World:
    tenants: list[uuid.UUID]
    key: uuid.UUID
    version: ModelVersion


def make_world(n_tenants: int = 3) -> World:
    plan = Plan.objects.create(name=f"p-{uuid.uuid4().hex[:6]}", admission_class="standard")
    version = priced_version(
        family="llama-8b", display_name="Llama 8B", version=VERSION, actor_label="system:tests"
    )
    tenants = [
        Tenant.objects.create(name=f"t-{uuid.uuid4().hex[:8]}", plan=plan).id
        for _ in range(n_tenants)
    ]
    return World(tenants=tenants, key=uuid.uuid4(), version=version)


@pytest.fixture
def world(transactional_db: None) -> World:
    return make_world()


def event(world: World, **changes: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "schema_version": 1,
        "request_id": uuid.uuid4().hex,
        "tenant_id": str(world.tenants[0]),
        "api_key_id": str(world.key),
        "model": "llama-8b",
        "model_version": VERSION,
        "replica_id": "r1",
        "started_at": datetime.now(UTC).isoformat(),
        "prompt_tokens": 100,
        "completion_tokens": 20,
        "cached_tokens": 10,
        "ttft_ms": 12.5,
        "tpot_ms": 20.0,
        "finish_reason": "stop",
        "status": 200,
        "is_retry": False,
    }
    base.update(changes)
    return base


class Producer:
    def __init__(self, bootstrap: str) -> None:
        from kafka import KafkaProducer

        self._producer = KafkaProducer(
            bootstrap_servers=bootstrap, acks="all", linger_ms=5, batch_size=1 << 20
        )

    def send(self, topic: str, messages: Sequence[dict[str, Any] | bytes]) -> None:
        """Keyed by tenant like the gateway (raw bytes: keyed by their hash of nothing)."""
        for message in messages:
            if isinstance(message, bytes):
                self._producer.send(topic, value=message, key=b"raw")
            else:
                key = str(message.get("tenant_id", "")).encode()
                self._producer.send(topic, value=orjson.dumps(message), key=key)
        self._producer.flush(timeout=30)

    def close(self) -> None:
        self._producer.close(timeout=5)


@pytest.fixture
def producer(ingest_kafka: str) -> Iterator[Producer]:
    p = Producer(ingest_kafka)
    yield p
    p.close()


@pytest.fixture
def consumers(ingest_kafka: str, topic: str) -> Iterator[Callable[..., UsageConsumer]]:
    """Start in-process consumers on this test's topic; all stopped at the end."""
    started: list[UsageConsumer] = []
    group = f"billing-{uuid.uuid4().hex[:6]}"

    def start(**kwargs: Any) -> UsageConsumer:
        clock = kwargs.pop("clock", None)
        config = ConsumerConfig(bootstrap=ingest_kafka, topic=topic, group_id=group, **kwargs)
        consumer = UsageConsumer(config, clock=clock) if clock else UsageConsumer(config)
        consumer.start()
        started.append(consumer)
        return consumer

    yield start
    for consumer in started:
        consumer.stop()


@dataclass(frozen=True)
class Metered:
    """Gateways' usage events on their way into ``usage``: this test's topic on the package's
    broker with the consumer on it, the control plane's read model in this Redis DB."""

    redis_url: str
    kafka: str
    topic: str
    tmp: Path

    def gateway(
        self, *, extra_env: dict[str, str] | None = None, **options: Any
    ) -> LaunchedGateway:
        """A gateway process (``start_gateway``'s options) sending its usage events to the
        topic."""
        env = {"GATEWAY_USAGE_TOPIC": self.topic, **(extra_env or {})}
        return start_gateway(self.tmp, self.redis_url, self.kafka, extra_env=env, **options)


@pytest.fixture
def metered(
    transactional_db: None,
    settings: Any,
    rdb: redis.Redis,
    redis_url: str,
    ingest_kafka: str,
    topic: str,
    consumers: Callable[..., UsageConsumer],
    tmp_path: Path,
) -> Metered:
    """The control plane on the test database pushing to ``redis_url``; a consumer started."""
    settings.REDIS_URL = redis_url
    consumers()
    return Metered(redis_url, ingest_kafka, topic, tmp_path)


def usage_totals(**filters: Any) -> dict[str, int]:
    from django.db.models import Sum

    sums = Usage.objects.filter(**filters).aggregate(
        requests=Sum("requests"),
        prompt_tokens=Sum("prompt_tokens"),
        cached_tokens=Sum("cached_tokens"),
        completion_tokens=Sum("completion_tokens"),
        cancelled_requests=Sum("cancelled_requests"),
        errored_requests=Sum("errored_requests"),
    )
    return {k: int(v or 0) for k, v in sums.items()}


def request_log_count(tenant_ids: list[uuid.UUID]) -> int:
    with connection.cursor() as cur:
        cur.execute("SELECT count(*) FROM request_log WHERE tenant_id = ANY(%s)", [tenant_ids])
        return int(cur.fetchone()[0])


def wait_for_requests(tenant_ids: list[uuid.UUID], expected: int, timeout: float = 30) -> None:
    def done() -> bool:
        got = usage_totals(tenant_id__in=tenant_ids)["requests"]
        assert got <= expected, f"{got} requests counted, expected {expected}"
        return got == expected

    wait_until(done, timeout, interval=0.1, what=f"{expected} requests in usage")


# -- a real Celery worker process with the consumer enabled --------------------------------


def database_url() -> str:
    s = connection.settings_dict
    user = s.get("USER") or "postgres"
    password = f":{s['PASSWORD']}" if s.get("PASSWORD") else ""
    host = s.get("HOST") or "127.0.0.1"
    port = s.get("PORT") or 5432
    return f"postgres://{user}{password}@{host}:{port}/{s['NAME']}"


@dataclass
class Worker:
    process: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        # The whole process group: the worker and its pool children.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(10)

    def terminate(self, timeout: float = 30) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return -9


def start_worker(
    tmp: Path, *, bootstrap: str, topic: str, group: str, redis_url: str, env: dict[str, str]
) -> Worker:
    """``celery -A fairway.celery worker --usage-consumer`` on the test database."""
    log_path = tmp / f"worker-{uuid.uuid4().hex[:6]}.log"
    child_env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    child_env.update(
        {
            "DJANGO_SETTINGS_MODULE": "fairway.settings.local",
            "DATABASE_URL": database_url(),
            "KAFKA_BOOTSTRAP": bootstrap,
            "REDIS_URL": redis_url,
            "FAIRWAY_INGEST_TOPIC": topic,
            "FAIRWAY_INGEST_GROUP": group,
            "FAIRWAY_INGEST_SESSION_TIMEOUT_MS": "6000",
            "PYTHONPATH": str(ROOT),
            "DEBUG": "0",
            **env,
        }
    )
    argv = [sys.executable, "-m", "celery", "-A", "fairway.celery", "worker", "--usage-consumer"]
    argv += ["--pool", "solo", "-l", "info", "-n", f"ingest-{uuid.uuid4().hex[:6]}@%h"]
    with open(log_path, "ab") as logfile:
        process = subprocess.Popen(
            argv,
            cwd=ROOT,
            env=child_env,
            stdout=logfile,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return Worker(process, log_path)
