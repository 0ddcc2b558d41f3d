"""Development defaults shared by the control plane and the gateway.

Both sides hash API keys with the same pepper, so their defaults must be one value. They
are public on purpose: production settings (``fairway/settings/production.py``) and the
gateway's configuration (``gateway/config.py``) refuse to start while any is in use.
"""

from __future__ import annotations

from urllib.parse import urlsplit

DEV_SECRET_KEY = "fairway-dev-secret-key-not-for-production-0123456789abcdefghijklmnop"  # noqa: S105
DEV_KEY_PEPPER = "fairway-dev-key-pepper-not-secret"  # noqa: S105 - public dev default
DEV_CACHE_SALT_KEY = "fairway-dev-cache-salt-key-not-secret"  # noqa: S105
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
# Production asks at least this many bytes of every secret, on both sides.
MIN_SECRET_BYTES = 32


def is_redis_url(url: str) -> bool:
    """Whether ``url`` names a Redis server: redis:// or rediss:// with a host, or unix://
    with a path. Production on both sides refuses anything else at start, so a typo in one
    role's URL stops the process instead of surfacing at its first command."""
    parts = urlsplit(url)
    if parts.scheme == "unix":
        return bool(parts.path)
    return parts.scheme in ("redis", "rediss") and bool(parts.hostname)
