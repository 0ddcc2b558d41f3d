"""Billing shows cache-aware routing: the same conversations through a real gateway to fresh
emulated replicas, once routed by P2C for one tenant and once by cache-aware routing for
another, usage events through Kafka into ``usage`` by the real consumer, each tenant's invoice
drafted: the lines bill exactly what the clients were told, at the catalog's prices, and the
cache-aware tenant pays less for the same prompts.

The pieces are bench/prefix_invoice.py's (its docstring says how the arms are built).

Why four replicas: with two, P2C samples both every time and sends a turn to the less loaded
one, which at a low load can keep a conversation where its history is by accident. With four
it samples two of four, so each of the 224 later turns leaves the replica that served the
turn before (and loses at least that turn's new blocks from the cache) with probability at
least 1/2 whatever the loads (all four have room at this load): "more cached tokens under
cache-aware routing" fails only if cache-aware routing itself loses as much, which it does
not (below).

The totals: each invoice has two lines that differ between the arms (prompt, cached), each
rounded to cents, so the rounded totals keep the order of the exact ones when the exact
saving exceeds two cents: 45,000 tokens moved to the cached price at the 70B's $0.45 per
million between the two prices (at the 8B's $0.045 it would take ten times as many, hence the
70B). Measured on this workload (``python -m bench.prefix_invoice --sizes 4,4,4 --speed 20``,
three runs in one, bench/results/prefix_invoice.md): of 946,817 prompt tokens, P2C had
750,064-759,056 cached, cache-aware routing 874,768 in each run: 115,712-124,704 tokens
more, an exact saving of $0.052-0.056.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.utils import timezone

from bench.prefix_invoice import ARMS, VERSION, Workload, draft_invoices, fresh_replicas, run_arm
from billing.models import LineKind, TokenType
from billing.pricing import round_line, token_cost
from billing.selectors import price_of
from catalog.models import ModelVersion
from catalog.selectors import price_in_force
from tests.metering.conftest import Metered, usage_totals, wait_for_requests

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

REPLICAS = 4
SPEED = 20.0


def test_cache_aware_tenant_is_billed_less_for_the_same_prompts(
    metered: Metered, tmp_path: Path
) -> None:
    @contextlib.contextmanager
    def gateway(env: dict[str, str]) -> Iterator[str]:
        gw = metered.gateway(extra_env=env, ready_timeout=60)
        try:
            yield gw.base_url
        finally:
            gw.terminate()  # drains: every usage event produced

    workload = Workload(conversations=8 * REPLICAS)
    arms = []
    for label, strategy in ARMS:
        with fresh_replicas(REPLICAS, SPEED, tmp_path) as urls:
            arms.append(run_arm(label, strategy, urls, workload, tmp_path / "keys.json", gateway))
    p2c, aware = arms
    # The same workload: the same prompts, turn by turn, and replies of the same length.
    assert [[(t.prompt_tokens, t.completion_tokens) for t in c] for c in p2c.conversations] == [
        [(t.prompt_tokens, t.completion_tokens) for t in c] for c in aware.conversations
    ]

    wait_for_requests([a.tenant.pk for a in arms], sum(len(a.turns) for a in arms), timeout=60)
    version = ModelVersion.objects.get(name=VERSION)
    price = price_in_force(version=version, at=timezone.now())
    assert price is not None
    for arm in arms:
        received = arm.received()
        assert usage_totals(tenant_id=arm.tenant.pk)["requests"] == len(arm.turns)
        arm.invoices = draft_invoices(arm.tenant)
        billed = dict.fromkeys(TokenType.values, 0)
        for invoice in arm.invoices:
            for line in invoice.lines.all():
                assert line.kind == LineKind.USAGE  # no fee on this plan, nothing else
                assert line.model_version_id == version.pk
                assert line.unit_price_per_mtok == price_of(price, line.token_type)
                assert line.amount_exact == token_cost(line.tokens, line.unit_price_per_mtok)
                assert line.amount == round_line(line.amount_exact, invoice.currency)
                billed[line.token_type] += line.tokens
        # The prompt line bills the prompt tokens not served from cache.
        assert billed == {
            TokenType.PROMPT: received["prompt"] - received["cached"],
            TokenType.CACHED: received["cached"],
            TokenType.COMPLETION: received["completion"],
        }, arm.label

    assert p2c.received()["prompt"] == aware.received()["prompt"]
    assert aware.received()["cached"] > p2c.received()["cached"]
    assert aware.total < p2c.total
