"""Management-API tokens (``tenants.models.ApiToken``): looked up by their digest, refused
once older than ``FAIRWAY_API_TOKEN_MAX_AGE_H`` hours. Expired rows are deleted when their
user obtains a new token and by the hourly ``api_tokens_expired_delete`` task, not here: a
refused request's transaction is rolled back (``ATOMIC_REQUESTS``), a delete with it. Kept
apart from the token view (``tenants.auth``): DRF imports authentication classes while its
views module loads.
"""

from __future__ import annotations

from typing import Any

from django.db import transaction
from django.utils import timezone
from rest_framework import exceptions
from rest_framework.authentication import TokenAuthentication

from tenants import selectors, services
from tenants.models import ApiToken


class ExpiringTokenAuthentication(TokenAuthentication):
    """``Authorization: Token <token>`` (DRF's header; ``metering.http`` adds ``Bearer``)."""

    model = ApiToken

    def authenticate_credentials(self, key: str) -> tuple[Any, ApiToken]:
        token = selectors.api_token_for_secret(secret=key)
        if token is None:
            raise exceptions.AuthenticationFailed("Invalid token.")
        if not token.user.is_active:
            raise exceptions.AuthenticationFailed("User inactive or deleted.")
        if token.is_expired():
            raise exceptions.AuthenticationFailed(
                "The API token has expired; obtain a new one from /api/v1/auth/token/.",
                code="token_expired",
            )
        _record_use(token)
        return token.user, token


def _record_use(token: ApiToken) -> None:
    """Stamp ``last_used_at`` once the request's transaction commits (a refused or failed
    request leaves no stamp), in a short transaction of its own: the request's would hold the
    token's row lock, and so queue the same token's concurrent requests, until it ended."""
    now = timezone.now()
    if token.last_used_at is not None and (
        token.last_used_at > now - services.API_TOKEN_LAST_USED_RESOLUTION
    ):
        return
    transaction.on_commit(
        lambda: services.api_token_last_used_record(token=token, at=now), robust=True
    )
