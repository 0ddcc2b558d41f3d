"""Clients → a real gateway → Kafka → the consumer → ``usage``: the totals are what the
clients were told (and, for the requests that told them nothing, what the rule bills).

The control plane is the real one: demo data seeded into the test database and pushed to
Redis as the read model the gateway serves from; an emulated replica serves llama-8b.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from django.core.management import call_command
from django.db import connection
from django.utils import timezone

from billing.models import LineKind, TokenType
from billing.periods import month_start
from billing.pricing import round_line, token_cost
from billing.selectors import price_of
from billing.services import invoice_draft_build
from catalog.models import ModelVersion
from catalog.selectors import price_in_force
from emulator.testing import SpawnedEmulator, spawn_emulator
from tenants.models import Tenant
from tenants.readmodel import read_model
from tests.gateway.conftest import set_faults
from tests.metering.conftest import Metered, usage_totals
from tests.support import wait_until

pytestmark = pytest.mark.kafka

VERSION = "llama-8b-2026-05"


@pytest.fixture
def replica() -> Iterator[SpawnedEmulator]:
    with spawn_emulator("llama-8b-tp1-h100", VERSION, 20.0) as emu:
        yield emu


def _body(stream: bool, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {
        "model": "llama-8b",
        "stream": stream,
        "max_tokens": max_tokens,
        # Every request runs to max_tokens: the emulator draws a natural end (EOS) from a
        # distribution that now and then falls below a small max_tokens.
        "ignore_eos": True,
        "messages": [{"role": "user", "content": f"count sheep {uuid.uuid4().hex}"}],
        **extra,
    }


def seed_demo_standard(
    settings: Any, redis_url: str, replica: SpawnedEmulator, tmp_path: Path
) -> tuple[str, str]:
    """The demo data, served by ``replica``, pushed to Redis as the read model: the
    ``demo-standard`` tenant's id and API key."""
    settings.REDIS_URL = redis_url
    keys = tmp_path / "keys.json"
    call_command("seed_demo", "--replicas", f"{VERSION}={replica.base_url}", "--keys-out", keys)
    read_model().rebuild()
    demo = json.loads(keys.read_text())["demo-standard"]
    return demo["tenant_id"], demo["key"]


def sse_lines(response: httpx.Response) -> Iterator[str]:
    for line in response.iter_lines():
        if line.startswith("data: "):
            yield line[6:]


def _stream_usage(response: httpx.Response) -> tuple[dict[str, Any] | None, int]:
    """The final usage object (if sent) and how many content deltas arrived."""
    usage, deltas = None, 0
    for data in sse_lines(response):
        if data == "[DONE]":
            break
        chunk = json.loads(data)
        if chunk.get("usage"):
            usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            if (choice.get("delta") or {}).get("content"):
                deltas += 1
    return usage, deltas


