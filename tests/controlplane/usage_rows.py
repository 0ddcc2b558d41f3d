"""Helpers for the usage and costs API tests: rollup rows written straight through the ORM
(as the usage pipeline leaves them) and response parsing that keeps decimals exact."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any
from uuid import UUID

from catalog.models import ModelVersion
from metering.models import Usage
from tenants.demo import MODELS
from tenants.models import Tenant

HOUR = 3600
DAY = 86400
# Midnight UTC, in the past: "now" never falls inside a test's explicit range.
T0_DT = datetime(2026, 3, 1, tzinfo=UTC)
T0 = int(T0_DT.timestamp())


def at(seconds: int) -> datetime:
    """T0 plus ``seconds``, as the aware UTC datetime the rollup stores."""
    return T0_DT + timedelta(seconds=seconds)


def usage_row(
    tenant: Tenant,
    version: ModelVersion,
    hour: datetime,
    *,
    prompt: int = 0,
    cached: int = 0,
    completion: int = 0,
    requests: int = 1,
    api_key_id: UUID | None = None,
) -> Usage:
    """Add to the rollup row of (tenant, key, version, hour) as the pipeline does (the row
    is created at zero first); the key defaults to a fixed one."""
    row, _ = Usage.objects.get_or_create(
        tenant=tenant, api_key_id=api_key_id or UUID(int=1), model_version=version, hour=hour
    )
    row.requests += requests
    row.prompt_tokens += prompt
    row.cached_tokens += cached
    row.completion_tokens += completion
    row.save()
    return row


def add_usage(
    *, tenant: Tenant, key: UUID, version: ModelVersion, offset: int, **tokens: int
) -> Usage:
    """``usage_row`` at T0 + ``offset`` seconds (``tokens``: prompt, cached, completion,
    requests)."""
    return usage_row(tenant, version, at(offset), api_key_id=key, **tokens)


def make_version_8b() -> ModelVersion:
    return MODELS[1].upsert()


def exact_json(response: Any) -> Any:
    """The body with every JSON number that has a fraction parsed as a Decimal."""
    return json.loads(response.content, parse_float=Decimal)
