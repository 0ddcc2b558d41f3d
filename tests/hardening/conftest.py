"""Hardening tests reuse the gateway and control-plane suites' fixtures: real Redis, real
PostgreSQL, real emulated replicas, real gateway processes."""

from tests.admission.conftest import aredis, redis_sync  # noqa: F401
from tests.controlplane.conftest import (  # noqa: F401
    client_for,
    family_70b,
    make_user,
    operator,
    owner_a,
    plain_staff,
    plans,
    rm,
    tenant_a,
    tenant_b,
    version_70b,
)
from tests.gateway.conftest import gateways, replica, seeder  # noqa: F401
