"""A gateway process SIGKILLed mid-stream: the request it was relaying is billed exactly once,
by the gateway that adopts its spool (its in-flight marks, gateway/usage/producer.py), through
the real Kafka path into ``request_log`` and ``usage``."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from django.db import connection

from emulator.testing import SpawnedEmulator, spawn_emulator
from tests.metering.conftest import Metered, usage_totals
from tests.metering.test_end_to_end import seed_demo_standard, sse_lines
from tests.support import wait_until

pytestmark = pytest.mark.kafka

VERSION = "llama-8b-2026-05"


@pytest.fixture
def slow_replica() -> Iterator[SpawnedEmulator]:
    with spawn_emulator("llama-8b-tp1-h100", VERSION, 1.0) as emu:
        yield emu


def _rows(request_id: str) -> list[tuple[Any, ...]]:
    with connection.cursor() as cur:
        cur.execute(
            "SELECT finish_reason, status, prompt_tokens, completion_tokens FROM request_log "
            "WHERE request_id = %s",
            [request_id],
        )
        return list(cur.fetchall())


def test_a_stream_cut_off_by_a_sigkill_is_billed_once_after_adoption(
    metered: Metered, settings: Any, slow_replica: SpawnedEmulator, tmp_path: Path
) -> None:
    tenant_id, secret = seed_demo_standard(settings, metered.redis_url, slow_replica, tmp_path)
    doomed = metered.gateway()
    body = {
        "model": "llama-8b",
        "stream": True,
        "max_tokens": 2000,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": f"count sheep {uuid.uuid4().hex}"}],
    }
    received = 0
    successor = None
    try:
        with httpx.Client(
            base_url=doomed.base_url, timeout=60, headers={"authorization": f"Bearer {secret}"}
        ) as client:
            with client.stream("POST", "/v1/chat/completions", json=body) as response:
                assert response.status_code == 200
                request_id = response.headers["x-request-id"]
                killed_at: float | None = None
                started = time.monotonic()
                try:
                    for data in sse_lines(response):
                        chunk = json.loads(data)
                        if any((c.get("delta") or {}).get("content") for c in chunk["choices"]):
                            received += 1
                        # Past one mark interval (the exchange's MARK_INTERVAL_S) mid-stream.
                        if killed_at is None and time.monotonic() - started > 3.0:
                            doomed.process.kill()  # SIGKILL: no terminal handler runs
                            killed_at = time.monotonic()
                except httpx.HTTPError:
                    pass  # the connection died with the process
                assert killed_at is not None, "the stream ended before the kill"
        assert doomed.process.wait(10) == -9
        assert received > 10
        time.sleep(2.0)
        assert _rows(request_id) == []  # the dead process never wrote its event
        # A successor on the same spool directory adopts the dead process's spool.
        successor = metered.gateway(spool_dir=doomed.spool_dir)
        wait_until(lambda: len(_rows(request_id)) == 1, 40, interval=0.2, what="billed")
        ((finish, status, prompt, completion),) = _rows(request_id)
        # A failed stream (metering/rules.py): status 200 from its first byte on, the prompt
        # (prefill ran: tokens came back), the output relayed as of the last mark — never
        # more than the client received.
        assert (finish, status) == ("error", 200)
        assert prompt > 0 and 0 < completion <= received
        time.sleep(3.0)  # nothing else arrives for it
        assert len(_rows(request_id)) == 1
        totals = usage_totals(tenant_id=tenant_id)
        assert (totals["requests"], totals["errored_requests"]) == (1, 1)
        assert totals["completion_tokens"] == completion
    finally:
        if successor is not None:
            assert successor.terminate() == 0
        doomed.terminate(5)
