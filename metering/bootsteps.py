"""The Celery worker bootstep that runs the usage consumer inside the worker process.

Enabled by ``celery -A fairway.celery worker --usage-consumer`` (or the setting
FAIRWAY_USAGE_CONSUMER=1). It starts after the worker's pool, so prefork children are forked
before the consumer thread and its sockets exist, and stops on warm shutdown: the consumer
finishes the batch it is writing, or abandons the one it has only read, without committing
its offsets.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from celery import bootsteps

log = logging.getLogger("metering.bootsteps")


class UsageConsumerStep(bootsteps.StartStopStep):
    requires = {"celery.worker.components:Pool"}
    label = "usage-consumer"

    def __init__(self, parent: Any, usage_consumer: bool = False, **options: Any) -> None:
        from django.conf import settings

        self.enabled = bool(usage_consumer or getattr(settings, "FAIRWAY_USAGE_CONSUMER", False))
        self.consumer: Any = None
        super().__init__(parent, **options)

    def create(self, parent: Any) -> None:
        from django.conf import settings

        from metering.consumer import ConsumerConfig, UsageConsumer

        self.consumer = UsageConsumer(
            ConsumerConfig(
                bootstrap=settings.KAFKA_BOOTSTRAP,
                topic=settings.FAIRWAY_INGEST_TOPIC,
                group_id=settings.FAIRWAY_INGEST_GROUP,
                batch_max=settings.FAIRWAY_INGEST_BATCH_MAX,
                session_timeout_ms=settings.FAIRWAY_INGEST_SESSION_TIMEOUT_MS,
                kill_after_batches=int(os.environ.get("FAIRWAY_INGEST_FAULT_KILL_AFTER", "0")),
            )
        )

    def start(self, parent: Any) -> None:
        port = os.environ.get("FAIRWAY_INGEST_METRICS_PORT", "").strip()
        if port:
            from prometheus_client import start_http_server

            # Loopback unless told otherwise: a container's scraper needs 0.0.0.0.
            addr = os.environ.get("FAIRWAY_INGEST_METRICS_ADDR", "").strip() or "127.0.0.1"
            start_http_server(int(port), addr=addr)
            log.info("usage consumer metrics on http://%s:%s/metrics", addr, port)
        log.info("usage consumer starting (Kafka %s)", self.consumer.config.bootstrap)
        self.consumer.start()

    def stop(self, parent: Any) -> None:
        if self.consumer is not None:
            log.info("usage consumer stopping")
            self.consumer.stop()

    shutdown = stop
