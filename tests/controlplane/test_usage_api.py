"""GET /api/v1/tenants/<id>/usage/completions (and /organization/usage/completions): the
hourly rollup in OpenAI's usage-API shape, bucketed on the UTC grid, paged, filtered, grouped,
and exported as CSV with the same numbers."""

from __future__ import annotations

import csv
import io
import random
import uuid
from typing import Any

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from catalog.models import ModelVersion
from metering.pages import encode_cursor
from tenants import services
from tenants.models import Tenant

from .helpers import error_of
from .usage_rows import DAY, HOUR, T0, add_usage, make_version_8b

pytestmark = pytest.mark.django_db

USAGE_RESULT_KEYS = {
    "object",
    "input_tokens",
    "input_cached_tokens",
    "output_tokens",
    "input_audio_tokens",
    "output_audio_tokens",
    "num_model_requests",
    "project_id",
    "user_id",
    "api_key_id",
    "model",
    "batch",
}


def url(tenant: Tenant, suffix: str = "") -> str:
    return f"/api/v1/tenants/{tenant.id}/usage/completions{suffix}"


def get_ok(client: APIClient, path: str, **params: Any) -> dict[str, Any]:
    response = client.get(path, params)
    assert response.status_code == 200, response.content
    body: dict[str, Any] = response.json()
    assert body["object"] == "page"
    return body


def totals(result: dict[str, Any]) -> tuple[int, int, int, int]:
    return (
        result["num_model_requests"],
        result["input_tokens"],
        result["input_cached_tokens"],
        result["output_tokens"],
    )


@pytest.fixture
def owner_client(owner_a: Any, client_for: Any) -> APIClient:
    client: APIClient = client_for(owner_a)
    return client


def test_daily_buckets_follow_utc_midnight_and_are_contiguous(
    tenant_a: Tenant, version_70b: ModelVersion, owner_client: APIClient
) -> None:
    key = services.api_key_create(tenant=tenant_a, name="k")[0].pk
    rows = [
        (-HOUR, 1, 10, 0, 1),  # the previous day: before the range
        (0, 2, 1000, 400, 50),  # first hour of day 0
        (23 * HOUR, 3, 500, 0, 20),  # last hour of day 0
        (DAY, 4, 70, 7, 9),  # first hour of day 1: not day 0
        (3 * DAY + 12 * HOUR, 5, 11, 11, 2),  # day 3
        (4 * DAY, 6, 99, 0, 9),  # day 4 00:00: the end is exclusive
    ]
    for offset, requests, prompt, cached, completion in rows:
        add_usage(
            tenant=tenant_a,
            key=key,
            version=version_70b,
            offset=offset,
            requests=requests,
            prompt=prompt,
            cached=cached,
            completion=completion,
        )

    # A start inside day 0 is floored to midnight; the end is exclusive.
    body = get_ok(owner_client, url(tenant_a), start_time=T0 + 5 * HOUR, end_time=T0 + 4 * DAY)

    assert [(b["start_time"], b["end_time"]) for b in body["data"]] == [
        (T0 + d * DAY, T0 + (d + 1) * DAY) for d in range(4)
    ]
    assert all(b["object"] == "bucket" for b in body["data"])
    day0, day1, day2, day3 = (b["results"] for b in body["data"])
    assert len(day0) == 1 and set(day0[0]) == USAGE_RESULT_KEYS
    # input_tokens includes the cached ones (cached is a subset of prompt).
    assert totals(day0[0]) == (5, 1500, 400, 70)
    assert totals(day1[0]) == (4, 70, 7, 9)
    assert day2 == []  # an empty day is still a bucket
    assert totals(day3[0]) == (5, 11, 11, 2)
    assert day0[0]["object"] == "organization.usage.completions.result"
    assert (day0[0]["model"], day0[0]["api_key_id"], day0[0]["project_id"]) == (None, None, None)
    assert (day0[0]["input_audio_tokens"], day0[0]["output_audio_tokens"]) == (0, 0)
    assert (body["has_more"], body["next_page"]) == (False, None)


