"""One admitted request: upstream call, relay to the client, and its single terminal handler.

docs/design.md §3: everything fallible happens before the first byte. The 200 and its headers are
sent only once the replica's first chunk has arrived, so a refused, unreachable or failing replica
is still an honest status code. After that, a failure can only be said inside the stream:
``data: {"error": …}`` then ``data: [DONE]`` (§8: never a silent switch to another replica,
whose KV holds none of this generation).

R4: a client that disconnects cancels this task within one event-loop turn; closing the
upstream response closes its connection, which makes the replica abort and free the KV.
Tokens generated so far are billed (``cancelled``).

First tokens go first: a replica's step delivers one token to every running stream at the
same moment, and vLLM's scheduler (like the emulator) lists the requests it just
prefilled last, so their first tokens arrive at the back of that burst. Relayed in arrival
order, every first token waited for the whole burst's relay. While some stream awaits its
first token, a mid-stream read therefore gives way for one event-loop turn before it is
relayed: first tokens (and new requests' admission) in the same turn go out ahead of it,
and an inter-token gap grows by at most one turn.

§5 decision 5: whatever the ending — complete, error, cancel, timeout — ``_terminal`` runs
exactly once, emits exactly one usage event (a synchronous hand-off that cancellation cannot
interrupt) and settles admission in a shielded task. The one ending it cannot run for is the
process's own death (SIGKILL, OOM): for that, ``_mark`` spools what the request would be
billed as a failed one at dispatch, at the first token and every ``MARK_INTERVAL_S`` of a
stream, and a successor that adopts the spool bills it (gateway/usage/producer.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

import orjson

from contracts.schema import ModelVersionRecord
from gateway.admission import idempotency
from gateway.admission.controller import AdmissionController, Ticket
from gateway.admission.idempotency import IdempotencyStore
from gateway.admission.replicas import ReplicaRegistry
from gateway.admission.router import Router
from gateway.config import GatewayConfig
from gateway.endpoints.validation import GenerationRequest
from gateway.errors import ApiError, GatewayTimeout, UpstreamError, capacity_unavailable
from gateway.identity.auth import Principal
from gateway.lifecycle import Lifecycle
from gateway.metrics import GatewayMetrics
from gateway.serving.http import JSON, SSE, Receive, Send, encode_headers, send_error
from gateway.upstream.client import (
    Dispatch,
    ReplicaStalled,
    ReplicaUnreachable,
    UpstreamClient,
    UpstreamFailure,
    UpstreamResponse,
    UpstreamStatusError,
)
from gateway.upstream.relay import END, ERROR, SSE_DONE, USAGE, SSEEvents, StreamTracker
from gateway.usage.events import UsageEvent
from gateway.usage.producer import UsageProducer

log = logging.getLogger("gateway.exchange")

# vLLM finish reasons → the usage event's vocabulary.
_FINISH = {
    "stop": "stop",
    "length": "length",
    "abort": "cancelled",
    "repetition": "stop",
    "tool_calls": "stop",
    "error": "error",
}
CLIENT_CLOSED = 499  # nginx's convention for "client closed the request"
# A stream's in-flight mark (gateway/usage/producer.py) is renewed at most this often: what
# a SIGKILL of this process leaves unbilled is the output relayed since the last mark.
MARK_INTERVAL_S = 2.0
# What a request cut off by the process's death is recorded with before its response began:
# the status a proxy in front reports for a dead upstream.
DIED_STATUS = 502


def _error_event(message: str, code: str) -> bytes:
    body = orjson.dumps(
        {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
    )
    return b"data: " + body + b"\n\n"


def _stream_error(message: str, code: str) -> bytes:
    return _error_event(message, code) + SSE_DONE


@dataclass(slots=True)
class FirstTokens:
    """How many streams of this process await their first token: while any do, mid-stream
    relays give way to them for one event-loop turn (see the module docstring)."""

    waiting: int = 0


@dataclass(frozen=True, slots=True)
class ExchangeServices:
    """The process's components an exchange uses, passed in once by the server."""

    config: GatewayConfig
    metrics: GatewayMetrics
    upstream: UpstreamClient
    registry: ReplicaRegistry
    router: Router
    admission: AdmissionController
    idempotency: IdempotencyStore
    usage: UsageProducer
    lifecycle: Lifecycle
    first_tokens: FirstTokens


