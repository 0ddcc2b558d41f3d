"""Each Redis role (read model, limits, idempotency) in its own store: a gateway started with
a URL per role writes every key to the store of its role and none to another, and never
touches REDIS_URL's (here the Celery broker's) database."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from bench import prom_parse
from bench.cluster import redis_url_with_db
from contracts import schema
from emulator.testing import SpawnedEmulator
from gateway.admission import idempotency, quota
from tests.gateway.conftest import VERSION, ReadModelSeeder, start_gateway
from tests.support import flushed_redis, free_port, wait_until

# The databases of this module on the suite's Redis, one per role.
ROLE_DBS = {"readmodel": 12, "limits": 13, "idempotency": 14, "broker": 15}
# The key prefixes each role owns.
ROLE_PREFIXES = {
    "readmodel": (schema.PREFIX, schema.KEY_LAST_USED_HASH),
    "limits": (quota.PREFIX,),
    "idempotency": (idempotency.KEY_PREFIX,),
    "broker": (),
}


@pytest.fixture
def role_dbs(redis_url: str) -> Iterator[dict[str, tuple[str, redis.Redis]]]:
    """Each role's URL and a client of it, its database emptied before and after."""
    with (
        flushed_redis(redis_url_with_db(redis_url, ROLE_DBS["readmodel"])) as readmodel,
        flushed_redis(redis_url_with_db(redis_url, ROLE_DBS["limits"])) as limits,
        flushed_redis(redis_url_with_db(redis_url, ROLE_DBS["idempotency"])) as idem,
        flushed_redis(redis_url_with_db(redis_url, ROLE_DBS["broker"])) as broker,
    ):
        clients = {"readmodel": readmodel, "limits": limits, "idempotency": idem, "broker": broker}
        yield {
            role: (redis_url_with_db(redis_url, ROLE_DBS[role]), client)
            for role, client in clients.items()
        }


def keys_by_role(client: redis.Redis) -> dict[str, set[str]]:
    """The database's keys, grouped by the role whose prefix they carry ("unknown": none)."""
    out: dict[str, set[str]] = {}
    for raw in client.scan_iter(count=1000):
        key = raw.decode()
        role = next(
            (r for r, prefixes in ROLE_PREFIXES.items() if prefixes and key.startswith(prefixes)),
            "unknown",
        )
        out.setdefault(role, set()).add(key)
    return out


def test_each_role_writes_only_to_its_own_redis(
    tmp_path: Path,
    role_dbs: dict[str, tuple[str, redis.Redis]],
    replica: SpawnedEmulator,
) -> None:
    readmodel_url, readmodel = role_dbs["readmodel"]
    seeder = ReadModelSeeder(readmodel)
    seeder.set_replicas([("r1", replica.base_url)])
    tenant = seeder.tenant(rpm=1000)
    gw = start_gateway(
        tmp_path,
        role_dbs["broker"][0],  # REDIS_URL: nothing of the gateway's may land there
        None,
        extra_env={
            "READMODEL_REDIS_URL": readmodel_url,
            "LIMITS_REDIS_URL": role_dbs["limits"][0],
            "IDEMPOTENCY_REDIS_URL": role_dbs["idempotency"][0],
        },
    )
    try:
        body = {"model": VERSION, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
        auth = {"authorization": f"Bearer {tenant.secret}"}
        with httpx.Client(base_url=gw.base_url, headers=auth, timeout=30) as client:
            keyed = {"idempotency-key": "roles-1"}
            first = client.post("/v1/chat/completions", json=body, headers=keyed)
            assert first.status_code == 200, first.text
            replay = client.post("/v1/chat/completions", json=body, headers=keyed)
            assert replay.status_code == 200 and replay.json() == first.json()
            assert client.post("/v1/chat/completions", json=body).status_code == 200
            # The read model answers from its own store: a revocation there is seen.
            seeder.revoke(tenant)
            wait_until(
                lambda: client.get("/v1/models").status_code == 401,
                timeout=5,
                what="the revocation, announced on the read model's Redis",
            )
        # The last-used stamps are flushed every 0.2 s (start_gateway's setting).
        wait_until(
            lambda: readmodel.hexists(schema.KEY_LAST_USED_HASH, tenant.key_id),
            timeout=5,
            what="the key's last-used stamp in the read model's Redis",
        )
        found = {role: keys_by_role(client) for role, (_, client) in role_dbs.items()}
        assert found["broker"] == {}, found["broker"]
        for role in ("readmodel", "limits", "idempotency"):
            assert set(found[role]) == {role}, (role, found[role])
        assert any(k.endswith(":quota") for k in found["idempotency"]["idempotency"])

        metrics = httpx.get(gw.base_url + "/metrics", timeout=5).text
        for role in ("readmodel", "limits", "idempotency"):
            up = prom_parse.metric_sum(metrics, "fairway_gateway_redis_up", role=role)
            assert up == 1.0, role
    finally:
        gw.terminate(10)


def test_a_limits_store_outage_is_reported_by_role_and_does_not_fail_readiness(
    tmp_path: Path,
    role_dbs: dict[str, tuple[str, redis.Redis]],
    replica: SpawnedEmulator,
) -> None:
    """Limits on a Redis nobody answers: the gateway still turns ready (admission has its
    fallback), serves, and /readyz's details and its gauge name the store that is down."""
    readmodel_url, readmodel = role_dbs["readmodel"]
    seeder = ReadModelSeeder(readmodel)
    seeder.set_replicas([("r1", replica.base_url)])
    tenant = seeder.tenant()
    gw = start_gateway(
        tmp_path,
        readmodel_url,
        None,
        extra_env={"LIMITS_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0"},
    )
    try:
        ready = httpx.get(gw.base_url + "/readyz", timeout=5)
        assert ready.status_code == 200 and ready.json()["problems"] == []
        wait_until(
            lambda: (
                httpx.get(gw.base_url + "/readyz", timeout=5).json()["dependencies"]
                == {
                    "redis": True,
                    "redis_limits": False,
                    "usage_spool_writable": True,
                    "usage_broker": True,
                }
            ),
            timeout=5,
            what="the limits store reported down, apart from the read model's",
        )
        (degraded,) = httpx.get(gw.base_url + "/readyz", timeout=5).json()["degraded"]
        assert degraded.startswith("redis (limits): ")
        body = {"model": VERSION, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
        auth = {"authorization": f"Bearer {tenant.secret}"}
        reply = httpx.post(
            gw.base_url + "/v1/chat/completions", json=body, headers=auth, timeout=30
        )
        assert reply.status_code == 200, reply.text
        metrics = httpx.get(gw.base_url + "/metrics", timeout=5).text
        up = {
            role: prom_parse.metric_sum(metrics, "fairway_gateway_redis_up", role=role)
            for role in ("readmodel", "limits", "idempotency")
        }
        assert up == {"readmodel": 1.0, "limits": 0.0, "idempotency": 1.0}
        assert prom_parse.metric_sum(metrics, "fairway_admission_limits_store_up") == 0.0
    finally:
        gw.terminate(10)
