"""Small helpers shared by the control-plane tests."""

from __future__ import annotations

import time
from typing import Any

import redis

from gateway import schema


def wait_for_change(
    pubsub: redis.client.PubSub, *, kind: str, ident: str, timeout: float = 5.0
) -> schema.Change:
    """The first Change matching kind/ident; other publishers' messages are skipped."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        message = pubsub.get_message(ignore_subscribe_messages=True, timeout=0.2)
        if message is None or message["type"] != "message":
            continue
        change = schema.load_change(message["data"])
        if change.kind == kind and change.ident == ident:
            return change
    raise AssertionError(f"no {kind} change for {ident!r} within {timeout}s")


def subscribe(client: redis.Redis) -> redis.client.PubSub:
    pubsub = client.pubsub()
    pubsub.subscribe(schema.CHANGES_CHANNEL)
    # Wait for the subscription to be active before anything is published.
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        message = pubsub.get_message(timeout=0.2)
        if message and message["type"] == "subscribe":
            return pubsub
    raise AssertionError("subscription not confirmed")


def error_of(response: Any) -> dict[str, Any]:
    body = response.json()
    assert set(body) == {"error"}, body
    error: dict[str, Any] = body["error"]
    assert {"message", "type", "param", "code"} <= set(error), error
    return error
