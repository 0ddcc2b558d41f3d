"""Development settings, used by ``make up`` and ``manage.py`` by default.

PostgreSQL: DATABASE_URL, or the machine's at 127.0.0.1:5432, database fairway_dev (which
`make up` creates); DEBUG on; dev secrets allowed.
"""

from __future__ import annotations

from fairway.env import VAR_DIR, env_bool, env_list
from fairway.settings.base import *  # noqa: F403

VAR_DIR.mkdir(exist_ok=True)  # beat schedule, demo keys, gateway spool

DEBUG = env_bool("DEBUG", True)
ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", ["127.0.0.1", "localhost", "[::1]"])
# The browsable API helps when poking at the management API by hand.
REST_FRAMEWORK = {
    **REST_FRAMEWORK,  # noqa: F405
    "DEFAULT_RENDERER_CLASSES": [
        "rest_framework.renderers.JSONRenderer",
        "rest_framework.renderers.BrowsableAPIRenderer",
    ],
}
