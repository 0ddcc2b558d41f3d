"""Management-API tokens: they expire, and obtaining one is throttled per client address.

DRF's tokens never expire on their own; a token copied into a script or a CI log would
work for ever. ``tenants.authentication`` refuses one older than
``FAIRWAY_API_TOKEN_MAX_AGE_H`` hours; ``ObtainExpiringToken`` hands out a fresh one in its
place. The token endpoint checks passwords, so it is throttled per address
(``FAIRWAY_AUTH_TOKEN_RATE``) in a cache shared by every web process (Redis), as the
console's sign-in is by django-axes.
"""

from __future__ import annotations

import logging
from typing import Any

from django.conf import settings
from django.core.cache import caches
from django.db import transaction
from rest_framework.authtoken.models import Token
from rest_framework.authtoken.views import ObtainAuthToken
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.throttling import ScopedRateThrottle

from tenants.authentication import token_expired

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


class ObtainExpiringToken(ObtainAuthToken):
    throttle_classes = [AuthTokenThrottle]
    throttle_scope = "auth-token"

    def post(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        serializer = self.get_serializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        user = serializer.validated_data["user"]
        with transaction.atomic():
            token = Token.objects.select_for_update().filter(user=user).first()
            if token is not None and token_expired(token):
                token.delete()
                token = None
            if token is None:
                token = Token.objects.create(user=user)
        return Response({"token": token.key})
