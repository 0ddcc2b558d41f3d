"""Usage events survive a broker outage and a gateway restart (the durable spool)."""

from __future__ import annotations

import errno
import gc
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from emulator.testing import SpawnedEmulator
from gateway.config import GatewayConfig
from gateway.metrics import GatewayMetrics
from gateway.serving.server import Gateway
from gateway.usage.events import MARK_PREFIX, UsageEvent
from gateway.usage.producer import UsageProducer
from gateway.usage.spool import Spool, encode_position
from tests.gateway.conftest import (
    GatewayProcess,
    ReadModelSeeder,
    Tenant,
    UsageLog,
)
from tests.gateway.tcpproxy import TcpProxy
from tests.support import proxied_kafka, wait_until, wait_until_async

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
    assert Spool.adopt(spool.lock_path) is None  # the owner is alive: its lock is held
    os.write(os.open(spool.path, os.O_WRONLY | os.O_APPEND), b'{"request_id":"torn')
    spool.close()  # the owner dies without removing its files
    adopted = Spool.adopt(spool.lock_path)
    assert adopted is not None and adopted.depth == 2
    assert [r for _, r in adopted.pending(10)] == [_event(1).to_json(), _event(2).to_json()]
    # The torn line is kept aside, not silently dropped.
    (torn,) = _quarantined(adopted)
    assert torn["reason"] == "torn_tail" and torn["line"] == '{"request_id":"torn'
    segment = adopted.path
    adopted.remove()
    assert not segment.exists() and not spool.lock_path.exists()
    assert not (tmp_path / "usage-a.pos").exists()


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
    leftover = Spool.adopt(tmp_path / "usage-one.lock")
    assert leftover is not None and leftover.depth == 5
    leftover.close()


# -- faults in our own file code, with a sink double ----------------------------------------
#
# The faults below are in the spool's file handling, so a sink that records what it was
# given stands in for Kafka here (the broker tests further down run the real KafkaSink).


def _quarantined(spool: Spool) -> list[dict[str, Any]]:
    path = spool.quarantine_path
    return [orjson.loads(line) for line in path.read_bytes().splitlines()] if path.exists() else []


class FakeSink:
    """Acknowledges records in order until ``refuse`` says no (a broker that refuses)."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []
        self.refuse: Callable[[dict[str, Any]], bool] = lambda event: False
        self.batches = 0

    def send_batch(self, records: Sequence[tuple[bytes, bytes]]) -> int:
        self.batches += 1
        acked = 0
        for key, value in records:
            event = orjson.loads(value)
            assert key == event["tenant_id"].encode()
            if self.refuse(event):
                break
            self.sent.append(event)
            acked += 1
        return acked

    def close(self) -> None:
        pass

    def ids(self, tenant: str | None = None) -> list[str]:
        return [e["request_id"] for e in list(self.sent) if tenant in (None, e["tenant_id"])]


class DiskFaults:
    """``os.write`` / ``os.fsync`` / ``os.ftruncate`` with injected faults, on spool segment
    files only (everything else in the process writes as usual).

    ``room``: bytes the disk still takes (None: unlimited); a write past it is short, the
    next one fails with ENOSPC, as on a disk that fills up. ``short``: at most this many
    bytes per write, without an error. ``fsync_errors`` / ``truncate_errors``: that many of
    the next calls fail with EIO.
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.room: int | None = None
        self.short: int | None = None
        self.fsync_errors = 0
        self.truncate_errors = 0
        self.enospc = 0
        self.failed_truncates = 0
        self._write, self._fsync, self._ftruncate = os.write, os.fsync, os.ftruncate
        monkeypatch.setattr(os, "write", self.write)
        monkeypatch.setattr(os, "fsync", self.fsync)
        monkeypatch.setattr(os, "ftruncate", self.ftruncate)

    @staticmethod
    def _segment(fd: int) -> bool:
        try:
            return os.readlink(f"/proc/self/fd/{fd}").endswith(".spool")
        except OSError:
            return False

    def write(self, fd: int, data: bytes | memoryview) -> int:
        if not self._segment(fd):
            return self._write(fd, data)
        view = memoryview(data)
        if self.short is not None:
            view = view[: self.short]
        if self.room is not None:
            if self.room == 0:
                self.enospc += 1
                raise OSError(errno.ENOSPC, "No space left on device (injected)")
            view = view[: self.room]
            self.room -= len(view)
        return self._write(fd, view)

    def fsync(self, fd: int) -> None:
        if self.fsync_errors and self._segment(fd):
            self.fsync_errors -= 1
            raise OSError(errno.EIO, "Input/output error (injected)")
        self._fsync(fd)

    def ftruncate(self, fd: int, length: int) -> None:
        if self.truncate_errors and self._segment(fd):
            self.truncate_errors -= 1
            self.failed_truncates += 1
            raise OSError(errno.EIO, "Input/output error (injected)")
        self._ftruncate(fd, length)


