"""The ASGI application: a hand-written router over five endpoints.

No framework: the hot path is one dict lookup and a handler call, which keeps the gateway's
added latency to what auth, validation and the upstream hop cost (bench/gateway_overhead.py).
"""

from __future__ import annotations

import logging

import orjson
from redis.exceptions import RedisError

from gateway.chat import ChatCompletions
from gateway.errors import ApiError, MethodNotAllowed, NotFound, config_store_unavailable
from gateway.http import (
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
from gateway.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from gateway.server import Gateway

log = logging.getLogger("gateway.app")

CHAT = "/v1/chat/completions"
MODELS = "/v1/models"


class GatewayApp:
    def __init__(self, gateway: Gateway) -> None:
        self.gw = gateway
        self.chat = ChatCompletions(gateway)

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
                    await self.gw.startup()
                except Exception as exc:
                    log.exception("gateway startup failed")
                    await send({"type": "lifespan.startup.failed", "message": repr(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.gw.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope["path"]
        method: str = scope["method"]
        hdrs = pick_headers(scope)
        request_id = new_request_id()
        client_rid = client_request_id(hdrs.request_id)
        headers = {"x-request-id": client_rid or request_id}
        try:
            if path == CHAT:
                if method != "POST":
                    raise MethodNotAllowed(
                        "Use POST for /v1/chat/completions.", code="method_not_allowed"
                    )
                await self.chat(receive, send, hdrs, request_id, client_rid, headers)
            elif method != "GET" and path in (MODELS, "/healthz", "/readyz", "/metrics"):
                raise MethodNotAllowed(f"Use GET for {path}.", code="method_not_allowed")
            elif path == MODELS:
                await self._models(send, hdrs.authorization, headers)
            elif path == "/healthz":
                await send_bytes(send, 200, b'{"status":"ok"}', JSON, headers)
            elif path == "/readyz":
                await self._ready(send, headers)
            elif path == "/metrics":
                await send_bytes(
                    send, 200, self.gw.metrics.render(), METRICS_CONTENT_TYPE.encode(), headers
                )
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

    async def _models(
        self, send: Send, authorization: bytes | None, headers: dict[str, str]
    ) -> None:
        principal = await self.gw.auth.authenticate(authorization, "models:read")
        catalog = self.gw.readmodel.catalog
        allowed = principal.tenant.limits
        data = []
        for family, current in sorted(catalog.families.items()):
            if family not in allowed:
                continue
            versions = sorted(v.version for v in catalog.versions.values() if v.family == family)
            data.append(
                _model_card(family, "fairway", {"current_version": current, "versions": versions})
            )
        data.extend(
            _model_card(
                v.version,
                "fairway",
                {
                    "family": v.family,
                    "context_length": min(v.context_length, allowed[v.family].max_context),
                    "max_output": allowed[v.family].max_output,
                },
            )
            for v in sorted(catalog.versions.values(), key=lambda v: v.version)
            if v.family in allowed
        )
        body = orjson.dumps({"object": "list", "data": data})
        await send_bytes(send, 200, body, JSON, headers)

    async def _ready(self, send: Send, headers: dict[str, str]) -> None:
        problems = []
        if self.gw.draining:
            problems.append("draining")
        if not self.gw.started:
            problems.append("starting")
        try:
            await self.gw.redis.ping()
        except Exception as exc:  # noqa: BLE001
            problems.append(f"redis: {exc!r}")
        if not self.gw.registry.any_healthy():
            problems.append("no replica reachable")
        status = 503 if problems else 200
        body = orjson.dumps(
            {"status": "ready" if not problems else "not ready", "problems": problems}
        )
        await send_bytes(send, status, body, JSON, headers)


def _model_card(model_id: str, owner: str, extra: dict[str, object]) -> dict[str, object]:
    return {"id": model_id, "object": "model", "created": 0, "owned_by": owner, **extra}
