"""bench/nn_trace.py: the join of the gateway's usage events, the replicas' request logs and
the load generator's outcomes, on a hand-made trace directory."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench import nn_trace

LONG = nn_trace.LONG_PROMPT_EMULATED


def _event(gid: str, tenant: str, replica: str, second: int, ttft_ms: float | None) -> dict:
    return {
        "schema_version": 1, "request_id": gid, "tenant_id": tenant, "replica_id": replica,
        "started_at": f"2026-12-03T18:00:{second:02d}.000+00:00", "ttft_ms": ttft_ms,
        "status": 200,
    }  # fmt: skip


def _rec(rid: str, prompt: int, arrival: float, scheduled: float, first: float, finish: float,
         priority: int = 1) -> dict:  # fmt: skip
    return {
        "request_id": rid, "priority": priority, "prompt": prompt, "output": 10, "cached": 0,
        "arrival": arrival, "scheduled": scheduled, "first_token": first, "finish": finish,
        "preemptions": 0, "reason": "length",
    }  # fmt: skip


def _outcome(rid: str, tenant: str, status: int, ttft: float | None, prompt: int) -> dict:
    return {"request_id": rid, "tenant_id": tenant, "status": status, "ttft_s": ttft,
            "prompt_tokens": prompt}  # fmt: skip


def _write(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _arm(root: Path, name: str, *, flood: bool) -> None:
    d = root / name
    spool = [
        {"inflight": True, **_event("g1", "free", "r0", 0, None)},  # superseded by its event
        _event("g1", "free", "r0", 0, 600.0),  # 0.6 wall s at speed 1.5: 0.9 model s
        _event("g2", "std-1", "r1", 1, 300.0),
    ]
    r0 = [_rec("g1-1", 100, 10.0, 10.2, 10.8, 12.0, priority=2)]
    r1 = [_rec("g2-1", 50, 11.0, 11.1, 11.4, 12.0)]
    if flood:
        spool.append(_event("g3", "noisy", "r1", 2, 20_000.0))
        # a long prompt prefilling on r1 from 10.5 to 30: g2 waited beside it
        r1.append(_rec("g3-1", LONG * 10, 10.4, 10.5, 30.0, 40.0))
    _write(d / "spool" / "usage-x-0000000001.spool", spool)
    _write(d / "r0.jsonl", r0)
    _write(d / "r1.jsonl", r1)
    outcomes = [
        _outcome("b1", "free", 200, 0.9 if flood else 0.6, 800),
        _outcome("b2", "std-1", 200, 0.45, 400),
        # the standard tenant's own long prompt: served when quiet, refused beside the flood
        _outcome("b4", "std-1", 503 if flood else 200, None if flood else 2.0, LONG * 8 + 8),
    ]
    if flood:
        outcomes.append(_outcome("b3", "noisy", 200, 20.0, 128_000))
    _write(d / "outcomes.jsonl", outcomes)


def test_load_arm_joins_gateway_and_replica_records(tmp_path: Path) -> None:
    _arm(tmp_path, "s7-n1-c", flood=True)
    reqs, outcomes = nn_trace.load_arm(tmp_path / "s7-n1-c", speed=1.5)
    by_tenant = {r.tenant: r for r in reqs}
    free, std = by_tenant["free"], by_tenant["std-1"]
    assert free.replica == "r0" and free.prompt == 100
    assert free.gateway_ttft_s == pytest.approx(0.9)
    assert (free.queue_s, free.prefill_s) == (pytest.approx(0.2), pytest.approx(0.6))
    assert free.gateway_part_s == pytest.approx(0.9 - 0.8)
    assert not free.long_overlap and std.long_overlap  # std-1 waited beside the long prefill
    assert not by_tenant["noisy"].long_overlap  # a long prompt is not "beside" itself
    assert len(outcomes) == 4


def test_compare_shows_refused_long_prompts_and_the_spread(tmp_path: Path) -> None:
    _arm(tmp_path, "s7-n1-c", flood=True)
    _arm(tmp_path, "s7-n1-quiet", flood=False)
    md = "\n".join(nn_trace.compare(tmp_path, speed=1.5, warmup_s=0.0, arm="c"))
    assert "(1 runs: s7-n1)" in md
    assert "| free | 1.50x" in md  # 0.9 s against 0.6 s, the same request in both arms
    assert "- std-1: {503: 1} / {200: 1}" in md
    assert "noisy" not in md.split("Prompts over")[0]  # flooders are not neighbours
    assert "1 long prompts, prefilling 20 s, resident 30 s" in md


def test_union_of_spans() -> None:
    assert nn_trace._union([(0, 2), (1, 3), (5, 6)]) == 4
    assert nn_trace._union([]) == 0
    assert math.isclose(nn_trace._union([(1.5, 2.0)]), 0.5)
