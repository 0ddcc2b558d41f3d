"""Effective-dated prices (catalog.ModelPrice): usage is billed at the price in force at its
hour, a change is never in the past, the history is append-only in the database, and the
admin and API record who changed a price and why.

The months are in the future (March 2027), so that ``price_change`` schedules a real
change with the real clock; invoices are finalized with an explicit ``now``.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from decimal import Decimal
from html.parser import HTMLParser
from typing import Any

import pytest
from django.contrib.auth.models import Permission
from django.core.exceptions import ValidationError
from django.db import DatabaseError, IntegrityError, connection, transaction
from django.test import Client

from billing import services
from billing.models import Invoice, InvoiceLine, LineKind
from billing.reconciliation import reconcile
from catalog import services as catalog_services
from catalog.models import PRICE_EPOCH, ModelPrice, ModelVersion
from metering.pages import HOUR
from metering.selectors import cost_buckets
from tenants.models import Tenant
from tests.billing.conftest import utc

MAR = utc(2027, 3, 1)
APR = utc(2027, 4, 1)
CHANGE = utc(2027, 3, 16, 12)  # 70B: 0.60 / 0.15 / 0.80 until here, 0.50 / 0.10 / 0.90 after
FINANCE = services.Actor(label="finance-test")

pytestmark = pytest.mark.django_db


def change_70b(version: ModelVersion, **extra: Any) -> ModelPrice:
    return catalog_services.price_change(
        version=version,
        prompt=Decimal("0.50"),
        cached_prompt=Decimal("0.10"),
        completion=Decimal("0.90"),
        effective_from=CHANGE,
        actor_label=extra.pop("actor_label", "pricing-test"),
        reason=extra.pop("reason", "spring price list"),
        **extra,
    )


def usage_lines(invoice: Invoice) -> list[tuple[str, int, Decimal, Decimal]]:
    return [
        (ln.token_type, ln.tokens, ln.unit_price_per_mtok, ln.amount)
        for ln in invoice.lines.filter(kind=LineKind.USAGE).order_by("position")
    ]


def march_draft(tenant: Tenant, version: ModelVersion, add_usage: Callable[..., Any]) -> Invoice:
    """The 70B price change at CHANGE, usage on both sides of it, and March's draft."""
    change_70b(version)
    add_usage(
        tenant, version, utc(2027, 3, 5, 10), prompt=3_000_000, cached=1_000_000, completion=10**6
    )
    add_usage(tenant, version, CHANGE - timedelta(hours=1), completion=500_000)  # last old hour
    add_usage(tenant, version, CHANGE, prompt=1_000_000, completion=250_001)  # first new hour
    add_usage(tenant, version, utc(2027, 3, 31, 23), completion=1_111)
    invoice = services.invoice_draft_build(tenant=tenant, period_start=MAR)
    assert invoice is not None
    return invoice


