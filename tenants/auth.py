"""Management-API tokens: stored only as a digest, shown once, expiring; obtaining one is
throttled per client address.

``POST /api/v1/auth/token/`` (username and password) answers ``{"token": …}`` with a new
token: its plaintext is in that response only; the database keeps its peppered HMAC
(``tenants.models.ApiToken``), as for API keys but with a label of its own
(``contracts.schema.hash_api_token``). ``tenants.authentication`` refuses a token
older than ``FAIRWAY_API_TOKEN_MAX_AGE_H`` hours, so a token copied into a script or a CI log
does not work for ever. ``DELETE`` on the same URL revokes the token the request was made
with, or (``?all=true``) every token of the caller; a change of the user's password revokes
them all (``tenants.credential_hooks``). The password check is throttled per
address (``FAIRWAY_AUTH_TOKEN_RATE``) in a cache shared by every web process (Redis), as the
console's sign-in is by django-axes.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from django.conf import settings
from django.core.cache import caches
from django.utils.cache import add_never_cache_headers
from drf_spectacular.utils import extend_schema, inline_serializer
from rest_framework import serializers
from rest_framework.authtoken.views import ObtainAuthToken
from rest_framework.permissions import BasePermission, IsAuthenticated
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.throttling import BaseThrottle, ScopedRateThrottle

from tenants import services
from tenants.models import ApiToken

log = logging.getLogger("tenants.auth")


class AuthTokenThrottle(ScopedRateThrottle):
    """Per client address (the caller is anonymous), in the shared ``throttle`` cache."""

    scope_attr = "throttle_scope"

    def __init__(self) -> None:
        self.cache = caches["throttle"]
        super().__init__()

    def get_rate(self) -> str | None:
        return str(settings.FAIRWAY_AUTH_TOKEN_RATE)

    def allow_request(self, request: Request, view: Any) -> bool:
        try:
            return bool(super().allow_request(request, view))
        except Exception:  # noqa: BLE001 - the counter store is down: fail open, loudly
            log.warning("auth-token throttle unavailable; allowing the request", exc_info=True)
            return True


class RevokeQuery(serializers.Serializer):
    all = serializers.BooleanField(
        default=False,
        help_text="Revoke every management-API token of the caller, not only the one sent.",
    )


# DRF's token view for its input (form, JSON or multipart) and serializer, so the request and
# response are DRF's as before; it issues ApiTokens instead of DRF's plaintext Token rows.
class ObtainExpiringToken(ObtainAuthToken):
    throttle_classes = [AuthTokenThrottle]
    throttle_scope = "auth-token"

    def get_permissions(self) -> Sequence[BasePermission]:
        if self.request.method == "DELETE":
            return [IsAuthenticated()]
        return list(super().get_permissions())

    def get_throttles(self) -> Sequence[BaseThrottle]:
        # The throttle guards the password check; revoking checks none.
        return [] if self.request.method == "DELETE" else list(super().get_throttles())

    @extend_schema(
        description="A new management-API token for the user whose username and password are "
        "given. The token is in this response only (it is stored as a digest) and expires "
        "after FAIRWAY_API_TOKEN_MAX_AGE_H hours (24 by default). Send it as "
        "`Authorization: Token <token>`, or `Bearer <token>` to the usage and costs reports."
    )
    def post(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        serializer = self.get_serializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        _, secret = services.api_token_create(user=serializer.validated_data["user"])
        response = Response({"token": secret})
        add_never_cache_headers(response)  # the only time the token is shown: no cache keeps it
        return response

    @extend_schema(
        description="Revoke the management-API token this request is made with, or every "
        "token of the caller with all=true. Answers how many were revoked.",
        parameters=[RevokeQuery],
        request=None,
        responses={
            200: inline_serializer("ApiTokenRevoked", {"revoked": serializers.IntegerField()})
        },
    )
    def delete(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        query = RevokeQuery(data=request.query_params)
        query.is_valid(raise_exception=True)
        if query.validated_data["all"]:
            revoked = services.api_token_revoke_all(user=request.user)
        elif isinstance(request.auth, ApiToken):
            revoked = int(services.api_token_revoke(token=request.auth))
        else:
            raise serializers.ValidationError(
                {"all": "This request carries no API token: pass all=true to revoke all yours."}
            )
        return Response({"revoked": revoked})
