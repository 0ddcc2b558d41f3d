"""Management API (/api/v1/): tenants, members, API keys, limits. Thin views: validate,
check the caller's role, call one service or selector, serialise.

Creating tenants and changing a tenant's plan, suspension or limits are the operators' (staff
holding ``tenants.operate``, ``tenants.permissions``): checked before the tenant is looked
up, so nobody else gets further than a 403 and nothing is written. Being staff is not enough.
"""

from __future__ import annotations

from typing import Any
from uuid import UUID

from django.contrib.auth import get_user_model
from django.db.models import Q
from django.http import Http404
from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from catalog.models import ModelFamily, ModelVersion
from contracts.schema import SCOPES
from tenants import selectors, services
from tenants.models import LIMIT_FIELDS, ApiKey, Membership, Plan, Role

# -- tenants ------------------------------------------------------------------------------


class TenantOutput(serializers.Serializer):
    id = serializers.UUIDField()
    name = serializers.CharField()
    plan = serializers.CharField(source="plan.name")
    admission_class = serializers.CharField(source="plan.admission_class")
    billing_email = serializers.EmailField()
    suspended = serializers.BooleanField(source="is_suspended")
    suspended_at = serializers.DateTimeField(allow_null=True)
    created_at = serializers.DateTimeField()
    role = serializers.SerializerMethodField(
        help_text="The caller's role in the tenant: their membership's role; on a single "
        "tenant, 'operator' for an operator; null in the list for a tenant they are not a "
        "member of."
    )

    def get_role(self, tenant: Any) -> str | None:
        return self.context.get("roles", {}).get(tenant.id)


class TenantListApi(APIView):
    class TenantCreateInput(serializers.Serializer):
        name = serializers.CharField(max_length=100)
        plan = serializers.SlugRelatedField(slug_field="name", queryset=Plan.objects.all())
        owner = serializers.CharField(
            required=False, help_text="Username or email of an existing user."
        )
        billing_email = serializers.EmailField(default="")

    @extend_schema(responses=TenantOutput(many=True))
    def get(self, request: Request) -> Response:
        tenants = selectors.tenant_list_for_user(user=request.user)
        roles = selectors.tenant_roles_for_user(user=request.user)
        return Response(TenantOutput(tenants, many=True, context={"roles": roles}).data)

    @extend_schema(request=TenantCreateInput, responses={201: TenantOutput})
    def post(self, request: Request) -> Response:
        selectors.require_operator(user=request.user, action="create tenants")
        data = _valid(self.TenantCreateInput, request)
        owner = _user_by_login(data["owner"], field="owner") if data.get("owner") else None
        tenant = services.tenant_create(
            name=data["name"], plan=data["plan"], owner=owner, billing_email=data["billing_email"]
        )
        return Response(
            TenantOutput(tenant, context={"roles": {}}).data, status=status.HTTP_201_CREATED
        )


class TenantDetailApi(APIView):
    class TenantUpdateInput(serializers.Serializer):
        name = serializers.CharField(max_length=100, required=False)
        billing_email = serializers.EmailField(required=False, allow_blank=True)
        # Operators only:
        plan = serializers.SlugRelatedField(
            slug_field="name", queryset=Plan.objects.all(), required=False
        )
        suspended = serializers.BooleanField(required=False)

    @extend_schema(responses=TenantOutput)
    def get(self, request: Request, tenant_id: UUID) -> Response:
        access = selectors.tenant_access(user=request.user, tenant_id=tenant_id)
        return Response(_tenant_out(access))

    @extend_schema(request=TenantUpdateInput, responses=TenantOutput)
    def patch(self, request: Request, tenant_id: UUID) -> Response:
        data = _valid(self.TenantUpdateInput, request)
        if {"plan", "suspended"} & data.keys():
            selectors.require_operator(
                user=request.user, action="change a tenant's plan or suspension"
            )
        access = selectors.tenant_access(user=request.user, tenant_id=tenant_id)
        access.require(selectors.TENANT_EDITORS, "edit this tenant")
        tenant = access.tenant
        if "name" in data or "billing_email" in data:
            tenant = services.tenant_update(
                tenant=tenant, name=data.get("name"), billing_email=data.get("billing_email")
            )
        if "plan" in data:
            tenant = services.tenant_change_plan(tenant=tenant, plan=data["plan"])
        if "suspended" in data:
            tenant = services.tenant_set_suspended(tenant=tenant, suspended=data["suspended"])
        return Response(_tenant_out(selectors.TenantAccess(tenant=tenant, role=access.role)))