def test_mid_month_change_bills_each_hour_at_the_price_in_force(
    tenant_a: Tenant, version_70b: ModelVersion, add_usage: Callable[..., Any]
) -> None:
    invoice = march_draft(tenant_a, version_70b, add_usage)
    # Worked by hand, per line, rounded once (half up):
    #   uncached prompt before: 3,000,000 - 1,000,000 at 0.60 = 1.20
    #   uncached prompt after:  1,000,000 at 0.50 = 0.50
    #   cached prompt (before only): 1,000,000 at 0.15 = 0.15
    #   completion before: 1,000,000 + 500,000 at 0.80 = 1.20
    #   completion after: 250,001 + 1,111 = 251,112 at 0.90 = 0.2260008 -> 0.23
    assert usage_lines(invoice) == [
        ("prompt", 2_000_000, Decimal("0.600000"), Decimal("1.20")),
        ("prompt", 1_000_000, Decimal("0.500000"), Decimal("0.50")),
        ("cached_prompt", 1_000_000, Decimal("0.150000"), Decimal("0.15")),
        ("completion", 1_500_000, Decimal("0.800000"), Decimal("1.20")),
        ("completion", 251_112, Decimal("0.900000"), Decimal("0.23")),
    ]
    assert invoice.total == Decimal("3.28")
    line = invoice.lines.get(token_type="completion", unit_price_per_mtok=Decimal("0.9"))
    assert line.amount_exact == Decimal("0.2260008")
    # A month with more than one price says each line's price period.
    descriptions = {
        (ln.token_type, ln.unit_price_per_mtok): ln.description for ln in invoice.lines.all()
    }
    name = version_70b.name
    assert descriptions[("completion", Decimal("0.8"))] == (
        f"{name}: completion tokens, 2027-03-01 00:00–2027-03-16 12:00 UTC"
    )
    assert descriptions[("completion", Decimal("0.9"))] == (
        f"{name}: completion tokens, 2027-03-16 12:00–2027-04-01 00:00 UTC"
    )
    # A month with one price keeps the plain description.
    add_usage(tenant_a, version_70b, utc(2027, 2, 3, 4), completion=1_000_000)
    feb = services.invoice_draft_build(tenant=tenant_a, period_start=utc(2027, 2, 1))
    assert feb is not None
    assert [ln.description for ln in feb.lines.filter(kind=LineKind.USAGE)] == [
        f"{name}: completion tokens"
    ]
    assert usage_lines(feb) == [("completion", 1_000_000, Decimal("0.800000"), Decimal("0.80"))]


def test_late_event_is_adjusted_at_the_price_of_its_hour(
    tenant_a: Tenant, version_70b: ModelVersion, add_usage: Callable[..., Any]
) -> None:
    march = services.invoice_finalize(
        invoice=march_draft(tenant_a, version_70b, add_usage), actor=FINANCE, now=APR
    )
    # Late events: one in an hour before the change, one after it.
    add_usage(tenant_a, version_70b, utc(2027, 3, 10, 0), completion=1_000_000)
    add_usage(tenant_a, version_70b, utc(2027, 3, 20, 0), completion=100_000)
    pending = [
        (d.subject, d.amount)
        for d in reconcile(period_start=MAR, tenant=tenant_a).differences
        if d.check == "usage/invoices"
    ]
    name = version_70b.name
    assert sorted(pending) == [
        (f"{name} completion at 0.8/Mtok", Decimal("0.80")),
        (f"{name} completion at 0.9/Mtok", Decimal("0.09")),
    ]
    april = services.invoice_draft_build(tenant=tenant_a, period_start=APR)
    assert april is not None
    adjustments = [
        (ln.adjusts_period_start, ln.token_type, ln.tokens, ln.unit_price_per_mtok, ln.amount)
        for ln in april.lines.filter(kind=LineKind.ADJUSTMENT).order_by("position")
    ]
    # Before the change: 2,500,000 at 0.80 = 2.00, minus 1.20 billed = 0.80.
    # After: 351,112 at 0.90 = 0.3160008 -> 0.32, minus 0.23 billed = 0.09.
    assert adjustments == [
        (MAR, "completion", 1_000_000, Decimal("0.800000"), Decimal("0.80")),
        (MAR, "completion", 100_000, Decimal("0.900000"), Decimal("0.09")),
    ]
    # March is untouched, and once April is final, March reconciles clean.
    assert usage_lines(march) == usage_lines(Invoice.objects.get(pk=march.pk))
    services.invoice_finalize(invoice=april, actor=FINANCE, reason="test", now=utc(2027, 5, 1))
    report = reconcile(period_start=MAR, tenant=tenant_a)
    assert [d for d in report.differences if d.check == "usage/invoices"] == []


