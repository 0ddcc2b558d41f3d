"""Small helpers shared by the control-plane tests."""

from __future__ import annotations

from typing import Any

import redis
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

from contracts import schema
from tests.support import wait_until


def migrate_tenants(target: tuple[str, str] | None = None) -> None:
    """Migrate the tenants app of the test database to ``target`` (None: its latest)."""
    executor = MigrationExecutor(connection)
    executor.loader.build_graph()
    targets = (
        [target] if target else [n for n in executor.loader.graph.leaf_nodes() if n[0] == "tenants"]
    )
    executor.migrate(targets)


def wait_for_change(
    pubsub: redis.client.PubSub, *, kind: str, ident: str, timeout: float = 5.0
) -> schema.Change:
    """The first Change matching kind/ident; other publishers' messages are skipped."""

    def matching() -> schema.Change | None:
        message = pubsub.get_message(ignore_subscribe_messages=True, timeout=0.2)
        if message is None or message["type"] != "message":
            return None
        change = schema.load_change(message["data"])
        return change if change.kind == kind and change.ident == ident else None

    # get_message waits up to 0.2 s itself: no pause between polls
    return wait_until(matching, timeout, 0, f"a {kind} change for {ident!r}")


def subscribe(client: redis.Redis) -> redis.client.PubSub:
    pubsub = client.pubsub()
    pubsub.subscribe(schema.CHANGES_CHANNEL)
    # Wait for the subscription to be active before anything is published.

    def confirmed() -> bool:
        message = pubsub.get_message(timeout=0.2)
        return bool(message and message["type"] == "subscribe")

    wait_until(confirmed, 5, 0, "the subscription confirmed")
    return pubsub


def error_of(response: Any) -> dict[str, Any]:
    body = response.json()
    assert set(body) == {"error"}, body
    error: dict[str, Any] = body["error"]
    assert {"message", "type", "param", "code"} <= set(error), error
    return error