def test_hourly_buckets_floor_the_start_and_ceil_the_end(
    tenant_a: Tenant, version_70b: ModelVersion, owner_client: APIClient
) -> None:
    key = services.api_key_create(tenant=tenant_a, name="k")[0].pk
    for offset, prompt in [(0, 1), (HOUR, 2), (3 * HOUR, 4), (4 * HOUR, 8)]:
        add_usage(tenant=tenant_a, key=key, version=version_70b, offset=offset, prompt=prompt)

    body = get_ok(
        owner_client,
        url(tenant_a),
        start_time=T0 + HOUR + 1800,  # 01:30 -> the 01:00 bucket
        end_time=T0 + 3 * HOUR + 1,  # 03:00:01 -> up to 04:00
        bucket_width="1h",
    )

    assert [b["start_time"] for b in body["data"]] == [T0 + HOUR, T0 + 2 * HOUR, T0 + 3 * HOUR]
    assert all(b["end_time"] - b["start_time"] == HOUR for b in body["data"])
    assert [[r["input_tokens"] for r in b["results"]] for b in body["data"]] == [[2], [], [4]]


def test_end_time_defaults_to_the_end_of_the_current_bucket(
    tenant_a: Tenant, version_70b: ModelVersion, owner_client: APIClient
) -> None:
    key = services.api_key_create(tenant=tenant_a, name="k")[0].pk
    before = int(timezone.now().timestamp())
    this_hour = before - before % HOUR
    add_usage(tenant=tenant_a, key=key, version=version_70b, offset=this_hour - T0, prompt=5)
    start = this_hour - 2 * HOUR

    body = get_ok(owner_client, url(tenant_a), start_time=start, bucket_width="1h")

    after = int(timezone.now().timestamp())
    # The clock may pass an hour boundary during the call: either end is right then.
    possible = [list(range(start, t - t % HOUR + HOUR, HOUR)) for t in sorted({before, after})]
    assert [b["start_time"] for b in body["data"]] in possible
    assert body["data"][2]["results"][0]["input_tokens"] == 5
    # A start in the future with no end: nothing to report yet.
    future = get_ok(owner_client, url(tenant_a), start_time=this_hour + 10 * DAY)
    assert future["data"] == [] and future["has_more"] is False


# -- grouping and filters -----------------------------------------------------------------


@pytest.fixture
def grid(tenant_a: Tenant, version_70b: ModelVersion) -> dict[str, Any]:
    """Two keys x two model versions in day 0, one row each (different hours)."""
    version_8b = make_version_8b()
    key1 = services.api_key_create(tenant=tenant_a, name="k1")[0].pk
    key2 = services.api_key_create(tenant=tenant_a, name="k2")[0].pk
    cells = {
        (version_70b.name, key1): (1, 100, 10, 1),
        (version_70b.name, key2): (2, 200, 20, 2),
        (version_8b.name, key1): (3, 300, 30, 3),
        (version_8b.name, key2): (4, 400, 0, 4),
    }
    versions = {version_70b.name: version_70b, version_8b.name: version_8b}
    for hour, ((model, key), (requests, prompt, cached, completion)) in enumerate(cells.items()):
        add_usage(
            tenant=tenant_a,
            key=key,
            version=versions[model],
            offset=hour * HOUR,
            requests=requests,
            prompt=prompt,
            cached=cached,
            completion=completion,
        )
    return {
        "cells": cells,
        "key1": key1,
        "key2": key2,
        "m70": version_70b.name,
        "m8": version_8b.name,
    }


def _expected(
    cells: dict[tuple[str, Any], tuple[int, ...]], group_by: set[str]
) -> dict[tuple[Any, Any], tuple[int, ...]]:
    out: dict[tuple[Any, Any], tuple[int, ...]] = {}
    for (model, key), counts in cells.items():
        group = (
            model if "model" in group_by else None,
            str(key) if "api_key_id" in group_by else None,
        )
        previous = out.get(group, (0, 0, 0, 0))
        out[group] = tuple(a + b for a, b in zip(previous, counts, strict=True))
    return out


