"""GET /api/v1/models/: the model families, their current version and pinnable versions,
each with the prices in force now.

PATCH /api/v1/models/<version>/profile/: correct a version's replica-profile facts (prefill
rate, TTFT target, prefill attention share), for staff holding
``catalog.change_modelversion``; the gateway reads them with the version.

GET/POST /api/v1/models/<version>/prices/: a version's price history and price changes,
for staff holding ``catalog.view_modelprice`` / ``catalog.add_modelprice`` (being staff
is not enough). A change records who made it and why; it takes effect from the current
UTC hour or a later one, never an earlier one (catalog.services.price_change).

POST /api/v1/models/<version>/prices/<id>/withdraw/: withdraw a change not yet in force
(catalog.services.price_change_withdraw), with the permission that schedules one: a
withdrawal does no more than scheduling the previous price again at that hour would.
"""

from __future__ import annotations

import math
from typing import Any

from django.core.exceptions import PermissionDenied
from django.http import Http404
from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from catalog import selectors, services
from catalog.models import ModelPrice, ModelVersion

VIEW_PRICES = "catalog.view_modelprice"
CHANGE_PRICES = "catalog.add_modelprice"
CHANGE_PROFILE = "catalog.change_modelversion"


class VersionOutput(serializers.Serializer):
    name = serializers.CharField()
    is_current = serializers.BooleanField()
    context_length = serializers.IntegerField()
    kv_bytes_per_token = serializers.IntegerField()
    tpot_target_ms = serializers.IntegerField()
    kv_capacity_tokens = serializers.IntegerField()
    prefill_attention_share = serializers.FloatField()
    capabilities = serializers.SerializerMethodField()
    currency = serializers.CharField()
    # Strings, so prices stay exact decimals in JSON.
    price_prompt_per_mtok = serializers.DecimalField(max_digits=12, decimal_places=6)
    price_cached_prompt_per_mtok = serializers.DecimalField(max_digits=12, decimal_places=6)
    price_completion_per_mtok = serializers.DecimalField(max_digits=12, decimal_places=6)

    def get_capabilities(self, version: Any) -> dict[str, Any]:
        return {
            "tools": version.supports_tools,
            "tool_call_parser": version.tool_call_parser or None,
            "structured_output": version.supports_structured_output,
            "max_n": version.max_n,
            "logprobs": version.supports_logprobs,
            "max_top_logprobs": version.max_top_logprobs,
        }


class FamilyOutput(serializers.Serializer):
    name = serializers.CharField()
    display_name = serializers.CharField()
    current_version = serializers.SerializerMethodField()
    versions = VersionOutput(many=True, source="active_versions")

    def get_current_version(self, family: Any) -> str | None:
        return next((v.name for v in family.active_versions if v.is_current), None)


class ModelListApi(APIView):
    @extend_schema(responses=FamilyOutput(many=True))
    def get(self, request: Request) -> Response:
        return Response(FamilyOutput(selectors.family_list(), many=True).data)


class VersionProfile(serializers.Serializer):
    """The replica profile's facts the gateway reads with a version (all optional on input:
    a PATCH sets those given)."""

    name = serializers.CharField(read_only=True)
    prefill_tokens_per_s = serializers.IntegerField(
        min_value=0, max_value=2**31 - 1, required=False, help_text="0 = unknown."
    )
    ttft_target_ms = serializers.IntegerField(min_value=1, max_value=2**31 - 1, required=False)
    prefill_attention_share = serializers.FloatField(
        min_value=0.0,
        max_value=1.0,
        required=False,
        help_text="Share of the threshold prompt's prefill time that is attention; 0 = unknown.",
    )

    def validate_prefill_attention_share(self, value: float) -> float:
        if not math.isfinite(value):  # "NaN" passes the bounds (every comparison is false)
            raise serializers.ValidationError("A share between 0 and 1 (0 = unknown).")
        return value