@dataclass(slots=True)
class ExchangeContext:
    """One admitted request, as the request pipeline hands it over."""

    request_id: str
    client_request_id: str | None
    principal: Principal
    req: GenerationRequest
    version: ModelVersionRecord
    ticket: Ticket
    prompt_estimate: int
    max_tokens: int
    claim: idempotency.Claim | None
    is_retry: bool
    started_at: str  # UTC ISO-8601, the usage event's
    t0: float  # monotonic, when the request arrived
    headers: dict[str, str]  # the response's
    dispatch: Dispatch | None = None  # already sent (early dispatch, endpoints/pipeline.py)
    dispatched_at: float = 0.0
    # how long the long-context hold kept it before admission (gateway/admission/hold.py):
    # counted in its latency and its maximum duration, not in the gateway's own time
    held_s: float = 0.0


class Exchange:
    def __init__(self, services: ExchangeServices, ctx: ExchangeContext) -> None:
        self.svc = services
        self.request_id = ctx.request_id
        self.client_request_id = ctx.client_request_id
        self.principal = ctx.principal
        self.req = req = ctx.req
        self.version = ctx.version
        self.ticket = ctx.ticket
        self.prompt_estimate = ctx.prompt_estimate
        self.max_tokens = ctx.max_tokens
        self.claim = claim = ctx.claim
        self.is_retry = ctx.is_retry
        self.started_at = ctx.started_at
        self.headers = ctx.headers
        t0 = ctx.t0
        self.tracker = StreamTracker(
            assemble=not req.stream,
            started=t0,
            kind=req.kind,
            n=req.n,
            indexed=req.sequences > 1,
        )
        # The replica was asked for per-chunk usage (gateway/upstream/client.py): the relay
        # keeps it and strips it from what the client gets.
        self.continuous = req.stream and services.config.continuous_usage
        self.capture: list[bytes] | None = [] if claim is not None and req.stream else None
        self.status = 0
        self.finish: str | None = None
        self.headers_sent = False
        self.response_done = False
        self.client_gone = False
        self.stored = False
        self.dispatch = ctx.dispatch
        self.dispatched_at = ctx.dispatched_at
        self.held_s = ctx.held_s
        self.added_observed = False
        self.prefill_released = False  # a long context's prefill slot, at its first token
        self._awaiting_first_token = False
        self._terminated = False
        self._next_mark = 0.0  # monotonic; 0 until the first token's mark
        self.expired = False  # ran past the configured maximum duration

    # -- lifecycle ---------------------------------------------------------------------
    async def run(self, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        assert task is not None
        watcher = asyncio.create_task(self._watch(receive, task))
        # No response outlives max_stream_s: a client reading very slowly (or a replica
        # trickling) must not hold a connection, a tenant slot and the replica's KV for ever.
        deadline = asyncio.get_running_loop().call_later(
            self.svc.config.max_stream_s - self.held_s, self._expire, task
        )
        self.svc.metrics.inflight.inc()
        self._mark()  # dispatched (or about to be): a death from here on is billed
        if self.req.stream:
            self._awaiting_first_token = True
            self.svc.first_tokens.waiting += 1
            self.svc.metrics.awaiting_first_token.inc()
        try:
            await self._exchange(send)
        except asyncio.CancelledError:
            if self.expired and not self.client_gone:
                task.uncancel()
                self.finish = "timeout"
                self.status = self.status or 504
                await self._send_expired(send)
            elif not self.client_gone:
                # Not the client: the server's drain deadline passed. Bill what was made.
                self.finish = self.finish or "error"
                self.status = self.status or 503
                raise
            task.uncancel()
            self.finish = "cancelled"
            self.status = 200 if self.headers_sent else CLIENT_CLOSED
        finally:
            deadline.cancel()
            watcher.cancel()
            self.svc.metrics.inflight.dec()
            self._first_token_relayed()
            await self._terminal()

    def _expire(self, task: asyncio.Task[None]) -> None:
        if not self.response_done:
            self.expired = True
            task.cancel()

    async def _send_expired(self, send: Send) -> None:
        if self.response_done:
            return
        self.response_done = True
        message = "The response exceeded the maximum duration and was cut off."
        # Bounded: the client that made the response overrun may not be reading at all.
        with contextlib.suppress(Exception):
            async with asyncio.timeout(1.0):
                await self._send_expired_now(send, message)

    async def _send_expired_now(self, send: Send, message: str) -> None:
        if self.headers_sent:
            body = _stream_error(message, "max_duration_exceeded")
            await send({"type": "http.response.body", "body": body, "more_body": False})
        else:
            error = GatewayTimeout(message, code="max_duration_exceeded")
            await send_error(send, error, self.headers)

    def _first_token_relayed(self) -> None:
        if self._awaiting_first_token:
            self._awaiting_first_token = False
            self.svc.first_tokens.waiting -= 1
            self.svc.metrics.awaiting_first_token.dec()

    async def _give_way(self) -> None:
        """One event-loop turn for the streams awaiting their first token, if any."""
        if not self._awaiting_first_token and self.svc.first_tokens.waiting > 0:
            await asyncio.sleep(0)

    async def _watch(self, receive: Receive, task: asyncio.Task[None]) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                if not self.response_done:
                    self.client_gone = True
                    task.cancel()
                return

    async def _exchange(self, send: Send) -> None:
        try:
            response = await self._open()
            try:
                if self.req.stream:
                    await self._relay_stream(response, send)
                else:
                    await self._relay_json(response, send)
            finally:
                response.close()
        except ApiError as exc:
            self.status = self.status or exc.status
            if self.finish is None:
                self.finish = "timeout" if isinstance(exc, GatewayTimeout) else "error"
            if not self.headers_sent:
                self.response_done = True
                await send_error(send, exc, self.headers)

    async def _open(self) -> UpstreamResponse:
        svc, replica, dispatch = self.svc, self.ticket.replica, self.dispatch
        if dispatch is None:
            body = svc.upstream.build_body(
                self.req,
                self.version,
                max_tokens=self.max_tokens,
                priority=self.ticket.priority,
                tenant_id=self.principal.tenant.tenant_id,
            )
            self.dispatched_at = time.monotonic()
        self.svc.metrics.preflight.observe(self._preflight())
        try:
            if dispatch is None:
                dispatch = svc.upstream.send(replica, body, self.request_id, self.req.path)
            return await dispatch.response()
        except UpstreamStatusError as exc:
            svc.metrics.upstream_errors.labels(replica.replica_id, f"status_{exc.status}").inc()
            # The replica's own text stays in our log: it can name hosts, paths, versions
            # or another request's details, none of which is the client's business.
            log.warning(
                "replica %s answered %s for %s: %s",
                replica.replica_id,
                exc.status,
                self.request_id,
                exc.message[:512],
            )
            if exc.status in (429, 503):
                raise capacity_unavailable("The model replica is busy; retry shortly.") from None
            if exc.status == 400:
                raise ApiError(
                    "The model replica rejected the request"
                    + (f" (parameter `{exc.param}`)." if exc.param else "."),
                    status=400,
                    type="invalid_request_error",
                    code="upstream_rejected",
                    param=exc.param,
                ) from None
            raise UpstreamError(
                f"The model replica failed ({exc.status}).", code="upstream_error"
            ) from None
        except ReplicaUnreachable as exc:
            svc.metrics.upstream_errors.labels(replica.replica_id, "connect").inc()
            if exc.refused:
                svc.registry.mark_failed(replica.replica_id, str(exc))
            raise capacity_unavailable(
                "The model replica is unreachable; retry shortly.", code="replica_unavailable"
            ) from None
        except ReplicaStalled:
            svc.metrics.upstream_errors.labels(replica.replica_id, "timeout").inc()
            raise GatewayTimeout(
                "The model replica did not answer in time.", code="upstream_timeout"
            ) from None
        except UpstreamFailure as exc:
            svc.metrics.upstream_errors.labels(replica.replica_id, "transport").inc()
            log.warning("replica %s failed for %s: %s", replica.replica_id, self.request_id, exc)
            raise UpstreamError("The model replica failed.", code="upstream_error") from None

    # -- relays ------------------------------------------------------------------------
    async def _relay_stream(self, response: UpstreamResponse, send: Send) -> None:
        tracker = self.tracker
        events = SSEEvents()
        replica_id = self.ticket.replica.replica_id
        try:
            first = await self._next(response, events)
            if first is None:
                raise UpstreamError(
                    "The model replica closed the stream before responding.", code="upstream_error"
                )
            if first[0].startswith(b'{"error"'):
                tracker.observe(first[0], time.monotonic())
                self._log_replica_error()
                raise UpstreamError("The model replica failed.", code="upstream_error")
        except UpstreamFailure as exc:
            self.svc.metrics.upstream_errors.labels(replica_id, "before_first_chunk").inc()
            if isinstance(exc, ReplicaStalled):
                raise GatewayTimeout(
                    "The model replica stalled before the first token.", code="upstream_timeout"
                ) from None
            raise UpstreamError(
                "The model replica failed before the first token.", code="upstream_error"
            ) from None

        headers = encode_headers(self.headers)
        headers += [(b"content-type", SSE), (b"cache-control", b"no-cache")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        self.headers_sent = True
        self.status = 200

        failure: bytes | None = None
        try:
            batch: list[bytes] | None = first
            while batch is not None:
                if await self._forward(batch, send):
                    break
                batch = await self._next(response, events)
                await self._give_way()
        except ReplicaStalled:
            self.finish = "timeout"
            self.svc.metrics.upstream_errors.labels(replica_id, "stall").inc()
            failure = _stream_error("The model replica stalled mid-stream.", "upstream_timeout")
        except UpstreamFailure:
            self.finish = "error"
            self.svc.metrics.upstream_errors.labels(replica_id, "mid_stream").inc()
            failure = _stream_error("The model replica failed mid-stream.", "upstream_error")

        if failure is None and tracker.error is not None:
            self.finish = "error"
            self.svc.metrics.upstream_errors.labels(replica_id, "in_stream_error").inc()
            failure = SSE_DONE  # the replica's error event went out already
        elif failure is None and not tracker.done:
            self.finish = "error"
            self.svc.metrics.upstream_errors.labels(replica_id, "truncated").inc()
            failure = _stream_error("The model replica ended the stream early.", "upstream_error")
        if failure is None and self.capture is not None and self.claim is not None:
            self.capture.append(SSE_DONE)
            await self._store(idempotency.KIND_SSE, b"".join(self.capture))
        self.response_done = True
        await send({"type": "http.response.body", "body": failure or SSE_DONE, "more_body": False})
        if failure is None:
            await self._drain(response)

    async def _drain(self, response: UpstreamResponse) -> None:
        """Read what follows ``[DONE]`` (the chunked-encoding terminator) so the upstream
        connection goes back to the pool; closing a response early drops its connection,
        and a new TCP connection per request costs more than the whole relay."""
        with contextlib.suppress(Exception):
            async with asyncio.timeout(0.5):
                while await response.read():
                    pass

    @staticmethod
    async def _next(response: UpstreamResponse, events: SSEEvents) -> list[bytes] | None:
        """The next read's complete events; None at the end of the body."""
        while True:
            data = await response.read()
            if not data:
                return events.close() or None
            batch = events.feed(data)
            if batch:
                return batch

    async def _forward(self, batch: list[bytes], send: Send) -> bool:
        """Relay one read's events; True once the stream's end ([DONE] or error) is seen."""
        tracker, include_usage = self.tracker, self.req.include_usage
        now = time.monotonic()
        out: list[bytes] = []
        ended = False
        continuous = self.continuous
        for data in batch:
            if continuous:
                data = tracker.take_usage(data)
            kind = tracker.observe(data, now)
            if kind == END:
                ended = True
                break
            if kind == USAGE and not include_usage:
                continue
            if kind == ERROR:
                # Our own error event in place of the replica's (its text is logged).
                self._log_replica_error()
                out.append(
                    _error_event("The model replica failed mid-generation.", "upstream_error")
                )
                ended = True
                break
            out.append(b"data: " + data + b"\n\n")
        if out:
            chunk = b"".join(out)
            if self.capture is not None:
                self.capture.append(chunk)
            # Awaiting the send is the backpressure: a slow reader slows the upstream read.
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            if not self.added_observed and tracker.first_token_at is not None:
                self._first_token_relayed()
                self._observe_added(tracker.first_token_at)
                self._prefill_done()
                self._mark(now)
            elif self._next_mark and now >= self._next_mark:
                self._mark(now)
        return ended

    def _prefill_done(self) -> None:
        """The first token arrived, so the prefill is over (streaming or not): the router's
        in-flight charge may lapse at the replica's next scrape, and a long context gives
        its prefill slot back to the fleet's budget now (docs/design.md §7 "Long
        contexts"), in the background so the relay does not wait for the round trip."""
        self.svc.router.on_first_token(self.ticket.replica, self.ticket.request_id)
        grant = self.ticket.grant
        if self.prefill_released or grant is None or grant.long_tag is None:
            return
        self.prefill_released = True
        self.svc.lifecycle.spawn(self.svc.admission.prefill_done(self.ticket))

    def _log_replica_error(self) -> None:
        message = str((self.tracker.error or {}).get("message", "unknown error"))
        log.warning(
            "replica %s sent an error event for %s: %s",
            self.ticket.replica.replica_id,
            self.request_id,
            message[:512],
        )

    def _observe_added(self, upstream_event_at: float) -> None:
        """The gateway's own share of the client's latency: its time before the upstream
        request left, plus its time from the upstream's first token (streaming) or last
        event (JSON) to handing the bytes to the client's socket."""
        self.added_observed = True
        self.svc.metrics.added.observe(self._preflight() + time.monotonic() - upstream_event_at)

    def _preflight(self) -> float:
        """The gateway's own time before the upstream request left (a hold is not)."""
        return self.dispatched_at - self.tracker.started - self.held_s

    async def _relay_json(self, response: UpstreamResponse, send: Send) -> None:
        tracker = self.tracker
        replica_id = self.ticket.replica.replica_id
        done_at = time.monotonic()
        events = SSEEvents()
        try:
            while (batch := await self._next(response, events)) is not None:
                await self._give_way()
                now = done_at = time.monotonic()
                for data in batch:
                    kind = tracker.observe(data, now)
                    if kind == ERROR:
                        self._log_replica_error()
                        raise UpstreamError(
                            "The model replica failed mid-generation.", code="upstream_error"
                        )
                    if kind == END:
                        break
                if not self._next_mark and tracker.first_token_at is not None:
                    self._mark(now)  # prefill ran: the prompt is billed from here on
                    self._prefill_done()
                if tracker.done:
                    break
        except ReplicaStalled:
            self.svc.metrics.upstream_errors.labels(replica_id, "stall").inc()
            raise GatewayTimeout("The model replica stalled.", code="upstream_timeout") from None
        except UpstreamFailure:
            self.svc.metrics.upstream_errors.labels(replica_id, "mid_stream").inc()
            raise UpstreamError(
                "The model replica failed mid-generation.", code="upstream_error"
            ) from None
        if not tracker.done:
            raise UpstreamError("The model replica ended the stream early.", code="upstream_error")
        body = orjson.dumps(tracker.completion(self.req.model, self.prompt_estimate))
        if self.claim is not None:
            await self._store(idempotency.KIND_JSON, body)
        self.status = 200
        self.response_done = True
        headers = encode_headers(self.headers)
        headers += [(b"content-type", JSON), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})
        self._observe_added(done_at)
        await self._drain(response)

    async def _store(self, kind: bytes, body: bytes) -> None:
        """Keep the response for replays before the client can see its end (and retry)."""
        assert self.claim is not None
        task = self.svc.lifecycle.spawn(self.svc.idempotency.complete(self.claim, kind, body))
        try:
            await asyncio.shield(task)
            self.stored = True
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a replay store failure must not fail the reply
            log.warning("idempotency store failed for %s: %r", self.request_id, exc)

    # -- usage -------------------------------------------------------------------------
    def _usage_event(self, finish: str, status: int, prompt: int, completion: int) -> UsageEvent:
        tracker = self.tracker
        return UsageEvent(
            request_id=self.request_id,
            tenant_id=self.principal.tenant.tenant_id,
            api_key_id=self.principal.key.key_id,
            model=self.req.model,
            model_version=self.version.version,
            replica_id=self.ticket.replica.replica_id,
            started_at=self.started_at,
            prompt_tokens=prompt,
            completion_tokens=completion,
            cached_tokens=tracker.cached_tokens,
            ttft_ms=tracker.ttft_ms(),
            tpot_ms=tracker.tpot_ms(),
            finish_reason=finish,
            status=status,
            is_retry=self.is_retry,
        )

    def _mark(self, now: float = 0.0) -> None:
        """Spool what this request is billed if the process dies now: a failed request
        (metering/rules.py) with the prompt once prefill is known to have run and the
        output relayed so far (a stream's status is 200 from its first byte on)."""
        if now:
            self._next_mark = now + MARK_INTERVAL_S
        try:
            status = 200 if self.headers_sent else DIED_STATUS
            prompt = self.tracker.prompt_tokens(self.prompt_estimate)
            completion = self.tracker.completion_tokens if self.headers_sent else 0
            self.svc.usage.mark(self._usage_event("error", status, prompt, completion))
        except Exception:  # noqa: BLE001 - a mark must never fail the request
            log.exception("usage mark failed for %s", self.request_id)

    # -- the one terminal handler ------------------------------------------------------
    async def _terminal(self) -> None:
        if self._terminated:
            return
        self._terminated = True
        svc, tracker, version = self.svc, self.tracker, self.version
        finish = self.finish or _FINISH.get(tracker.finish_reason or "stop", "error")
        status = self.status or 200
        prompt = tracker.prompt_tokens(self.prompt_estimate)
        completion = tracker.completion_tokens
        tenant_id = self.principal.tenant.tenant_id
        try:
            svc.usage.emit(self._usage_event(finish, status, prompt, completion))
        except Exception:  # noqa: BLE001 - never lose the settle below to a metrics bug
            log.exception("usage emit failed for %s", self.request_id)
        with contextlib.suppress(Exception):
            cls = self.ticket.admission_class
            tenant = svc.metrics.tenant_label(tenant_id)
            svc.metrics.requests.labels(tenant, version.version, str(status)).inc()
            svc.metrics.finished.labels(version.version, finish).inc()
            svc.metrics.usage_source.labels(tracker.usage_source).inc()
            if tracker.first_token_at is not None:
                svc.metrics.ttft.labels(version.version, cls).observe(
                    tracker.first_token_at - tracker.started
                )
            tpot = tracker.tpot_ms()
            if tpot is not None:
                svc.metrics.tpot.labels(version.version, cls).observe(tpot / 1000.0)
        if self.claim is not None and not self.stored:
            svc.lifecycle.spawn(svc.idempotency.abandon(self.claim))
        settle = svc.lifecycle.spawn(
            svc.admission.settle(
                self.ticket, prompt_tokens=prompt, completion_tokens=completion, outcome=finish
            )
        )
        await asyncio.shield(settle)
