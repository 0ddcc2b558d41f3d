"""Continuous usage through real processes: a real-time emulated replica, two gateways (the
feature on, its default, and ``GATEWAY_CONTINUOUS_USAGE=0``), the Kafka usage log.

A stream the client leaves before the replica's usage chunk is billed the replica's exact
prompt count (from the role chunk on), not the gateway's estimate, which for CJK and emoji
is ~4x the emulated count (gateway/README.md, "Tokens"); and the client's bytes are the same
with and without the feature, whatever it asked of ``stream_options``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from emulator.testing import SpawnedEmulator, spawn_emulator
from emulator.tokenizer import Tokenizer
from gateway.admission import tokens
from tests.gateway.conftest import (
    PROFILE,
    GatewayProcess,
    ReadModelSeeder,
    Tenant,
    UsageLog,
    replica_healthy,
    set_faults,
    start_gateway,
)
from tests.support import wait_until

pytestmark = pytest.mark.kafka

FAMILY = "llama-8b-cu"
VERSION = "llama-8b-cu-2026-05"
CJK = "请用中文写一首关于秋天的诗，描写落叶、月光和思乡之情。🍁🌕🏮 " * 6


@pytest.fixture(scope="module")
def replica(seeder: ReadModelSeeder) -> Iterator[SpawnedEmulator]:
    """Real-time speed: a long generation lasts seconds, time enough to leave mid-stream."""
    with spawn_emulator(PROFILE, VERSION, 1.0) as emu:
        seeder.set_replicas([("cu-1", emu.base_url)], version=VERSION, family=FAMILY, max_n=4)
        yield emu


@pytest.fixture(scope="module")
def pair(
    tmp_path_factory: pytest.TempPathFactory,
    redis_url: str,
    kafka_bootstrap: str,
    replica: SpawnedEmulator,
) -> Iterator[tuple[GatewayProcess, GatewayProcess]]:
    """(feature on, feature off), both routing to ``replica``."""
    on = start_gateway(tmp_path_factory.mktemp("on"), redis_url, kafka_bootstrap)
    off = start_gateway(
        tmp_path_factory.mktemp("off"),
        redis_url,
        kafka_bootstrap,
        extra_env={"GATEWAY_CONTINUOUS_USAGE": "0"},
    )
    try:
        wait_until(
            lambda: all(replica_healthy(gw, "cu-1") for gw in (on, off)),
            10,
            what="replica scraped",
        )
        yield on, off
    finally:
        on.terminate()
        off.terminate()


def _tenant(seeder: ReadModelSeeder, gateways: tuple[GatewayProcess, ...]) -> Tenant:
    tenant = seeder.tenant(families=(FAMILY,), max_output=2000, max_context=16384)
    headers = {"authorization": f"Bearer {tenant.secret}"}

    def live() -> bool:
        return all(
            httpx.get(gw.base_url + "/v1/models", headers=headers, timeout=5).status_code == 200
            for gw in gateways
        )

    wait_until(live, 5, what="key live")
    return tenant


def _leave_after(gw: GatewayProcess, tenant: Tenant, body: dict[str, Any], events: int) -> None:
    """Stream ``body``, read ``events`` data events, then close the connection."""
    headers = {"authorization": f"Bearer {tenant.secret}"}
    with (
        httpx.Client(base_url=gw.base_url, timeout=30) as client,
        client.stream("POST", body.pop("path"), json=body, headers=headers) as response,
    ):
        assert response.status_code == 200
        seen = 0
        for line in response.iter_lines():
            if line.startswith("data: "):
                assert '"usage"' not in line  # the client asked for none
                seen += 1
                if seen == events:
                    break
        response.close()


def _estimate_and_exact(text: str) -> tuple[int, int]:
    exact = len(Tokenizer().apply_chat_template([{"role": "user", "content": text}]))
    return tokens.prompt_tokens([text]), exact


def test_a_client_that_leaves_mid_stream_is_billed_the_replicas_prompt_count(
    pair: tuple[GatewayProcess, GatewayProcess], seeder: ReadModelSeeder, usage_log: UsageLog
) -> None:
    on, off = pair
    estimate, exact = _estimate_and_exact(CJK)
    assert estimate > 3 * exact  # 565 vs 151: the bound is far above the emulated count
    body = {
        "model": FAMILY,
        "messages": [{"role": "user", "content": CJK}],
        "max_tokens": 2000,
        "stream": True,
        "ignore_eos": True,
    }
    continuous_before = _continuous_events(on)
    billed = {}
    for name, gw in (("on", on), ("off", off)):
        tenant = _tenant(seeder, (gw,))
        _leave_after(gw, tenant, {**body, "path": "/v1/chat/completions"}, 6)
        (event,) = usage_log.events(tenant.tenant_id, 1)
        assert event["finish_reason"] == "cancelled" and event["status"] == 200
        assert 5 <= event["completion_tokens"] < 200
        billed[name] = event["prompt_tokens"]
    # Today's behaviour with the feature off: the estimate. On: the replica's own count.
    assert billed == {"on": exact, "off": estimate}
    assert _continuous_events(on) == continuous_before + 1


def _continuous_events(gw: GatewayProcess) -> float:
    """Usage events of ``gw`` billed from the replica's per-chunk counts."""
    text = httpx.get(gw.base_url + "/metrics", timeout=5).text
    found = re.search(r'fairway_gateway_usage_source_total\{source="continuous"\} (\S+)', text)
    return float(found.group(1)) if found else 0.0


