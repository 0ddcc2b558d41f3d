"""Settings shared by every environment. Values come from the environment via fairway.env."""

from __future__ import annotations

from datetime import timedelta

from contracts.defaults import (
    DEFAULT_REDIS_URL,
    DEV_CACHE_SALT_KEY,
    DEV_KEY_PEPPER,
    DEV_SECRET_KEY,
)
from fairway.env import (
    BASE_DIR,  # noqa: F401 - re-exported for settings users
    DEFAULT_DATABASE_URL,
    DEFAULT_KAFKA_BOOTSTRAP,
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
    "django.contrib.humanize",
    "axes",
    "rest_framework",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "catalog",
    "tenants",
    "metering",
    "billing",
    "console",
]

MIDDLEWARE = [
    # First: every log line of the request carries its id (fairway.logs).
    "fairway.middleware.RequestIdMiddleware",
    # Probes by pod IP over plain HTTP, before host validation and the HTTPS redirect.
    "fairway.health.HealthMiddleware",
    "django.middleware.security.SecurityMiddleware",
    # Static files (the console's CSS and vendored JS) from the app itself, no CDN.
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    # Last, as django-axes requires: it turns a locked-out sign-in into its lockout response.
    "axes.middleware.AxesMiddleware",
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
                "console.context.console",
            ],
        },
    },
]

# -- database -----------------------------------------------------------------------------
DATABASES = {"default": database_config(env_str("DATABASE_URL", DEFAULT_DATABASE_URL))}
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
LOGIN_URL = "console:login"
LOGIN_REDIRECT_URL = "console:home"
LOGOUT_REDIRECT_URL = "console:login"
# django-axes first: it refuses sign-ins for a locked-out username/address pair before the
# password is even checked. (Its backend needs the request: tests sign in with
# ``client.login(request=HttpRequest(), ...)`` or ``force_login``.)
AUTHENTICATION_BACKENDS = [
    "axes.backends.AxesStandaloneBackend",
    "django.contrib.auth.backends.ModelBackend",
]
# Lock a username from one address after 5 failures in a row for 15 minutes. Keyed on the
# pair, so an attacker cannot lock a customer out from elsewhere by guessing their name.
AXES_FAILURE_LIMIT = env_int("AXES_FAILURE_LIMIT", 5)
AXES_COOLOFF_TIME = timedelta(minutes=env_int("AXES_COOLOFF_MINUTES", 15))
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]
AXES_RESET_ON_SUCCESS = True
AXES_LOCKOUT_TEMPLATE = "console/locked_out.html"
AXES_VERBOSE = False
SESSION_COOKIE_HTTPONLY = True
SESSION_COOKIE_SAMESITE = "Lax"
CSRF_COOKIE_SAMESITE = "Lax"

# -- i18n / time: UTC everywhere ----------------------------------------------------------
LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

# -- static -------------------------------------------------------------------------------
STATIC_URL = "static/"
# Only production collects static files (into STATIC_ROOT, from the environment or var/).
STATIC_ROOT: str | None = None
# Served by WhiteNoise; outside production straight from the apps' static folders, so
# neither runserver nor the tests' live server needs collectstatic (production collects
# into STATIC_ROOT with hashed, compressed names).
WHITENOISE_USE_FINDERS = True
WHITENOISE_AUTOREFRESH = DEBUG

# -- backing services ---------------------------------------------------------------------
REDIS_URL = env_str("REDIS_URL", DEFAULT_REDIS_URL)
# The read model the gateways read (keys, tenants, catalog, its change channel): its own
# Redis when READMODEL_REDIS_URL is set (the gateway reads the same variable), else REDIS_URL.
READMODEL_REDIS_URL = env_str("READMODEL_REDIS_URL", REDIS_URL)
# REDIS_CLUSTER=1: REDIS_URL is one node of a Redis Cluster (the read model is written
# without MULTI there; see gateway.admission.quota for the key layout rule).
REDIS_CLUSTER = env_str("REDIS_CLUSTER", "").strip().lower() in ("1", "true", "yes", "on")
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
# How often beat checks that the read model is loaded (or a gateway asked for a rebuild).
FAIRWAY_READMODEL_CHECK_S = env_int("FAIRWAY_READMODEL_CHECK_S", 2)
# How often gateways' last-used stamps are flushed into ApiKey.last_used_at (seconds).
FAIRWAY_LAST_USED_FLUSH_S = env_int("FAIRWAY_LAST_USED_FLUSH_S", 30)

