"""The request pipeline every generation endpoint shares: auth → body → parse → model →
estimate → limits → idempotency → admission → upstream exchange (relay, usage event).
Refusals before admission are counted, never billed.

An endpoint supplies only what is its own (``Endpoint``): its scope, how its body parses,
how its prompt is estimated (with the model's tokenizer where one is configured), and its
prefix for cache-aware routing. When admission's ``early_route`` allows it, the upstream
request is written before the quota round trip starts, so the two overlap; a refusal
withdraws it (the replica aborts). With the long-context hold on, a long context the
budget refuses is held here and asks again after each told wait, until admitted, its
bound, its client's going away or the drain (gateway/admission/hold.py)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Protocol

from redis.exceptions import RedisError

from contracts.schema import Scope
from gateway.admission.controller import AdmissionRequest
from gateway.admission.hold import HELD_HEADER, HoldEnded, LongContextRefusal
from gateway.admission.idempotency import KIND_JSON, Claim, Replay, validate_key
from gateway.admission.prefix import PrefixQuery
from gateway.admission.retrymemory import RequestPrint, RetryIdentity, retryable
from gateway.admission.tokens import RULE, CountingPool, Rule
from gateway.endpoints.validation import GenerationRequest, apply_limits
from gateway.errors import (
    ApiError,
    NotFound,
    Unavailable,
    config_store_unavailable,
    jittered_retry_after,
)
from gateway.identity.auth import Authenticator
from gateway.identity.readmodel import ReadModelCache
from gateway.serving.connections import RecentRefusals, TenantConnections, peek_model
from gateway.serving.http import (
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
from gateway.upstream.client import Dispatch, UpstreamFailure
from gateway.upstream.exchange import CLIENT_CLOSED, Exchange, ExchangeContext, ExchangeServices

log = logging.getLogger("gateway.chat")

# The recently-refused memory answers only while the limits store answered within this long.
REFUSAL_MEMORY_TRUST_S = 1.0
STORE_ERROR_LOG_EVERY_S = 10.0  # at most one "redis unavailable" line per process this often


async def _disconnected(receive: Receive) -> None:
    """Returns when the client disconnects (its body was read: nothing else comes)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class Endpoint(Protocol):
    """What one endpoint adds to the shared pipeline."""

    scope: Scope  # the API key scope it requires

    def parse(self, body: bytes) -> GenerationRequest: ...

    def prompt_estimate(self, req: GenerationRequest, counter: Rule) -> tuple[int, int]:
        """Prompt tokens of the whole request (every prompt of it), for admission, and of
        its longest prompt, for the context limit."""
        ...

    def prefix_query(self, req: GenerationRequest, tenant_id: str) -> PrefixQuery | None: ...


class PipelineEndpoint:
    """An ASGI-facing endpoint that hands every request to the shared pipeline; subclasses
    add the ``Endpoint`` methods."""

    def __init__(self, pipeline: RequestPipeline) -> None:
        self.pipeline = pipeline

    async def __call__(self, call: Call) -> None:
        # A subclass supplies the Endpoint methods.
        await self.pipeline.handle(self, call)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class Call:
    """One HTTP request as the app hands it to an endpoint."""

    receive: Receive
    send: Send
    hdrs: RequestHeaders
    request_id: str  # the gateway's own: the usage event's key
    client_request_id: str | None  # the caller's X-Request-Id, when well-formed
    headers: dict[str, str]  # go on the response, whatever it is (x-request-id so far)


@dataclass(frozen=True, slots=True)
class PipelineServices:
    """The components the pipeline uses before the exchange, passed in by the server."""

    auth: Authenticator
    readmodel: ReadModelCache
    tenant_connections: TenantConnections
    recent_refusals: RecentRefusals
    exchange: ExchangeServices
    retries: RetryIdentity  # which requests are retries (docs/design.md R6)
    counting: CountingPool  # large prompts counted off the event loop, fair between tenants


