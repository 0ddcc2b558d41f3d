"""console.operate became tenants.operate (console/migrations/0002): whoever held the
console's permission, directly or through a group, holds the tenants one afterwards and still
opens the operators' pages; the console's permission is gone. Run on the real PostgreSQL test
database, migrating the console app back one step and forward again."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group, Permission
from django.contrib.contenttypes.models import ContentType
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.test import Client

from console.access import is_operator
from tenants.permissions import OPERATE

BEFORE = [("console", "0001_initial")]
AFTER = [("console", "0002_operate_moves_to_tenants")]


def _migrate(targets: list[tuple[str, str]]) -> None:
    executor = MigrationExecutor(connection)
    executor.loader.build_graph()
    executor.migrate(targets)


@pytest.fixture
def console_at_0001(transactional_db: None) -> Iterator[None]:
    _migrate(BEFORE)
    try:
        yield
    finally:
        _migrate(AFTER)  # whatever happened, the database ends on the latest state


def _perm(app_label: str) -> Any:
    return Permission.objects.filter(content_type__app_label=app_label, codename="operate").first()


def test_grants_move_from_console_operate_to_tenants_operate(console_at_0001: None) -> None:
    # Backwards, 0002 gave console.operate back (to nobody yet: no grants existed).
    old = _perm("console")
    assert old is not None
    users = get_user_model().objects
    direct = users.create_user("direct", password="pw-12345", is_staff=True)
    direct.user_permissions.add(old)
    grouped = users.create_user("grouped", password="pw-12345", is_staff=True)
    group = Group.objects.create(name="ops")
    group.permissions.add(old)
    grouped.groups.add(group)
    bystander = users.create_user("bystander", password="pw-12345", is_staff=True)
    new = _perm("tenants")
    if new is not None:
        new.user_set.clear()
        new.group_set.clear()

    _migrate(AFTER)

    assert _perm("console") is None
    assert not ContentType.objects.filter(app_label="console", model="consoleaccess").exists()
    new = _perm("tenants")
    assert new is not None
    assert list(new.user_set.all()) == [direct] and list(new.group_set.all()) == [group]
    for user, expected in ((direct, True), (grouped, True), (bystander, False)):
        fresh = users.get(pk=user.pk)  # no cached permissions
        assert fresh.has_perm(OPERATE) is expected and is_operator(fresh) is expected
        client = Client()
        client.force_login(fresh)
        assert client.get("/ops/tenants/").status_code == (200 if expected else 403)


def test_backwards_gives_the_console_permission_to_the_operators(
    transactional_db: None,
) -> None:
    users = get_user_model().objects
    operator = users.create_user("op", password="pw-12345", is_staff=True)
    operator.user_permissions.add(_perm("tenants"))
    try:
        _migrate(BEFORE)
        old = _perm("console")
        assert old is not None and list(old.user_set.all()) == [operator]
        assert list(_perm("tenants").user_set.all()) == [operator]  # kept
    finally:
        _migrate(AFTER)
    assert _perm("console") is None and users.get(pk=operator.pk).has_perm(OPERATE)