# -- usage ingestion (metering) -----------------------------------------------------------
# Run the usage.v1 consumer in every Celery worker (or per worker: `worker --usage-consumer`).
FAIRWAY_USAGE_CONSUMER = env_bool("FAIRWAY_USAGE_CONSUMER", False)
FAIRWAY_INGEST_TOPIC = env_str("FAIRWAY_INGEST_TOPIC", "usage.v1")
FAIRWAY_INGEST_GROUP = env_str("FAIRWAY_INGEST_GROUP", "billing")
FAIRWAY_INGEST_BATCH_MAX = env_int("FAIRWAY_INGEST_BATCH_MAX", 5000)
FAIRWAY_INGEST_SESSION_TIMEOUT_MS = env_int("FAIRWAY_INGEST_SESSION_TIMEOUT_MS", 6000)
# request_log keeps this many UTC days before today; usage is kept forever.
FAIRWAY_REQUEST_LOG_RETENTION_DAYS = env_int("FAIRWAY_REQUEST_LOG_RETENTION_DAYS", 30)

# -- billing ------------------------------------------------------------------------------
# Current-month drafts are refreshed this often; last month is finalized once it has been
# over for the grace period (late usage events still land in it until then).
BILLING_INVOICE_REFRESH_S = env_int("BILLING_INVOICE_REFRESH_S", 900)
BILLING_FINALIZE_GRACE_S = env_int("BILLING_FINALIZE_GRACE_S", 3600)
# The Stripe outbox: drained after every commit that writes to it and every N seconds;
# a failing row waits base * 2^(attempts-1) (capped) before its next try.
BILLING_OUTBOX_DRAIN_S = env_int("BILLING_OUTBOX_DRAIN_S", 30)
BILLING_OUTBOX_BACKOFF_BASE_MS = env_int("BILLING_OUTBOX_BACKOFF_BASE_MS", 2000)
BILLING_OUTBOX_BACKOFF_MAX_S = env_int("BILLING_OUTBOX_BACKOFF_MAX_S", 3600)
BILLING_OUTBOX_MAX_ATTEMPTS = env_int("BILLING_OUTBOX_MAX_ATTEMPTS", 15)
# Stripe: no API key = sync off (invoices are still built; the outbox marks rows skipped).
# STRIPE_API_BASE points the SDK elsewhere (our fake in tests); empty = Stripe itself.
STRIPE_API_KEY = env_str("STRIPE_API_KEY", "")
STRIPE_WEBHOOK_SECRET = env_str("STRIPE_WEBHOOK_SECRET", "")
STRIPE_API_BASE = env_str("STRIPE_API_BASE", "")
STRIPE_TIMEOUT_MS = env_int("STRIPE_TIMEOUT_MS", 20000)

# -- Celery -------------------------------------------------------------------------------
# Celery's Redis transport cannot use a Redis Cluster: with REDIS_CLUSTER, point
# CELERY_BROKER_URL at a plain Redis (it holds only the task queue).
CELERY_BROKER_URL = env_str("CELERY_BROKER_URL", REDIS_URL)
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
    "readmodel-check": {
        "task": "tenants.tasks.readmodel_check",
        "schedule": timedelta(seconds=FAIRWAY_READMODEL_CHECK_S),
        "options": {"expires": FAIRWAY_READMODEL_CHECK_S},
    },
    "api-key-last-used-flush": {
        "task": "tenants.tasks.api_key_last_used_flush",
        "schedule": timedelta(seconds=FAIRWAY_LAST_USED_FLUSH_S),
        "options": {"expires": FAIRWAY_LAST_USED_FLUSH_S},
    },
    "api-tokens-expired-delete": {
        "task": "tenants.tasks.api_tokens_expired_delete",
        "schedule": timedelta(hours=1),
        "options": {"expires": 3600},
    },
    # Hourly, so tomorrow's partition exists long before midnight UTC and a missed run
    # is repaired within the hour (the consumer also creates a day on demand).
    "request-log-partitions": {
        "task": "metering.tasks.request_log_partitions_maintain",
        "schedule": timedelta(hours=1),
        "options": {"expires": 3600},
    },
    "billing-invoice-cycle": {
        "task": "billing.tasks.invoice_cycle",
        "schedule": timedelta(seconds=BILLING_INVOICE_REFRESH_S),
        "options": {"expires": BILLING_INVOICE_REFRESH_S},
    },
    "billing-stripe-outbox-drain": {
        "task": "billing.tasks.stripe_outbox_drain",
        "schedule": timedelta(seconds=BILLING_OUTBOX_DRAIN_S),
        "options": {"expires": BILLING_OUTBOX_DRAIN_S},
    },
}

