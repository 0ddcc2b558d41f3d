"""In-flight marks: a request running when its gateway process dies is billed once, by the
process that adopts the spool (gateway/usage/producer.py, "A request in flight")."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import orjson

from gateway.usage.events import mark_record, record_key, settled_record
from gateway.usage.spool import Spool
from tests.gateway.test_usage import (
    FakeSink,
    _event,
    _producer,
    _sample,
    _segment_lines,
    reaches,
)
from tests.support import wait_until


def _mark(i: int, completion: int = 0, status: int = 502) -> bytes:
    """What the exchange spools while request ``r<i>`` runs: a failed request as of now."""
    event = dataclasses.replace(
        _event(i), completion_tokens=completion, finish_reason="error", status=status
    )
    return mark_record(event)


def test_a_mark_is_its_event_plus_one_field_and_is_never_sent() -> None:
    mark = _mark(1, completion=7, status=200)
    assert orjson.loads(mark)["inflight"] is True
    assert (
        settled_record(mark)
        == dataclasses.replace(
            _event(1), completion_tokens=7, finish_reason="error", status=200
        ).to_json()
    )
    assert record_key(mark) == (None, "inflight")


def test_the_spool_follows_marks_and_rebuilds_them_on_adoption(tmp_path: Path) -> None:
    spool = Spool.create(tmp_path, "usage-dead")
    # r1 dispatched, then renewed at its first token; r2 dispatched and finished; r3 marked.
    spool.append([_mark(1), _mark(2), _mark(1, completion=3, status=200)])
    spool.append([_event(2).to_json(), _mark(3)])
    assert set(spool.inflight) == {b"r1", b"r3"}
    assert spool.inflight[b"r1"] == _mark(1, completion=3, status=200)  # the latest mark
    spool.append([_event(3).to_json()])
    spool.close()  # the owner dies with r1 in flight

    adopted = Spool.adopt(spool.lock_path)
    assert adopted is not None
    assert adopted.inflight == {b"r1": _mark(1, completion=3, status=200)}
    assert adopted.settle_inflight() == 1
    assert adopted.inflight == {}
    # The synthetic event is appended after everything the dead process wrote.
    last = orjson.loads(_segment_lines(tmp_path, "usage-dead")[-1])
    assert last["request_id"] == "r1" and last["finish_reason"] == "error"
    assert last["completion_tokens"] == 3 and last["status"] == 200
    adopted.close()
    # Settled once: the next adopter finds the event after the mark, nothing to settle.
    again = Spool.adopt(spool.lock_path)
    assert again is not None and again.inflight == {} and again.settle_inflight() == 0
    again.close()


def test_a_successor_bills_the_requests_in_flight_once_and_sends_no_mark(
    tmp_path: Path,
) -> None:
    dead = Spool.create(tmp_path, "usage-dead")
    dead.append([_mark(1), _mark(2), _event(2).to_json(), _mark(1, completion=5, status=200)])
    dead.close()
    sink = FakeSink()
    producer = _producer(tmp_path, sink, "live")
    try:
        wait_until(lambda: not dead.lock_path.exists(), 10, what="the dead spool drained")
        assert sink.ids() == ["r2", "r1"]  # the real event, then the settled one
        assert sink.sent[0]["finish_reason"] == "stop"  # r2's own event, not a mark's
        r1 = sink.sent[1]
        assert (r1["finish_reason"], r1["status"], r1["completion_tokens"]) == ("error", 200, 5)
        assert "inflight" not in r1
        assert _sample(producer, "fairway_gateway_usage_events_total", step="settled") == 1
    finally:
        producer.stop(2.0)
        producer.close()


def test_a_real_event_in_the_spool_is_never_replaced_by_a_settled_one(tmp_path: Path) -> None:
    dead = Spool.create(tmp_path, "usage-dead")
    dead.append([_mark(1)])
    dead.append([_mark(1, completion=2, status=200), _event(1).to_json()])
    dead.close()
    sink = FakeSink()
    producer = _producer(tmp_path, sink, "live")
    try:
        wait_until(lambda: not dead.lock_path.exists(), 10, what="the dead spool drained")
        assert sink.sent == [orjson.loads(_event(1).to_json())]
        assert _sample(producer, "fairway_gateway_usage_events_total", step="settled") is None
    finally:
        producer.stop(2.0)
        producer.close()


def test_a_new_segment_carries_the_open_marks_so_deleting_old_ones_loses_none(
    tmp_path: Path,
) -> None:
    sink = FakeSink()
    first = _producer(tmp_path, sink, "first", segment_bytes=1500)
    spool = first._spool
    assert spool is not None
    first.mark(dataclasses.replace(_event(1000), finish_reason="error", status=502))
    wait_until(lambda: b"r1000" in spool.inflight, 5, what="the mark written")
    for i in range(30):
        first.emit(_event(i))
        if i % 5 == 4:  # a few group commits, so that the writer rotates between them
            wait_until(reaches(lambda: len(sink.sent), i + 1), 5, what="delivered")
    # The segment that held the mark was acknowledged and deleted; the mark was not lost.
    wait_until(lambda: not (tmp_path / "usage-first-0000000001.spool").exists(), 5, what="retired")
    first.stop(1.0)
    first.close()  # a request still in flight at the end: the files stay for a successor
    assert (tmp_path / "usage-first.lock").exists()
    assert sink.ids() == [f"r{i}" for i in range(30)]

    second = _producer(tmp_path, sink, "second")
    try:
        wait_until(lambda: not (tmp_path / "usage-first.lock").exists(), 10, what="adopted")
        assert sink.ids()[30:] == ["r1000"]
        assert sink.sent[30]["finish_reason"] == "error"
    finally:
        second.stop(2.0)
        second.close()
