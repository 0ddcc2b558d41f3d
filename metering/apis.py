"""Usage and costs reports in the shape of OpenAI's organization usage and costs APIs.

``/api/v1/tenants/<id>/usage/completions`` and ``/api/v1/tenants/<id>/costs``; the same under
``/api/v1/organization/…`` with the tenant from ``tenant_id`` (or the caller's only tenant),
so the OpenAI SDK's admin client works with ``base_url=<host>/api/v1`` and a Fairway API
token as its admin key (sent as ``Authorization: Bearer …``).

Money is exact: amounts are Decimals rendered as JSON numbers with every digit (at most 12
decimal places: a price per million tokens has 6), never through a float. A client that
needs exactness parses them as decimals (``json.loads(text, parse_float=Decimal)``).
"""

from __future__ import annotations

from collections.abc import Sequence
from decimal import Decimal
from typing import Any, Literal
from uuid import UUID

from django.http import Http404
from django.utils import timezone
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema, extend_schema_field
from rest_framework import serializers
from rest_framework.renderers import JSONRenderer
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from metering import selectors
from metering.http import AUTHENTICATION, ExactJSONRenderer, UsageCsvRenderer
from metering.pages import MAX_TIME, WIDTHS, PageError, PageWindow, plan_page
from tenants.selectors import TenantAccess, tenant_access, tenant_roles_for_user

MAX_FILTER_VALUES = 100
# OpenAI's bucket limits: (default, maximum) per width.
USAGE_LIMITS = {"1d": (7, 31), "1h": (24, 168)}
COST_LIMITS = (7, 180)
# OpenAI filters that have no meaning here: refused, because ignoring one would silently
# answer a different question than the one asked.
UNSUPPORTED_FILTERS = {
    "project_ids": "Fairway has no projects; filter by api_key_ids instead.",
    "user_ids": "Usage is recorded per API key, not per user; filter by api_key_ids instead.",
    "batch": "Fairway has no batch API; all usage is non-batch.",
}


# -- query input --------------------------------------------------------------------------


class BucketWidthField(serializers.ChoiceField):
    default_error_messages = {
        "minute": "bucket_width 1m is not supported: usage is rolled up per hour; use 1h or 1d.",
    }

    def to_internal_value(self, data: Any) -> Any:
        if data == "1m":
            self.fail("minute")
        return super().to_internal_value(data)


def _list_field(help_text: str) -> serializers.ListField:
    return serializers.ListField(
        child=serializers.CharField(max_length=100),
        required=False,
        max_length=MAX_FILTER_VALUES,
        help_text=f"{help_text} Repeat the parameter or separate values with commas.",
    )


class ReportQuery(serializers.Serializer):
    start_time = serializers.IntegerField(
        min_value=0,
        max_value=MAX_TIME,
        help_text="Unix seconds, inclusive; floored to the bucket grid (UTC).",
    )
    end_time = serializers.IntegerField(
        min_value=0,
        max_value=MAX_TIME,
        required=False,
        help_text="Unix seconds, exclusive; ceiled to the bucket grid. Default: now.",
    )
    limit = serializers.IntegerField(required=False, help_text="Buckets per page.")
    page = serializers.CharField(
        required=False, max_length=200, help_text="The next_page cursor of the previous page."
    )
    api_key_ids = _list_field("Only usage of these API keys.")
    models = _list_field("Only these model versions (a family name means all its versions).")
    group_by = _list_field("Group results by these fields.")

    groups: tuple[str, ...] = ()
    limits: dict[str, tuple[int, int]] = {}

    def validate_api_key_ids(self, values: list[str]) -> list[UUID]:
        ids = []
        for value in values:
            try:
                ids.append(UUID(value))
            except ValueError:
                raise serializers.ValidationError(f"'{value}' is not an API key id.") from None
        return ids

    def validate_group_by(self, values: list[str]) -> list[str]:
        for value in values:
            if value not in self.groups:
                raise serializers.ValidationError(
                    f"Cannot group by '{value}'; supported: {', '.join(self.groups)}."
                )
        return values

    def validate(self, data: dict[str, Any]) -> dict[str, Any]:
        width = data["bucket_width"]
        default, maximum = self.limits[width]
        limit = data.get("limit", default)
        if not 1 <= limit <= maximum:
            raise serializers.ValidationError(
                {"limit": [f"limit must be 1 to {maximum} for bucket_width {width}."]}
            )
        try:
            data["window"] = plan_page(
                start_time=data["start_time"],
                end_time=data.get("end_time"),
                bucket_width=width,
                limit=limit,
                cursor=data.get("page"),
                now=int(timezone.now().timestamp()),
            )
        except PageError as exc:
            raise serializers.ValidationError({exc.param: [str(exc)]}) from None
        return data


