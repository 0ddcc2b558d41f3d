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

# The development secrets and Redis URL are shared with the gateway: contracts/defaults.py.
# The development database on the machine's PostgreSQL (`make up` creates it, or points
# DATABASE_URL at an embedded server where none runs).
DEFAULT_DATABASE_URL = "postgres://postgres@127.0.0.1:5432/fairway_dev"
DEFAULT_KAFKA_BOOTSTRAP = "127.0.0.1:9092"

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def default_settings_module() -> str:
    """What every entry point uses when DJANGO_SETTINGS_MODULE is unset: production settings
    under FAIRWAY_ENV=production (whose checks refuse development secrets), else local ones.
    A production host that forgot DJANGO_SETTINGS_MODULE must not run with DEBUG and the
    development keys."""
    env = os.environ.get("FAIRWAY_ENV", "").strip().lower()
    return "fairway.settings.production" if env == "production" else "fairway.settings.local"


def set_default_settings_module() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", default_settings_module())


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
    """A Django DATABASES entry from a postgres:// URL.

    PostgreSQL only: ``request_log`` is a table partitioned by day, which SQLite cannot do.
    """
    config: dict[str, Any] = dict(
        dj_database_url.parse(url, conn_max_age=conn_max_age, conn_health_checks=True)
    )
    if config["ENGINE"] != "django.db.backends.postgresql":
        raise EnvError(f"DATABASE_URL must be a postgres:// URL, not {url.split(':', 1)[0]}://")
    return config