def test_reconciliation_prices_request_log_by_the_hour_each_request_started(
    tenant_a: Tenant,
    version_70b: ModelVersion,
    add_usage: Callable[..., Any],
    add_request: Callable[..., Any],
) -> None:
    change_70b(version_70b)
    for started, hour in ((CHANGE - timedelta(seconds=1), CHANGE - timedelta(hours=1)),):
        add_request(tenant_a, version_70b, started, completion=500_000)
        add_usage(tenant_a, version_70b, hour, completion=500_000)
    add_request(tenant_a, version_70b, CHANGE, completion=250_000)
    add_usage(tenant_a, version_70b, CHANGE, completion=250_000)
    # A request logged but missing from usage, after the change: priced at 0.90.
    add_request(tenant_a, version_70b, CHANGE + timedelta(minutes=5), completion=100_000)
    report = reconcile(period_start=MAR, tenant=tenant_a)
    behind = [d for d in report.differences if d.check == "request_log/usage"]
    assert [(d.subject, d.amount) for d in behind] == [
        (f"{version_70b.name} completion at 0.9/Mtok", Decimal("0.09"))
    ]


def test_costs_price_each_hour_of_a_bucket_at_its_own_price(
    tenant_a: Tenant, version_70b: ModelVersion, add_usage: Callable[..., Any]
) -> None:
    change_70b(version_70b)
    add_usage(tenant_a, version_70b, CHANGE - timedelta(hours=1), completion=500_000)
    add_usage(tenant_a, version_70b, CHANGE, completion=250_001)
    from console.selectors import window  # the console's day-window helper

    day = CHANGE.date()
    buckets = cost_buckets(
        tenant=tenant_a, window=window(day, day, 24 * HOUR), group_by=("line_item",)
    )
    results = [r for b in buckets for r in b.results]
    # 500,000 at 0.80 + 250,001 at 0.90 = 0.40 + 0.2250009, exact (costs are not rounded).
    assert [(r.line_item, r.quantity, r.amount) for r in results] == [
        (f"{version_70b.name}, output", 750_001, Decimal("0.6250009"))
    ]


def test_a_change_in_the_past_is_refused_and_writes_nothing(version_70b: ModelVersion) -> None:
    before = list(ModelPrice.objects.values_list("pk", flat=True))
    hour = catalog_services.current_hour()

    def refused(words: str, **change: Any) -> None:
        values = {"prompt": "1", "cached_prompt": "0.5", "completion": "2", "reason": "why"}
        with pytest.raises(ValidationError) as exc:
            catalog_services.price_change(
                version=version_70b, actor_label="pricing-test", **{**values, **change}
            )
        assert words in str(exc.value)

    refused("in the past", effective_from=hour - timedelta(hours=1))
    refused("in the past", effective_from=utc(2026, 1, 1))
    refused("start of a UTC hour", effective_from=hour + timedelta(minutes=30))
    refused("time zone", effective_from=(hour + timedelta(hours=2)).replace(tzinfo=None))
    refused("cannot cost more", cached_prompt="2")
    refused("why", reason=" ")
    assert list(ModelPrice.objects.values_list("pk", flat=True)) == before


def test_a_change_from_the_current_hour_is_the_price_shown_now(
    version_70b: ModelVersion, plain_staff: Any, client_for: Callable[..., Any]
) -> None:
    first = ModelPrice.objects.get(version=version_70b)
    assert first.effective_from == PRICE_EPOCH and first.replaces is None
    now = catalog_services.price_change(
        version=version_70b,
        prompt="0.70",
        cached_prompt="0.20",
        completion="0.95",
        actor_label="pricing-test",
        reason="from now",
    )
    assert now.effective_from == catalog_services.current_hour()
    assert now.replaces == first  # the before
    later = change_70b(version_70b, reason="scheduled")
    assert later.replaces == now
    with pytest.raises(ValidationError, match="already has a price from that hour"):
        change_70b(version_70b)
    families = client_for(plain_staff).get("/api/v1/models/").json()
    shown = next(v for f in families for v in f["versions"] if v["name"] == version_70b.name)
    assert (
        shown["price_prompt_per_mtok"],
        shown["price_cached_prompt_per_mtok"],
        shown["price_completion_per_mtok"],
    ) == ("0.700000", "0.200000", "0.950000")


