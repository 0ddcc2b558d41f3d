"""The fault scenario's pure parts: outcome accounting, recovery time, reconciliation."""

from __future__ import annotations

from bench.faults import (
    LogRow,
    Record,
    error_fraction,
    outcome,
    reconcile,
    recovery_time,
    tally,
)


def _r(
    t: float,
    status: int = 200,
    *,
    complete: bool = True,
    error: str | None = None,
    cls: str = "standard",
    rid: str | None = None,
    tokens: int | None = None,
) -> Record:
    return Record(
        tenant_id="t",
        admission_class=cls,
        stream=True,
        t_sent=t,
        status=status,
        request_id=rid,
        complete=complete,
        completion_tokens=tokens,
        error=error,
    )


def test_outcome_sorts_every_ending() -> None:
    assert outcome(_r(0)) == "ok"
    assert outcome(_r(0, complete=False)) == "partial"  # a 200 stream cut off
    assert outcome(_r(0, error="replica gone")) == "partial"  # in-stream error after a 200
    assert outcome(_r(0, 429)) == "429"
    assert outcome(_r(0, 503)) == "503"
    assert outcome(_r(0, 401)) == "failed"
    assert outcome(_r(0, 500)) == "failed"
    assert outcome(_r(0, 0, error="ClientConnectorError")) == "failed"


def test_tally_counts_by_class_in_the_window_only() -> None:
    recs = [
        _r(0.5),
        _r(1.0, 503),
        _r(1.5, 429, cls="best_effort"),
        _r(2.0, 0, cls="reserved"),  # at t1: outside [t0, t1)
    ]
    got = tally(recs, 0.0, 2.0)
    assert got["standard"] == {"ok": 1, "503": 1}
    assert got["best_effort"] == {"429": 1}
    assert got["reserved"] == {}
    # 429 is a tenant's own limit, not an error of the platform.
    assert error_fraction(recs, 0.0, 2.0) == 1 / 3


def test_recovery_is_the_end_of_the_last_bad_bucket() -> None:
    end = 10.0
    recs = [_r(end + 0.2, 503), _r(end + 0.7), _r(end + 1.5, 0), _r(end + 2.5)]
    recs += [_r(end + 3 + i * 0.5) for i in range(10)]
    # Buckets [0,1) 50 % errors, [1,2) 100 %, then clean: recovered 2 s after the fault.
    assert recovery_time(recs, end, end + 8, baseline=0.0) == 2.0
    # Errors within baseline + tolerance do not count: a 50 % baseline forgives bucket 0.
    assert recovery_time(recs, end, end + 8, baseline=0.5, tolerance=0.0) == 2.0
    assert recovery_time(recs, end, end + 8, baseline=1.0) == 0.0


def test_recovery_leaves_out_requests_the_next_fault_ended() -> None:
    cut = _r(14.5, 0, error="replica gone")
    cut.t_end = 15.5  # still in flight when the window (and the next fault) began
    assert recovery_time([_r(10.5), cut], 10.0, 15.0, baseline=0.0) == 0.0


def test_recovery_none_when_still_failing_at_the_window_end() -> None:
    recs = [_r(10.5), _r(14.5, 503)]
    assert recovery_time(recs, 10.0, 15.0, baseline=0.0) is None
    assert recovery_time([], 10.0, 15.0, baseline=0.0) == 0.0  # no traffic: nothing bad


def test_reconcile_finds_lost_duplicated_and_mismatched() -> None:
    recs = [
        _r(0, rid="a", tokens=5),
        _r(0, rid="b", tokens=7),  # absent: lost
        _r(0, rid="c", tokens=9),  # logged with 8: mismatch
        _r(0, complete=False, rid="d", tokens=None),  # partial stream: present, no token check
        _r(0, rid=None),  # a 200 without the header
        _r(0, 503, rid="e"),  # admitted then failed: logged, but not required
    ]
    rows = [
        LogRow("a", 200, 10, 5, "length"),
        LogRow("c", 200, 10, 8, "length"),
        LogRow("d", 200, 10, 3, "error"),
        LogRow("d", 200, 10, 3, "error"),  # the same id twice: double-counted
        LogRow("e", 503, 0, 0, "error"),
    ]
    rec = reconcile(recs, rows)
    assert rec.seen_200 == 5
    assert rec.logged == 3
    assert rec.lost == ["b"]
    assert rec.duplicated == ["d"]
    assert rec.completion_mismatch == [("c", 9, 8)]
    assert rec.no_request_id == 1
    assert rec.logged_non_200 == {"503": 1}
