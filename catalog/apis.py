"""GET /api/v1/models/: the model families, their current version and pinnable versions."""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from catalog import selectors


class VersionOutput(serializers.Serializer):
    name = serializers.CharField()
    is_current = serializers.BooleanField()
    context_length = serializers.IntegerField()
    kv_bytes_per_token = serializers.IntegerField()
    tpot_target_ms = serializers.IntegerField()
    kv_capacity_tokens = serializers.IntegerField()
    currency = serializers.CharField()
    # Strings, so prices stay exact decimals in JSON.
    price_prompt_per_mtok = serializers.DecimalField(max_digits=12, decimal_places=6)
    price_cached_prompt_per_mtok = serializers.DecimalField(max_digits=12, decimal_places=6)
    price_completion_per_mtok = serializers.DecimalField(max_digits=12, decimal_places=6)


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
