"""GET /api/v1/tenants/<id>/costs (and /organization/costs): exact money per UTC day at the
catalog's prices; who may see usage and costs; tenant isolation through every parameter; the
/organization routes' tenant choice; OpenAI's own SDK reading both reports over HTTP."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest
from rest_framework.test import APIClient

from billing.pricing import token_cost
from catalog import services as catalog_services
from catalog.models import ModelVersion
from catalog.selectors import price_in_force
from metering.models import Usage
from tenants import services
from tenants.models import Role, Tenant

from .helpers import error_of
from .usage_rows import DAY, HOUR, T0, add_usage, at, exact_json, make_version_8b

pytestmark = pytest.mark.django_db


def costs_url(tenant: Tenant) -> str:
    return f"/api/v1/tenants/{tenant.id}/costs"


def usage_url(tenant: Tenant) -> str:
    return f"/api/v1/tenants/{tenant.id}/usage/completions"


@pytest.fixture
def priced(tenant_a: Tenant, version_70b: ModelVersion) -> dict[str, Any]:
    """Day 0 of tenant A: the 70B model over two hours and the 8B model once.

    Prices per million tokens: 70B 0.60 input / 0.15 cached / 0.80 output; 8B 0.06 / 0.015 /
    0.08. By hand:
      70B input  (1,234,567 - 234,567) = 1,000,000 x 0.60 / 1e6 = 0.6
      70B cached 234,567 x 0.15 / 1e6 = 0.03518505
      70B output 89,001 x 0.80 / 1e6 = 0.0712008
      8B  input  333 x 0.06 / 1e6 = 0.00001998
      8B  output 7 x 0.08 / 1e6 = 0.00000056   (no cached tokens: no cached line)
      day total 0.70640639
    Day 2 holds 1,000 70B output tokens (0.0008); day 1 is empty.
    """
    version_8b = make_version_8b()
    key1 = services.api_key_create(tenant=tenant_a, name="k1")[0].pk
    key2 = services.api_key_create(tenant=tenant_a, name="k2")[0].pk
    add_usage(
        tenant=tenant_a,
        key=key1,
        version=version_70b,
        offset=HOUR,
        requests=10,
        prompt=1_000_000,
        cached=200_000,
        completion=80_000,
    )
    add_usage(
        tenant=tenant_a,
        key=key2,
        version=version_70b,
        offset=23 * HOUR,
        requests=3,
        prompt=234_567,
        cached=34_567,
        completion=9_001,
    )
    add_usage(
        tenant=tenant_a, key=key1, version=version_8b, offset=5 * HOUR, prompt=333, completion=7
    )
    add_usage(tenant=tenant_a, key=key1, version=version_70b, offset=2 * DAY, completion=1000)
    return {"key1": str(key1), "key2": str(key2), "m70": version_70b.name, "m8": version_8b.name}


def test_costs_equal_exact_token_cost_sums_per_line_item(
    tenant_a: Tenant, priced: dict[str, Any], owner_a: Any, client_for: Any
) -> None:
    client = client_for(owner_a)
    response = client.get(
        costs_url(tenant_a),
        {"start_time": T0, "end_time": T0 + 3 * DAY, "group_by": "line_item"},
    )
    assert response.status_code == 200, response.content
    body = exact_json(response)
    day0, day1, day2 = body["data"]
    assert [(b["start_time"], b["end_time"]) for b in body["data"]] == [
        (T0 + d * DAY, T0 + (d + 1) * DAY) for d in range(3)
    ]
    m70, m8 = priced["m70"], priced["m8"]
    got = {r["line_item"]: (r["amount"]["value"], r["quantity"]) for r in day0["results"]}
    assert got == {
        f"{m70}, input": (Decimal("0.6"), 1_000_000),
        f"{m70}, cached input": (Decimal("0.03518505"), 234_567),
        f"{m70}, output": (Decimal("0.0712008"), 89_001),
        f"{m8}, input": (Decimal("0.00001998"), 333),
        f"{m8}, output": (Decimal("0.00000056"), 7),
    }
    assert all(
        r["object"] == "organization.costs.result"
        and r["amount"]["currency"] == "usd"
        and r["quantity_unit"] == "tokens"
        and r["project_id"] is None
        for r in day0["results"]
    )
    assert day1["results"] == []
    assert [(r["line_item"], r["amount"]["value"]) for r in day2["results"]] == [
        (f"{m70}, output", Decimal("0.0008"))
    ]

    # Ungrouped: one result per day, the exact sum; the digits travel as a JSON number.
    response = client.get(costs_url(tenant_a), {"start_time": T0, "end_time": T0 + DAY})
    (result,) = exact_json(response)["data"][0]["results"]
    assert result["amount"] == {"value": Decimal("0.70640639"), "currency": "usd"}
    assert result["line_item"] is None and result["quantity"] is None
    assert b'"value":0.70640639,' in response.content
    # The same figure as pricing every hourly row on its own.
    by_row = Decimal(0)
    for row in Usage.objects.filter(tenant=tenant_a, hour__lt=at(DAY)).select_related(
        "model_version"
    ):
        price = price_in_force(version=row.model_version, at=row.hour)
        assert price is not None
        by_row += token_cost(row.prompt_tokens - row.cached_tokens, price.price_prompt_per_mtok)
        by_row += token_cost(row.cached_tokens, price.price_cached_prompt_per_mtok)
        by_row += token_cost(row.completion_tokens, price.price_completion_per_mtok)
    assert by_row == Decimal("0.70640639")


def test_costs_group_by_model_and_key_and_filter_line_items(
    tenant_a: Tenant, priced: dict[str, Any], owner_a: Any, client_for: Any
) -> None:
    client = client_for(owner_a)
    base = {"start_time": T0, "end_time": T0 + DAY}
    response = client.get(costs_url(tenant_a), {**base, "group_by": "model,api_key_id"})
    got = {
        (r["model"], r["api_key_id"]): r["amount"]["value"]
        for r in exact_json(response)["data"][0]["results"]
    }
    k1, k2, m70, m8 = priced["key1"], priced["key2"], priced["m70"], priced["m8"]
    # Per million tokens: key1 70B 800,000 x 0.60 + 200,000 x 0.15 + 80,000 x 0.80;
    # key2 70B 200,000 x 0.60 + 34,567 x 0.15 + 9,001 x 0.80; key1 8B 333 x 0.06 + 7 x 0.08.
    assert got == {
        (m70, k1): Decimal("0.574"),
        (m70, k2): Decimal("0.13238585"),
        (m8, k1): Decimal("0.00002054"),
    }
    assert sum(got.values()) == Decimal("0.70640639")

    response = client.get(
        costs_url(tenant_a),
        {**base, "group_by": "line_item", "line_items": f"{m70}, cached input"},
    )
    (only,) = exact_json(response)["data"][0]["results"]
    assert (only["line_item"], only["amount"]["value"]) == (
        f"{m70}, cached input",
        Decimal("0.03518505"),
    )
    response = client.get(costs_url(tenant_a), {**base, "api_key_ids": k2, "models": m70})
    assert exact_json(response)["data"][0]["results"][0]["amount"]["value"] == Decimal("0.13238585")


def test_amounts_keep_all_twelve_decimal_places(
    tenant_a: Tenant, version_70b: ModelVersion, owner_a: Any, client_for: Any
) -> None:
    odd = catalog_services.version_upsert(
        family=version_70b.family,
        name="llama-70b-odd",
        context_length=8192,
        kv_bytes_per_token=1,
        tpot_target_ms=50,
        kv_capacity_tokens=1000,
        price_prompt_per_mtok=Decimal("0.123457"),
        price_cached_prompt_per_mtok=Decimal("0.000001"),
        price_completion_per_mtok=Decimal("999999.999999"),
    )
    key = services.api_key_create(tenant=tenant_a, name="k")[0].pk
    add_usage(tenant=tenant_a, key=key, version=odd, offset=0, prompt=2, cached=1, completion=3)
    response = client_for(owner_a).get(
        costs_url(tenant_a),
        {"start_time": T0, "end_time": T0 + DAY, "group_by": "line_item"},
    )
    values = {
        r["line_item"]: r["amount"]["value"] for r in exact_json(response)["data"][0]["results"]
    }
    assert values == {
        "llama-70b-odd, input": Decimal("0.000000123457"),
        "llama-70b-odd, cached input": Decimal("0.000000000001"),
        "llama-70b-odd, output": Decimal("2.999999999997"),
    }
    assert b'"value":0.000000000001,' in response.content


# -- roles and isolation --------------------------------------------------------------------


@pytest.mark.parametrize("role", Role.values)
def test_every_role_sees_usage_but_only_owner_admin_billing_see_costs(
    tenant_a: Tenant, priced: dict[str, Any], member_of: Any, client_for: Any, role: str
) -> None:
    user = (
        tenant_a.memberships.get(role=Role.OWNER).user
        if role == Role.OWNER
        else member_of(tenant_a, role)
    )
    client = client_for(user)
    query = {"start_time": T0, "end_time": T0 + DAY}
    usage = client.get(usage_url(tenant_a), query)
    assert usage.status_code == 200
    assert usage.json()["data"][0]["results"][0]["input_tokens"] == 1_234_900
    costs = client.get(costs_url(tenant_a), query)
    org_costs = client.get("/api/v1/organization/costs", query)
    if role == Role.MEMBER:
        assert (costs.status_code, org_costs.status_code) == (403, 403)
        assert error_of(costs)["type"] == "permission_error"
        assert "value" not in costs.content.decode()
    else:
        assert (costs.status_code, org_costs.status_code) == (200, 200)
        assert exact_json(costs)["data"][0]["results"][0]["amount"]["value"] == Decimal(
            "0.70640639"
        )


def test_operators_see_any_tenant(
    tenant_a: Tenant, priced: dict[str, Any], operator: Any, client_for: Any
) -> None:
    client = client_for(operator)
    query = {"start_time": T0, "end_time": T0 + DAY}
    assert client.get(costs_url(tenant_a), query).status_code == 200
    assert client.get("/api/v1/organization/costs", {**query, "tenant_id": tenant_a.id}).json()
    # Operators belong to no tenant: the organization routes need an explicit tenant_id.
    response = client.get("/api/v1/organization/usage/completions", query)
    assert response.status_code == 400 and error_of(response)["param"] == "tenant_id"


def test_another_tenants_usage_never_shows(
    tenant_a: Tenant,
    tenant_b: Tenant,
    priced: dict[str, Any],
    version_70b: ModelVersion,
    owner_a: Any,
    client_for: Any,
) -> None:
    key_b = services.api_key_create(tenant=tenant_b, name="b")[0].pk
    add_usage(tenant=tenant_b, key=key_b, version=version_70b, offset=HOUR, prompt=7_777_777)
    client = client_for(owner_a)
    query = {"start_time": T0, "end_time": T0 + DAY}

    for path in (usage_url(tenant_b), costs_url(tenant_b), usage_url(tenant_b) + ".csv"):
        response = client.get(path, query)
        assert response.status_code == 404, path
        assert error_of(response)["type"] == "not_found_error"
    for path in ("/api/v1/organization/usage/completions", "/api/v1/organization/costs"):
        assert client.get(path, {**query, "tenant_id": tenant_b.id}).status_code == 404
        assert client.get(path, {**query, "tenant_id": "nope"}).status_code == 400
    # B's key id through A's own report filters to nothing: no error, no data.
    for path in (usage_url(tenant_a), costs_url(tenant_a)):
        response = client.get(path, {**query, "api_key_ids": str(key_b)})
        assert response.status_code == 200 and response.json()["data"][0]["results"] == []
    # And B's rows never enter A's sums.
    usage = client.get(usage_url(tenant_a), {**query, "group_by": "api_key_id"}).json()
    assert {r["api_key_id"] for r in usage["data"][0]["results"]} == {
        priced["key1"],
        priced["key2"],
    }
    assert sum(r["input_tokens"] for r in usage["data"][0]["results"]) == 1_234_900
    assert "7777777" not in client.get(usage_url(tenant_a), query).content.decode()


def test_anonymous_callers_get_401(tenant_a: Tenant) -> None:
    for path in (usage_url(tenant_a), costs_url(tenant_a), "/api/v1/organization/costs"):
        response = APIClient().get(path, {"start_time": T0})
        assert response.status_code == 401
        assert error_of(response)["type"] == "authentication_error"


def test_organization_routes_default_to_the_callers_only_tenant(
    tenant_a: Tenant, tenant_b: Tenant, priced: dict[str, Any], owner_a: Any, client_for: Any
) -> None:
    client = client_for(owner_a)
    query = {"start_time": T0, "end_time": T0 + DAY}
    org = client.get("/api/v1/organization/usage/completions", query)
    assert org.status_code == 200
    assert org.json() == client.get(usage_url(tenant_a), query).json()
    assert client.get("/api/v1/organization/costs", query).content == (
        client.get(costs_url(tenant_a), query).content
    )

    services.membership_add(tenant=tenant_b, user=owner_a, role=Role.MEMBER)
    ambiguous = client.get("/api/v1/organization/usage/completions", query)
    assert ambiguous.status_code == 400
    assert error_of(ambiguous)["param"] == "tenant_id"
    chosen = client.get(
        "/api/v1/organization/usage/completions", {**query, "tenant_id": tenant_b.id}
    )
    assert chosen.status_code == 200 and chosen.json()["data"][0]["results"] == []
    # In B this user is a plain member: usage yes, money no.
    chosen_costs = client.get("/api/v1/organization/costs", {**query, "tenant_id": tenant_b.id})
    assert chosen_costs.status_code == 403


BAD_COST_QUERIES = [
    ({"start_time": T0, "bucket_width": "1h"}, "bucket_width"),
    ({"start_time": T0, "bucket_width": "1m"}, "bucket_width"),
    ({"start_time": T0, "limit": "181"}, "limit"),
    ({"start_time": T0, "limit": "0"}, "limit"),
    ({"start_time": T0, "group_by": "user_id"}, "group_by"),
    ({"start_time": T0, "group_by": "project_id"}, "group_by"),
    ({"start_time": T0, "end_time": T0 - DAY}, "end_time"),
    ({"start_time": T0, "project_ids": "p"}, "project_ids"),
    ({"end_time": T0}, "start_time"),
    ({"start_time": T0, "format": "csv"}, "format"),
]


@pytest.mark.parametrize(("params", "param"), BAD_COST_QUERIES)
def test_bad_cost_parameters_are_400_naming_the_parameter(
    tenant_a: Tenant, owner_a: Any, client_for: Any, params: dict[str, Any], param: str
) -> None:
    response = client_for(owner_a).get(costs_url(tenant_a), params)
    assert response.status_code == 400, response.content
    assert error_of(response)["param"] == param


@pytest.mark.parametrize(("limit", "pages"), [(None, 29), (30, 7), (180, 2)])
def test_cost_pages_cover_every_day_once(
    tenant_a: Tenant,
    priced: dict[str, Any],
    owner_a: Any,
    client_for: Any,
    limit: int | None,
    pages: int,
) -> None:
    client = client_for(owner_a)
    params: dict[str, Any] = {"start_time": T0, "end_time": T0 + 200 * DAY}
    if limit is not None:
        params["limit"] = limit
    per_page = limit or 7  # OpenAI's default for costs
    starts: list[int] = []
    total = Decimal(0)
    for _ in range(pages):
        body = exact_json(client.get(costs_url(tenant_a), params))
        assert len(body["data"]) == (per_page if body["has_more"] else 200 - len(starts))
        starts += [b["start_time"] for b in body["data"]]
        total += sum(r["amount"]["value"] for b in body["data"] for r in b["results"])
        params["page"] = body["next_page"]
    assert body["has_more"] is False and body["next_page"] is None
    assert starts == [T0 + d * DAY for d in range(200)]
    assert total == Decimal("0.70640639") + Decimal("0.0008")


# -- OpenAI's SDK over HTTP -----------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_openai_sdk_admin_client_reads_usage_and_costs(
    live_server: Any, tenant_a: Tenant, priced: dict[str, Any], owner_a: Any
) -> None:
    from openai import OpenAI
    from openai.types.admin.organization.usage_costs_response import (
        DataResultOrganizationCostsResult,
    )

    _, token = services.api_token_create(user=owner_a)
    client = OpenAI(api_key="unused", admin_api_key=token, base_url=f"{live_server.url}/api/v1")
    usage = client.admin.organization.usage.completions(
        start_time=T0, end_time=T0 + 3 * DAY, group_by=["model"], models=[priced["m70"]]
    )
    assert [b.start_time for b in usage.data] == [T0, T0 + DAY, T0 + 2 * DAY]
    (day0,) = usage.data[0].results
    assert day0.object == "organization.usage.completions.result"
    assert (day0.model, day0.input_tokens, day0.input_cached_tokens, day0.output_tokens) == (
        priced["m70"],
        1_234_567,
        234_567,
        89_001,
    )
    assert usage.data[1].results == [] and usage.has_more is False

    costs = client.admin.organization.usage.costs(
        start_time=T0, end_time=T0 + DAY, group_by=["line_item"]
    )
    results = costs.data[0].results
    rows = [r for r in results if isinstance(r, DataResultOrganizationCostsResult)]
    assert rows == results  # every row of a costs page is a costs result
    items = {r.line_item: r for r in rows}
    cached = items[f"{priced['m70']}, cached input"]
    assert cached.amount is not None and cached.amount.currency == "usd"
    assert cached.amount.value == pytest.approx(0.03518505)  # the SDK itself parses floats
    assert (cached.quantity, cached.quantity_unit) == (234_567, "tokens")
    # Paging through the SDK with its own cursor argument.
    first = client.admin.organization.usage.completions(
        start_time=T0, end_time=T0 + 3 * DAY, bucket_width="1h", limit=24
    )
    assert first.has_more and first.next_page
    second = client.admin.organization.usage.completions(
        start_time=T0, end_time=T0 + 3 * DAY, bucket_width="1h", limit=24, page=first.next_page
    )
    assert second.data[0].start_time == T0 + DAY
