"""Announcing a read-model change: one message on ``CHANGES_CHANNEL`` after the write, so
that every gateway drops its cached copy at once instead of waiting for its TTL."""

from __future__ import annotations

from typing import Any, Protocol

from contracts.schema import CHANGES_CHANNEL, Change, ChangeKind, dumps


class Publisher(Protocol):
    """A Redis client or pipeline (sync), anything with ``publish``."""

    def publish(self, channel: str, message: bytes) -> Any: ...


def publish_change(client: Publisher, kind: ChangeKind, ident: str, version: int) -> None:
    client.publish(CHANGES_CHANNEL, dumps(Change(kind=kind, ident=ident, version=version)))