@pytest.mark.parametrize(
    "group_by",
    [
        [],
        ["model"],
        ["api_key_id"],
        ["model", "api_key_id"],
        ["model,api_key_id"],
        ["api_key_id", "model"],
    ],
)
def test_group_by_combinations(
    tenant_a: Tenant, grid: dict[str, Any], owner_client: APIClient, group_by: list[str]
) -> None:
    query = f"start_time={T0}&end_time={T0 + DAY}" + "".join(f"&group_by={g}" for g in group_by)
    response = owner_client.get(f"{url(tenant_a)}?{query}")
    assert response.status_code == 200, response.content
    (bucket,) = response.json()["data"]
    groups = {part for g in group_by for part in g.split(",")}
    got = {(r["model"], r["api_key_id"]): totals(r) for r in bucket["results"]}
    assert got == _expected(grid["cells"], groups)
    # Results come in a stable order (model, then key).
    assert list(got) == sorted(got, key=lambda k: (k[0] or "", k[1] or ""))


def test_openai_bracket_lists_and_filters(
    tenant_a: Tenant, grid: dict[str, Any], owner_client: APIClient
) -> None:
    base = (
        f"{url(tenant_a)}?start_time={T0}&end_time={T0 + DAY}"
        "&group_by[]=model&group_by[]=api_key_id"
    )

    def results(extra: str) -> set[tuple[Any, Any]]:
        response = owner_client.get(base + extra)
        assert response.status_code == 200, response.content
        return {(r["model"], r["api_key_id"]) for r in response.json()["data"][0]["results"]}

    k1, k2, m70, m8 = str(grid["key1"]), str(grid["key2"]), grid["m70"], grid["m8"]
    assert results(f"&models={m8}") == {(m8, k1), (m8, k2)}
    assert results("&models[]=llama-70b") == {(m70, k1), (m70, k2)}  # a family alias
    assert results(f"&models={m70},{m8}&api_key_ids={k2}") == {(m70, k2), (m8, k2)}
    assert results(f"&api_key_ids[]={k1}&api_key_ids[]={k2}") == {
        (m70, k1),
        (m70, k2),
        (m8, k1),
        (m8, k2),
    }
    assert results("&models=no-such-model") == set()
    assert results(f"&api_key_ids={uuid.uuid4()}") == set()


# -- pagination ---------------------------------------------------------------------------


def test_pages_cover_every_bucket_exactly_once_and_do_not_shift(
    tenant_a: Tenant, version_70b: ModelVersion, owner_client: APIClient
) -> None:
    key = services.api_key_create(tenant=tenant_a, name="k")[0].pk
    hours = 50
    for h in range(0, hours, 3):
        add_usage(tenant=tenant_a, key=key, version=version_70b, offset=h * HOUR, prompt=h + 1)
    params: dict[str, Any] = {
        "start_time": T0,
        "end_time": T0 + hours * HOUR,
        "bucket_width": "1h",
        "limit": 7,
    }
    starts: list[int] = []
    tokens = 0
    pages = 0
    while True:
        body = get_ok(owner_client, url(tenant_a), **params)
        pages += 1
        assert len(body["data"]) == (7 if body["has_more"] else hours % 7)
        starts += [b["start_time"] for b in body["data"]]
        tokens += sum(r["input_tokens"] for b in body["data"] for r in b["results"])
        if pages == 2:
            # Usage arriving for an already-served hour does not move later pages.
            add_usage(tenant=tenant_a, key=key, version=version_70b, offset=HOUR, prompt=1000)
        if not body["has_more"]:
            assert body["next_page"] is None
            break
        assert isinstance(body["next_page"], str)
        params["page"] = body["next_page"]
        assert pages < 20
    assert starts == [T0 + h * HOUR for h in range(hours)]
    assert pages == 8
    assert tokens == sum(h + 1 for h in range(0, hours, 3))


def test_default_and_maximum_limits(
    tenant_a: Tenant, version_70b: ModelVersion, owner_client: APIClient
) -> None:
    far = T0 + 400 * DAY
    assert len(get_ok(owner_client, url(tenant_a), start_time=T0, end_time=far)["data"]) == 7
    assert (
        len(get_ok(owner_client, url(tenant_a), start_time=T0, end_time=far, limit=31)["data"])
        == 31
    )
    hourly = get_ok(owner_client, url(tenant_a), start_time=T0, end_time=far, bucket_width="1h")
    assert len(hourly["data"]) == 24 and hourly["has_more"] is True
    assert (
        len(
            get_ok(
                owner_client,
                url(tenant_a),
                start_time=T0,
                end_time=far,
                bucket_width="1h",
                limit=168,
            )["data"]
        )
        == 168
    )


