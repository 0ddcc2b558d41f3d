"""The Celery app: broker = CELERY_BROKER_URL (default REDIS_URL), beat schedule in settings
(CELERY_BEAT_SCHEDULE).

Run with ``celery -A fairway.celery worker --beat``; add ``--usage-consumer`` to run the
Kafka usage consumer in that worker (``metering.bootsteps``). Not imported from
``fairway/__init__`` so that Django-free users of the package (the gateway imports
``fairway.embedded``) do not pay for Celery; the tenants app imports it at startup so tasks
bind to this app.
"""

from __future__ import annotations

from typing import Any

from celery import Celery, signals
from click import Option

from fairway.env import set_default_settings_module

# Production settings under FAIRWAY_ENV=production, development ones otherwise.
set_default_settings_module()

app = Celery("fairway")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@signals.setup_logging.connect
def _logging(**_: Any) -> None:
    """Celery logs through Django's LOGGING (LOG_FORMAT=json included), not its own."""
    import logging.config

    from django.conf import settings

    logging.config.dictConfig(settings.LOGGING)


@signals.task_prerun.connect
def _task_started(task_id: str | None = None, task: Any = None, **_: Any) -> None:
    from fairway.logs import request_id_var

    if task is not None:
        task.request.fairway_log_token = request_id_var.set(task_id)


@signals.task_postrun.connect
def _task_finished(task: Any = None, **_: Any) -> None:
    from fairway.logs import request_id_var

    token = getattr(task.request, "fairway_log_token", None) if task is not None else None
    if token is not None:
        request_id_var.reset(token)


app.user_options["worker"].add(
    Option(
        ["--usage-consumer"],
        is_flag=True,
        default=False,
        help="Run the Kafka usage.v1 consumer (metering) in this worker.",
    )
)


def _add_steps() -> None:
    from metering.bootsteps import UsageConsumerStep

    app.steps["worker"].add(UsageConsumerStep)


_add_steps()
