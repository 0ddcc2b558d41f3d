"""Production settings refuse to start on unsafe configuration, and start on a proper one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STARTUP = (
    "import django; django.setup(); from django.conf import settings; "
    "print('started', settings.DEBUG, settings.ALLOWED_HOSTS)"
)
CONTROLLED = (
    "DEBUG",
    "SECRET_KEY",
    "ALLOWED_HOSTS",
    "FAIRWAY_KEY_PEPPER",
    "FAIRWAY_CACHE_SALT_KEY",
    "DATABASE_URL",
    "REDIS_URL",
    "READMODEL_REDIS_URL",
    "CELERY_BROKER_URL",
    "FAIRWAY_THROTTLE_REDIS_URL",
)


def _start(**env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k not in CONTROLLED}
    base["DJANGO_SETTINGS_MODULE"] = "fairway.settings.production"
    return subprocess.run(
        [sys.executable, "-c", STARTUP],
        cwd=ROOT,
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _good_env() -> dict[str, str]:
    # django.setup() opens no connection, so the database need not exist.
    return {
        "SECRET_KEY": "s" * 50,
        "FAIRWAY_KEY_PEPPER": "p" * 40,
        "FAIRWAY_CACHE_SALT_KEY": "c" * 40,
        "ALLOWED_HOSTS": "api.example.com",
        "DATABASE_URL": "postgres://fairway@db.internal:5432/fairway",
        "REDIS_URL": "redis://127.0.0.1:6379/0",
    }


def test_production_refuses_unsafe_configuration() -> None:
    bare = _start()
    assert bare.returncode != 0
    assert "Refusing to start with fairway.settings.production" in bare.stderr
    for needle in (
        "SECRET_KEY",
        "FAIRWAY_KEY_PEPPER",
        "FAIRWAY_CACHE_SALT_KEY",
        "ALLOWED_HOSTS",
        "DATABASE_URL",
    ):
        assert needle in bare.stderr, needle

    debug = _start(**_good_env(), DEBUG="1")
    assert debug.returncode != 0 and "DEBUG must be off" in debug.stderr

    dev_secret = _start(
        **{**_good_env(), "FAIRWAY_KEY_PEPPER": "fairway-dev-key-pepper-not-secret"}
    )
    assert dev_secret.returncode != 0 and "FAIRWAY_KEY_PEPPER" in dev_secret.stderr


def test_production_refuses_a_redis_role_url_that_is_not_redis() -> None:
    bad = _start(**_good_env(), READMODEL_REDIS_URL="127.0.0.1:6379/12")
    assert bad.returncode != 0
    assert "READMODEL_REDIS_URL must be a redis://" in bad.stderr
    assert "CELERY_BROKER_URL" not in bad.stderr  # defaulted to REDIS_URL, which is fine
    split = _start(
        **_good_env(),
        READMODEL_REDIS_URL="rediss://readmodel.internal:6380/0",
        CELERY_BROKER_URL="redis://broker.internal:6379/0",
    )
    assert split.returncode == 0, split.stderr


def test_production_starts_with_a_proper_environment() -> None:
    result = _start(**_good_env())
    assert result.returncode == 0, result.stderr
    assert "started False ['api.example.com']" in result.stdout
