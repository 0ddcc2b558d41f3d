"""Production settings: every secret from the environment, and refuse to start otherwise.

Importing this module raises ImproperlyConfigured (so ``manage.py``, gunicorn/uvicorn and
Celery all exit non-zero) when DEBUG is on, a development secret is still in use, or a
required value is missing. All problems are reported at once.
"""

from __future__ import annotations

from django.core.exceptions import ImproperlyConfigured

from contracts.defaults import (
    DEV_CACHE_SALT_KEY,
    DEV_KEY_PEPPER,
    DEV_SECRET_KEY,
    MIN_SECRET_BYTES,
    is_redis_url,
)
from fairway.env import (
    VAR_DIR,
    env_bool,
    env_int,
    env_is_set,
    env_str,
)
from fairway.settings.base import *  # noqa: F403

MIN_SECRET_LENGTH = MIN_SECRET_BYTES


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
    # Each Redis role's URL (defaulted or not) must name a Redis: a typo would otherwise
    # surface only at the first publish or task.
    redis_urls = {
        "REDIS_URL": REDIS_URL,  # noqa: F405
        "READMODEL_REDIS_URL": READMODEL_REDIS_URL,  # noqa: F405
        "CELERY_BROKER_URL": CELERY_BROKER_URL,  # noqa: F405
        "FAIRWAY_THROTTLE_REDIS_URL": env_str("FAIRWAY_THROTTLE_REDIS_URL", CELERY_BROKER_URL),  # noqa: F405
    }
    problems.extend(
        f"{name} must be a redis://, rediss:// or unix:// URL"
        for name, url in redis_urls.items()
        if not is_redis_url(url)
    )
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
# Static files are collected (``manage.py collectstatic``) into STATIC_ROOT with hashed,
# compressed names and served by WhiteNoise with far-future cache headers.
STATIC_ROOT = env_str("STATIC_ROOT", str(VAR_DIR / "static"))
WHITENOISE_USE_FINDERS = False
WHITENOISE_AUTOREFRESH = False
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "whitenoise.storage.CompressedManifestStaticFilesStorage"},
}
