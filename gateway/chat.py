"""``POST /v1/chat/completions`` up to admission: auth → body → validation → model →
estimate → idempotency → admission. Refusals here are counted, never billed.

When admission's ``early_route`` allows it, the upstream request is written before the
quota round trip starts, so the two overlap; a refusal withdraws it (the replica aborts)."""

from __future__ import annotations

import contextlib
import logging
import time
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from redis.exceptions import RedisError

from gateway import tokens
from gateway.admission import AdmissionRequest
from gateway.errors import (
    ApiError,
    NotFound,
    Unavailable,
    config_store_unavailable,
    jittered_retry_after,
)
from gateway.exchange import Exchange
from gateway.http import (
    JSON,
    SSE,
    ClientGone,
    Receive,
    RequestHeaders,
    Send,
    read_body,
    sdk_retry,
    send_bytes,
    send_error,
)
from gateway.idempotency import KIND_JSON, Claim, Replay, validate_key
from gateway.upstream import Dispatch, UpstreamFailure
from gateway.validation import apply_limits, parse_chat

if TYPE_CHECKING:
    from gateway.server import Gateway

log = logging.getLogger("gateway.chat")


class ChatCompletions:
    def __init__(self, gw: Gateway) -> None:
        self.gw = gw

    async def __call__(
        self,
        receive: Receive,
        send: Send,
        hdrs: RequestHeaders,
        request_id: str,
        client_request_id: str | None,
        headers: dict[str, str],
    ) -> None:
        """``headers`` (``x-request-id`` so far) go on the response, whatever it is."""
        gw = self.gw
        t0 = time.monotonic()
        started_at = datetime.now(UTC).isoformat(timespec="milliseconds")
        tenant_id = "-"
        model = "-"
        claim: Claim | None = None
        dispatch: Dispatch | None = None  # the upstream request, when sent before admission
        dispatched_at = 0.0
        try:
            if gw.draining:
                raise Unavailable(
                    "The gateway is shutting down; retry on another instance.",
                    code="shutting_down",
                    headers={"connection": "close", **jittered_retry_after(1, 2)},
                )
            principal = await gw.auth.authenticate(hdrs.authorization, "chat")
            tenant_id = principal.tenant.tenant_id
            body = await read_body(receive, gw.config.max_body_bytes, hdrs.content_length)
            req = parse_chat(body)
            version = gw.readmodel.catalog.resolve(req.model)
            limit = principal.tenant.limit_for(version.family) if version is not None else None
            if version is None or limit is None:
                raise NotFound(
                    f"The model `{req.model}` does not exist or you do not have access to it.",
                    param="model",
                    code="model_not_found",
                )
            model = version.version
            prompt_estimate = tokens.prompt_tokens(req.message_texts)
            max_tokens = apply_limits(req, version, limit, prompt_estimate)
            if hdrs.idempotency_key is not None:
                key = validate_key(hdrs.idempotency_key)
                outcome = await gw.idempotency.begin(tenant_id, key, body)
                if isinstance(outcome, Replay):
                    await self._replay(send, outcome, headers, tenant_id, model)
                    return
                claim = outcome
                gw.metrics.idempotency.labels("retry" if claim.is_retry else "claimed").inc()
            # R6: a retry is a failed Idempotency-Key's next attempt or an SDK retry.
            is_retry = (claim is not None and claim.is_retry) or sdk_retry(hdrs.retry_count)
            admission = AdmissionRequest(
                request_id=request_id,
                tenant=principal.tenant,
                limit=limit,
                version=version,
                prompt_tokens_est=prompt_estimate,
                max_output=max_tokens,
                is_retry=is_retry,
            )
            early = gw.admission.early_route(admission)
            if early is not None:
                body = gw.upstream.build_body(
                    req,
                    version,
                    max_tokens=max_tokens,
                    priority=early.priority,
                    tenant_id=tenant_id,
                )
                dispatched_at = time.monotonic()
                with contextlib.suppress(UpstreamFailure):  # the exchange retries and reports
                    dispatch = gw.upstream.send(early.replica, body, request_id)
            ticket = await gw.admission.admit(admission, early)
        except ClientGone:
            self._release(claim, dispatch)
            return
        except RedisError as exc:
            log.warning("redis unavailable on the request path: %r", exc)
            self._release(claim, dispatch)
            await self._refuse(send, config_store_unavailable(), headers, tenant_id, model)
            return
        except ApiError as exc:
            if exc.status == 409 or exc.status == 422:
                gw.metrics.idempotency.labels(str(exc.code)).inc()
            self._release(claim, dispatch)
            await self._refuse(send, exc, headers, tenant_id, model)
            return
        except BaseException:
            self._release(claim, dispatch)
            raise

        if dispatch is not None and not ticket.early:
            dispatch.discard()  # admitted in another class than predicted: routed again
            dispatch = None
        headers.update(ticket.headers)
        exchange = Exchange(
            gw,
            request_id=request_id,
            client_request_id=client_request_id,
            principal=principal,
            req=req,
            version=version,
            ticket=ticket,
            prompt_estimate=prompt_estimate,
            max_tokens=max_tokens,
            claim=claim,
            is_retry=is_retry,
            started_at=started_at,
            t0=t0,
            headers=headers,
            dispatch=dispatch,
            dispatched_at=dispatched_at,
        )
        await exchange.run(receive, send)

    def _release(self, claim: Claim | None, dispatch: Dispatch | None = None) -> None:
        if dispatch is not None:
            dispatch.discard()
        if claim is not None:
            self.gw.spawn(self.gw.idempotency.abandon(claim))

    async def _refuse(
        self, send: Send, exc: ApiError, headers: dict[str, str], tenant_id: str, model: str
    ) -> None:
        self.gw.metrics.requests.labels(tenant_id, model, str(exc.status)).inc()
        self.gw.metrics.rejections.labels(str(exc.status), str(exc.code)).inc()
        await send_error(send, exc, headers)

    async def _replay(
        self, send: Send, replay: Replay, headers: dict[str, str], tenant_id: str, model: str
    ) -> None:
        """The stored response, byte for byte: no generation, no usage event, no charge."""
        self.gw.metrics.idempotency.labels("replayed").inc()
        self.gw.metrics.requests.labels(tenant_id, model, "200").inc()
        content_type = JSON if replay.kind == KIND_JSON else SSE
        await send_bytes(
            send, 200, replay.body, content_type, {**headers, "idempotent-replayed": "true"}
        )
