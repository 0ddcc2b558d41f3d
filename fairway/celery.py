"""The Celery app: broker = REDIS_URL, beat schedule in settings (CELERY_BEAT_SCHEDULE).

Run with ``celery -A fairway.celery worker --beat``. Not imported from ``fairway/__init__``
so that Django-free users of the package (the gateway imports ``fairway.embedded``) do not
pay for Celery; the tenants app imports it at startup so tasks bind to this app.
"""

from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "fairway.settings.local")

app = Celery("fairway")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