def _tenant_out(access: selectors.TenantAccess) -> dict[str, Any]:
    roles = {access.tenant.id: access.role}
    return dict(TenantOutput(access.tenant, context={"roles": roles}).data)


# -- members ------------------------------------------------------------------------------


class MemberOutput(serializers.Serializer):
    id = serializers.IntegerField()
    username = serializers.CharField(source="user.username")
    email = serializers.EmailField(source="user.email")
    role = serializers.CharField()
    created_at = serializers.DateTimeField()


def _check_owner_change(access: selectors.TenantAccess, *roles: str) -> None:
    """Only owners (or operators) may grant, change or remove the owner role."""
    if Role.OWNER in roles:
        access.require((Role.OWNER,), "grant, change or remove the owner role")


class MemberListApi(APIView):
    class MemberAddInput(serializers.Serializer):
        user = serializers.CharField(help_text="Username or email of an existing user.")
        role = serializers.ChoiceField(choices=Role.choices)

    @extend_schema(responses=MemberOutput(many=True))
    def get(self, request: Request, tenant_id: UUID) -> Response:
        access = selectors.tenant_access(user=request.user, tenant_id=tenant_id)
        access.require(selectors.MEMBER_MANAGERS, "see members")
        return Response(
            MemberOutput(selectors.membership_list(tenant=access.tenant), many=True).data
        )

    @extend_schema(request=MemberAddInput, responses={201: MemberOutput})
    def post(self, request: Request, tenant_id: UUID) -> Response:
        access = selectors.tenant_access(user=request.user, tenant_id=tenant_id)
        access.require(selectors.MEMBER_MANAGERS, "add members")
        data = _valid(self.MemberAddInput, request)
        _check_owner_change(access, data["role"])
        user = _user_by_login(data["user"], field="user")
        membership = services.membership_add(tenant=access.tenant, user=user, role=data["role"])
        return Response(MemberOutput(membership).data, status=status.HTTP_201_CREATED)


class MemberDetailApi(APIView):
    class MemberRoleInput(serializers.Serializer):
        role = serializers.ChoiceField(choices=Role.choices)

    def _get(
        self, request: Request, tenant_id: UUID, member_id: int
    ) -> tuple[selectors.TenantAccess, Membership]:
        access = selectors.tenant_access(user=request.user, tenant_id=tenant_id)
        access.require(selectors.MEMBER_MANAGERS, "manage members")
        return access, selectors.membership_get(tenant=access.tenant, membership_id=member_id)

    @extend_schema(responses=MemberOutput)
    def get(self, request: Request, tenant_id: UUID, member_id: int) -> Response:
        _, membership = self._get(request, tenant_id, member_id)
        return Response(MemberOutput(membership).data)

    @extend_schema(request=MemberRoleInput, responses=MemberOutput)
    def patch(self, request: Request, tenant_id: UUID, member_id: int) -> Response:
        access, membership = self._get(request, tenant_id, member_id)
        data = _valid(self.MemberRoleInput, request)
        _check_owner_change(access, membership.role, data["role"])
        membership = services.membership_change_role(membership=membership, role=data["role"])
        return Response(MemberOutput(membership).data)

    @extend_schema(responses={204: None})
    def delete(self, request: Request, tenant_id: UUID, member_id: int) -> Response:
        access, membership = self._get(request, tenant_id, member_id)
        _check_owner_change(access, membership.role)
        services.membership_remove(membership=membership)
        return Response(status=status.HTTP_204_NO_CONTENT)


# -- API keys -----------------------------------------------------------------------------


