"""The one place that reads the process environment for the Django side.

Plain ``os.environ`` helpers plus dj-database-url. Settings modules call these; nothing else
in the control plane reads ``os.environ`` directly. No Django import here.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import dj_database_url

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = BASE_DIR / "var"

# Development defaults. Production settings refuse to start while any of these is in use,
# so they are safe to keep in the source.
DEV_SECRET_KEY = "fairway-dev-secret-key-not-for-production-0123456789abcdefghijklmnop"  # noqa: S105
DEV_KEY_PEPPER = "fairway-dev-key-pepper-not-secret"
DEV_CACHE_SALT_KEY = "fairway-dev-cache-salt-key-not-secret"
DEFAULT_SQLITE_URL = f"sqlite:///{VAR_DIR / 'fairway.sqlite3'}"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_KAFKA_BOOTSTRAP = "127.0.0.1:9092"

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


class EnvError(ValueError):
    """An environment variable holds a value that cannot be parsed."""


def env_str(name: str, default: str = "") -> str:
    return os.environ.get(name, default)


def env_is_set(name: str) -> bool:
    return bool(os.environ.get(name, "").strip())


def env_bool(name: str, default: bool = False) -> bool:
    raw = os.environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise EnvError(f"{name}={raw!r} is not a boolean (use 1/0, true/false, yes/no, on/off)")


def env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        return int(raw)
    except ValueError as exc:
        raise EnvError(f"{name}={raw!r} is not an integer") from exc


def env_list(name: str, default: list[str] | None = None) -> list[str]:
    """Comma-separated list; blanks dropped."""
    raw = os.environ.get(name)
    if raw is None:
        return list(default or [])
    return [item.strip() for item in raw.split(",") if item.strip()]


def database_config(url: str, *, conn_max_age: int = 60) -> dict[str, Any]:
    """A Django DATABASES entry from a URL (postgres://, sqlite:///...)."""
    config: dict[str, Any] = dict(
        dj_database_url.parse(url, conn_max_age=conn_max_age, conn_health_checks=True)
    )
    if config["ENGINE"] == "django.db.backends.sqlite3":
        # SQLite holds one writer; a long-lived connection per thread is fine, and the
        # file's directory must exist before Django opens it.
        Path(config["NAME"]).parent.mkdir(parents=True, exist_ok=True)
        config["CONN_MAX_AGE"] = 0
    return config