# -- CSV ------------------------------------------------------------------------------------


def test_csv_export_has_the_same_numbers(
    tenant_a: Tenant, grid: dict[str, Any], owner_client: APIClient
) -> None:
    query = (
        f"start_time={T0}&end_time={T0 + 3 * HOUR}"
        "&bucket_width=1h&group_by=model,api_key_id&limit=2"
    )
    as_json = owner_client.get(f"{url(tenant_a)}?{query}").json()
    expected = [
        [
            str(b["start_time"]),
            str(b["end_time"]),
            r["model"],
            r["api_key_id"],
            *map(str, totals(r)),
        ]
        for b in as_json["data"]
        for r in b["results"]
    ]
    assert len(expected) == 2

    for path in (f"{url(tenant_a)}?{query}&format=csv", f"{url(tenant_a, '.csv')}?{query}"):
        response = owner_client.get(path)
        assert response.status_code == 200, response.content
        assert response["Content-Type"].startswith("text/csv")
        assert response["Content-Disposition"].startswith("attachment; filename=")
        rows = list(csv.DictReader(io.StringIO(response.content.decode())))
        got = [
            [
                r["start_time"],
                r["end_time"],
                r["model"],
                r["api_key_id"],
                r["num_model_requests"],
                r["input_tokens"],
                r["input_cached_tokens"],
                r["output_tokens"],
            ]
            for r in rows
        ]
        assert got == expected
        assert rows[0]["start_time_iso"] == "2026-03-01T00:00:00Z"
        # The next page is linked, cursor included.
        assert (
            f"page={as_json['next_page']}" in response["Link"] and 'rel="next"' in response["Link"]
        )

    # Errors stay JSON even when CSV was asked for.
    bad = owner_client.get(f"{url(tenant_a, '.csv')}?start_time=oops")
    assert bad.status_code == 400 and bad["Content-Type"] == "application/json"
    assert error_of(bad)["param"] == "start_time"


# -- bad input ------------------------------------------------------------------------------


def _cursor_1h(t: int) -> str:
    return encode_cursor("1h", t)


BAD_QUERIES = [
    ({}, "start_time"),
    ({"start_time": "abc"}, "start_time"),
    ({"start_time": "-1"}, "start_time"),
    ({"start_time": "1" * 40}, "start_time"),
    ({"start_time": "1.5"}, "start_time"),
    ({"start_time": T0, "end_time": T0 - 1}, "end_time"),
    ({"start_time": T0, "end_time": T0}, "end_time"),
    ({"start_time": T0, "end_time": "99999999999999"}, "end_time"),
    ({"start_time": T0, "bucket_width": "1m"}, "bucket_width"),
    ({"start_time": T0, "bucket_width": "2d"}, "bucket_width"),
    ({"start_time": T0, "limit": "0"}, "limit"),
    ({"start_time": T0, "limit": "32"}, "limit"),
    ({"start_time": T0, "bucket_width": "1h", "limit": "169"}, "limit"),
    ({"start_time": T0, "limit": "many"}, "limit"),
    ({"start_time": T0, "page": "garbage!!"}, "page"),
    ({"start_time": T0, "page": "djEuMWQuMTIz"}, "page"),  # base64 of v1.1d.123: off the range
    ({"start_time": T0, "end_time": T0 + DAY, "page": _cursor_1h(T0)}, "page"),  # wrong width
    (
        {"start_time": T0, "end_time": T0 + DAY, "bucket_width": "1h", "page": _cursor_1h(T0 + 1)},
        "page",
    ),
    ({"start_time": T0, "group_by": "project_id"}, "group_by"),
    ({"start_time": T0, "group_by": "line_item"}, "group_by"),
    ({"start_time": T0, "api_key_ids": "not-a-uuid"}, "api_key_ids"),
    ({"start_time": T0, "models": ",".join(f"m{i}" for i in range(101))}, "models"),
    ({"start_time": T0, "project_ids": "proj_1"}, "project_ids"),
    ({"start_time": T0, "user_ids": "user_1"}, "user_ids"),
    ({"start_time": T0, "batch": "true"}, "batch"),
    ({"start_time": "12\x00"}, "start_time"),
    ({"start_time": T0, "format": "xml"}, "format"),
]


