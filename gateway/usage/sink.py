"""Where spooled usage events go: a ``Sink`` sends records in order and says how many the
broker acknowledged; ``KafkaSink`` is the real one."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from typing import Any, Protocol

log = logging.getLogger("gateway.usage")


class Sink(Protocol):
    def send_batch(self, records: Sequence[tuple[bytes, bytes]]) -> int:
        """Send ``(key, value)`` records in order; return how many leading ones the broker
        acknowledged."""

    def close(self) -> None: ...


class KafkaSink:
    """kafka-python producer, created lazily and thrown away after a failure.

    Recreating after a failure drops whatever the old producer still buffered, so the only
    copy that is retried is the spool's (no second in-producer retry racing it).
    """

    def __init__(self, bootstrap: str, topic: str, timeout_s: float = 2.0) -> None:
        self._bootstrap = bootstrap
        self._topic = topic
        self._timeout_s = timeout_s
        self._producer: Any = None

    def send_batch(self, records: Sequence[tuple[bytes, bytes]]) -> int:
        """Send in order; return how many leading records the broker acknowledged."""
        from kafka import KafkaProducer

        if self._producer is None:
            ms = int(self._timeout_s * 1000)
            self._producer = KafkaProducer(
                bootstrap_servers=self._bootstrap,
                client_id="fairway-gateway",
                acks="all",
                linger_ms=2,
                max_block_ms=ms,
                request_timeout_ms=ms,
                delivery_timeout_ms=2 * ms,
                bootstrap_timeout_ms=ms,
                max_in_flight_requests_per_connection=1,
                reconnect_backoff_max_ms=1000,
            )
        futures = []
        acked = 0
        try:
            for key, value in records:
                futures.append(self._producer.send(self._topic, value=value, key=key))
            self._producer.flush(timeout=2 * self._timeout_s)
            for future in futures:
                if not future.succeeded():
                    break
                acked += 1
        except Exception as exc:  # noqa: BLE001 - any broker failure: back off, retry
            log.warning("kafka send failed after %d/%d records: %r", acked, len(records), exc)
        if acked < len(records):
            self.reset()
        return acked

    def reset(self) -> None:
        producer, self._producer = self._producer, None
        if producer is not None:
            with contextlib.suppress(Exception):
                producer.close(timeout=0)

    def close(self) -> None:
        self.reset()