class UsageQuery(ReportQuery):
    bucket_width = BucketWidthField(
        choices=list(WIDTHS), default="1d", help_text="1h or 1d (1m is not kept)."
    )
    group_by = _list_field("Group results by model and/or api_key_id.")
    groups = selectors.USAGE_GROUPS
    limits = USAGE_LIMITS


class CostsQuery(ReportQuery):
    bucket_width = serializers.ChoiceField(
        choices=["1d"],
        default="1d",
        error_messages={"invalid_choice": "Costs support only bucket_width 1d."},
    )
    limit = serializers.IntegerField(required=False, help_text="Buckets per page, 1 to 180.")
    group_by = _list_field("Group results by line_item, model and/or api_key_id.")
    line_items = serializers.ListField(
        child=serializers.CharField(max_length=200),
        required=False,
        max_length=MAX_FILTER_VALUES,
        help_text="Only these line items, e.g. 'llama-70b-2026-05, cached input' (repeat the "
        "parameter for several; commas belong to the names).",
    )
    groups = selectors.COST_GROUPS
    limits = {"1d": COST_LIMITS}


# Line items contain ", " themselves ("<version>, cached input"): they can only repeat.
REPEAT_ONLY = {"line_items"}


def _query_data(request: Request, serializer_class: type[ReportQuery]) -> dict[str, Any]:
    """Query parameters as serializer input: list fields may repeat (``models=a&models=b``,
    or ``models[]=…`` as OpenAI's SDKs send them) or hold comma-separated values."""
    fields = serializer_class().fields
    lists = {name for name, field in fields.items() if isinstance(field, serializers.ListField)}
    params = request.query_params
    data: dict[str, Any] = {}
    for key in params:
        name = key.removesuffix("[]")
        if name in UNSUPPORTED_FILTERS:
            raise serializers.ValidationError({name: [UNSUPPORTED_FILTERS[name]]})
        if name in REPEAT_ONLY:
            data.setdefault(name, []).extend(params.getlist(key))
        elif name in lists:
            parts = (part.strip() for value in params.getlist(key) for part in value.split(","))
            data.setdefault(name, []).extend(part for part in parts if part)
        elif name in fields:
            data[name] = params.get(key)
    serializer = serializer_class(data=data)
    serializer.is_valid(raise_exception=True)
    return dict(serializer.validated_data)


def _org_tenant_access(request: Request) -> TenantAccess:
    raw = request.query_params.get("tenant_id")
    if raw:
        try:
            tenant_id = UUID(raw)
        except ValueError:
            raise serializers.ValidationError({"tenant_id": ["Not a tenant id."]}) from None
        return tenant_access(user=request.user, tenant_id=tenant_id)
    tenants = list(tenant_roles_for_user(user=request.user))
    if len(tenants) != 1:
        raise serializers.ValidationError(
            {"tenant_id": [f"Required: you belong to {len(tenants)} tenants."]}
        )
    return tenant_access(user=request.user, tenant_id=tenants[0])


ORG_TENANT_PARAM = OpenApiParameter(
    "tenant_id",
    OpenApiTypes.UUID,
    description="The tenant; optional when you belong to exactly one.",
)


# -- output -------------------------------------------------------------------------------


@extend_schema_field({"type": "number", "description": "Exact decimal, never rounded."})
class ExactDecimalField(serializers.Field):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(read_only=True, **kwargs)

    def to_representation(self, value: Decimal) -> Decimal:
        return value


