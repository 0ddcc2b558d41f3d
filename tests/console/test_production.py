"""Production settings protect the console: secure, HTTP-only cookies, HSTS, CSRF, and
static files from WhiteNoise's manifest (collected, hashed), never from a CDN."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRINT = (
    "import django, json; django.setup(); from django.conf import settings as s; "
    "print(json.dumps({'session_secure': s.SESSION_COOKIE_SECURE, "
    "'csrf_secure': s.CSRF_COOKIE_SECURE, 'httponly': s.SESSION_COOKIE_HTTPONLY, "
    "'hsts': s.SECURE_HSTS_SECONDS, 'ssl_redirect': s.SECURE_SSL_REDIRECT, "
    "'csrf': 'django.middleware.csrf.CsrfViewMiddleware' in s.MIDDLEWARE, "
    "'axes': s.MIDDLEWARE[-1], 'static': s.STORAGES['staticfiles']['BACKEND'], "
    "'finders': s.WHITENOISE_USE_FINDERS}))"
)


def _production_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("DEBUG", "SECRET_KEY")}
    env.update(
        DJANGO_SETTINGS_MODULE="fairway.settings.production",
        SECRET_KEY="s" * 50,
        FAIRWAY_KEY_PEPPER="p" * 40,
        FAIRWAY_CACHE_SALT_KEY="c" * 40,
        ALLOWED_HOSTS="console.example.com",
        DATABASE_URL="postgres://fairway@db.internal:5432/fairway",
        REDIS_URL="redis://127.0.0.1:6379/0",
        **extra,
    )
    return env


def test_production_settings_secure_the_console() -> None:
    done = subprocess.run(
        [sys.executable, "-c", PRINT], cwd=ROOT, env=_production_env(), capture_output=True,
        text=True,
        timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["session_secure"] and got["csrf_secure"] and got["httponly"]
    assert got["hsts"] > 0 and got["ssl_redirect"] and got["csrf"]
    assert got["axes"] == "axes.middleware.AxesMiddleware"
    assert got["static"] == "whitenoise.storage.CompressedManifestStaticFilesStorage"
    assert got["finders"] is False


def test_collectstatic_builds_the_hashed_manifest(tmp_path: Path) -> None:
    """Every static file (console CSS and JS, vendored libraries, the API docs' assets)
    survives WhiteNoise's manifest post-processing, which fails on a dangling reference."""
    done = subprocess.run(
        [sys.executable, "manage.py", "collectstatic", "--noinput"],
        cwd=ROOT, env=_production_env(STATIC_ROOT=str(tmp_path)), capture_output=True,
        text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    manifest = json.loads((tmp_path / "staticfiles.json").read_text())["paths"]
    for name in (
        "console/console.css",
        "console/vendor/htmx.min.js",
        "console/vendor/chart.umd.min.js",
        "drf_spectacular_sidecar/swagger-ui-dist/swagger-ui-bundle.js",
    ):
        assert (tmp_path / manifest[name]).exists(), name