def test_a_replica_failing_mid_stream_is_billed_its_own_counts(
    pair: tuple[GatewayProcess, GatewayProcess],
    seeder: ReadModelSeeder,
    usage_log: UsageLog,
    replica: SpawnedEmulator,
) -> None:
    """The replica's error event replaces its usage chunk: the last per-chunk counts bill."""
    on, _ = pair
    estimate, exact = _estimate_and_exact(CJK)
    tenant = _tenant(seeder, (on,))
    set_faults(replica, fail_after_tokens=8)
    try:
        response = httpx.post(
            on.base_url + "/v1/chat/completions",
            json={
                "model": FAMILY,
                "messages": [{"role": "user", "content": CJK}],
                "max_tokens": 50,
                "stream": True,
                "stream_options": {"include_usage": True},
                "ignore_eos": True,
            },
            headers={"authorization": f"Bearer {tenant.secret}"},
            timeout=30,
        )
    finally:
        set_faults(replica, fail_after_tokens=None)
    assert response.status_code == 200 and '"error"' in response.text
    assert '"usage"' not in response.text  # no usage chunk came, and none per chunk
    (event,) = usage_log.events(tenant.tenant_id, 1)
    assert event["finish_reason"] == "error"
    assert (event["prompt_tokens"], event["completion_tokens"]) == (exact, 8)
    assert exact < estimate


_VOLATILE = re.compile(rb'"(id|created)":("[^"]*"|\d+)')


def _normalised(raw: bytes) -> bytes:
    """The stream without what differs between two calls: the response id and time."""
    return _VOLATILE.sub(rb'"\1":_', raw)


CASES = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": CJK}]}),
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "stream_options": {"include_usage": True},
        },
    ),
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "n": 2,
            "stream_options": {"include_usage": True},
        },
    ),
    ("/v1/completions", {"prompt": ["one", "two three"], "n": 2}),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": False}}),
]


@pytest.mark.parametrize(("path", "fields"), CASES)
def test_the_clients_bytes_are_the_same_with_and_without_the_feature(
    pair: tuple[GatewayProcess, GatewayProcess],
    seeder: ReadModelSeeder,
    usage_log: UsageLog,
    path: str,
    fields: dict[str, Any],
) -> None:
    on, off = pair
    tenant = _tenant(seeder, pair)
    headers = {"authorization": f"Bearer {tenant.secret}"}
    body = {"model": FAMILY, "max_tokens": 6, "seed": 7, "stream": True, **fields}
    streams = [
        httpx.post(gw.base_url + path, json=body, headers=headers, timeout=30).content
        for gw in (on, off)
    ]
    assert _normalised(streams[0]) == _normalised(streams[1])
    asked = fields.get("stream_options", {}).get("include_usage", False)
    events = streams[0].split(b"\n\n")
    assert sum(b'"usage"' in e for e in events) == (1 if asked else 0)
    assert streams[0].endswith(b"data: [DONE]\n\n")
    billed = usage_log.events(tenant.tenant_id, 2)
    assert billed[0]["prompt_tokens"] == billed[1]["prompt_tokens"]  # both from the final chunk
    assert billed[0]["completion_tokens"] == billed[1]["completion_tokens"]


def test_json_requests_are_untouched(
    pair: tuple[GatewayProcess, GatewayProcess], seeder: ReadModelSeeder
) -> None:
    on, off = pair
    tenant = _tenant(seeder, pair)
    headers = {"authorization": f"Bearer {tenant.secret}"}
    body = {
        "model": FAMILY,
        "max_tokens": 6,
        "seed": 7,
        "messages": [{"role": "user", "content": CJK}],
    }
    answers = [
        httpx.post(gw.base_url + "/v1/chat/completions", json=body, headers=headers, timeout=30)
        for gw in (on, off)
    ]
    assert [a.status_code for a in answers] == [200, 200]
    assert _normalised(answers[0].content) == _normalised(answers[1].content)
    assert answers[0].json()["usage"]["prompt_tokens"] == _estimate_and_exact(CJK)[1]