class UsageResultOutput(serializers.Serializer):
    object = serializers.SerializerMethodField()
    input_tokens = serializers.IntegerField(help_text="Including cached tokens.")
    input_cached_tokens = serializers.IntegerField()
    output_tokens = serializers.IntegerField()
    input_audio_tokens = serializers.SerializerMethodField()
    output_audio_tokens = serializers.SerializerMethodField()
    num_model_requests = serializers.IntegerField()
    project_id = serializers.SerializerMethodField()
    user_id = serializers.SerializerMethodField()
    api_key_id = serializers.UUIDField(allow_null=True, help_text="Set when grouped by it.")
    model = serializers.CharField(allow_null=True, help_text="Set when grouped by it.")
    batch = serializers.SerializerMethodField()

    def get_object(self, _: Any) -> Literal["organization.usage.completions.result"]:
        return "organization.usage.completions.result"

    def get_input_audio_tokens(self, _: Any) -> int:
        return 0

    def get_output_audio_tokens(self, _: Any) -> int:
        return 0

    def get_project_id(self, _: Any) -> str | None:
        return None

    def get_user_id(self, _: Any) -> str | None:
        return None

    def get_batch(self, _: Any) -> bool | None:
        return None


class AmountOutput(serializers.Serializer):
    value = ExactDecimalField(source="amount")
    currency = serializers.CharField(help_text="Lower-case ISO 4217.")


class CostResultOutput(serializers.Serializer):
    object = serializers.SerializerMethodField()
    amount = AmountOutput(source="*")
    line_item = serializers.CharField(allow_null=True, help_text="Set when grouped by it.")
    quantity = serializers.IntegerField(allow_null=True, help_text="Tokens, per line item.")
    quantity_unit = serializers.SerializerMethodField()
    project_id = serializers.SerializerMethodField()
    api_key_id = serializers.UUIDField(allow_null=True, help_text="Set when grouped by it.")
    model = serializers.CharField(allow_null=True, help_text="Set when grouped by it.")

    def get_object(self, _: Any) -> Literal["organization.costs.result"]:
        return "organization.costs.result"

    def get_quantity_unit(self, result: selectors.CostResult) -> Literal["tokens"] | None:
        return "tokens" if result.quantity is not None else None

    def get_project_id(self, _: Any) -> str | None:
        return None


class _BucketOutput(serializers.Serializer):
    object = serializers.SerializerMethodField()
    start_time = serializers.IntegerField(help_text="Unix seconds, UTC, inclusive.")
    end_time = serializers.IntegerField(help_text="Unix seconds, UTC, exclusive.")

    def get_object(self, _: Any) -> Literal["bucket"]:
        return "bucket"


class UsageBucketOutput(_BucketOutput):
    results = UsageResultOutput(many=True)


class CostBucketOutput(_BucketOutput):
    results = CostResultOutput(many=True)


class _PageOutput(serializers.Serializer):
    object = serializers.SerializerMethodField()
    has_more = serializers.BooleanField()
    next_page = serializers.CharField(allow_null=True)

    def get_object(self, _: Any) -> Literal["page"]:
        return "page"


class UsagePageOutput(_PageOutput):
    data = UsageBucketOutput(many=True)


class CostPageOutput(_PageOutput):
    data = CostBucketOutput(many=True)


def _page(window: PageWindow, buckets: Sequence[selectors.Bucket[Any]]) -> dict[str, Any]:
    return {"data": buckets, "has_more": window.has_more, "next_page": window.next_page}


# -- views --------------------------------------------------------------------------------