# -- console ------------------------------------------------------------------------------
# The OpenAI-compatible base URL customers are told to use (the gateway's public address).
FAIRWAY_API_BASE_URL = env_str("FAIRWAY_API_BASE_URL", "http://127.0.0.1:8080/v1")
# Where the console scrapes the gateway's Prometheus metrics (comma-separated for several
# gateway processes).
FAIRWAY_GATEWAY_METRICS_URLS = env_list(
    "FAIRWAY_GATEWAY_METRICS_URLS", ["http://127.0.0.1:8080/metrics"]
)
# The gateway's GATEWAY_METRICS_TOKEN, sent as a bearer token with those scrapes.
FAIRWAY_GATEWAY_METRICS_TOKEN = env_str("FAIRWAY_GATEWAY_METRICS_TOKEN", "")
# The usage consumer's metrics (the Celery worker's FAIRWAY_INGEST_METRICS_PORT).
FAIRWAY_INGEST_METRICS_URLS = env_list(
    "FAIRWAY_INGEST_METRICS_URLS", ["http://127.0.0.1:9464/metrics"]
)
# Each replica / gateway scrape gives up after this many seconds (scrapes run concurrently).
FAIRWAY_SCRAPE_TIMEOUT_S = 1.5

# -- DRF ----------------------------------------------------------------------------------
# Hosts a replica's base_url may point at (replicas receive every tenant's prompts): CIDRs,
# exact names, "*.suffix", and "." for single-label names (container / cluster service
# names). The default is the private and loopback networks; production lists its own.
FAIRWAY_REPLICA_ALLOWED_HOSTS = env_list(
    "FAIRWAY_REPLICA_ALLOWED_HOSTS",
    [
        "127.0.0.0/8",
        "::1/128",
        "10.0.0.0/8",
        "172.16.0.0/12",
        "192.168.0.0/16",
        "fc00::/7",
        "localhost",
        ".",
        "*.svc.cluster.local",
        "*.internal",
    ],
)
# The most unrevoked API keys one tenant may hold.
FAIRWAY_MAX_KEYS_PER_TENANT = env_int("FAIRWAY_MAX_KEYS_PER_TENANT", 100)

# Management-API tokens are refused once this old; sign in again for a new one. Only their
# HMAC is stored (tenants.models.ApiToken); expired rows are deleted hourly, and a user's
# password change deletes all of theirs.
FAIRWAY_API_TOKEN_MAX_AGE_H = env_int("FAIRWAY_API_TOKEN_MAX_AGE_H", 24)
# Each obtain issues a new token; a user keeps at most this many (the oldest go first).
FAIRWAY_API_TOKENS_PER_USER = env_int("FAIRWAY_API_TOKENS_PER_USER", 20)
# Password checks at /api/v1/auth/token/, per client address (DRF rate syntax).
FAIRWAY_AUTH_TOKEN_RATE = env_str("FAIRWAY_AUTH_TOKEN_RATE", "10/min")
# Throttle counters live in Redis so every web process shares them (a plain Redis: Django's
# cache cannot use a cluster, so by default the Celery broker's).
CACHES = {
    "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
    "throttle": {
        "BACKEND": "django.core.cache.backends.redis.RedisCache",
        "LOCATION": env_str("FAIRWAY_THROTTLE_REDIS_URL", CELERY_BROKER_URL),
        "KEY_PREFIX": "fw:throttle",
        "TIMEOUT": 3600,
    },
}

REST_FRAMEWORK = {
    # Token first: an unauthenticated call then gets 401 with a WWW-Authenticate header
    # (DRF takes the header from the first class) rather than a bare 403.
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "tenants.authentication.ExpiringTokenAuthentication",
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
    "DESCRIPTION": (
        "Tenants, members, API keys, per-model limits, the model registry, usage and costs, "
        "invoices and billing reconciliation."
    ),
    "VERSION": "1.0.0",
    "SERVE_INCLUDE_SCHEMA": False,
    # Swagger UI and ReDoc from the drf-spectacular-sidecar package, served locally.
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    "COMPONENT_SPLIT_REQUEST": True,
    # The usage and costs reports' OpenAI-style "object" tags, one enum each.
    "ENUM_NAME_OVERRIDES": {
        "PageObjectEnum": ["page"],
        "BucketObjectEnum": ["bucket"],
        "UsageCompletionsResultObjectEnum": ["organization.usage.completions.result"],
        "CostsResultObjectEnum": ["organization.costs.result"],
    },
}

# -- logging ------------------------------------------------------------------------------
# LOG_FORMAT=json: one JSON object per line with the request id (fairway.logs).
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "filters": {"request_id": {"()": "fairway.logs.RequestIdFilter"}},
    "formatters": {
        "plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"},
        "json": {"()": "fairway.logs.JsonFormatter"},
    },
    "handlers": {
        "console": {
            "class": "logging.StreamHandler",
            "formatter": "json" if env_str("LOG_FORMAT", "").lower() == "json" else "plain",
            "filters": ["request_id"],
        }
    },
    "root": {"handlers": ["console"], "level": env_str("LOG_LEVEL", "INFO")},
}