class VersionProfileApi(APIView):
    @extend_schema(request=VersionProfile, responses={200: VersionProfile})
    def patch(self, request: Request, version: str) -> Response:
        _require(request, CHANGE_PROFILE)
        data = VersionProfile(data=request.data, partial=True)
        data.is_valid(raise_exception=True)
        row = services.version_profile_update(version=_version(version), **data.validated_data)
        return Response(VersionProfile(row).data)


PRICE = {"max_digits": 12, "decimal_places": 6, "min_value": 0}


class PriceOutput(serializers.Serializer):
    id = serializers.IntegerField()
    effective_from = serializers.DateTimeField()
    currency = serializers.CharField()
    price_prompt_per_mtok = serializers.DecimalField(max_digits=12, decimal_places=6)
    price_cached_prompt_per_mtok = serializers.DecimalField(max_digits=12, decimal_places=6)
    price_completion_per_mtok = serializers.DecimalField(max_digits=12, decimal_places=6)
    actor = serializers.CharField(source="actor_label")
    reason = serializers.CharField()
    created_at = serializers.DateTimeField()
    replaces_effective_from = serializers.DateTimeField(
        source="replaces.effective_from", default=None
    )
    withdrawn_at = serializers.DateTimeField(allow_null=True)
    withdrawn_by = serializers.CharField(source="withdrawn_by_label")
    withdrawal_reason = serializers.CharField()


class PriceChangeInput(serializers.Serializer):
    price_prompt_per_mtok = serializers.DecimalField(**PRICE)
    price_cached_prompt_per_mtok = serializers.DecimalField(**PRICE)
    price_completion_per_mtok = serializers.DecimalField(**PRICE)
    effective_from = serializers.DateTimeField(
        required=False, allow_null=True, help_text="A UTC hour, not before the current one."
    )
    reason = serializers.CharField(max_length=2000)


class PriceWithdrawInput(serializers.Serializer):
    reason = serializers.CharField(max_length=2000)


def _require(request: Request, perm: str) -> None:
    user = request.user
    if not (user.is_staff and user.is_active and user.has_perm(perm)):
        raise PermissionDenied(f"This needs a staff account with the {perm} permission.")


def _version(name: str) -> ModelVersion:
    version = ModelVersion.objects.filter(name=name).first()
    if version is None:
        raise Http404
    return version


class VersionPriceApi(APIView):
    @extend_schema(responses=PriceOutput(many=True))
    def get(self, request: Request, version: str) -> Response:
        _require(request, VIEW_PRICES)
        rows = selectors.price_history(version=_version(version))
        return Response(PriceOutput(rows, many=True).data)

    @extend_schema(request=PriceChangeInput, responses={201: PriceOutput})
    def post(self, request: Request, version: str) -> Response:
        _require(request, CHANGE_PRICES)
        data = PriceChangeInput(data=request.data)
        data.is_valid(raise_exception=True)
        values = data.validated_data
        row = services.price_change(
            version=_version(version),
            prompt=values["price_prompt_per_mtok"],
            cached_prompt=values["price_cached_prompt_per_mtok"],
            completion=values["price_completion_per_mtok"],
            effective_from=values.get("effective_from"),
            actor=request.user,
            actor_label=request.user.get_username(),
            reason=values["reason"],
        )
        return Response(PriceOutput(row).data, status=201)


class VersionPriceWithdrawApi(APIView):
    @extend_schema(request=PriceWithdrawInput, responses={200: PriceOutput})
    def post(self, request: Request, version: str, price_id: int) -> Response:
        _require(request, CHANGE_PRICES)
        data = PriceWithdrawInput(data=request.data)
        data.is_valid(raise_exception=True)
        price = ModelPrice.objects.filter(pk=price_id, version=_version(version)).first()
        if price is None:
            raise Http404
        row = services.price_change_withdraw(
            price=price,
            actor=request.user,
            actor_label=request.user.get_username(),
            reason=data.validated_data["reason"],
        )
        return Response(PriceOutput(row).data)
