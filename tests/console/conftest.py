"""Console fixtures: the control-plane fixtures (real PostgreSQL, plain ORM set-up through
the services) plus Django test clients signed in as a given user."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from django.test import Client

from tests.controlplane.conftest import (  # noqa: F401 - fixtures
    family_70b,
    grant,
    make_user,
    member_of,
    operator,
    owner_a,
    plain_staff,
    plans,
    rm,
    tenant_a,
    tenant_b,
    version_70b,
)


@pytest.fixture
def browser_for() -> Callable[[Any], Client]:
    """A Django test client signed in as ``user`` (CSRF enforced, as in a browser)."""

    def make(user: Any) -> Client:
        client = Client(enforce_csrf_checks=False)
        client.force_login(user)
        return client

    return make


@pytest.fixture
def finance(make_user: Callable[..., Any]) -> Any:  # noqa: F811
    return grant(
        make_user("fin", is_staff=True), "billing.view_reconciliation", "billing.manage_invoices"
    )
