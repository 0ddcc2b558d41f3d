"""`make up`'s database and worker wiring: PostgreSQL only, a dedicated database created on
demand, and the worker's --usage-consumer option."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import psycopg
import pytest

from fairway.embedded import (
    LOCAL_POSTGRES_URL,
    EmbeddedServices,
    create_database,
    postgres_answers,
    with_database,
)
from fairway.env import EnvError, database_config
from tests.support import ROOT


def test_with_database_keeps_the_server_and_the_options() -> None:
    assert with_database("postgres://postgres@127.0.0.1:5432/test", "fairway_dev") == (
        "postgres://postgres@127.0.0.1:5432/fairway_dev"
    )
    assert with_database("postgresql://postgres:@/postgres?host=/tmp/pg", "x") == (
        "postgresql://postgres:@/x?host=/tmp/pg"
    )


def test_sqlite_is_refused() -> None:
    with pytest.raises(EnvError, match="postgres"):
        database_config("sqlite:///var/fairway.sqlite3")
    assert database_config("postgres://u@h:5432/d")["ENGINE"] == "django.db.backends.postgresql"


@pytest.mark.skipif(not postgres_answers(LOCAL_POSTGRES_URL), reason="no local PostgreSQL")
def test_a_named_database_is_created_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DATABASE_URL", raising=False)
    name = f"fairway_devtest_{uuid.uuid4().hex[:8]}"
    services = EmbeddedServices()
    try:
        url = services.database_url(name=name)
        assert url == with_database(LOCAL_POSTGRES_URL, name)
        with psycopg.connect(url.replace("postgres://", "postgresql://")) as conn:
            assert conn.execute("SELECT current_database()").fetchone() == (name,)
        assert create_database(LOCAL_POSTGRES_URL, name) is False  # already there
    finally:
        services.stop()
        admin = LOCAL_POSTGRES_URL.replace("postgres://", "postgresql://")
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}"')


def test_the_worker_has_the_usage_consumer_option() -> None:
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "fairway.settings.local",
        "PYTHONPATH": str(ROOT),
    }
    out = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "fairway.celery", "worker", "--help"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert "--usage-consumer" in out
