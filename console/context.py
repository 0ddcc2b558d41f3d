"""Template context for every console page: the tenant switcher and which staff pages exist."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest

from console import access


def console(request: HttpRequest) -> dict[str, Any]:
    user = getattr(request, "user", None)
    if user is None or not user.is_authenticated:
        return {}
    current = getattr(request, "access", None)
    return {
        "my_tenants": access.memberships(user),
        "current": current,
        "is_operator": access.is_operator(user),
        "is_finance": access.is_finance(user),
    }
