"""Small ASGI helpers: header picking, bounded body reading, plain responses."""

from __future__ import annotations

import asyncio
import random
import re
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

from gateway.errors import ApiError, BadRequest, PayloadTooLarge

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

JSON = b"application/json"
SSE = b"text/event-stream; charset=utf-8"
_REQUEST_ID = re.compile(rb"[A-Za-z0-9][A-Za-z0-9._:\-]{0,127}")


class ClientGone(Exception):
    """The client disconnected before its response began: while its body was still coming,
    or while the gateway held it before admission (gateway/admission/hold.py)."""


@dataclass(slots=True)
class RequestHeaders:
    authorization: bytes | None = None
    request_id: bytes | None = None
    idempotency_key: bytes | None = None
    content_length: bytes | None = None
    retry_count: bytes | None = None  # x-stainless-retry-count (the openai SDKs' retries)
    client: str | None = None  # the peer's address (behind a proxy: as the server resolved it)


def pick_headers(scope: Scope) -> RequestHeaders:
    picked = RequestHeaders()
    peer = scope.get("client")
    if peer:
        picked.client = str(peer[0])
    for name, value in scope["headers"]:
        if name == b"authorization":
            picked.authorization = value
        elif name == b"x-request-id":
            picked.request_id = value
        elif name == b"idempotency-key":
            picked.idempotency_key = value
        elif name == b"content-length":
            picked.content_length = value
        elif name == b"x-stainless-retry-count":
            picked.retry_count = value
    return picked


def sdk_retry(raw: bytes | None) -> bool:
    """True when the official openai SDK says this is one of its automatic retries: it
    sends ``x-stainless-retry-count: N`` on every attempt, 0 on the first. Advisory only
    (docs/design.md R6): it labels a metric and decides whether the shared retry marks are
    asked, never makes a retry by itself; a malformed value is ignored, never refused."""
    if raw is None or not raw.isdigit() or len(raw) > 9:
        return False
    return int(raw) > 0


# Request ids need uniqueness, not secrecy: a per-process generator seeded from the OS once
# is ~50x cheaper than uuid4's os.urandom call per request on this kind of VM.
_ids = random.Random()


def new_request_id() -> str:
    return f"{_ids.getrandbits(128):032x}"


def client_request_id(raw: bytes | None) -> str | None:
    """The client's X-Request-Id when well-formed (≤128 of ``[A-Za-z0-9._:-]``), else None."""
    if raw is not None and _REQUEST_ID.fullmatch(raw):
        return raw.decode("ascii")
    return None


async def read_body(
    receive: Receive, limit: int, content_length: bytes | None, *, timeout_s: float | None = None
) -> bytes:
    """The request body, at most ``limit`` bytes, all of it within ``timeout_s`` (a client
    trickling its body must not hold a connection and a tenant slot for ever)."""
    if timeout_s is None:
        return await _read_body(receive, limit, content_length)
    # One timer that cancels this task, as asyncio.timeout does, without its per-use Python
    # machinery: this runs on every request (bench/results/gateway_cpu_trace.md).
    task = asyncio.current_task()
    assert task is not None
    expired: list[bool] = []
    cancelling = task.cancelling()
    timer = asyncio.get_running_loop().call_later(timeout_s, _expire, task, expired)
    try:
        body = await _read_body(receive, limit, content_length)
    except asyncio.CancelledError:
        if expired and task.uncancel() <= cancelling:
            raise ApiError(
                f"The request body did not arrive within {timeout_s:g} s.",
                status=408,
                type="invalid_request_error",
                code="request_timeout",
                headers={"connection": "close"},
            ) from None
        raise  # cancelled by someone else (the client left, the server stops)
    finally:
        timer.cancel()
    if expired:
        task.uncancel()  # fired just as the body completed: the deadline was met
    return body


def _expire(task: asyncio.Task[Any], expired: list[bool]) -> None:
    expired.append(True)
    task.cancel()


async def _read_body(receive: Receive, limit: int, content_length: bytes | None) -> bytes:
    if content_length is not None:
        try:
            declared = int(content_length)
        except ValueError:
            raise BadRequest("Invalid Content-Length header.", code="invalid_header") from None
        if declared > limit:
            raise PayloadTooLarge(
                f"The request body exceeds the limit of {limit} bytes.", code="request_too_large"
            )
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        if chunk:
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(
                    f"The request body exceeds the limit of {limit} bytes.",
                    code="request_too_large",
                )
            chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def encode_headers(headers: Mapping[str, str]) -> list[tuple[bytes, bytes]]:
    return [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]


async def send_bytes(
    send: Send,
    status: int,
    body: bytes,
    content_type: bytes,
    headers: Mapping[str, str] | None = None,
) -> None:
    raw = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
    if headers:
        raw += encode_headers(headers)
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def send_error(send: Send, error: ApiError, headers: Mapping[str, str]) -> None:
    merged = dict(headers)
    merged.update(error.headers)
    await send_bytes(send, error.status, error.body(), JSON, merged)
