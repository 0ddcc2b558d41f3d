"""One admitted request: upstream call, relay to the client, and its single terminal handler.

§3: everything fallible happens before the first byte. The 200 and its headers are sent only
once the replica's first chunk has arrived, so a refused, unreachable or failing replica is
still an honest status code. After that, a failure can only be said inside the stream:
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
interrupt) and settles admission in a shielded task.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING

import orjson

from gateway import idempotency
from gateway.admission import Ticket
from gateway.auth import Principal
from gateway.errors import ApiError, GatewayTimeout, UpstreamError, capacity_unavailable
from gateway.http import JSON, SSE, Receive, Send, encode_headers, send_error
from gateway.relay import END, ERROR, SSE_DONE, USAGE, SSEEvents, StreamTracker
from gateway.schema import ModelVersionRecord
from gateway.upstream import (
    Dispatch,
    ReplicaStalled,
    ReplicaUnreachable,
    UpstreamFailure,
    UpstreamResponse,
    UpstreamStatusError,
)
from gateway.usage import UsageEvent
from gateway.validation import ChatRequest

if TYPE_CHECKING:
    from gateway.server import Gateway

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


def _stream_error(message: str, code: str) -> bytes:
    body = orjson.dumps(
        {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
    )
    return b"data: " + body + b"\n\n" + SSE_DONE


class Exchange:
    def __init__(
        self,
        gw: Gateway,
        *,
        request_id: str,
        client_request_id: str | None,
        principal: Principal,
        req: ChatRequest,
        version: ModelVersionRecord,
        ticket: Ticket,
        prompt_estimate: int,
        max_tokens: int,
        claim: idempotency.Claim | None,
        is_retry: bool,
        started_at: str,
        t0: float,
        headers: dict[str, str],
        dispatch: Dispatch | None = None,
        dispatched_at: float = 0.0,
    ) -> None:
        self.gw = gw
        self.request_id = request_id
        self.client_request_id = client_request_id
        self.principal = principal
        self.req = req
        self.version = version
        self.ticket = ticket
        self.prompt_estimate = prompt_estimate
        self.max_tokens = max_tokens
        self.claim = claim
        self.is_retry = is_retry
        self.started_at = started_at
        self.headers = headers
        self.tracker = StreamTracker(assemble=not req.stream, started=t0)
        self.capture: list[bytes] | None = [] if claim is not None and req.stream else None
        self.status = 0
        self.finish: str | None = None
        self.headers_sent = False
        self.response_done = False
        self.client_gone = False
        self.stored = False
        self.dispatch = dispatch  # already sent (early dispatch, gateway.chat)
        self.dispatched_at = dispatched_at
        self.added_observed = False
        self._awaiting_first_token = False
        self._terminated = False

    # -- lifecycle ---------------------------------------------------------------------
    async def run(self, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        assert task is not None
        watcher = asyncio.create_task(self._watch(receive, task))
        self.gw.metrics.inflight.inc()
        if self.req.stream:
            self._awaiting_first_token = True
            self.gw.awaiting_first_token += 1
            self.gw.metrics.awaiting_first_token.inc()
        try:
            await self._exchange(send)
        except asyncio.CancelledError:
            if not self.client_gone:
                # Not the client: the server's drain deadline passed. Bill what was made.
                self.finish = self.finish or "error"
                self.status = self.status or 503
                raise
            task.uncancel()
            self.finish = "cancelled"
            self.status = 200 if self.headers_sent else CLIENT_CLOSED
        finally:
            watcher.cancel()
            self.gw.metrics.inflight.dec()
            self._first_token_relayed()
            await self._terminal()

    def _first_token_relayed(self) -> None:
        if self._awaiting_first_token:
            self._awaiting_first_token = False
            self.gw.awaiting_first_token -= 1
            self.gw.metrics.awaiting_first_token.dec()

    async def _give_way(self) -> None:
        """One event-loop turn for the streams awaiting their first token, if any."""
        if not self._awaiting_first_token and self.gw.awaiting_first_token > 0:
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
        gw, replica, dispatch = self.gw, self.ticket.replica, self.dispatch
        if dispatch is None:
            body = gw.upstream.build_body(
                self.req,
                self.version,
                max_tokens=self.max_tokens,
                priority=self.ticket.priority,
                tenant_id=self.principal.tenant.tenant_id,
            )
            self.dispatched_at = time.monotonic()
        self.gw.metrics.preflight.observe(self.dispatched_at - self.tracker.started)
        try:
            if dispatch is None:
                dispatch = gw.upstream.send(replica, body, self.request_id)
            return await dispatch.response()
        except UpstreamStatusError as exc:
            gw.metrics.upstream_errors.labels(replica.replica_id, f"status_{exc.status}").inc()
            if exc.status in (429, 503):
                raise capacity_unavailable(f"The model replica is busy: {exc.message}") from None
            if exc.status == 400:
                raise ApiError(
                    exc.message, status=400, type="invalid_request_error", code="upstream_rejected"
                ) from None
            raise UpstreamError(
                f"The model replica failed ({exc.status}): {exc.message}", code="upstream_error"
            ) from None
        except ReplicaUnreachable as exc:
            gw.metrics.upstream_errors.labels(replica.replica_id, "connect").inc()
            if exc.refused:
                gw.registry.mark_failed(replica.replica_id, str(exc))
            raise capacity_unavailable(
                "The model replica is unreachable; retry shortly.", code="replica_unavailable"
            ) from None
        except ReplicaStalled:
            gw.metrics.upstream_errors.labels(replica.replica_id, "timeout").inc()
            raise GatewayTimeout(
                "The model replica did not answer in time.", code="upstream_timeout"
            ) from None
        except UpstreamFailure as exc:
            gw.metrics.upstream_errors.labels(replica.replica_id, "transport").inc()
            raise UpstreamError(f"The model replica failed: {exc}", code="upstream_error") from None

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
                message = str((tracker.error or {}).get("message", "unknown error"))
                raise UpstreamError(f"The model replica failed: {message}", code="upstream_error")
        except UpstreamFailure as exc:
            self.gw.metrics.upstream_errors.labels(replica_id, "before_first_chunk").inc()
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
            self.gw.metrics.upstream_errors.labels(replica_id, "stall").inc()
            failure = _stream_error("The model replica stalled mid-stream.", "upstream_timeout")
        except UpstreamFailure:
            self.finish = "error"
            self.gw.metrics.upstream_errors.labels(replica_id, "mid_stream").inc()
            failure = _stream_error("The model replica failed mid-stream.", "upstream_error")

        if failure is None and tracker.error is not None:
            self.finish = "error"
            self.gw.metrics.upstream_errors.labels(replica_id, "in_stream_error").inc()
            failure = SSE_DONE  # the replica's error event went out already
        elif failure is None and not tracker.done:
            self.finish = "error"
            self.gw.metrics.upstream_errors.labels(replica_id, "truncated").inc()
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
        for data in batch:
            kind = tracker.observe(data, now)
            if kind == END:
                ended = True
                break
            if kind == USAGE and not include_usage:
                continue
            out.append(b"data: " + data + b"\n\n")
            if kind == ERROR:
                ended = True
                break
        if out:
            chunk = b"".join(out)
            if self.capture is not None:
                self.capture.append(chunk)
            # Awaiting the send is the backpressure: a slow reader slows the upstream read.
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            if not self.added_observed and tracker.first_token_at is not None:
                self._first_token_relayed()
                self._observe_added(tracker.first_token_at)
                # Prefill done: the router's in-flight charge may lapse at the next scrape.
                self.gw.router.on_first_token(self.ticket.replica, self.ticket.request_id)
        return ended

    def _observe_added(self, upstream_event_at: float) -> None:
        """The gateway's own share of the client's latency: its time before the upstream
        request left, plus its time from the upstream's first token (streaming) or last
        event (JSON) to handing the bytes to the client's socket."""
        self.added_observed = True
        preflight = self.dispatched_at - self.tracker.started
        self.gw.metrics.added.observe(preflight + time.monotonic() - upstream_event_at)

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
                        message = str((tracker.error or {}).get("message", "unknown error"))
                        raise UpstreamError(
                            f"The model replica failed: {message}", code="upstream_error"
                        )
                    if kind == END:
                        break
                if tracker.done:
                    break
        except ReplicaStalled:
            self.gw.metrics.upstream_errors.labels(replica_id, "stall").inc()
            raise GatewayTimeout("The model replica stalled.", code="upstream_timeout") from None
        except UpstreamFailure:
            self.gw.metrics.upstream_errors.labels(replica_id, "mid_stream").inc()
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
        task = self.gw.spawn(self.gw.idempotency.complete(self.claim, kind, body))
        try:
            await asyncio.shield(task)
            self.stored = True
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a replay store failure must not fail the reply
            log.warning("idempotency store failed for %s: %r", self.request_id, exc)

    # -- the one terminal handler ------------------------------------------------------
    async def _terminal(self) -> None:
        if self._terminated:
            return
        self._terminated = True
        gw, tracker, version = self.gw, self.tracker, self.version
        finish = self.finish or _FINISH.get(tracker.finish_reason or "stop", "error")
        status = self.status or 200
        prompt = tracker.prompt_tokens(self.prompt_estimate)
        completion = tracker.completion_tokens
        tenant_id = self.principal.tenant.tenant_id
        try:
            gw.usage.emit(
                UsageEvent(
                    request_id=self.request_id,
                    tenant_id=tenant_id,
                    api_key_id=self.principal.key.key_id,
                    model=self.req.model,
                    model_version=version.version,
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
            )
        except Exception:  # noqa: BLE001 - never lose the settle below to a metrics bug
            log.exception("usage emit failed for %s", self.request_id)
        with contextlib.suppress(Exception):
            cls = self.ticket.admission_class
            gw.metrics.requests.labels(tenant_id, version.version, str(status)).inc()
            gw.metrics.finished.labels(version.version, finish).inc()
            if tracker.first_token_at is not None:
                gw.metrics.ttft.labels(version.version, cls).observe(
                    tracker.first_token_at - tracker.started
                )
            tpot = tracker.tpot_ms()
            if tpot is not None:
                gw.metrics.tpot.labels(version.version, cls).observe(tpot / 1000.0)
        if self.claim is not None and not self.stored:
            gw.spawn(gw.idempotency.abandon(self.claim))
        settle = gw.spawn(
            gw.admission.settle(
                self.ticket, prompt_tokens=prompt, completion_tokens=completion, outcome=finish
            )
        )
        await asyncio.shield(settle)