class KeyOutput(serializers.Serializer):
    id = serializers.UUIDField()
    name = serializers.CharField()
    prefix = serializers.CharField()
    scopes = serializers.ListField(child=serializers.CharField())
    status = serializers.SerializerMethodField()
    created_by = serializers.CharField(source="created_by.username", allow_null=True, default=None)
    created_at = serializers.DateTimeField()
    last_used_at = serializers.DateTimeField(allow_null=True)
    expires_at = serializers.DateTimeField(allow_null=True)
    revoked_at = serializers.DateTimeField(allow_null=True)

    def get_status(self, key: ApiKey) -> str:
        if key.revoked_at is not None:
            return "revoked"
        return "active" if key.is_active() else "expired"


class KeyCreatedOutput(KeyOutput):
    secret = serializers.CharField(help_text="Shown once; it cannot be recovered.")


DEFAULT_PAGE = 100
MAX_PAGE = 500


class KeyListApi(APIView):
    class KeyCreateInput(serializers.Serializer):
        name = serializers.CharField(max_length=100)
        scopes = serializers.ListField(
            child=serializers.ChoiceField(
                choices=SCOPES,
                error_messages={
                    "invalid_choice": f'Unknown scope "{{input}}"; known: {", ".join(SCOPES)}.'
                },
            ),
            allow_empty=False,
            default=list(SCOPES),
        )
        expires_at = serializers.DateTimeField(allow_null=True, default=None)

    class KeyPageInput(serializers.Serializer):
        limit = serializers.IntegerField(min_value=1, max_value=MAX_PAGE, default=DEFAULT_PAGE)
        offset = serializers.IntegerField(min_value=0, default=0)

    @extend_schema(parameters=[KeyPageInput], responses=KeyOutput(many=True))
    def get(self, request: Request, tenant_id: UUID) -> Response:
        """One page of keys, newest first (``limit``/``offset``); the body stays a list, the
        total is in ``X-Total-Count`` and the next page in a ``Link: rel="next"`` header."""
        access = selectors.tenant_access(user=request.user, tenant_id=tenant_id)
        access.require(selectors.KEY_READERS, "see API keys")
        page = self.KeyPageInput(data=request.query_params)
        page.is_valid(raise_exception=True)
        limit, offset = page.validated_data["limit"], page.validated_data["offset"]
        keys = selectors.api_key_list(tenant=access.tenant)
        total = keys.count()
        response = Response(KeyOutput(keys[offset : offset + limit], many=True).data)
        response["X-Total-Count"] = str(total)
        if offset + limit < total:
            url = request.build_absolute_uri(request.path)
            response["Link"] = f'<{url}?limit={limit}&offset={offset + limit}>; rel="next"'
        return response

    @extend_schema(request=KeyCreateInput, responses={201: KeyCreatedOutput})
    def post(self, request: Request, tenant_id: UUID) -> Response:
        access = selectors.tenant_access(user=request.user, tenant_id=tenant_id)
        access.require(selectors.KEY_WRITERS, "create API keys")
        data = _valid(self.KeyCreateInput, request)
        api_key, secret = services.api_key_create(
            tenant=access.tenant,
            name=data["name"],
            scopes=data["scopes"],
            created_by=request.user,
            expires_at=data["expires_at"],
        )
        body = dict(KeyOutput(api_key).data)
        body["secret"] = secret
        response = Response(body, status=status.HTTP_201_CREATED)
        response["Cache-Control"] = "no-store"  # the secret must not sit in any cache
        return response


class KeyDetailApi(APIView):
    @extend_schema(responses=KeyOutput)
    def get(self, request: Request, tenant_id: UUID, key_id: UUID) -> Response:
        access = selectors.tenant_access(user=request.user, tenant_id=tenant_id)
        access.require(selectors.KEY_READERS, "see API keys")
        return Response(KeyOutput(selectors.api_key_get(tenant=access.tenant, key_id=key_id)).data)


class KeyRevokeApi(APIView):
    @extend_schema(request=None, responses=KeyOutput)
    def post(self, request: Request, tenant_id: UUID, key_id: UUID) -> Response:
        access = selectors.tenant_access(user=request.user, tenant_id=tenant_id)
        access.require(selectors.KEY_WRITERS, "revoke API keys")
        api_key = selectors.api_key_get(tenant=access.tenant, key_id=key_id)
        api_key = services.api_key_revoke(api_key=api_key, revoked_by=request.user)
        return Response(KeyOutput(api_key).data)


