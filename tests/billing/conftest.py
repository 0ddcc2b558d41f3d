"""Billing fixtures: the control-plane fixtures (plans, tenants, users, the 70B model),
a second model version, usage and request_log writers, and the Stripe fake.

Stripe sync is off unless a test asks for ``stripe_fake`` (which points the settings at a
fresh fake with small timeouts and backoff).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest
from django.db import connection

from billing.testing.stripe_fake import StripeFake
from catalog.models import ModelVersion
from metering.models import RequestLog, Usage
from tenants import services as tenant_services
from tenants.demo import MODELS
from tenants.models import Plan, Tenant
from tests.controlplane.conftest import (  # noqa: F401 - fixtures shared with the control plane
    client_for,
    family_70b,
    make_user,
    member_of,
    operator,
    owner_a,
    plain_staff,
    plans,
    tenant_a,
    tenant_b,
    version_70b,
)
from tests.controlplane.usage_rows import usage_row

WEBHOOK_SECRET = "whsec_fairway_test_secret"


@pytest.fixture(autouse=True)
def _stripe_off(settings: Any) -> None:
    settings.STRIPE_API_KEY = ""
    settings.STRIPE_API_BASE = ""
    settings.STRIPE_WEBHOOK_SECRET = WEBHOOK_SECRET
    settings.BILLING_OUTBOX_BACKOFF_BASE_MS = 0
    settings.BILLING_OUTBOX_MAX_ATTEMPTS = 15


@pytest.fixture
def version_8b(db: None) -> ModelVersion:
    return MODELS[1].upsert()


@pytest.fixture
def standard_fee(plans: dict[str, Plan]) -> Decimal:  # noqa: F811 - the fixture
    fee = Decimal("49.00")
    tenant_services.plan_set_base_fee(plan=plans["standard"], base_fee=fee)
    return fee


def utc(
    year: int, month: int, day: int, hour: int = 0, minute: int = 0, second: int = 0
) -> datetime:
    return datetime(year, month, day, hour, minute, second, tzinfo=UTC)


@pytest.fixture
def add_usage() -> Callable[..., Usage]:
    """Add tokens to the usage row of (tenant, key, version, hour) as the pipeline would."""
    return usage_row


def request_log_partition(day: datetime) -> None:
    start = day.astimezone(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    end = start + timedelta(days=1)
    with connection.cursor() as cur:
        cur.execute(
            f"CREATE TABLE IF NOT EXISTS request_log_{start:%Y%m%d} PARTITION OF request_log "
            f"FOR VALUES FROM ('{start.isoformat()}') TO ('{end.isoformat()}')"
        )


@pytest.fixture
def add_request() -> Callable[..., RequestLog]:
    """One request_log row (its day's partition is created first)."""

    def add(
        tenant: Tenant,
        version: ModelVersion,
        started_at: datetime,
        *,
        prompt: int = 0,
        cached: int = 0,
        completion: int = 0,
    ) -> RequestLog:
        request_log_partition(started_at)
        return RequestLog.objects.create(
            request_id=uuid.uuid4().hex,
            started_at=started_at,
            tenant_id=tenant.pk,
            api_key_id=uuid.UUID(int=1),
            model=version.family.name,
            model_version_id=version.pk,
            replica_id="r70-a",
            prompt_tokens=prompt,
            cached_tokens=cached,
            completion_tokens=completion,
            ttft_ms=100.0,
            tpot_ms=20.0,
            finish_reason="stop",
            status=200,
            is_retry=False,
            ingested_at=started_at,
        )

    return add


@pytest.fixture
def stripe_fake(settings: Any) -> Iterator[StripeFake]:
    """A fresh fake Stripe, with Fairway's settings pointed at it (sync on)."""
    with StripeFake() as fake:
        settings.STRIPE_API_KEY = fake.api_key
        settings.STRIPE_API_BASE = fake.url
        settings.STRIPE_TIMEOUT_MS = 500
        yield fake