def test_database_refuses_to_change_or_delete_a_price(version_70b: ModelVersion) -> None:
    row = ModelPrice.objects.get(version=version_70b)
    for sql in (
        "UPDATE catalog_modelprice SET price_completion_per_mtok = 0 WHERE id = %s",
        "UPDATE catalog_modelprice SET reason = 'rewritten' WHERE id = %s",
        "DELETE FROM catalog_modelprice WHERE id = %s",
    ):
        with pytest.raises((IntegrityError, DatabaseError), match="append-only"):
            with transaction.atomic(), connection.cursor() as cur:
                cur.execute(sql, [row.pk])
    with pytest.raises((IntegrityError, DatabaseError)), transaction.atomic():
        ModelPrice.objects.filter(pk=row.pk).update(price_prompt_per_mtok=Decimal(0))
    # Inserts are checked too: an hour boundary, cached <= prompt, non-negative, who/why.
    insert = (
        "INSERT INTO catalog_modelprice (version_id, effective_from, price_prompt_per_mtok, "
        "price_cached_prompt_per_mtok, price_completion_per_mtok, currency, actor_label, "
        "reason, created_at) VALUES (%s, %s, %s, %s, %s, 'usd', %s, %s, now())"
    )
    hour = utc(2030, 1, 1, 5)
    for values in (
        (hour + timedelta(minutes=1), 1, 1, 1, "x", "y"),
        (hour, 1, 2, 1, "x", "y"),
        (hour, -1, 0, 1, "x", "y"),
        (hour, 1, 1, 1, "", "y"),
        (hour, 1, 1, 1, "x", ""),
        (utc(1970, 1, 1), 1, 1, 1, "x", "y"),  # (version, effective_from) is unique
    ):
        with pytest.raises(IntegrityError), transaction.atomic(), connection.cursor() as cur:
            cur.execute(insert, [version_70b.pk, *values])
    assert ModelPrice.objects.get(pk=row.pk).price_completion_per_mtok == Decimal("0.8")


def test_version_upsert_changes_prices_only_through_a_recorded_change(
    version_70b: ModelVersion,
) -> None:
    from tenants.demo import MODELS

    MODELS[0].upsert()  # the same prices again: no change, no row
    assert ModelPrice.objects.filter(version=version_70b).count() == 1
    fields = {"family": version_70b.family, "name": version_70b.name}
    with pytest.raises(ValidationError, match="why"):
        catalog_services.version_upsert(**fields, price_completion_per_mtok="0.85")
    assert ModelPrice.objects.filter(version=version_70b).count() == 1
    catalog_services.version_upsert(
        **fields, price_completion_per_mtok="0.85", price_reason="seed update"
    )
    row = ModelPrice.objects.filter(version=version_70b).latest("effective_from")
    assert (row.price_prompt_per_mtok, row.price_completion_per_mtok) == (
        Decimal("0.6"),
        Decimal("0.85"),
    )
    assert (row.actor_label, row.reason) == ("system:catalog", "seed update")
    assert row.effective_from == catalog_services.current_hour()


class _FormValues(HTMLParser):
    """The values a browser would submit for the page's main form."""

    def __init__(self) -> None:
        super().__init__()
        self.values: dict[str, Any] = {}
        self._textarea: str | None = None
        self._select: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        name = a.get("name")
        if tag == "input" and name and a.get("type") not in ("submit", "button"):
            if a.get("type") == "checkbox":
                if "checked" in a:
                    self.values[name] = "on"
            else:
                self.values[name] = a.get("value") or ""
        elif tag == "textarea" and name:
            self._textarea = name
            self.values[name] = ""
        elif tag == "select" and name:
            self._select = name
            self.values.setdefault(name, "")
        elif tag == "option" and self._select and "selected" in a:
            self.values[self._select] = a.get("value") or ""

    def handle_endtag(self, tag: str) -> None:
        if tag == "textarea":
            self._textarea = None
        elif tag == "select":
            self._select = None

    def handle_data(self, data: str) -> None:
        if self._textarea:
            self.values[self._textarea] += data


