"""The gateway's Redis paths on a real 3-master Redis Cluster (loopback redis-server nodes).

The admission core of tests/admission/test_limits.py runs unchanged against the cluster
client; the read model is pushed by the control plane's writer and invalidated in a
gateway over cluster pub/sub; idempotency and the last-used flush work across nodes.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import cast

import httpx
import pytest
import redis
import redis.asyncio as aioredis

from contracts import schema
from emulator.testing import spawn_emulator
from fairway.embedded import EmbeddedServices
from gateway.admission.config import AdmissionConfig
from gateway.admission.idempotency import IdempotencyStore, Replay
from gateway.admission.long_context import LongContextClause
from gateway.admission.quota import (
    Limiter,
    long_context_tag,
    retry_key,
    slot_of,
    tenant_tag,
)
from gateway.admission.scriptchannel import ClusterScriptChannel
from gateway.config import GatewayConfig
from gateway.identity.readmodel import ReadModelCache
from gateway.metrics import GatewayMetrics
from gateway.redis_client import connect
from tests.admission import test_limits as core
from tests.admission import test_long_context_budget as lc
from tests.gateway.conftest import FAMILY, PROFILE, SPEED, VERSION, ReadModelSeeder
from tests.support import launch_gateway, wait_until, wait_until_async

CORE: list[Callable[[aioredis.Redis], Awaitable[None]]] = [
    core.test_requests_limit_refuses_the_next_request_and_says_when,
    core.test_tokens_charge_estimate_then_refund_unused_at_settle,
    core.test_tokens_admit_while_positive_then_refuse_until_repaid,
    core.test_rejected_request_is_refunded_entirely,
    core.test_kv_cap_is_strict_except_for_a_lone_oversized_request,
    core.test_unrenewed_leases_are_reclaimed_and_renewed_ones_are_not,
    core.test_retry_budget_in_redis_matches_the_pure_rule,
    core.test_every_key_is_namespaced_and_expires,
    # per-key limits: the key's buckets in the tenant-model's slot, one call
    core.test_a_keys_requests_limit_binds_it_alone_and_the_tenants_bounds_both,
    core.test_a_keys_tokens_are_charged_on_the_estimate_and_reconciled_at_settle,
    core.test_a_keys_concurrency_cap_is_exact_and_released_by_settle,
    core.test_a_keys_in_flight_slot_comes_back_when_its_lease_is_reclaimed,
    core.test_a_keys_limits_are_exact_under_concurrent_admissions,
    # the fleet's long-context budget: the ledger in its own slot, claimed after the tenant's
    # admit call, released and renewed in its own slot
    lc.test_a_lone_heavy_tenant_may_use_the_whole_budget,
    lc.test_a_second_tenant_gets_half_as_the_first_one_drains,
    lc.test_concurrent_long_prefills_are_bounded,
    lc.test_expired_prefills_free_their_slot,
    lc.test_a_prefill_holds_its_slot_until_its_first_token,
    lc.test_the_safety_expiry_frees_a_slot_whose_release_never_came,
    lc.test_settle_and_reclaim_return_the_budget,
    lc.test_renewal_keeps_the_long_lease,
    lc.test_a_short_request_reads_the_ledger_without_claiming,
]


@pytest.fixture(scope="module")
def cluster_urls() -> Iterator[list[str]]:
    svc = EmbeddedServices()
    try:
        yield svc.start_redis_cluster(masters=3)
    finally:
        svc.stop()


@pytest.fixture
def cluster_sync(cluster_urls: list[str]) -> Iterator[redis.RedisCluster]:
    client = redis.RedisCluster.from_url(cluster_urls[0], socket_timeout=5)
    client.flushall(target_nodes=redis.RedisCluster.PRIMARIES)
    yield client
    client.flushall(target_nodes=redis.RedisCluster.PRIMARIES)
    client.close()


@pytest.fixture
async def acluster(
    cluster_urls: list[str], cluster_sync: redis.RedisCluster
) -> AsyncIterator[aioredis.Redis]:
    # Seeded with the second node: any node finds the rest.
    client = connect(cluster_urls[1], timeout_s=5, cluster=True)
    yield client
    await client.aclose()


@pytest.mark.parametrize("case", CORE, ids=lambda c: c.__name__.removeprefix("test_"))
async def test_admission_core_on_a_three_master_cluster(
    case: Callable[[aioredis.Redis], Awaitable[None]], acluster: aioredis.Redis
) -> None:
    await case(acluster)


async def test_the_long_context_budget_is_enforced_across_masters(
    acluster: aioredis.Redis, cluster_sync: redis.RedisCluster
) -> None:
    """Tenants on every master draw on one ledger on yet another slot: the budget binds
    across them, a refused claim gives the tenant's request and tokens back, and settling
    frees the budget for the next tenant."""
    lim = Limiter(acluster, AdmissionConfig())
    ledger = f"{long_context_tag('fam-v1')}:l"
    tenants = [f"t{i}" for i in range(12)]
    nodes = {cluster_sync.get_node_from_key(f"{tenant_tag(t, 'fam')}:l").name for t in tenants}
    assert len(nodes) == 3 and all(
        slot_of(tenant_tag(t, "fam")) != slot_of(ledger) for t in tenants
    )
    grants = []
    for t in tenants[:10]:  # 10 GiB each: the 100 GiB budget
        d = await lim.admit(replace(lc.q(t), request_id=f"r-{t}"))
        assert d.admitted and d.grant is not None and d.grant.long_tag is not None
        grants.append(d.grant)
    assert int(cluster_sync.hget(ledger, "#")) == lc.BUDGET  # type: ignore[arg-type]
    late = tenants[10]
    refused = await lim.admit(replace(lc.q(late), request_id="r-late", rpm=2, tpm=1000))
    assert not refused.admitted and refused.long_context_full and refused.grant is None
    assert refused.long_context_clause == LongContextClause.KV_FULL  # the ledger's script's
    assert refused.long_inflight_bytes == lc.BUDGET and refused.frees_in_ms >= 1000
    # nothing of the refused request stays charged to its tenant: no lease, full buckets
    tag = tenant_tag(late, "fam")
    assert cluster_sync.hget(f"{tag}:l", "#") in (None, b"0")
    again = await lim.admit(replace(lc.q(late, gib=0), request_id="r-late2", rpm=2, tpm=1000))
    assert again.state.remaining_requests == 1 and again.state.remaining_tokens == 900
    assert await lim.renew(grants) == (20, 0)  # tenant and ledger leases, each in its slot
    for g in grants[:3]:
        assert await lim.settle(g, actual_tokens=0, refund_request=False)
    assert int(cluster_sync.hget(ledger, "#")) == lc.BUDGET - 30 * lc.GIB  # type: ignore[arg-type]
    d = await lim.admit(replace(lc.q(tenants[11], gib=30), request_id="r-t11"))
    assert d.admitted and d.long_inflight_bytes == lc.BUDGET
    await lim.aclose()


def test_the_key_layout_spreads_tenants_and_keeps_each_tenant_model_in_one_slot() -> None:
    tag = tenant_tag("t1", "fam")
    assert {slot_of(f"{tag}:{k}") for k in "ble"} == {slot_of(tag)}
    slots = {slot_of(tenant_tag(f"tenant-{i}", "llama-70b")) for i in range(200)}
    assert len(slots) > 150  # tenants spread over the slots (and so over the masters)
    assert slot_of(retry_key("v1")) == slot_of("{v1}")


async def test_renewal_of_many_tenants_spans_every_master_in_one_call(
    acluster: aioredis.Redis, cluster_sync: redis.RedisCluster
) -> None:
    lim = Limiter(acluster, AdmissionConfig())
    grants = []
    for i in range(60):
        d = await lim.admit(core.q(request_id=f"r{i}", tenant_id=f"t{i}", kv_cap_milli=5000))
        assert d.admitted and d.grant is not None and not d.degraded
        grants.append(d.grant)
    owners = {
        cluster_sync.get_node_from_key(f"{tenant_tag(g.tenant_id, 'fam')}:l").name for g in grants
    }
    assert len(owners) == 3  # the leases really live on all three masters
    assert await lim.renew(grants) == (60, 0)
    for g in grants[:30]:
        assert await lim.settle(g, actual_tokens=1, refund_request=False)
    assert await lim.renew(grants) == (30, 0)  # settled ones are gone, the rest renewed
    await lim.aclose()


async def test_a_moved_slot_is_followed(
    acluster: aioredis.Redis, cluster_urls: list[str], cluster_sync: redis.RedisCluster
) -> None:
    """The channel's slot map goes stale when a slot moves to another master: the MOVED
    reply refreshes it and the call lands on the new owner."""
    lim = Limiter(acluster, AdmissionConfig())
    first = await lim.admit(core.q(tenant_id="mover", rpm=5))
    assert first.admitted and not first.degraded
    tag = tenant_tag("mover", "fam")
    slot = slot_of(tag)
    src = cluster_sync.get_node_from_key(tag)
    dst = next(n for n in cluster_sync.get_primaries() if n.name != src.name)
    src_r, dst_r = (redis.Redis(host=n.host, port=n.port) for n in (src, dst))
    src_id, dst_id = (r.execute_command("CLUSTER MYID").decode() for r in (src_r, dst_r))
    # Move the slot and its keys by hand (what redis-cli --cluster reshard does).
    dst_r.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", src_id)
    src_r.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", dst_id)
    keys = src_r.execute_command("CLUSTER GETKEYSINSLOT", slot, 100)
    assert keys
    src_r.execute_command("MIGRATE", dst.host, dst.port, "", 0, 5000, "KEYS", *keys)
    for r in (dst_r, src_r):
        r.execute_command("CLUSTER SETSLOT", slot, "NODE", dst_id)
    second = await lim.admit(core.q(tenant_id="mover", rpm=5))
    assert second.admitted and not second.degraded
    assert second.state.remaining_requests == 3  # the moved bucket, not a fresh one
    for r in (src_r, dst_r):
        r.close()
    await lim.aclose()


async def test_idempotency_store_on_the_cluster(acluster: aioredis.Redis) -> None:
    store = IdempotencyStore(acluster, ttl_s=60, inflight_ttl_s=10)
    claims = [await store.begin(f"t{i}", "k", b'{"a": 1}') for i in range(10)]
    for claim in claims:
        assert not isinstance(claim, Replay)
        await store.complete(claim, b"j", b'{"ok": true}')
    replay = await store.begin("t3", "k", b'{"a":1}')
    assert isinstance(replay, Replay) and replay.body == b'{"ok": true}'


async def test_control_plane_push_reaches_a_gateway_over_cluster_pubsub(
    cluster_urls: list[str], cluster_sync: redis.RedisCluster, acluster: aioredis.Redis
) -> None:
    from tenants.readmodel import Desired, ReadModelPublisher

    writer = ReadModelPublisher.from_url(cluster_urls[2], cluster=True)
    assert writer.cluster
    gateway = ReadModelCache(
        acluster, GatewayConfig(redis_url=cluster_urls[1], redis_cluster=True), GatewayMetrics()
    )
    await gateway.start()
    try:
        await wait_until_async(lambda: gateway.subscribed, 5, 0.01, "the gateway subscribed")
        records = {
            f"h{i}": schema.KeyRecord(key_id=f"k{i}", tenant_id=f"t{i}", scopes=("chat",))
            for i in range(20)
        }
        wanted = {schema.key_redis_key(h): Desired(schema.dumps(r)) for h, r in records.items()}
        # Loaded, as a full rebuild leaves it (the pushes below are partial ones).
        cluster_sync.set(schema.LOADED_KEY, "1")
        result = await asyncio.to_thread(writer._push, lambda: wanted)
        assert len(result.changed) == 20 and result.version == 1
        nodes = {cluster_sync.get_node_from_key(k).name for k in wanted}
        assert len(nodes) == 3  # the records really are spread over the masters
        assert await gateway.key("h7") == records["h7"]
        # Revoke: the writer deletes and announces; the gateway drops its cached copy.
        gone = {schema.key_redis_key("h7"): Desired(None)}
        result = await asyncio.to_thread(writer._push, lambda: gone)
        assert result.version == 2

        async def revoked() -> bool:
            return await gateway.key("h7") is None

        await wait_until_async(revoked, 1.0, 0.005, "the revocation (within 1 s)")
        snapshot = await asyncio.to_thread(writer.snapshot)
        assert len(snapshot) == 19 and writer.version() == 2
    finally:
        await gateway.stop()
        writer.redis.close()


def test_last_used_flush_renames_within_one_slot(cluster_sync: redis.RedisCluster) -> None:
    from tenants.tasks import FLUSHING_KEY

    assert cluster_sync.keyslot(FLUSHING_KEY) == cluster_sync.keyslot(schema.KEY_LAST_USED_HASH)
    cluster_sync.hset(schema.KEY_LAST_USED_HASH, mapping={"k1": "1700000000"})
    cluster_sync.rename(schema.KEY_LAST_USED_HASH, FLUSHING_KEY)
    assert cluster_sync.hgetall(FLUSHING_KEY) == {b"k1": b"1700000000"}


async def test_cluster_channel_refuses_a_cross_slot_call(cluster_urls: list[str]) -> None:
    from gateway.admission.quota import RENEW_LUA
    from gateway.admission.scriptchannel import LuaScript

    host, port = cluster_urls[0].removeprefix("redis://").split("/")[0].split(":")
    channel = ClusterScriptChannel([(host, int(port))], timeout_s=2)
    a, b = tenant_tag("a", "f"), tenant_tag("b", "f")
    assert slot_of(a) != slot_of(b)
    with pytest.raises(redis.ResponseError, match="CROSSSLOT"):
        await channel.evalsha(LuaScript.of(RENEW_LUA), [f"{a}:e", f"{b}:l"], [1000])
    await channel.aclose()


def test_a_gateway_process_serves_chat_on_the_cluster(
    cluster_urls: list[str], cluster_sync: redis.RedisCluster, tmp_path: Path
) -> None:
    """End to end: `python -m gateway` with REDIS_CLUSTER=1 and an emulated replica; the
    read model, admission (429 at the limit), idempotency and revocation all go through
    the cluster."""
    seeder = ReadModelSeeder(cast(redis.Redis, cluster_sync))
    with spawn_emulator(PROFILE, VERSION, SPEED) as emu:
        seeder.set_replicas([("r1", emu.base_url)])
        tenant = seeder.tenant(rpm=3)
        gw = launch_gateway(tmp_path, cluster_urls[2], env={"REDIS_CLUSTER": "1"})
        try:
            url = f"http://127.0.0.1:{gw.port}/v1/chat/completions"
            auth = {"authorization": f"Bearer {tenant.secret}"}
            body = {
                "model": FAMILY,
                "messages": [{"role": "user", "content": "hello"}],
                "max_tokens": 4,
            }
            first = httpx.post(
                url, json=body, headers={**auth, "idempotency-key": "c-1"}, timeout=30
            )
            assert first.status_code == 200, first.text
            replay = httpx.post(
                url, json=body, headers={**auth, "idempotency-key": "c-1"}, timeout=30
            )
            assert replay.status_code == 200 and replay.json() == first.json()
            statuses = [
                httpx.post(url, json=body, headers=auth, timeout=30).status_code for _ in range(3)
            ]
            # rpm 3: the first request, its replay (one request of requests/min, no tokens)
            # and one more pass, then 429.
            assert statuses == [200, 429, 429], statuses
            tag = tenant_tag(tenant.tenant_id, FAMILY)
            assert cluster_sync.exists(f"{tag}:b") and cluster_sync.get_node_from_key(f"{tag}:b")
            seeder.revoke(tenant)

            def refused() -> bool:
                return httpx.post(url, json=body, headers=auth, timeout=30).status_code == 401

            wait_until(refused, 1.0, interval=0.02, what="revocation over cluster pub/sub")
        finally:
            assert gw.process.poll() is None, gw.log_path.read_text()
            gw.process.terminate()
            gw.process.wait(timeout=60)


async def test_a_lost_master_degrades_only_the_tenants_it_holds() -> None:
    """A master dies (no replica to fail over to; the cluster runs with
    cluster-require-full-coverage no, as docs/operations.md advises): its tenants are
    admitted by the local fallback (rates open, KV closed), every other tenant stays on
    the shared ledger, and renewal keeps the reachable masters' leases."""
    svc = EmbeddedServices()
    try:
        urls = svc.start_redis_cluster(masters=3, full_coverage=False)
        nodes = svc.processes[-3:]
        client = connect(urls[0], timeout_s=1, cluster=True)
        lim = Limiter(client, AdmissionConfig(), probe_interval_s=0.2)
        grants = {}
        for i in range(30):
            d = await lim.admit(core.q(request_id=f"r{i}", tenant_id=f"t{i}", kv_cap_milli=5000))
            assert d.grant is not None and not d.degraded
            grants[f"t{i}"] = d.grant
        channel = lim._channel
        assert isinstance(channel, ClusterScriptChannel)
        victim_port = int(urls[1].rsplit(":", 1)[1].split("/")[0])
        owner = {t: channel.owner_of(tenant_tag(t, "fam")) for t in grants}
        lost = [t for t, o in owner.items() if o and o[1] == victim_port]
        kept = [t for t in grants if t not in lost]
        assert lost and kept
        nodes[1].kill()
        nodes[1].wait(timeout=10)
        for tenant in lost:
            d = await lim.admit(
                core.q(request_id=f"x-{tenant}", tenant_id=tenant, kv_cap_milli=5000)
            )
            assert d.degraded  # decided in-process
        assert not lim.redis_up
        for tenant in kept:
            d = await lim.admit(
                core.q(request_id=f"y-{tenant}", tenant_id=tenant, kv_cap_milli=5000)
            )
            assert not d.degraded and d.inflight_kv_milli == 1000  # the shared ledger
        renewed, lost_leases = await lim.renew(list(grants.values()))
        assert (renewed, lost_leases) == (len(kept), 0)
        await lim.aclose()
        await client.aclose()
    finally:
        svc.stop()