@pytest.mark.parametrize(("params", "param"), BAD_QUERIES)
def test_bad_parameters_are_400_naming_the_parameter(
    tenant_a: Tenant, owner_client: APIClient, params: dict[str, Any], param: str
) -> None:
    response = owner_client.get(url(tenant_a), params)
    assert response.status_code == 400, response.content
    error = error_of(response)
    assert (error["type"], error["param"]) == ("invalid_request_error", param), error
    if params.get("bucket_width") == "1m":
        assert "hour" in error["message"]


def test_fuzzed_queries_never_500(tenant_a: Tenant, owner_client: APIClient) -> None:
    rng = random.Random(20260301)
    junk = [
        "",
        "-",
        "0",
        "-5",
        "1e9",
        "NaN",
        "null",
        "[]",
        "1h",
        "1d",
        "1m",
        "model",
        "\u00e9",
        "%00",
        str(2**63),
        str(T0),
        str(T0 + DAY),
        "a" * 300,
        "model,,api_key_id",
        str(uuid.uuid4()),
    ]
    names = [
        "start_time",
        "end_time",
        "bucket_width",
        "limit",
        "page",
        "models",
        "api_key_ids",
        "group_by",
        "group_by[]",
        "tenant_id",
        "line_items",
        "format",
    ]
    paths = [
        url(tenant_a),
        f"/api/v1/tenants/{tenant_a.id}/costs",
        "/api/v1/organization/usage/completions",
        "/api/v1/organization/costs",
        url(tenant_a, ".csv"),
    ]
    for _ in range(150):
        params = {rng.choice(names): rng.choice(junk) for _ in range(rng.randint(0, 5))}
        if rng.random() < 0.6:
            params["start_time"] = str(rng.choice([T0, T0 + 7, 0, 2**40]))
        path = rng.choice(paths)
        response = owner_client.get(path, params)
        # The caller's own tenant: 200 or a 400 naming a parameter (a random tenant_id: 404).
        allowed = {200, 400} | (
            {404} if "tenant_id" in params and "organization" in path else set()
        )
        assert response.status_code in allowed, (path, params, response.status_code)
        if response.status_code == 400:
            assert error_of(response)["param"], (path, params, response.content)


def test_other_methods_answer_in_the_api_shape(tenant_a: Tenant, owner_client: APIClient) -> None:
    for path in (url(tenant_a), f"/api/v1/tenants/{tenant_a.id}/costs"):
        response = owner_client.post(path, {}, format="json")
        assert response.status_code == 405 and error_of(response)["type"] == "invalid_request_error"
        options = owner_client.options(path)
        assert options.status_code == 200 and options.json()["name"]
    options = owner_client.options(url(tenant_a, ".csv"), HTTP_ACCEPT="text/csv")
    assert options.status_code == 200 and options["Content-Type"] == "application/json"
    head = owner_client.head(url(tenant_a), {"start_time": T0, "end_time": T0 + DAY})
    assert head.status_code == 200
    # The trailing-slash form is not a route (the paths are OpenAI's, without one).
    assert owner_client.get(url(tenant_a, "/"), {"start_time": T0}).status_code == 404


def test_openapi_schema_documents_the_reports() -> None:
    response = APIClient().get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json")
    paths = response.json()["paths"]
    usage = paths["/api/v1/tenants/{tenant_id}/usage/completions"]["get"]
    assert set(usage["responses"]["200"]["content"]) == {"application/json", "text/csv"}
    assert {"start_time", "bucket_width", "group_by", "page"} <= {
        p["name"] for p in usage["parameters"]
    }
    org_costs = paths["/api/v1/organization/costs"]["get"]
    assert "tenant_id" in {p["name"] for p in org_costs["parameters"]}
    assert "/api/v1/tenants/{tenant_id}/costs" in paths
    assert "/api/v1/organization/usage/completions" in paths
    # The .csv aliases are the same operation, not documented twice.
    assert not [p for p in paths if p.endswith(".csv")]