def form_of(page: Any) -> dict[str, Any]:
    parser = _FormValues()
    parser.feed(page.content.decode())
    return parser.values


def test_admin_records_who_and_why_and_refuses_the_past(
    version_70b: ModelVersion, make_user: Callable[..., Any]
) -> None:
    root = make_user("pricing-root", is_staff=True, is_superuser=True)
    client = Client()
    client.force_login(root)
    url = f"/admin/catalog/modelversion/{version_70b.pk}/change/"
    data = form_of(client.get(url))
    assert data["price_completion_per_mtok"] == "0.800000"

    # No reason, or a past hour: the form says so and nothing is written.
    past = catalog_services.current_hour() - timedelta(hours=1)
    for extra in (
        {"price_completion_per_mtok": "0.95"},
        {
            "price_completion_per_mtok": "0.95",
            "price_change_reason": "r",
            "price_effective_from": f"{past:%Y-%m-%d %H:%M:%S}",
        },
    ):
        page = client.post(url, {**data, **extra})
        assert page.status_code == 200  # the form again, with its errors
        assert page.context["adminform"].form.errors
    assert ModelPrice.objects.filter(version=version_70b).count() == 1

    page = client.post(
        url, {**data, "price_completion_per_mtok": "0.95", "price_change_reason": "admin test"}
    )
    assert page.status_code == 302, page.context and page.context["adminform"].form.errors
    row = ModelPrice.objects.filter(version=version_70b).latest("effective_from")
    assert (row.actor, row.actor_label, row.reason) == (root, "pricing-root", "admin test")
    assert row.price_completion_per_mtok == Decimal("0.95")
    assert row.effective_from == catalog_services.current_hour()
    # The history is shown, and no price row can be edited or deleted there.
    assert b"admin test" in client.get(url).content
    assert client.get(f"/admin/catalog/modelprice/{row.pk}/delete/").status_code == 403
    assert client.get("/admin/catalog/modelprice/").status_code == 200


def test_admin_adds_a_version_with_its_first_price(
    version_70b: ModelVersion, make_user: Callable[..., Any]
) -> None:
    root = make_user("pricing-root", is_staff=True, is_superuser=True)
    client = Client()
    client.force_login(root)
    data = form_of(client.get(f"/admin/catalog/modelversion/{version_70b.pk}/change/"))
    data.update(
        {
            "name": f"{version_70b.family.name}-2099-01",
            "is_current": "",
            "price_prompt_per_mtok": "1.5",
            "price_cached_prompt_per_mtok": "0.5",
            "price_completion_per_mtok": "2",
        }
    )
    data = {k: v for k, v in data.items() if not k.startswith(("prices-", "replicas-"))}
    data.update({f"{p}-{k}": 0 for p in ("prices", "replicas") for k in ("TOTAL_FORMS",)})
    data.update({f"{p}-INITIAL_FORMS": 0 for p in ("prices", "replicas")})
    data.pop("is_current")
    page = client.post("/admin/catalog/modelversion/add/", data)
    assert page.status_code == 302, page.context and page.context["adminform"].form.errors
    version = ModelVersion.objects.get(name=data["name"])
    row = ModelPrice.objects.get(version=version)
    assert (row.effective_from, row.price_prompt_per_mtok, row.actor) == (
        PRICE_EPOCH,
        Decimal("1.5"),
        root,
    )


