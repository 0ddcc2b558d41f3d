"""The emulator's ``--request-log``: one line per finished request, its model-time milestones
(bench/nn_trace.py splits a tenant's TTFT with them)."""

from __future__ import annotations

import io

import orjson

from emulator.__main__ import build_parser, log_finished

from .conftest import run_until_idle, small_engine


def test_each_finished_request_is_logged_once_with_ordered_milestones() -> None:
    engine = small_engine(scheduling_policy="priority")
    out = io.BytesIO()
    log_finished(engine, out)
    engine.add_request("a-1", list(range(100, 180)), 5, priority=1, ignore_eos=True)
    engine.add_request("b-1", list(range(200, 230)), 3, priority=2, ignore_eos=True)
    engine.add_request("c-1", list(range(300, 340)), 50, ignore_eos=True)
    engine.abort("c-1")
    run_until_idle(engine)
    recs = {r["request_id"]: r for r in map(orjson.loads, out.getvalue().splitlines())}
    assert set(recs) == {"a-1", "b-1", "c-1"}
    a, b, c = recs["a-1"], recs["b-1"], recs["c-1"]
    assert (a["priority"], a["prompt"], a["output"], a["reason"]) == (1, 80, 5, "length")
    assert (b["priority"], b["prompt"], b["output"]) == (2, 30, 3)
    for r in (a, b):
        assert r["arrival"] <= r["scheduled"] <= r["first_token"] <= r["finish"]
        assert r["preemptions"] == 0
    # aborted while waiting: never scheduled, no first token
    assert c["reason"] == "abort" and c["scheduled"] < 0 and c["first_token"] < 0


def test_the_flag_is_off_unless_given() -> None:
    assert build_parser().parse_args([]).request_log is None
    assert build_parser().parse_args(["--request-log", "x.jsonl"]).request_log == "x.jsonl"