# -- per-key limits -----------------------------------------------------------------------

MAX_LIMIT = 2**62  # keeps every value inside a PostgreSQL bigint


class KeyLimitOutput(serializers.Serializer):
    model = serializers.CharField(source="family")
    rpm = serializers.IntegerField(allow_null=True, help_text="The key's own; null: none.")
    tpm = serializers.IntegerField(allow_null=True)
    max_concurrency = serializers.IntegerField(allow_null=True, help_text="Requests in flight.")
    effective_rpm = serializers.IntegerField(
        help_text="What binds: the smaller of the key's and the tenant's (0: unlimited)."
    )
    effective_tpm = serializers.IntegerField()


def _model_family(value: str) -> ModelFamily:
    family = selectors.family_get(name=value)
    if family is not None:
        return family
    version = ModelVersion.objects.filter(name=value).select_related("family").first()
    if version is not None:
        raise serializers.ValidationError(
            f"Limits are set per model family; use '{version.family.name}'."
        )
    raise serializers.ValidationError(f"Unknown model '{value}'.", code="model_not_found")


class KeyLimitListApi(APIView):
    """A key's own limits per model family, inside its tenant's: whoever may see the key
    reads them; owners and admins change them."""

    class KeyLimitSetInput(serializers.Serializer):
        model = serializers.CharField(help_text="Model family, e.g. llama-70b.")
        rpm = serializers.IntegerField(min_value=1, max_value=2**31 - 1, allow_null=True,
                                       default=None)  # fmt: skip
        tpm = serializers.IntegerField(min_value=1, max_value=MAX_LIMIT, allow_null=True,
                                       default=None)  # fmt: skip
        max_concurrency = serializers.IntegerField(
            min_value=1, max_value=2**31 - 1, allow_null=True, default=None
        )

        def validate_model(self, value: str) -> ModelFamily:
            return _model_family(value)

    @extend_schema(responses=KeyLimitOutput(many=True))
    def get(self, request: Request, tenant_id: UUID, key_id: UUID) -> Response:
        access = selectors.tenant_access(user=request.user, tenant_id=tenant_id)
        access.require(selectors.KEY_READERS, "see key limits")
        api_key = selectors.api_key_get(tenant=access.tenant, key_id=key_id)
        limits = selectors.api_key_limit_list(api_key=api_key)
        return Response(KeyLimitOutput(limits, many=True).data)

    @extend_schema(request=KeyLimitSetInput, responses=KeyLimitOutput)
    def post(self, request: Request, tenant_id: UUID, key_id: UUID) -> Response:
        """Set the key's limits for one family, replacing what it had there."""
        access = selectors.tenant_access(user=request.user, tenant_id=tenant_id)
        access.require(selectors.KEY_WRITERS, "change key limits")
        api_key = selectors.api_key_get(tenant=access.tenant, key_id=key_id)
        data = _valid(self.KeyLimitSetInput, request)
        family = data.pop("model")
        services.api_key_limit_set(api_key=api_key, family=family, **data)
        limit = selectors.api_key_limit_get(api_key=api_key, family=family.name)
        return Response(KeyLimitOutput(limit).data)


class KeyLimitDetailApi(APIView):
    @extend_schema(responses=KeyLimitOutput)
    def get(self, request: Request, tenant_id: UUID, key_id: UUID, model: str) -> Response:
        access = selectors.tenant_access(user=request.user, tenant_id=tenant_id)
        access.require(selectors.KEY_READERS, "see key limits")
        api_key = selectors.api_key_get(tenant=access.tenant, key_id=key_id)
        limit = selectors.api_key_limit_get(api_key=api_key, family=model)
        return Response(KeyLimitOutput(limit).data)

    @extend_schema(responses={204: None})
    def delete(self, request: Request, tenant_id: UUID, key_id: UUID, model: str) -> Response:
        """Drop the key's own limits for the family: only the tenant's apply again."""
        access = selectors.tenant_access(user=request.user, tenant_id=tenant_id)
        access.require(selectors.KEY_WRITERS, "change key limits")
        api_key = selectors.api_key_get(tenant=access.tenant, key_id=key_id)
        family = selectors.family_get(name=model)
        if family is None or not services.api_key_limit_clear(api_key=api_key, family=family):
            raise Http404
        return Response(status=status.HTTP_204_NO_CONTENT)