def test_admin_price_writes_need_the_price_permission_not_the_version_one(
    version_70b: ModelVersion, make_user: Callable[..., Any]
) -> None:
    """The admin asks for what the prices API asks for: ``catalog.add_modelprice``. An
    operator who may edit a version but not its prices sees them read-only, and a post
    that changes them writes nothing."""
    from tests.controlplane.conftest import grant

    editor = grant(
        make_user("version-editor", is_staff=True),
        "tenants.operate",
        "catalog.view_modelversion",
        "catalog.change_modelversion",
        "catalog.add_modelversion",
    )
    client = Client()
    client.force_login(editor)
    url = f"/admin/catalog/modelversion/{version_70b.pk}/change/"
    page = client.get(url)
    assert page.status_code == 200
    form = page.context["adminform"].form
    assert form.fields["price_completion_per_mtok"].disabled
    data = form_of(page)
    page = client.post(
        url,
        {
            **data,
            "context_length": "65536",
            "price_completion_per_mtok": "0.95",
            "price_change_reason": "not allowed",
        },
    )
    assert page.status_code == 302  # the version's own fields are saved ...
    version_70b.refresh_from_db()
    assert version_70b.context_length == 65536
    # ... and its prices are not
    assert ModelPrice.objects.filter(version=version_70b).count() == 1
    assert client.get("/admin/catalog/modelversion/add/").status_code == 403  # needs a price

    pricing = grant(editor, "catalog.add_modelprice")
    client.force_login(pricing)
    page = client.get(url)
    assert not page.context["adminform"].form.fields["price_completion_per_mtok"].disabled
    page = client.post(
        url, {**form_of(page), "price_completion_per_mtok": "0.95", "price_change_reason": "ok"}
    )
    assert page.status_code == 302, page.context and page.context["adminform"].form.errors
    assert ModelPrice.objects.filter(version=version_70b).count() == 2
    assert client.get("/admin/catalog/modelversion/add/").status_code == 200


def test_api_records_who_and_why_and_needs_the_permission(
    version_70b: ModelVersion, make_user: Callable[..., Any], client_for: Callable[..., Any]
) -> None:
    url = f"/api/v1/models/{version_70b.name}/prices/"
    body = {
        "price_prompt_per_mtok": "0.50",
        "price_cached_prompt_per_mtok": "0.10",
        "price_completion_per_mtok": "0.90",
        "effective_from": CHANGE.isoformat(),
        "reason": "spring price list",
    }
    plain_staff = make_user("staff-no-perm", is_staff=True)
    assert client_for(plain_staff).post(url, body, format="json").status_code == 403
    assert client_for(plain_staff).get(url).status_code == 403
    pricing = make_user("pricing", is_staff=True)
    pricing.user_permissions.add(
        *Permission.objects.filter(
            content_type__app_label="catalog", codename__in=["add_modelprice", "view_modelprice"]
        )
    )
    api = client_for(pricing)
    past = catalog_services.current_hour() - timedelta(hours=1)
    refused = api.post(url, {**body, "effective_from": past.isoformat()}, format="json")
    assert refused.status_code == 400, refused.content
    assert "effective_from" in refused.json()["error"]["fields"]
    assert api.post(url, {**body, "reason": ""}, format="json").status_code == 400
    assert ModelPrice.objects.filter(version=version_70b).count() == 1

    created = api.post(url, body, format="json")
    assert created.status_code == 201, created.content
    assert created.json()["actor"] == "pricing"
    row = ModelPrice.objects.get(version=version_70b, effective_from=CHANGE)
    assert (row.actor, row.reason) == (pricing, "spring price list")
    history = api.get(url).json()
    assert [(h["effective_from"], h["price_completion_per_mtok"]) for h in history] == [
        ("2027-03-16T12:00:00Z", "0.900000"),
        ("1970-01-01T00:00:00Z", "0.800000"),
    ]
    assert history[0]["replaces_effective_from"] == "1970-01-01T00:00:00Z"
    assert api.get("/api/v1/models/no-such-version/prices/").status_code == 404
    assert InvoiceLine.objects.count() == 0