def test_gateway_to_invoice_totals_equal_what_the_clients_received(
    metered: Metered, settings: Any, replica: SpawnedEmulator, tmp_path: Path
) -> None:
    tenant_id, secret = seed_demo_standard(settings, metered.redis_url, replica, tmp_path)
    gw = metered.gateway()
    auth = {"authorization": f"Bearer {secret}"}
    received: list[dict[str, Any]] = []
    try:
        with httpx.Client(base_url=gw.base_url, timeout=60, headers=auth) as client:
            # 1. JSON.
            r = client.post("/v1/chat/completions", json=_body(False, 24))
            assert r.status_code == 200, r.text
            received.append(r.json()["usage"])
            # 2. A stream that asked for usage.
            with client.stream(
                "POST",
                "/v1/chat/completions",
                json=_body(True, 32, stream_options={"include_usage": True}),
            ) as response:
                assert response.status_code == 200
                usage, _ = _stream_usage(response)
            assert usage is not None
            received.append(usage)
            # 3. A stream the client cancels after a few tokens (it never sees a usage object).
            with client.stream("POST", "/v1/chat/completions", json=_body(True, 400)) as response:
                lines = sse_lines(response)
                seen = 0
                for data in lines:
                    chunk = json.loads(data)
                    if any((c.get("delta") or {}).get("content") for c in chunk["choices"]):
                        seen += 1
                    if seen == 5:
                        break
                response.close()
            # 4. The replica refuses (503): the client gets an error and no usage.
            set_faults(replica, refuse_503=True)
            r = client.post("/v1/chat/completions", json=_body(False, 16))
            assert r.status_code >= 500 and "usage" not in r.json()
            set_faults(replica, refuse_503=False)
            # 5. The replica fails mid-stream after 3 tokens: the client got 3 tokens.
            set_faults(replica, fail_after_tokens=3)
            with client.stream("POST", "/v1/chat/completions", json=_body(True, 50)) as response:
                assert response.status_code == 200
                _, failed_deltas = _stream_usage(response)
            set_faults(replica, fail_after_tokens=None)
            assert failed_deltas == 3
    finally:
        gw.terminate()

    wait_until(
        lambda: usage_totals(tenant_id=tenant_id)["requests"] == 5,
        60,
        interval=0.2,
        what="five requests in usage",
    )
    with connection.cursor() as cur:
        cur.execute(
            "SELECT finish_reason, status, prompt_tokens, cached_tokens, completion_tokens "
            "FROM request_log WHERE tenant_id = %s ORDER BY started_at",
            [tenant_id],
        )
        log = cur.fetchall()
    assert [(f, s) for f, s, *_ in log] == [
        ("length", 200),
        ("length", 200),
        ("cancelled", 200),
        ("error", 503),
        ("error", 200),
    ]
    (_, _, c_prompt, c_cached, c_completion) = log[2]
    (_, _, e_prompt, e_cached, e_completion) = log[3]
    (_, _, f_prompt, f_cached, f_completion) = log[4]
    # The cancelled stream: prefill ran (billed), the tokens it relayed are billed.
    assert c_prompt > 0 and 5 <= c_completion < 400
    # The refused request: nothing.
    assert (e_prompt, e_cached, e_completion) == (0, 0, 0)
    # The failed stream: prefill ran, and the 3 tokens the client received.
    assert f_prompt > 0 and f_completion == 3

    def cached(u: dict[str, Any]) -> int:
        return int((u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)

    totals = usage_totals(tenant_id=tenant_id)
    assert totals == {
        "requests": 5,
        "prompt_tokens": sum(u["prompt_tokens"] for u in received) + c_prompt + f_prompt,
        "cached_tokens": sum(cached(u) for u in received) + c_cached + f_cached,
        "completion_tokens": sum(u["completion_tokens"] for u in received)
        + c_completion
        + f_completion,
        "cancelled_requests": 1,
        "errored_requests": 2,
    }

    # ... and on to the invoice: its usage lines bill exactly those tokens, each line at the
    # catalog price and rounded once.
    with connection.cursor() as cur:
        cur.execute("SELECT started_at FROM request_log WHERE tenant_id = %s", [tenant_id])
        months = {month_start(started) for (started,) in cur.fetchall()}
    tenant = Tenant.objects.get(pk=tenant_id)
    version = ModelVersion.objects.get(name=VERSION)
    price = price_in_force(version=version, at=timezone.now())  # its one price
    assert price is not None
    billed = dict.fromkeys(TokenType.values, 0)
    for month in sorted(months):
        invoice = invoice_draft_build(tenant=tenant, period_start=month)
        assert invoice is not None
        for line in invoice.lines.filter(kind=LineKind.USAGE):
            assert line.model_version_id == version.pk
            assert line.unit_price_per_mtok == price_of(price, line.token_type)
            exact = token_cost(line.tokens, line.unit_price_per_mtok)
            assert line.amount == round_line(exact, invoice.currency)
            billed[line.token_type] += line.tokens
    assert billed == {
        TokenType.PROMPT: totals["prompt_tokens"] - totals["cached_tokens"],
        TokenType.CACHED: totals["cached_tokens"],
        TokenType.COMPLETION: totals["completion_tokens"],
    }
