"""Test settings: real PostgreSQL (never SQLite), fast password hashing.

The database is DATABASE_URL when set, else the machine's PostgreSQL at its standard
address when it answers, else an embedded one (pgserver). The test database name carries
the process id because several test runs may share one PostgreSQL server at once.
"""

from __future__ import annotations

import atexit
import os

from fairway.embedded import EmbeddedServices
from fairway.env import database_config, env_str
from fairway.settings.base import *  # noqa: F403

DEBUG = False
ALLOWED_HOSTS = ["testserver", "127.0.0.1", "localhost"]

_services = EmbeddedServices()
atexit.register(_services.stop)
DATABASES = {"default": database_config(_services.database_url(), conn_max_age=0)}
DATABASES["default"]["ATOMIC_REQUESTS"] = True
DATABASES["default"]["TEST"] = {
    "NAME": env_str("FAIRWAY_TEST_DB_NAME", f"test_fairway_{os.getpid()}"),
}

PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
LOGGING = {**LOGGING, "root": {"handlers": ["console"], "level": "WARNING"}}  # noqa: F405
CELERY_TASK_ALWAYS_EAGER = True
