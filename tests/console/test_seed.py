"""seed_demo gives the console its demo users and a few weeks of usage, once."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.test import Client

from console.access import is_finance, is_operator
from metering.models import Usage

pytestmark = pytest.mark.django_db


def test_seed_demo_creates_console_users_and_demo_usage_once(rm: Any, tmp_path: Path) -> None:
    keys_out = tmp_path / "keys.json"
    out = io.StringIO()
    call_command("seed_demo", "--keys-out", str(keys_out), "--usage-days", "3", stdout=out)
    printed = out.getvalue()
    assert "finance / fairway-demo" in printed and "operator" in printed
    assert "free-owner / fairway-demo" in printed
    users = get_user_model().objects
    assert is_finance(users.get(username="finance")) and not is_operator(
        users.get(username="finance")
    )
    assert is_operator(users.get(username="operator"))
    rows = Usage.objects.count()
    assert rows > 3 * 24  # three tenants, two models, most hours
    info = json.loads(keys_out.read_text())["demo-standard"]
    assert (
        Usage.objects.filter(tenant_id=info["tenant_id"]).values("api_key_id").distinct().count()
        == 1
    )

    call_command(
        "seed_demo", "--keys-out", str(keys_out), "--usage-days", "3", stdout=io.StringIO()
    )
    assert Usage.objects.count() == rows  # history is not rewritten

    client = Client()
    assert (
        client.post(
            "/login/", {"username": "standard-owner", "password": "fairway-demo"}
        ).status_code
        == 302
    )
    page = client.get(f"/t/{info['tenant_id']}/usage/")
    assert page.status_code == 200 and b"usage-chart" in page.content
