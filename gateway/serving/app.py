"""The ASGI application: a hand-written router over a handful of endpoints.

No framework: the hot path is one dict lookup and a handler call, which keeps the gateway's
added latency to what auth, validation and the upstream hop cost (bench/gateway_overhead.py).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import orjson
from redis.exceptions import RedisError

from fairway.logs import client_request_id_var, request_id_var
from gateway.config import GatewayConfig
from gateway.endpoints.chat import ChatCompletions
from gateway.endpoints.completions import Completions
from gateway.endpoints.models import ModelsList
from gateway.endpoints.pipeline import Call
from gateway.errors import ApiError, MethodNotAllowed, NotFound, config_store_unavailable
from gateway.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from gateway.metrics import GatewayMetrics
from gateway.serving.http import (
    JSON,
    Receive,
    Scope,
    Send,
    client_request_id,
    new_request_id,
    pick_headers,
    send_bytes,
    send_error,
)

log = logging.getLogger("gateway.app")

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MODELS = "/v1/models"
MODEL = "/v1/models/"  # + a model id (which may itself hold slashes)
OPERATIONS = ("/metrics", "/readyz", "/healthz")


@dataclass(frozen=True, slots=True)
class Readiness:
    """What ``/readyz`` says. A balancer needs one bit: can this process serve? So only
    ``problems`` (draining, starting, no read model, no replica reachable) make it not
    ready; a dependency the process serves through (Redis: the limits fail open and the
    read model answers from memory; the spool disk: events wait in memory; the broker:
    events wait in the spool) is ``degraded``, shown to operators only. Failing readiness
    for those would take every gateway sharing the dependency out of the balancer at once,
    while each of them could still serve."""

    problems: list[str] = field(default_factory=list)
    degraded: list[str] = field(default_factory=list)
    dependencies: dict[str, bool] = field(default_factory=dict)


class GatewayApp:
    """Routes requests to the endpoints and lifespan events to the process's startup and
    shutdown; every part is passed in (the server composes them, serving/server.py)."""

    def __init__(
        self,
        *,
        config: GatewayConfig,
        metrics: GatewayMetrics,
        chat: ChatCompletions,
        completions: Completions,
        models: ModelsList,
        readiness: Callable[[], Readiness],
        startup: Callable[[], Awaitable[None]],
        shutdown: Callable[[], Awaitable[None]],
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.chat = chat
        self.completions = completions
        self.models = models
        self.readiness = readiness  # what keeps this process from taking traffic, if anything
        self.startup = startup
        self.shutdown = shutdown

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            await self._http(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.startup()
                except Exception as exc:
                    log.exception("gateway startup failed")
                    await send({"type": "lifespan.startup.failed", "message": repr(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope["path"]
        method: str = scope["method"]
        hdrs = pick_headers(scope)
        request_id = new_request_id()
        client_rid = client_request_id(hdrs.request_id)
        headers = {"x-request-id": client_rid or request_id}
        # This request's task only (asyncio copies the context per task): its log lines
        # carry the gateway's id (the usage event's key) and the caller's, if it sent one.
        request_id_var.set(request_id)
        client_request_id_var.set(client_rid)
        # With a metrics listener (GATEWAY_METRICS_PORT), the operations surface is served
        # there only and the API on the API port only.
        metrics_port = self.config.metrics_port
        internal = metrics_port is not None and (scope.get("server") or ("", 0))[1] == metrics_port
        try:
            if internal and path not in OPERATIONS:
                raise NotFound(f"Unknown path {path[:200]}.", code="unknown_url")
            if path == CHAT:
                if method != "POST":
                    raise MethodNotAllowed(
                        "Use POST for /v1/chat/completions.", code="method_not_allowed"
                    )
                await self.chat(Call(receive, send, hdrs, request_id, client_rid, headers))
            elif path == COMPLETIONS:
                if method != "POST":
                    raise MethodNotAllowed(
                        "Use POST for /v1/completions.", code="method_not_allowed"
                    )
                await self.completions(Call(receive, send, hdrs, request_id, client_rid, headers))
            elif method != "GET" and (
                path in (MODELS, "/healthz", "/readyz", "/metrics") or path.startswith(MODEL)
            ):
                raise MethodNotAllowed(f"Use GET for {path[:200]}.", code="method_not_allowed")
            elif path == MODELS:
                await self.models(send, hdrs.authorization, headers, hdrs.client)
            elif path.startswith(MODEL):
                await self.models.retrieve(
                    send, path[len(MODEL) :], hdrs.authorization, headers, hdrs.client
                )
            elif path == "/healthz":
                await send_bytes(send, 200, b'{"status":"ok"}', JSON, headers)
            elif path == "/readyz":
                await self._ready(send, headers, self._operator(hdrs.authorization, internal))
            elif path == "/metrics":
                if not self._operator(hdrs.authorization, internal):
                    raise NotFound(f"Unknown path {path}.", code="unknown_url")
                # Summing the worker files is blocking disk work: off the event loop.
                loop = asyncio.get_running_loop()
                body = await loop.run_in_executor(None, self.metrics.render)
                await send_bytes(send, 200, body, METRICS_CONTENT_TYPE.encode(), headers)
            else:
                raise NotFound(f"Unknown path {path[:200]}.", code="unknown_url")
        except ApiError as exc:
            await send_error(send, exc, headers)
        except RedisError as exc:
            # /v1/models with a key not cached while the store is unreachable: the store's
            # outage, not a gateway bug (chat handles its own, with metrics).
            log.warning("redis unavailable on %s: %r", path, exc)
            await send_error(send, config_store_unavailable(), headers)
        except Exception:
            # A bug, not the client's fault. Log it with the request id; answer if we still can.
            log.exception("unhandled error on %s %s request_id=%s", method, path, request_id)
            error = ApiError("The gateway hit an internal error.", code="internal_error")
            try:
                await send_error(send, error, headers)
            except Exception:  # noqa: BLE001 - the response had started; nothing to add
                log.debug("could not send the 500 for %s", request_id)

    def _operator(self, authorization: bytes | None, internal: bool) -> bool:
        """Whether this caller may see metrics and readiness details: never on the API port
        while a metrics listener exists; else it presents the metrics token, or none is
        configured and this is the metrics listener or not production."""
        if self.config.metrics_port is not None and not internal:
            return False
        token = self.config.metrics_token
        if token is None:
            return internal or not self.config.production
        expected = b"Bearer " + token.encode()
        return authorization is not None and hmac.compare_digest(authorization, expected)

    async def _ready(self, send: Send, headers: dict[str, str], details: bool) -> None:
        readiness = self.readiness()  # no I/O: dependencies are probed in the background
        status = 503 if readiness.problems else 200
        verdict: dict[str, object] = {"status": "not ready" if readiness.problems else "ready"}
        if details:  # the load balancer needs the status only; the reasons are ours
            verdict["problems"] = readiness.problems
            verdict["degraded"] = readiness.degraded
            verdict["dependencies"] = readiness.dependencies
        body = orjson.dumps(verdict)
        await send_bytes(send, status, body, JSON, headers)
