"""Production settings: every secret from the environment, and refuse to start otherwise.

Importing this module raises ImproperlyConfigured (so ``manage.py``, gunicorn/uvicorn and
Celery all exit non-zero) when DEBUG is on, a development secret is still in use, or a
required value is missing. All problems are reported at once.
"""

from __future__ import annotations

from django.core.exceptions import ImproperlyConfigured

from fairway.env import (
    DEV_CACHE_SALT_KEY,
    DEV_KEY_PEPPER,
    DEV_SECRET_KEY,
    env_bool,
    env_int,
    env_is_set,
)
from fairway.settings.base import *  # noqa: F403

MIN_SECRET_LENGTH = 32


def _problems() -> list[str]:
    problems: list[str] = []
    if DEBUG:  # noqa: F405
        problems.append("DEBUG must be off in production (unset DEBUG or set DEBUG=0)")
    secrets = {
        "SECRET_KEY": (SECRET_KEY, DEV_SECRET_KEY),  # noqa: F405
        "FAIRWAY_KEY_PEPPER": (FAIRWAY_KEY_PEPPER, DEV_KEY_PEPPER),  # noqa: F405
        "FAIRWAY_CACHE_SALT_KEY": (FAIRWAY_CACHE_SALT_KEY, DEV_CACHE_SALT_KEY),  # noqa: F405
    }
    for name, (value, dev_default) in secrets.items():
        if not env_is_set(name) or value == dev_default:
            problems.append(
                f"{name} must be set to a secret value (the development default is refused)"
            )
        elif len(value) < MIN_SECRET_LENGTH:
            problems.append(f"{name} must be at least {MIN_SECRET_LENGTH} characters")
    if not ALLOWED_HOSTS:  # noqa: F405
        problems.append(
            "ALLOWED_HOSTS must list the host names this service answers to (comma-separated)"
        )
    problems.extend(
        f"{name} must be set" for name in ("DATABASE_URL", "REDIS_URL") if not env_is_set(name)
    )
    if env_is_set("DATABASE_URL") and DATABASES["default"]["ENGINE"].endswith("sqlite3"):  # noqa: F405
        problems.append("DATABASE_URL must point at PostgreSQL (SQLite is for `make up` only)")
    return problems


_found = _problems()
if _found:
    raise ImproperlyConfigured(
        "Refusing to start with fairway.settings.production:\n  - " + "\n  - ".join(_found)
    )

DEBUG = False
SESSION_COOKIE_SECURE = True
CSRF_COOKIE_SECURE = True
SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
SECURE_SSL_REDIRECT = env_bool("SECURE_SSL_REDIRECT", True)
SECURE_HSTS_SECONDS = env_int("SECURE_HSTS_SECONDS", 3600)
SECURE_CONTENT_TYPE_NOSNIFF = True
SECURE_REFERRER_POLICY = "same-origin"
X_FRAME_OPTIONS = "DENY"
