"""Settings shared by every environment. Values come from the environment via fairway.env."""

from __future__ import annotations

from datetime import timedelta

from fairway.env import (
    BASE_DIR,  # noqa: F401 - re-exported for settings users
    DEFAULT_KAFKA_BOOTSTRAP,
    DEFAULT_REDIS_URL,
    DEFAULT_SQLITE_URL,
    DEV_CACHE_SALT_KEY,
    DEV_KEY_PEPPER,
    DEV_SECRET_KEY,
    VAR_DIR,
    database_config,
    env_bool,
    env_int,
    env_list,
    env_str,
)

# -- core ---------------------------------------------------------------------------------
SECRET_KEY = env_str("SECRET_KEY", DEV_SECRET_KEY)
DEBUG = env_bool("DEBUG", False)
ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", [])

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "rest_framework.authtoken",
    "drf_spectacular",
    "catalog",
    "tenants",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "fairway.urls"
WSGI_APPLICATION = "fairway.wsgi.application"
ASGI_APPLICATION = "fairway.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

# -- database -----------------------------------------------------------------------------
DATABASES = {"default": database_config(env_str("DATABASE_URL", DEFAULT_SQLITE_URL))}
# Every request is one transaction, so read-model pushes (transaction.on_commit) only ever
# describe committed state.
DATABASES["default"]["ATOMIC_REQUESTS"] = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# -- auth ---------------------------------------------------------------------------------
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]
LOGIN_URL = "/admin/login/"

# -- i18n / time: UTC everywhere ----------------------------------------------------------
LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

# -- static -------------------------------------------------------------------------------
STATIC_URL = "static/"
STATIC_ROOT = VAR_DIR / "static"

# -- backing services ---------------------------------------------------------------------
REDIS_URL = env_str("REDIS_URL", DEFAULT_REDIS_URL)
KAFKA_BOOTSTRAP = env_str("KAFKA_BOOTSTRAP", DEFAULT_KAFKA_BOOTSTRAP)
# Seconds; every Redis call of the control plane has an explicit timeout.
REDIS_SOCKET_TIMEOUT = 5.0

# -- API keys and the gateway's read model ------------------------------------------------
# HMAC pepper for API-key hashes; the gateway reads the same variable to hash presented keys.
FAIRWAY_KEY_PEPPER = env_str("FAIRWAY_KEY_PEPPER", DEV_KEY_PEPPER)
# Keyed hash for the tenant-scoped prefix-cache salt (used by the gateway; required in
# production here so that all secrets are checked in one place).
FAIRWAY_CACHE_SALT_KEY = env_str("FAIRWAY_CACHE_SALT_KEY", DEV_CACHE_SALT_KEY)
# How often Celery beat rebuilds the whole read model to heal drift (seconds).
FAIRWAY_READMODEL_REBUILD_S = env_int("FAIRWAY_READMODEL_REBUILD_S", 60)
# How often gateways' last-used stamps are flushed into ApiKey.last_used_at (seconds).
FAIRWAY_LAST_USED_FLUSH_S = env_int("FAIRWAY_LAST_USED_FLUSH_S", 30)

# -- Celery -------------------------------------------------------------------------------
CELERY_BROKER_URL = REDIS_URL
CELERY_TASK_IGNORE_RESULT = True
CELERY_TIMEZONE = "UTC"
CELERY_ENABLE_UTC = True
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_TASK_TIME_LIMIT = 300
CELERY_TASK_SOFT_TIME_LIMIT = 240
CELERY_BEAT_SCHEDULE_FILENAME = env_str(
    "CELERY_BEAT_SCHEDULE_FILENAME", str(VAR_DIR / "celerybeat-schedule")
)
CELERY_BEAT_SCHEDULE = {
    "readmodel-rebuild": {
        "task": "tenants.tasks.readmodel_rebuild",
        "schedule": timedelta(seconds=FAIRWAY_READMODEL_REBUILD_S),
        # A rebuild older than its period is superseded by the next one.
        "options": {"expires": FAIRWAY_READMODEL_REBUILD_S},
    },
    "api-key-last-used-flush": {
        "task": "tenants.tasks.api_key_last_used_flush",
        "schedule": timedelta(seconds=FAIRWAY_LAST_USED_FLUSH_S),
        "options": {"expires": FAIRWAY_LAST_USED_FLUSH_S},
    },
}

# -- DRF ----------------------------------------------------------------------------------
REST_FRAMEWORK = {
    # Token first: an unauthenticated call then gets 401 with a WWW-Authenticate header
    # (DRF takes the header from the first class) rather than a bare 403.
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "rest_framework.authentication.TokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "DEFAULT_PARSER_CLASSES": ["rest_framework.parsers.JSONParser"],
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "EXCEPTION_HANDLER": "fairway.api_errors.exception_handler",
    "UNAUTHENTICATED_USER": "django.contrib.auth.models.AnonymousUser",
}

SPECTACULAR_SETTINGS = {
    "TITLE": "Fairway management API",
    "DESCRIPTION": "Tenants, members, API keys, per-model limits and the model registry.",
    "VERSION": "1.0.0",
    "SERVE_INCLUDE_SCHEMA": False,
    "COMPONENT_SPLIT_REQUEST": True,
}

# -- logging ------------------------------------------------------------------------------
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": env_str("LOG_LEVEL", "INFO")},
}