class RequestPipeline:
    def __init__(self, services: PipelineServices) -> None:
        self.svc = services
        self.x = services.exchange
        self.config = services.exchange.config
        self.metrics = services.exchange.metrics
        self._store_error_logged = float("-inf")
        self._store_errors = 0

    async def handle(self, endpoint: Endpoint, call: Call) -> None:
        held: list[str] = []  # the tenant whose concurrent-request slot this request holds
        try:
            await self._handle(endpoint, call, held)
        finally:
            for tenant_id in held:
                self.svc.tenant_connections.release(tenant_id)

    async def _handle(self, endpoint: Endpoint, call: Call, held: list[str]) -> None:
        svc, x, config = self.svc, self.x, self.config
        receive, send, hdrs, headers = call.receive, call.send, call.hdrs, call.headers
        request_id, client_request_id = call.request_id, call.client_request_id
        asked_model: str | None = None  # the model as the client named it, once parsed
        t0 = time.monotonic()
        started_at = datetime.now(UTC).isoformat(timespec="milliseconds")
        tenant_id = "-"
        model = "-"
        claim: Claim | None = None
        dispatch: Dispatch | None = None  # the upstream request, when sent before admission
        dispatched_at = 0.0
        shown: RequestPrint | None = None  # this body, for the retry memory (no Idempotency-Key)
        held_s = 0.0  # how long the long-context hold kept it before admission
        try:
            if x.lifecycle.draining:
                raise Unavailable(
                    "The gateway is shutting down; retry on another instance.",
                    code="shutting_down",
                    headers={"connection": "close", **jittered_retry_after(1, 2)},
                )
            principal = await svc.auth.authenticate(hdrs.authorization, endpoint.scope, hdrs.client)
            tenant_id = principal.tenant.tenant_id
            svc.tenant_connections.acquire(tenant_id)
            held.append(tenant_id)
            body = await read_body(
                receive,
                config.max_body_bytes,
                hdrs.content_length,
                timeout_s=config.body_timeout_s,
            )
            if hdrs.idempotency_key is None:
                shown = RequestPrint(tenant_id, principal.key.key_id, body)
            # Refused moments ago for this model: answer from memory, before parsing. Only
            # while the limits store answered this process within the last second: while it
            # is down requests/min fails open by design, and a remembered tenant's own
            # requests never ask the store, so without an answer this recent one of them
            # goes to the store (the probe) instead of the memory.
            if config.refusal_memory and self.x.admission.limiter.answered_within(
                REFUSAL_MEMORY_TRUST_S
            ):
                svc.recent_refusals.check(tenant_id, peek_model(body))
            req = endpoint.parse(body)
            asked_model = req.model
            version = svc.readmodel.catalog.resolve(req.model)
            limit = principal.tenant.limit_for(version.family) if version is not None else None
            if version is None or limit is None:
                raise NotFound(
                    f"The model `{req.model}` does not exist or you do not have access to it.",
                    param="model",
                    code="model_not_found",
                )
            model = version.version
            counter = config.token_counter(version.version, version.family)
            if counter is None:
                prompt_estimate, longest = endpoint.prompt_estimate(req, RULE)
            else:  # the model's tokenizer: a large body is counted off the event loop
                prompt_estimate, longest = await svc.counting.run(
                    tenant_id, len(body), lambda: endpoint.prompt_estimate(req, counter)
                )
            max_tokens = apply_limits(req, version, limit, longest)
            if hdrs.idempotency_key is not None:
                key = validate_key(hdrs.idempotency_key)
                outcome = await x.idempotency.begin(tenant_id, key, body)
                if isinstance(outcome, Replay):
                    # One request of requests/min, no tokens (gateway/README.md, Idempotency).
                    charged = AdmissionRequest(
                        request_id,
                        principal.tenant,
                        limit,
                        version,
                        prompt_estimate,
                        0,
                        False,
                        key=principal.key,
                    )
                    headers.update(await x.admission.charge_replay(charged))
                    await self._replay(send, outcome, headers, tenant_id, model)
                    return
                claim = outcome
                self.metrics.idempotency.labels("retry" if claim.is_retry else "claimed").inc()
            # A retry is what the gateway can tell is one (docs/design.md R6): a failed
            # Idempotency-Key's next attempt, or this tenant-key's body again shortly after a
            # retryable failure. The SDK's x-stainless-retry-count only labels the metric and
            # decides whether the shared marks are asked; it never counts by itself.
            claimed = sdk_retry(hdrs.retry_count)
            by: str | None = None
            if claim is not None:
                by = "idempotency" if claim.is_retry else None
            elif shown is not None:
                by = await svc.retries.recognise(shown, claimed=claimed)
            is_retry = by is not None
            if is_retry or claimed:
                self.metrics.retries.labels(
                    by or "unconfirmed", "claimed" if claimed else "absent"
                ).inc()
            admission = AdmissionRequest(
                request_id=request_id,
                tenant=principal.tenant,
                limit=limit,
                version=version,
                prompt_tokens_est=prompt_estimate,
                max_output=max_tokens,
                sequences=req.sequences,
                is_retry=is_retry,
                prefix=endpoint.prefix_query(req, tenant_id),
                key=principal.key,
            )
            early = x.admission.early_route(admission)
            if early is not None:
                body = x.upstream.build_body(
                    req,
                    version,
                    max_tokens=max_tokens,
                    priority=early.priority,
                    tenant_id=tenant_id,
                )
                dispatched_at = time.monotonic()
                with contextlib.suppress(UpstreamFailure):  # the exchange retries and reports
                    dispatch = x.upstream.send(early.replica, body, request_id, req.path)
            try:
                ticket = await x.admission.admit(admission, early)
            except LongContextRefusal as refusal:
                if not x.admission.hold.enabled or dispatch is not None:
                    raise
                # held: waits its told wait and asks again (gateway/admission/hold.py)
                ticket, hold = await x.admission.hold.run(
                    refusal,
                    lambda: x.admission.admit(admission),
                    tenant=tenant_id,
                    left_s=config.max_stream_s,
                    ended=lambda: self._hold_ended(receive),
                )
                headers[HELD_HEADER] = str(hold.held_ms)
                held_s = hold.held_s
        except ClientGone:
            self._release(claim, dispatch)
            self._failed(shown, CLIENT_CLOSED)
            return
        except RedisError as exc:
            # Every request with an Idempotency-Key lands here while Redis is down or out of
            # memory: one line per LOG_EVERY_S, with how many it stands for (the count per
            # request is rejections_total{code="config_store_unavailable"}).
            now = time.monotonic()
            self._store_errors += 1
            if now - self._store_error_logged >= STORE_ERROR_LOG_EVERY_S:
                log.warning(
                    "redis unavailable on the request path (%d requests since the last line): %r",
                    self._store_errors,
                    exc,
                )
                self._store_error_logged, self._store_errors = now, 0
            self._release(claim, dispatch)
            self._failed(shown, 503)
            await self._refuse(send, config_store_unavailable(), headers, tenant_id, model)
            return
        except ApiError as exc:
            if exc.status == 409 or exc.status == 422:
                self.metrics.idempotency.labels(str(exc.code)).inc()
            if exc.status == 429 and exc.code == "rate_limit_exceeded" and asked_model:
                svc.recent_refusals.remember(tenant_id, asked_model, exc)
            self._release(claim, dispatch)
            self._failed(shown, exc.status)
            await self._refuse(send, exc, headers, tenant_id, model)
            return
        except BaseException:
            self._release(claim, dispatch)
            raise

        if dispatch is not None and not ticket.early:
            dispatch.discard()  # admitted in another class than predicted: routed again
            dispatch = None
        headers.update(ticket.headers)
        ctx = ExchangeContext(
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
            held_s=held_s,
        )
        exchange = Exchange(x, ctx)
        try:
            await exchange.run(receive, send)
        finally:
            # Cut off after its 200 (finish set: error, timeout, cancelled) is a failure too.
            ended = exchange.status or 200
            self._failed(shown, 500 if ended == 200 and exchange.finish is not None else ended)

    async def _hold_ended(self, receive: Receive) -> BaseException:
        """What ends a long-context hold from outside: the client going away (answered as
        any client gone before admission) or this process's drain (the refusal is answered,
        ``HoldEnded``)."""
        gone = asyncio.ensure_future(_disconnected(receive))
        drain = asyncio.ensure_future(self.x.lifecycle.drain_begun())
        try:
            done, _ = await asyncio.wait({gone, drain}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            drain.cancel()
        return ClientGone() if gone in done else HoldEnded()

    def _failed(self, shown: RequestPrint | None, status: int) -> None:
        """Remember a retryable failure: the same body again is this request's retry."""
        if shown is not None and retryable(status):
            self.svc.retries.failed(shown)

    def _release(self, claim: Claim | None, dispatch: Dispatch | None = None) -> None:
        if dispatch is not None:
            dispatch.discard()
        if claim is not None:
            self.x.lifecycle.spawn(self.x.idempotency.abandon(claim, refused=True))

    async def _refuse(
        self, send: Send, exc: ApiError, headers: dict[str, str], tenant_id: str, model: str
    ) -> None:
        metrics = self.metrics
        metrics.requests.labels(metrics.tenant_label(tenant_id), model, str(exc.status)).inc()
        metrics.rejections.labels(str(exc.status), str(exc.code)).inc()
        await send_error(send, exc, headers)

    async def _replay(
        self, send: Send, replay: Replay, headers: dict[str, str], tenant_id: str, model: str
    ) -> None:
        """The stored response, byte for byte: no generation, no usage event (its one
        request of requests/min was charged by the caller)."""
        metrics = self.metrics
        metrics.idempotency.labels("replayed").inc()
        metrics.requests.labels(metrics.tenant_label(tenant_id), model, "200").inc()
        content_type = JSON if replay.kind == KIND_JSON else SSE
        await send_bytes(
            send, 200, replay.body, content_type, {**headers, "idempotent-replayed": "true"}
        )