# -- limits -------------------------------------------------------------------------------


class LimitOutput(serializers.Serializer):
    model = serializers.CharField(source="family")
    source = serializers.ChoiceField(choices=["plan", "override"])
    rpm = serializers.IntegerField()
    tpm = serializers.IntegerField()
    max_context = serializers.IntegerField()
    max_output = serializers.IntegerField()
    kv_seconds_cap = serializers.IntegerField(help_text="GiB·s")
    reserved_kv = serializers.IntegerField(help_text="GiB·s")


class LimitListApi(APIView):
    class LimitSetInput(serializers.Serializer):
        model = serializers.CharField(help_text="Model family, e.g. llama-70b.")
        rpm = serializers.IntegerField(min_value=0, max_value=2**31 - 1, required=False)
        tpm = serializers.IntegerField(min_value=0, max_value=MAX_LIMIT, required=False)
        max_context = serializers.IntegerField(min_value=0, max_value=2**31 - 1, required=False)
        max_output = serializers.IntegerField(min_value=0, max_value=2**31 - 1, required=False)
        kv_seconds_cap = serializers.IntegerField(min_value=0, max_value=MAX_LIMIT, required=False)
        reserved_kv = serializers.IntegerField(min_value=0, max_value=MAX_LIMIT, required=False)

        def validate_model(self, value: str) -> ModelFamily:
            return _model_family(value)

    @extend_schema(responses=LimitOutput(many=True))
    def get(self, request: Request, tenant_id: UUID) -> Response:
        access = selectors.tenant_access(user=request.user, tenant_id=tenant_id)
        access.require(selectors.LIMIT_READERS, "see limits")
        return Response(LimitOutput(selectors.limit_list(tenant=access.tenant), many=True).data)

    @extend_schema(request=LimitSetInput, responses=LimitOutput)
    def post(self, request: Request, tenant_id: UUID) -> Response:
        """Set the tenant's override for one model family (fields not given are kept)."""
        selectors.require_operator(user=request.user, action="change limits")
        access = selectors.tenant_access(user=request.user, tenant_id=tenant_id)
        data = _valid(self.LimitSetInput, request)
        family = data.pop("model")
        values = {name: data[name] for name in LIMIT_FIELDS if name in data}
        services.tenant_limit_set(tenant=access.tenant, family=family, **values)
        limit = selectors.limit_get(tenant=access.tenant, family=family.name)
        return Response(LimitOutput(limit).data)


class LimitDetailApi(APIView):
    @extend_schema(responses=LimitOutput)
    def get(self, request: Request, tenant_id: UUID, model: str) -> Response:
        access = selectors.tenant_access(user=request.user, tenant_id=tenant_id)
        access.require(selectors.LIMIT_READERS, "see limits")
        return Response(LimitOutput(selectors.limit_get(tenant=access.tenant, family=model)).data)

    @extend_schema(responses={204: None})
    def delete(self, request: Request, tenant_id: UUID, model: str) -> Response:
        """Drop the tenant's override: the plan default applies again."""
        selectors.require_operator(user=request.user, action="change limits")
        access = selectors.tenant_access(user=request.user, tenant_id=tenant_id)
        family = selectors.family_get(name=model)
        if family is None or not services.tenant_limit_clear(tenant=access.tenant, family=family):
            raise Http404
        return Response(status=status.HTTP_204_NO_CONTENT)


# -- helpers ------------------------------------------------------------------------------


def _valid(serializer_class: type[serializers.Serializer], request: Request) -> dict[str, Any]:
    if not isinstance(request.data, dict):
        raise serializers.ValidationError({"non_field_errors": ["Send a JSON object."]})
    serializer = serializer_class(data=request.data)
    serializer.is_valid(raise_exception=True)
    return dict(serializer.validated_data)


def _user_by_login(login: str, *, field: str) -> Any:
    user = (
        get_user_model()
        .objects.filter(Q(username=login) | Q(email__iexact=login), is_active=True)
        .first()
    )
    if user is None:
        raise serializers.ValidationError({field: [f"No active user '{login}'."]})
    return user
