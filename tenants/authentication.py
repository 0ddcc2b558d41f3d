"""Management-API tokens expire: ``ExpiringTokenAuthentication`` refuses (and deletes) a
DRF token older than ``FAIRWAY_API_TOKEN_MAX_AGE_H`` hours. Kept apart from the token view
(``tenants.auth``): DRF imports authentication classes while its views module loads.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.conf import settings
from django.utils import timezone
from rest_framework import exceptions
from rest_framework.authentication import TokenAuthentication
from rest_framework.authtoken.models import Token


def _max_age() -> timedelta:
    return timedelta(hours=float(settings.FAIRWAY_API_TOKEN_MAX_AGE_H))


def token_expired(token: Token) -> bool:
    return token.created <= timezone.now() - _max_age()


class ExpiringTokenAuthentication(TokenAuthentication):
    def authenticate_credentials(self, key: str) -> tuple[Any, Token]:
        user, token = super().authenticate_credentials(key)
        if token_expired(token):
            token.delete()
            raise exceptions.AuthenticationFailed(
                "The API token has expired; obtain a new one from /api/v1/auth/token/.",
                code="token_expired",
            )
        return user, token