def _producer(directory: Path, sink: FakeSink | None, instance: str, **kw: Any) -> UsageProducer:
    producer = UsageProducer(
        spool_dir=directory,
        bootstrap=None,
        topic="usage.v1",
        metrics=GatewayMetrics(),
        instance_id=instance,
        sink=sink,
        **kw,
    )
    producer.start()
    return producer


def _sample(producer: UsageProducer, name: str, **labels: str) -> float | None:
    return producer._metrics.registry.get_sample_value(name, labels)


def _segment_lines(directory: Path, name: str) -> list[bytes]:
    return [
        line
        for path in sorted(directory.glob(f"{name}-*.spool"))
        for line in path.read_bytes().split(b"\n")[:-1]
    ]


def reaches(count: Callable[[], int], n: int) -> Callable[[], bool]:
    return lambda: count() == n


def _ids(start: int, stop: int) -> list[str]:
    return [f"r{i}" for i in range(start, stop)]


def test_short_writes_are_written_in_full(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    faults = DiskFaults(monkeypatch)
    faults.short = 7
    sink = FakeSink()
    producer = _producer(tmp_path, sink, "short")
    try:
        for i in range(30):
            producer.emit(_event(i))
        wait_until(lambda: len(sink.sent) >= 30, 10, what="30 events delivered")
        assert sink.ids() == _ids(0, 30)
        # Every line in the spool is whole: the loop finished each short write.
        assert [
            orjson.loads(line)["request_id"] for line in _segment_lines(tmp_path, "usage-short")
        ] == _ids(0, 30)
    finally:
        producer.stop(2.0)
        producer.close()
    assert not list(tmp_path.glob("usage-short*"))  # all delivered: nothing left behind


def test_a_full_disk_keeps_the_events_fails_readiness_and_recovers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    faults = DiskFaults(monkeypatch)
    faults.room = 25  # the first write is cut short after 25 bytes, then ENOSPC
    faults.truncate_errors = 1  # and cutting the half line back fails once, too
    sink = FakeSink()
    producer = _producer(tmp_path, sink, "full", unhealthy_after_s=0.3)
    segment = tmp_path / "usage-full-0000000001.spool"
    try:
        assert producer.spool_problem() is None
        for i in range(10):
            producer.emit(_event(i))
        problem = wait_until(producer.spool_problem, 10, what="the spool reported unwritable")
        assert "cannot write" in problem and "No space left" in problem
        wait_until(lambda: _sample(producer, "fairway_gateway_usage_spool_writable") == 0, 5)
        for i in range(10, 20):  # the request path carries on meanwhile
            producer.emit(_event(i))
        wait_until(lambda: faults.enospc >= 3, 10, what="retries against the full disk")
        assert faults.failed_truncates == 1
        # The half line was cut back once the disk allowed it: nothing torn stays behind.
        assert segment.read_bytes() == b""
        assert sink.sent == []
        wait_until(
            lambda: _sample(producer, "fairway_gateway_usage_spool_unwritten_events") == 20, 5
        )

        faults.room = None  # room again: recovery needs nobody
        wait_until(lambda: len(sink.sent) >= 20, 10, what="held events delivered")
        assert sink.ids() == _ids(0, 20)  # all of them, in order, once
        wait_until(lambda: _sample(producer, "fairway_gateway_usage_spool_writable") == 1, 5)
        assert producer.spool_problem() is None
        lines = _segment_lines(tmp_path, "usage-full")
        assert [orjson.loads(line)["request_id"] for line in lines] == _ids(0, 20)
    finally:
        producer.stop(2.0)
        producer.close()


def test_too_many_unwritten_events_fail_readiness_before_the_time_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    faults = DiskFaults(monkeypatch)
    faults.room = 0
    producer = _producer(tmp_path, FakeSink(), "count", unhealthy_after_s=3600, unhealthy_events=5)
    try:
        for i in range(5):
            producer.emit(_event(i))
        wait_until(lambda: faults.enospc >= 1, 5, what="a failed write")
        assert producer.spool_problem() is None  # 5 held: at the bound, not past it
        producer.emit(_event(5))
        assert producer.spool_problem() is not None
    finally:
        faults.room = None
        producer.stop(2.0)
        producer.close()


def test_a_failed_fsync_rewrites_the_batch_without_duplicating_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    faults = DiskFaults(monkeypatch)
    faults.fsync_errors = 2
    sink = FakeSink()
    producer = _producer(tmp_path, sink, "eio")
    try:
        for i in range(5):
            producer.emit(_event(i))
        wait_until(lambda: len(sink.sent) >= 5, 10, what="5 events delivered")
        assert faults.fsync_errors == 0
        assert sink.ids() == _ids(0, 5)
        lines = _segment_lines(tmp_path, "usage-eio")
        assert [orjson.loads(line)["request_id"] for line in lines] == _ids(0, 5)
    finally:
        producer.stop(2.0)
        producer.close()


def test_events_the_disk_still_refuses_at_stop_are_logged_in_full(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    faults = DiskFaults(monkeypatch)
    faults.room = 0
    producer = _producer(tmp_path, FakeSink(), "stop")
    for i in range(2):
        producer.emit(_event(i))
    wait_until(lambda: faults.enospc >= 1, 5, what="a failed write")
    with caplog.at_level("ERROR", logger="gateway.usage"):
        producer.stop(0.3)
    producer.close()
    logged = [r.getMessage() for r in caplog.records if "NOT spooled" in r.getMessage()]
    assert [orjson.loads(m.split(": ", 1)[1])["request_id"] for m in logged] == ["r0", "r1"]


def _dead_spool(directory: Path, name: str, lines: list[bytes]) -> Spool:
    """A spool whose producer died: its files stay, its lock is free."""
    spool = Spool.create(directory, name)
    spool.append(lines)
    spool.close()
    return spool


def test_corrupt_lines_are_quarantined_and_delivery_goes_on(tmp_path: Path) -> None:
    garbage = [
        b"not json at all",
        b"[1, 2]",
        b'{"tenant_id": ""}',
        b'{"request_id": "x"}',
        b"\0" * (3 << 20),  # a run of zeros longer than one read
    ]
    dead = _dead_spool(
        tmp_path,
        "usage-dead",
        [_event(0).to_json(), garbage[0], _event(1).to_json(), *garbage[1:], _event(2).to_json()],
    )
    sink = FakeSink()
    producer = _producer(tmp_path, sink, "live")
    try:
        producer.emit(_event(3))
        wait_until(lambda: not dead.lock_path.exists(), 10, what="the dead spool drained")
        wait_until(lambda: len(sink.sent) >= 4, 10, what="the live event delivered")
        assert sink.ids() == _ids(0, 4)
        entries = _quarantined(dead)
        assert [(e["line"].encode(), e["reason"]) for e in entries] == [
            (garbage[0], "not_json"),
            (garbage[1], "not_an_object"),
            (garbage[2], "no_tenant_id"),
            (garbage[3], "no_tenant_id"),
            (garbage[4], "not_json"),
        ]
        assert all(e["segment"] == "usage-dead-0000000001.spool" for e in entries)
        assert _sample(producer, "fairway_gateway_usage_events_total", step="quarantined") == 5
        wait_until(
            lambda: _sample(producer, "fairway_gateway_usage_events_total", step="delivered") == 4,
            5,
        )
    finally:
        producer.stop(2.0)
        producer.close()


def test_an_orphan_that_cannot_be_delivered_does_not_block_the_live_spool(
    tmp_path: Path,
) -> None:
    dead = _dead_spool(tmp_path, "usage-dead", [_event(i, "t-stuck").to_json() for i in range(3)])
    sink = FakeSink()
    sink.refuse = lambda event: event["tenant_id"] == "t-stuck"
    producer = _producer(tmp_path, sink, "live")
    try:
        for i in range(10, 20):
            producer.emit(_event(i, "t-live"))
        wait_until(lambda: len(sink.sent) >= 10, 10, what="live events past the stuck orphan")
        assert sink.ids() == _ids(10, 20)
        assert dead.lock_path.exists()
        sink.refuse = lambda event: False  # the orphan becomes deliverable (its own backoff)
        wait_until(lambda: not dead.lock_path.exists(), 10, what="the orphan drained")
        assert sink.ids("t-stuck") == _ids(0, 3)
        assert sink.ids("t-live") == _ids(10, 20)
    finally:
        producer.stop(2.0)
        producer.close()


def _half_delivered(directory: Path) -> tuple[Spool, list[int]]:
    """A dead producer's spool of r0..r5 whose first three were acknowledged; with the
    offsets just past each line."""
    spool = Spool.create(directory, "usage-dead")
    spool.append([_event(i).to_json() for i in range(6)])
    ends = [end for end, _ in spool.pending(10)]
    spool.commit(ends[2], 3)
    spool.close()
    return spool, ends


def _write_position(spool: Spool, raw: bytes) -> None:
    spool.pos_path.write_bytes(raw)


def _rolled_back(spool: Spool, ends: list[int]) -> list[str]:
    _write_position(spool, encode_position(1, ends[0]))  # the later writes never hit disk
    return _ids(1, 6)


def _mid_line(spool: Spool, ends: list[int]) -> list[str]:
    _write_position(spool, encode_position(1, ends[1] + 10))  # inside r2's line
    return _ids(2, 6)


def _beyond_the_file(spool: Spool, ends: list[int]) -> list[str]:
    _write_position(spool, encode_position(1, ends[-1] + 1000))
    return _ids(0, 6)


def _garbled(spool: Spool, ends: list[int]) -> list[str]:
    raw = bytearray(encode_position(1, ends[2]))
    raw[5] ^= 1  # a torn in-place rewrite: the checksum no longer matches
    _write_position(spool, bytes(raw))
    return _ids(0, 6)


def _missing(spool: Spool, ends: list[int]) -> list[str]:
    spool.pos_path.unlink()
    return _ids(0, 6)


def _torn_tail(spool: Spool, ends: list[int]) -> list[str]:
    with spool.segment_path(1).open("ab") as f:
        f.write(_event(6).to_json()[:40])  # the append the power cut tore
    return _ids(3, 6)


@pytest.mark.parametrize(
    "damage", [_rolled_back, _mid_line, _beyond_the_file, _garbled, _missing, _torn_tail]
)
def test_after_a_power_loss_the_spool_resends_and_never_skips(
    tmp_path: Path, damage: Callable[[Spool, list[int]], list[str]]
) -> None:
    spool, ends = _half_delivered(tmp_path)
    expected = damage(spool, ends)
    sink = FakeSink()
    producer = _producer(tmp_path, sink, "live")
    try:
        wait_until(lambda: not spool.lock_path.exists(), 10, what="the dead spool drained")
        assert sink.ids() == expected
        assert not list(tmp_path.glob("usage-dead-*.spool"))
    finally:
        producer.stop(2.0)
        producer.close()
    if damage is _torn_tail:
        (torn,) = _quarantined(spool)
        assert torn["reason"] == "torn_tail"


def test_an_acknowledged_segment_left_by_a_crash_is_deleted_not_resent(tmp_path: Path) -> None:
    spool = Spool.create(tmp_path, "usage-dead")
    spool.append([_event(i).to_json() for i in range(3)])
    spool.rotate(1)  # r3.. go to segment 2
    spool.append([_event(i).to_json() for i in range(3, 6)])
    pending = spool.pending(10)
    spool.commit(pending[-1][0], 3)
    first = spool.segments[0].path
    content = first.read_bytes()
    assert [r for _, r in spool.pending(10)] == [_event(i).to_json() for i in range(3, 6)]
    assert not first.exists()  # the position moved to segment 2, then segment 1 went
    first.write_bytes(content)  # ...except the removal never reached the disk
    spool.close()
    sink = FakeSink()
    producer = _producer(tmp_path, sink, "live")
    try:
        wait_until(lambda: not spool.lock_path.exists(), 10, what="the dead spool drained")
        assert sink.ids() == _ids(3, 6)
        assert not first.exists()
    finally:
        producer.stop(2.0)
        producer.close()


def test_segments_rotate_are_adopted_in_order_and_deleted_once_acknowledged(
    tmp_path: Path,
) -> None:
    down = FakeSink()
    down.refuse = lambda event: True  # the broker is away
    first = _producer(tmp_path, down, "first", segment_bytes=1500)
    spool = first._spool
    assert spool is not None
    for i in range(25):
        first.emit(_event(i))
        if i % 5 == 4:  # a few group commits, so that the writer rotates between them
            wait_until(reaches(lambda: spool.depth, i + 1), 5, what="a group commit")
    first.stop(0.5)
    first.close()
    segments = sorted(tmp_path.glob("usage-first-*.spool"))
    assert len(segments) >= 3
    assert [orjson.loads(x)["request_id"] for x in _segment_lines(tmp_path, "usage-first")] == (
        _ids(0, 25)
    )

    sink = FakeSink()
    second = _producer(tmp_path, sink, "second", segment_bytes=1500)
    try:
        wait_until(lambda: not (tmp_path / "usage-first.lock").exists(), 10, what="adopted")
        assert sink.ids() == _ids(0, 25)  # across segments, in order
        assert not list(tmp_path.glob("usage-first*"))
        for i in range(25, 50):
            second.emit(_event(i))
            if i % 5 == 4:
                wait_until(reaches(lambda: len(sink.sent), i + 1), 5, what="delivered")
        assert sink.ids() == _ids(0, 50)

        # Acknowledged segments are deleted as the sender passes them (just after the sink
        # saw their last event); the tail remains.
        def only_the_tail() -> list[Path]:
            found = list(tmp_path.glob("usage-second-*.spool"))
            return found if len(found) == 1 else []

        (tail,) = wait_until(only_the_tail, 5, what="the acknowledged segments deleted")
        assert tail.name != "usage-second-0000000001.spool"
    finally:
        second.stop(2.0)
        second.close()
    assert not list(tmp_path.glob("usage-second*"))


def test_a_spool_of_the_one_file_layout_is_adopted_from_its_offset(tmp_path: Path) -> None:
    """An older gateway version left ``usage-<instance>.spool`` and its ``.offset``."""
    lines = [_event(i).to_json() + b"\n" for i in range(4)]
    (tmp_path / "usage-old.spool").write_bytes(b"".join(lines))
    (tmp_path / "usage-old.offset").write_bytes(b"%020d" % len(lines[0]))
    sink = FakeSink()
    producer = _producer(tmp_path, sink, "live")
    try:
        wait_until(lambda: len(sink.sent) >= 3, 10, what="the old spool delivered")
        wait_until(lambda: not (tmp_path / "usage-old.lock").exists(), 10, what="removed")
        assert sink.ids() == _ids(1, 4)
        assert not list(tmp_path.glob("usage-old*"))
    finally:
        producer.stop(2.0)
        producer.close()


async def test_a_spool_that_cannot_write_is_degraded_not_unready_and_recovers(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    redis_url: str,
    seeder: ReadModelSeeder,
    replica: SpawnedEmulator,
) -> None:
    """Through the app's own /readyz, /healthz and /metrics, in process (the disk fault is
    injected into this process's os calls)."""
    seeder.set_replicas([("r1", replica.base_url)])
    config = GatewayConfig(
        redis_url=redis_url,
        spool_dir=tmp_path,
        spool_unhealthy_s=0.2,
        spool_max_unwritten_events=3,
        instance_id="ready",
    )
    gw = Gateway(config)
    app = gw.app()
    await gw.startup()
    faults = DiskFaults(monkeypatch)
    try:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:

            async def until(path: str, ok: Callable[[httpx.Response], bool]) -> httpx.Response:
                async def answered() -> httpx.Response | None:
                    response = await client.get(path)
                    return response if ok(response) else None

                return await wait_until_async(answered, 10, 0.05, f"{path} as expected")

            def writable(value: float) -> Callable[[httpx.Response], bool]:
                line = f"fairway_gateway_usage_spool_writable {value}"
                return lambda response: line in response.text.splitlines()

            def spool_ok(ok: bool) -> Callable[[httpx.Response], bool]:
                return lambda r: r.json()["dependencies"]["usage_spool_writable"] is ok

            assert (await client.get("/readyz")).status_code == 200
            faults.room = 0  # the disk is full
            gw.usage.emit(_event(0))
            response = await until("/readyz", spool_ok(False))
            # Degraded, still ready: the process serves on and holds the events in memory
            # (gateways sharing this disk must not all leave the balancer at once).
            assert response.status_code == 200 and response.json()["problems"] == []
            (problem,) = response.json()["degraded"]
            assert problem.startswith("usage spool cannot write: 1 events unwritten")
            await until("/metrics", writable(0.0))
            assert (await client.get("/healthz")).status_code == 200
            # Past the memory bound on unwritten events, the process leaves the balancer.
            for i in range(1, 4):
                gw.usage.emit(_event(i))
            response = await until("/readyz", lambda r: r.status_code == 503)
            (problem,) = response.json()["problems"]
            assert problem == "usage spool backlog past its memory bound: 4 events unwritten"

            faults.room = None
            response = await until("/readyz", spool_ok(True))
            assert response.status_code == 200 and response.json()["degraded"] == []
            assert response.json()["problems"] == []
            await until("/metrics", writable(1.0))
            lines = _segment_lines(tmp_path, "usage-ready")
            assert [orjson.loads(line)["request_id"] for line in lines] == [
                f"r{i}" for i in range(4)
            ]
    finally:
        faults.room = None
        await gw.shutdown()
        gc.unfreeze()  # startup froze the collector's view of this (test) process


# -- through gateway processes, with a broker that can vanish ------------------------------


@pytest.fixture(scope="module")
def broker() -> Iterator[tuple[str, TcpProxy]]:
    with proxied_kafka() as broker:
        yield broker


def _request(client: httpx.Client, secret: str, stream: bool) -> str:
    body = {
        "model": "llama-8b",
        "max_tokens": 12,
        # runs to max_tokens: the test checks every event carries 12 tokens and "length",
        # and a natural end drawn at 12 or fewer would turn up in a few hundred requests
        "ignore_eos": True,
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
        assert len(files) == 1
        lines = files[0].read_bytes().splitlines()
        # Each request's in-flight marks, then its event (which supersedes them).
        spooled = [line for line in lines if not line.startswith(MARK_PREFIX)]
        assert len(spooled) == 4 and len(lines) > 4
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