class _ReportApi(APIView):
    authentication_classes = AUTHENTICATION
    renderer_classes = [ExactJSONRenderer]

    def perform_content_negotiation(self, request: Request, force: bool = False) -> Any:
        try:
            return super().perform_content_negotiation(request, force)
        except Http404:
            # DRF's answer to an unknown ?format= is a bare 404; name the parameter instead.
            formats = ", ".join(renderer.format for renderer in self.get_renderers())
            raise serializers.ValidationError({"format": [f"Use one of: {formats}."]}) from None

    def finalize_response(self, request: Request, response: Any, *args: Any, **kwargs: Any) -> Any:
        # Only a report page has a CSV form: errors and OPTIONS metadata are always JSON,
        # whatever format the caller asked for.
        is_page = response.status_code < 400 and isinstance(getattr(response, "data", None), dict)
        is_page = is_page and "has_more" in response.data
        if not is_page and not isinstance(
            getattr(request, "accepted_renderer", None), JSONRenderer
        ):
            request.accepted_renderer = ExactJSONRenderer()
            request.accepted_media_type = ExactJSONRenderer.media_type
        return super().finalize_response(request, response, *args, **kwargs)


class _UsageApi(_ReportApi):
    renderer_classes = [ExactJSONRenderer, UsageCsvRenderer]

    def _usage(self, request: Request, access: TenantAccess) -> Response:
        access.require(selectors.USAGE_READERS, "see usage")
        query = _query_data(request, UsageQuery)
        window: PageWindow = query["window"]
        buckets = selectors.usage_buckets(
            tenant=access.tenant,
            window=window,
            group_by=query.get("group_by", ()),
            api_key_ids=query.get("api_key_ids"),
            models=query.get("models"),
        )
        response = Response(UsagePageOutput(_page(window, buckets)).data)
        if isinstance(request.accepted_renderer, UsageCsvRenderer):
            name = f"usage-{access.tenant.id}-{window.start}-{window.end}.csv"
            response["Content-Disposition"] = f'attachment; filename="{name}"'
            if window.next_page is not None:
                params = request.query_params.copy()
                params["page"] = window.next_page
                next_url = request.build_absolute_uri(f"{request.path}?{params.urlencode()}")
                response["Link"] = f'<{next_url}>; rel="next"'
        return response


USAGE_DOC = extend_schema(
    parameters=[UsageQuery], responses=UsagePageOutput, summary="Completions usage per bucket"
)
COSTS_DOC = extend_schema(
    parameters=[CostsQuery], responses=CostPageOutput, summary="Exact costs per day"
)


class TenantUsageApi(_UsageApi):
    @USAGE_DOC
    def get(self, request: Request, tenant_id: UUID, format: str | None = None) -> Response:
        return self._usage(request, tenant_access(user=request.user, tenant_id=tenant_id))


class OrganizationUsageApi(_UsageApi):
    @extend_schema(
        parameters=[UsageQuery, ORG_TENANT_PARAM],
        responses=UsagePageOutput,
        summary="Completions usage per bucket (the caller's tenant)",
    )
    def get(self, request: Request, format: str | None = None) -> Response:
        return self._usage(request, _org_tenant_access(request))


class TenantUsageCsvApi(TenantUsageApi):
    """The same report at a ``.csv`` path, for links; documented under the main path."""

    schema = None


class OrganizationUsageCsvApi(OrganizationUsageApi):
    schema = None


class _CostsApi(_ReportApi):
    def _costs(self, request: Request, access: TenantAccess) -> Response:
        access.require(selectors.COST_READERS, "see costs")
        query = _query_data(request, CostsQuery)
        window: PageWindow = query["window"]
        line_items = query.get("line_items")
        buckets = selectors.cost_buckets(
            tenant=access.tenant,
            window=window,
            group_by=query.get("group_by", ()),
            api_key_ids=query.get("api_key_ids"),
            models=query.get("models"),
            line_items=set(line_items) if line_items is not None else None,
        )
        return Response(CostPageOutput(_page(window, buckets)).data)


class TenantCostsApi(_CostsApi):
    @COSTS_DOC
    def get(self, request: Request, tenant_id: UUID) -> Response:
        return self._costs(request, tenant_access(user=request.user, tenant_id=tenant_id))


class OrganizationCostsApi(_CostsApi):
    @extend_schema(
        parameters=[CostsQuery, ORG_TENANT_PARAM],
        responses=CostPageOutput,
        summary="Exact costs per day (the caller's tenant)",
    )
    def get(self, request: Request) -> Response:
        return self._costs(request, _org_tenant_access(request))
