"""Withdrawing a scheduled price change (catalog.services.price_change_withdraw): a change
not yet in force can be withdrawn, so its hours are billed at the price before it; one in
force (or once in force) cannot; the withdrawal says who and why; the database allows the
withdrawal stamp once, on a future row only, and nothing else.

As in test_prices, the change is in the future (March 2027) on the real clock.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from decimal import Decimal
from typing import Any

import pytest
from django.contrib.auth.models import Permission
from django.core.exceptions import ValidationError
from django.db import DatabaseError, IntegrityError, connection, transaction

from billing import services
from catalog import selectors as catalog_selectors
from catalog import services as catalog_services
from catalog.models import PRICE_EPOCH, ModelPrice, ModelVersion
from metering.pages import HOUR
from metering.selectors import cost_buckets
from tenants.models import Tenant
from tests.billing.test_prices import CHANGE, MAR, change_70b, usage_lines

pytestmark = pytest.mark.django_db


def withdraw(price: ModelPrice, **extra: Any) -> ModelPrice:
    return catalog_services.price_change_withdraw(
        price=price,
        actor_label=extra.pop("actor_label", "pricing-test"),
        reason=extra.pop("reason", "the spring price list was postponed"),
        **extra,
    )


def test_a_withdrawn_change_bills_the_price_before_it(
    tenant_a: Tenant,
    version_70b: ModelVersion,
    add_usage: Callable[..., Any],
    make_user: Callable[..., Any],
) -> None:
    first = ModelPrice.objects.get(version=version_70b, effective_from=PRICE_EPOCH)
    scheduled = change_70b(version_70b)
    assert catalog_selectors.price_in_force(version=version_70b, at=CHANGE) == scheduled
    who = make_user("pricing-lead", is_staff=True)
    withdrawn = withdraw(scheduled, actor=who, actor_label="pricing-lead")

    # The audit: the row stays, saying who withdrew it, when and why; its prices unchanged.
    assert withdrawn.pk == scheduled.pk and withdrawn.withdrawn_at is not None
    assert withdrawn.withdrawn_at < CHANGE
    assert (withdrawn.withdrawn_by, withdrawn.withdrawn_by_label, withdrawn.withdrawal_reason) == (
        who,
        "pricing-lead",
        "the spring price list was postponed",
    )
    assert (withdrawn.price_completion_per_mtok, withdrawn.reason) == (
        Decimal("0.9"),
        "spring price list",
    )
    assert list(catalog_selectors.price_history(version=version_70b)) == [withdrawn, first]
    assert catalog_selectors.price_in_force(version=version_70b, at=CHANGE) == first

    # Invoice and costs: every March hour at the old 0.60 / 0.15 / 0.80.
    add_usage(tenant_a, version_70b, CHANGE - timedelta(hours=1), completion=500_000)
    add_usage(tenant_a, version_70b, CHANGE, prompt=1_000_000, completion=250_000)
    invoice = services.invoice_draft_build(tenant=tenant_a, period_start=MAR)
    assert invoice is not None
    assert usage_lines(invoice) == [
        ("prompt", 1_000_000, Decimal("0.600000"), Decimal("0.60")),
        ("completion", 750_000, Decimal("0.800000"), Decimal("0.60")),
    ]
    from console.selectors import window

    day = CHANGE.date()
    buckets = cost_buckets(
        tenant=tenant_a, window=window(day, day, 24 * HOUR), group_by=("line_item",)
    )
    amounts = {r.line_item: r.amount for b in buckets for r in b.results}
    assert amounts[f"{version_70b.name}, output"] == Decimal("0.6")

    # The withdrawn hour can be scheduled again; the new change replaces the old price.
    again = change_70b(version_70b, reason="spring price list, for real")
    assert again.replaces == first
    assert catalog_selectors.price_in_force(version=version_70b, at=CHANGE) == again


def test_a_change_in_force_or_withdrawn_cannot_be_withdrawn(version_70b: ModelVersion) -> None:
    first = ModelPrice.objects.get(version=version_70b)
    now = catalog_services.price_change(
        version=version_70b,
        prompt="0.70",
        cached_prompt="0.20",
        completion="0.95",
        actor_label="pricing-test",
        reason="from this hour",
    )
    scheduled = change_70b(version_70b)
    for price in (first, now):  # in force once, and in force now
        with pytest.raises(ValidationError, match="has taken effect: only a change still"):
            withdraw(price)
    with pytest.raises(ValidationError, match="Say why"):
        withdraw(scheduled, reason="  ")
    with pytest.raises(ValidationError, match="Say who"):
        withdraw(scheduled, actor_label="")
    assert not ModelPrice.objects.filter(withdrawn_at__isnull=False).exists()
    withdraw(scheduled)
    with pytest.raises(ValidationError, match="already withdrawn"):
        withdraw(scheduled, reason="twice")
    assert ModelPrice.objects.get(pk=scheduled.pk).withdrawal_reason == (
        "the spring price list was postponed"
    )


def _sql(sql: str, *params: Any) -> None:
    with transaction.atomic(), connection.cursor() as cur:
        cur.execute(sql, list(params))


def test_database_allows_the_withdrawal_stamp_once_on_a_future_row_only(
    version_70b: ModelVersion,
) -> None:
    past = ModelPrice.objects.get(version=version_70b)
    future = change_70b(version_70b)
    stamp = (
        "UPDATE catalog_modelprice SET withdrawn_at = now(), withdrawn_by_label = 'x', "
        "withdrawal_reason = 'y'{extra} WHERE id = %s"
    )
    refused: list[tuple[str, int]] = [
        (stamp.format(extra=""), past.pk),  # in force since the epoch
        (stamp.format(extra=", price_completion_per_mtok = 0"), future.pk),  # and a price
        (stamp.format(extra=", reason = 'rewritten'"), future.pk),  # and the change's reason
        (stamp.format(extra=", effective_from = effective_from + interval '1 hour'"), future.pk),
        # A stamp from the future (the withdrawal would claim a time not yet come).
        (stamp.replace("now()", "now() + interval '1 day'").format(extra=""), future.pk),
        ("DELETE FROM catalog_modelprice WHERE id = %s", future.pk),
    ]
    for sql, pk in refused:
        with pytest.raises((IntegrityError, DatabaseError), match="append-only"):
            _sql(sql, pk)
    # Who and why are required (a check constraint), like the change's own.
    with pytest.raises(IntegrityError):
        _sql("UPDATE catalog_modelprice SET withdrawn_at = now() WHERE id = %s", future.pk)
    # A row cannot be inserted already withdrawn.
    with pytest.raises((IntegrityError, DatabaseError), match="append-only"):
        _sql(
            "INSERT INTO catalog_modelprice (version_id, effective_from, price_prompt_per_mtok, "
            "price_cached_prompt_per_mtok, price_completion_per_mtok, currency, actor_label, "
            "reason, created_at, withdrawn_at, withdrawn_by_label, withdrawal_reason) VALUES "
            "(%s, %s, 1, 1, 1, 'usd', 'x', 'y', now(), now(), 'x', 'y')",
            version_70b.pk,
            CHANGE + timedelta(hours=1),
        )
    assert ModelPrice.live().count() == 2

    # The stamp itself passes, once; then the row is as frozen as any other.
    _sql(stamp.format(extra=""), future.pk)
    for sql in (
        "UPDATE catalog_modelprice SET withdrawn_at = NULL, withdrawn_by_label = '', "
        "withdrawal_reason = '' WHERE id = %s",
        "UPDATE catalog_modelprice SET withdrawal_reason = 'rewritten' WHERE id = %s",
        "DELETE FROM catalog_modelprice WHERE id = %s",
    ):
        with pytest.raises((IntegrityError, DatabaseError), match="append-only"):
            _sql(sql, future.pk)
    row = ModelPrice.objects.get(pk=future.pk)
    assert (row.withdrawn_by_label, row.withdrawal_reason) == ("x", "y")
    assert row.price_completion_per_mtok == Decimal("0.9")


def test_api_withdraws_with_the_permission_that_schedules(
    version_70b: ModelVersion, make_user: Callable[..., Any], client_for: Callable[..., Any]
) -> None:
    scheduled = change_70b(version_70b)
    first = ModelPrice.objects.get(version=version_70b, effective_from=PRICE_EPOCH)
    base = f"/api/v1/models/{version_70b.name}/prices/"
    url = f"{base}{scheduled.pk}/withdraw/"
    body = {"reason": "postponed"}
    viewer = make_user("price-viewer", is_staff=True)
    viewer.user_permissions.add(
        Permission.objects.get(content_type__app_label="catalog", codename="view_modelprice")
    )
    assert client_for(viewer).post(url, body, format="json").status_code == 403
    pricing = make_user("pricing", is_staff=True)
    pricing.user_permissions.add(
        *Permission.objects.filter(
            content_type__app_label="catalog", codename__in=["add_modelprice", "view_modelprice"]
        )
    )
    api = client_for(pricing)
    assert api.post(url, {"reason": ""}, format="json").status_code == 400
    past = api.post(f"{base}{first.pk}/withdraw/", body, format="json")
    assert past.status_code == 400 and "effective_from" in past.json()["error"]["fields"]
    assert api.post(f"{base}999999/withdraw/", body, format="json").status_code == 404
    version_8b = catalog_services.version_upsert(
        family=version_70b.family,
        name=f"{version_70b.family.name}-other",
        context_length=1,
        kv_bytes_per_token=1,
        tpot_target_ms=1,
        kv_capacity_tokens=1,
        price_prompt_per_mtok="1",
        price_cached_prompt_per_mtok="1",
        price_completion_per_mtok="1",
    )
    other = f"/api/v1/models/{version_8b.name}/prices/{scheduled.pk}/withdraw/"
    assert api.post(other, body, format="json").status_code == 404  # not that version's
    assert not ModelPrice.objects.filter(withdrawn_at__isnull=False).exists()

    done = api.post(url, body, format="json")
    assert done.status_code == 200, done.content
    assert (done.json()["withdrawn_by"], done.json()["withdrawal_reason"]) == (
        "pricing",
        "postponed",
    )
    history = api.get(base).json()
    assert [(h["id"], h["withdrawn_at"] is not None) for h in history] == [
        (scheduled.pk, True),
        (first.pk, False),
    ]
    assert api.post(url, body, format="json").status_code == 400  # already withdrawn


def test_admin_withdraws_a_scheduled_change_for_those_who_change_prices(
    version_70b: ModelVersion, make_user: Callable[..., Any]
) -> None:
    from django.test import Client

    from tests.controlplane.conftest import grant

    scheduled = change_70b(version_70b)
    first = ModelPrice.objects.get(version=version_70b, effective_from=PRICE_EPOCH)
    url = f"/admin/catalog/modelprice/{scheduled.pk}/withdraw/"

    def client(user: Any) -> Client:
        c = Client()
        c.force_login(user)
        return c

    viewer = grant(make_user("price-viewer", is_staff=True), "catalog.view_modelprice")
    assert client(viewer).post(url, {"reason": "r"}).status_code == 403
    # The version's change permission is not the price permission (the API's).
    version_editor = grant(
        make_user("version-editor", is_staff=True),
        "tenants.operate",
        "catalog.view_modelprice",
        "catalog.change_modelversion",
    )
    assert client(version_editor).post(url, {"reason": "r"}).status_code == 403
    operator = grant(
        make_user("pricing-op", is_staff=True),
        "tenants.operate",
        "catalog.view_modelprice",
        "catalog.add_modelprice",
    )
    admin = client(operator)
    page = admin.get(f"/admin/catalog/modelprice/{scheduled.pk}/change/").content.decode()
    assert url in page  # the link, on a change not yet in force
    assert (
        url.replace(str(scheduled.pk), str(first.pk))
        not in admin.get(f"/admin/catalog/modelprice/{first.pk}/change/").content.decode()
    )
    assert admin.post(url, {"reason": ""}).status_code == 200  # the form again, nothing done
    refused = admin.post(f"/admin/catalog/modelprice/{first.pk}/withdraw/", {"reason": "r"})
    assert refused.status_code == 200 and "has taken effect" in refused.content.decode()
    assert not ModelPrice.objects.filter(withdrawn_at__isnull=False).exists()

    done = admin.post(url, {"reason": "customers asked for notice"})
    assert done.status_code == 302
    row = ModelPrice.objects.get(pk=scheduled.pk)
    assert (row.withdrawn_by, row.withdrawn_by_label, row.withdrawal_reason) == (
        operator,
        "pricing-op",
        "customers asked for notice",
    )
