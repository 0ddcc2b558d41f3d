"""Open-loop asyncio load generator for OpenAI-style SSE endpoints.

Requests are sent at their workload arrival times (model time compressed by the speed
factor), whatever happens to earlier ones — open loop, as real traffic is. Each stream is
read chunk by chunk and timed: TTFT at the first content token, mean TPOT over the rest.
Bounded in count (the workload), concurrency (``max_inflight``) and time (``deadline_s``).

With ``client_retries`` > 0 each request is a client of the openai Python SDK: a refused
attempt (429, 503, …) is retried as the SDK retries it (``sdk_should_retry``,
``sdk_retry_delay``), inside the request's own task, so the arrivals keep their schedule;
TTFT is timed from the first attempt, what the user waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import functools
import itertools
import math
import random
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from bench.stats import Outcome
from bench.workload import PromptFactory, RequestSpec
from gateway.admission.long_context import REFUSAL_CLAUSE_HEADER


@dataclass(frozen=True, slots=True)
class Target:
    """Where one request goes and as whom."""

    url: str  # full URL of /v1/chat/completions
    headers: dict[str, str] = field(default_factory=dict)
    extra_body: dict[str, object] = field(default_factory=dict)


Router = Callable[[RequestSpec], Target]


def round_robin(base_urls: Sequence[str]) -> Router:
    """Clients straight to replicas, in turn: arm (a), no gateway at all."""
    cycle = itertools.cycle([u.rstrip("/") + "/v1/chat/completions" for u in base_urls])

    def route(spec: RequestSpec) -> Target:
        return Target(url=next(cycle))

    return route


@dataclass(slots=True)
class RawResult:
    """Wall-clock observations of one request (seconds on the loop clock)."""

    spec: RequestSpec
    status: int = 0
    t_sent: float = 0.0
    t_first: float | None = None
    t_last: float | None = None
    chunks: int = 0
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    error: str | None = None
    retry_after_s: float | None = None
    cut_at: float | None = None  # when the deadline cut it off
    attempts: int = 0  # HTTP attempts made: 1 + the client's retries (0: never sent)
    retry_cut: bool = False  # the deadline cut it off while it waited to retry a refusal
    # each refused attempt's clause header (without one: the body's error code, else the
    # status) and retry-after (wall s; None: none)
    refusals: list[tuple[str, float | None]] = field(default_factory=list)


def _retry_after(headers: Mapping[str, str]) -> float | None:
    """Retry-After(-Ms) of a response (aiohttp's headers look names up case-insensitively)."""
    h = headers
    raw_ms = h.get("retry-after-ms") or h.get("Retry-After-Ms")
    if raw_ms:
        with contextlib.suppress(ValueError):
            return float(raw_ms) / 1000.0
    raw = h.get("retry-after") or h.get("Retry-After")
    if raw:
        with contextlib.suppress(ValueError):
            return float(raw)
    return None


def _refusal_code(body: bytes) -> str:
    """A refusal's OpenAI-style error ``code`` ("" when the body has none)."""
    try:
        err = orjson.loads(body).get("error")
    except (orjson.JSONDecodeError, AttributeError):
        return ""
    code = err.get("code") if isinstance(err, dict) else None
    return code if isinstance(code, str) else ""


# The openai Python SDK's client-side retries, modelled on the version installed here (.venv:
# openai/_constants.py for DEFAULT_MAX_RETRIES, INITIAL_RETRY_DELAY, MAX_RETRY_DELAY and
# MAX_RETRY_AFTER_DELAY; openai/_base_client.py for _parse_retry_after_header, _should_retry,
# _calculate_retry_timeout, and the request loop, which also retries a timeout or connection
# error before any response and never a stream that has begun). Times are the client's seconds.
SDK_MAX_RETRIES = 2
SDK_INITIAL_RETRY_DELAY_S = 0.5
SDK_MAX_RETRY_DELAY_S = 8.0
SDK_MAX_RETRY_AFTER_S = 120.0
_INF_WORDS = ("inf", "+inf", "infinity", "+infinity")


def sdk_retry_after(headers: Mapping[str, str], now: float | None = None) -> float | None:
    """The wait a response asks for, in seconds, read as the SDK reads it: ``retry-after-ms``
    first, then ``retry-after`` as a number (fractions allowed), then ``retry-after`` as an
    HTTP date (less ``now``, default the wall clock). A number that overflows to infinity
    without being written as one reads as just over the SDK's bound (it is not retried);
    None when there is neither or neither reads."""
    h = {k.lower(): v for k, v in headers.items()}
    for name, divisor in (("retry-after-ms", 1000.0), ("retry-after", 1.0)):
        value = h.get(name)
        if value is None:
            continue
        try:
            delay = float(value)
        except ValueError:
            continue
        if delay == math.inf and value.strip().lower() not in _INF_WORDS:
            return SDK_MAX_RETRY_AFTER_S + 1
        return delay / divisor
    try:
        parsed = email.utils.parsedate_tz(h.get("retry-after", ""))
        if parsed is None:
            return None
        at = email.utils.mktime_tz(parsed)
    except (TypeError, ValueError, OverflowError, OSError):
        return None
    return float(at - (time.time() if now is None else now))


def sdk_should_retry(status: int, retry_after_s: float | None, should_retry: str | None) -> bool:
    """Whether the SDK retries a response (its retries left aside): never when it asks for a
    wait over the SDK's bound; else as ``x-should-retry: true|false`` says, when it says;
    else on 408, 409, 429 and every 5xx."""
    if retry_after_s is not None and math.isfinite(retry_after_s):
        if retry_after_s > SDK_MAX_RETRY_AFTER_S:
            return False
    if should_retry == "true":
        return True
    if should_retry == "false":
        return False
    return status in (408, 409, 429) or status >= 500


def sdk_retry_delay(retry_after_s: float | None, retries_taken: int, rng: random.Random) -> float:
    """How long the SDK waits before retry number ``retries_taken + 1``: the response's
    retry-after when it is finite, positive and within the SDK's bound; else exponential
    backoff from 0.5 s (0.5, 1, 2, … capped at 8 s) less a random 0–25 %."""
    if retry_after_s is not None and math.isfinite(retry_after_s):
        if 0 < retry_after_s <= SDK_MAX_RETRY_AFTER_S:
            return retry_after_s
    backoff = SDK_INITIAL_RETRY_DELAY_S * 2.0 ** min(retries_taken, 1000)
    backoff = min(backoff, SDK_MAX_RETRY_DELAY_S)
    return max(0.0, backoff * (1 - 0.25 * rng.random()))


def _report(on_done: Callable[[RawResult], None], res: RawResult, _task: object) -> None:
    on_done(res)


class SseStream:
    """The chunks of an OpenAI-style SSE stream (``data: {json}`` lines up to ``data:
    [DONE]``); ``done`` tells whether the sentinel came (the stream ended properly)."""

    def __init__(self, lines: AsyncIterable[bytes]) -> None:
        self._lines = lines
        self.done = False

    async def __aiter__(self) -> AsyncIterator[dict[str, Any]]:
        async for line in self._lines:
            if not line.startswith(b"data: "):
                continue
            payload = line[6:].strip()
            if payload == b"[DONE]":
                self.done = True
                return
            yield orjson.loads(payload)


def stream_error(chunk: dict[str, Any]) -> str | None:
    """The message of an in-stream error event (vLLM's and the gateway's), else None."""
    if "error" not in chunk:
        return None
    return str(chunk["error"].get("message", chunk["error"]))


def content_deltas(chunk: dict[str, Any]) -> list[str]:
    """The non-empty content deltas of a chunk, one per choice that has one."""
    return [
        text
        for choice in chunk.get("choices") or ()
        if (text := (choice.get("delta") or {}).get("content"))
    ]


class LoadGenerator:
    def __init__(
        self,
        model: str,
        route: Router,
        prompts: PromptFactory,
        *,
        speed: float,
        max_inflight: int = 2000,
        read_timeout_s: float = 120.0,
        ignore_eos: bool = True,
        client_retries: int = 0,
        retry_seed: int = 0,
    ) -> None:
        """``client_retries``: the retries of the openai SDK's rule each request may make
        (the SDK's default is ``SDK_MAX_RETRIES``; 0 sends each request once). The client's
        seconds are model seconds (wall × ``speed``), and a ``retry-after`` is read in the
        server's seconds, the wall clock's, so a delay the server names is slept as it is and
        the SDK's own backoff ÷ ``speed``. ``retry_seed`` seeds the backoff's jitter."""
        if client_retries < 0:
            raise ValueError("client_retries must be >= 0")
        self.model = model
        self.route = route
        self.prompts = prompts
        self.speed = speed
        self.max_inflight = max_inflight
        self.read_timeout_s = read_timeout_s
        self.ignore_eos = ignore_eos
        self.client_retries = client_retries
        self._retry_rng = random.Random(retry_seed)
        self.inflight = 0

    def body(self, spec: RequestSpec, extra: dict[str, object]) -> bytes:
        payload: dict[str, object] = {
            "model": self.model,
            "messages": [{"role": "user", "content": self.prompts.prompt(spec)}],
            "max_tokens": spec.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            "seed": spec.seed,
        }
        if self.ignore_eos:
            # The workload, not the replica, decides the output length: the same seed
            # gives the same request in every arm.
            payload["ignore_eos"] = True
        payload.update(extra)
        return orjson.dumps(payload)

    async def _one(self, session: aiohttp.ClientSession, spec: RequestSpec, res: RawResult) -> None:
        """Send ``spec`` and read its stream; with client retries, retry a refusal (or a
        connection that failed before any response) as the openai SDK would, in this task,
        with ``t_sent`` the first attempt's."""
        loop = asyncio.get_running_loop()
        target = self.route(spec)
        headers = {"Content-Type": "application/json", "X-Request-Id": spec.request_id}
        headers.update(target.headers)
        data = self.body(spec, target.extra_body)
        res.t_sent = loop.time()
        for retries_taken in itertools.count():
            res.attempts += 1
            res.status, res.error = 0, None
            if self.client_retries:
                # the SDK labels every attempt, 0 on the first (the gateway only counts it)
                headers["x-stainless-retry-count"] = str(retries_taken)
            delay = await self._attempt(session, target.url, headers, data, res, retries_taken)
            if delay is None:
                return
            res.retry_cut = True  # until the wait is over: the deadline may cut it
            await asyncio.sleep(delay)
            res.retry_cut = False

    async def _attempt(
        self,
        session: aiohttp.ClientSession,
        url: str,
        headers: dict[str, str],
        data: bytes,
        res: RawResult,
        retries_taken: int,
    ) -> float | None:
        """One HTTP attempt into ``res``; the wall seconds to wait before the next one, or
        None when the request is over (streamed, or refused and not to be retried)."""
        loop = asyncio.get_running_loop()
        retries_left = retries_taken < self.client_retries
        answered = False
        try:
            async with session.post(url, data=data, headers=headers) as resp:
                answered = True
                res.status = resp.status
                if resp.status != 200:
                    res.retry_after_s = _retry_after(resp.headers)
                    body = await resp.read()
                    res.error = body[:300].decode("utf-8", "replace")
                    clause = resp.headers.get(REFUSAL_CLAUSE_HEADER) or _refusal_code(body)
                    res.refusals.append((clause or str(resp.status), res.retry_after_s))
                    if not retries_left:
                        return None
                    return self.retry_wait_s(resp.status, resp.headers, retries_taken)
                async for obj in SseStream(resp.content):
                    if (error := stream_error(obj)) is not None:
                        res.error = error[:300]
                        continue
                    usage = obj.get("usage")
                    if usage:
                        res.completion_tokens = usage.get("completion_tokens")
                        res.prompt_tokens = usage.get("prompt_tokens")
                    if deltas := content_deltas(obj):
                        now = loop.time()
                        if res.t_first is None:
                            res.t_first = now
                        res.t_last = now
                        res.chunks += len(deltas)
                return None
        except (aiohttp.ClientError, TimeoutError, ConnectionError) as exc:
            if answered or not retries_left:
                raise
            # no response at all: the SDK retries a timeout or connection error with backoff
            res.error = f"{type(exc).__name__}: {exc}"[:300]
            return sdk_retry_delay(None, retries_taken, self._retry_rng) / self.speed

    def retry_wait_s(
        self, status: int, headers: Mapping[str, str], retries_taken: int
    ) -> float | None:
        """Wall seconds the SDK's client waits before retrying this refusal, or None when it
        does not retry it. The server's seconds are the wall clock's and the client's are
        model seconds (× ``speed``): a retry-after is judged against the SDK's bound in
        model seconds and slept as it is; the SDK's own backoff is slept ÷ ``speed``."""
        wait = sdk_retry_after(headers)
        wait = None if wait is None else wait * self.speed
        if not sdk_should_retry(status, wait, headers.get("x-should-retry")):
            return None
        return sdk_retry_delay(wait, retries_taken, self._retry_rng) / self.speed

    async def _guarded(
        self, session: aiohttp.ClientSession, spec: RequestSpec, res: RawResult
    ) -> None:
        self.inflight += 1
        try:
            await self._one(session, spec, res)
        except asyncio.CancelledError:
            if res.retry_cut:
                res.error = f"cut off at the arm deadline waiting to retry: {res.error}"[:300]
            else:
                res.error = res.error or "cut off at the arm deadline"
            res.cut_at = asyncio.get_running_loop().time()
            raise
        except (aiohttp.ClientError, TimeoutError, ConnectionError) as exc:
            res.error = f"{type(exc).__name__}: {exc}"[:300]
        finally:
            self.inflight -= 1

    async def run(
        self,
        specs: Sequence[RequestSpec],
        deadline_s: float,
        on_done: Callable[[RawResult], None] | None = None,
    ) -> list[RawResult]:
        """Send every spec at ``at_s / speed`` wall seconds from now; stop at ``deadline_s``."""
        loop = asyncio.get_running_loop()
        results = [RawResult(spec=s) for s in specs]
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=None)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=5.0, sock_read=self.read_timeout_s)
        tasks: set[asyncio.Task[None]] = set()
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            t0 = loop.time()
            end = t0 + deadline_s

            async def dispatch() -> None:
                for res in results:
                    due = t0 + res.spec.at_s / self.speed
                    if due >= end:
                        break
                    delay = due - loop.time()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    if self.inflight >= self.max_inflight:
                        res.t_sent = loop.time()
                        res.error = "load generator at max_inflight"
                        if on_done:
                            on_done(res)
                        continue
                    task = asyncio.create_task(self._guarded(session, res.spec, res))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                    if on_done:
                        task.add_done_callback(functools.partial(_report, on_done, res))

            dispatcher = asyncio.create_task(dispatch())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(dispatcher), timeout=max(0.0, deadline_s))
            dispatcher.cancel()
            remaining = end - loop.time()
            if tasks and remaining > 0:
                await asyncio.wait(set(tasks), timeout=remaining)
            for task in list(tasks):
                task.cancel()
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)
            for res in results:
                if res.t_sent:
                    res.t_sent -= t0
                    if res.t_first is not None:
                        res.t_first -= t0
                    if res.t_last is not None:
                        res.t_last -= t0
                    if res.cut_at is not None:
                        res.cut_at -= t0
        return [r for r in results if r.t_sent or r.status or r.error]


def to_outcome(raw: RawResult, admission_class: str, speed: float) -> Outcome:
    """Wall-clock observations → model-time outcome."""
    ttft = tpot = None
    tokens = raw.completion_tokens if raw.completion_tokens is not None else raw.chunks
    if raw.t_first is not None:
        ttft = (raw.t_first - raw.t_sent) * speed
        if raw.t_last is not None and tokens > 1:
            tpot = (raw.t_last - raw.t_first) * speed / (tokens - 1)
    elif raw.cut_at is not None:
        # Cut off before its first token: its TTFT is at least the wait so far (a lower
        # bound that keeps the worst requests in the TTFT percentiles).
        ttft = (raw.cut_at - raw.t_sent) * speed
    return Outcome(
        request_id=raw.spec.request_id,
        tenant_id=raw.spec.tenant_id,
        admission_class=admission_class,
        status=raw.status,
        sent_s=raw.t_sent * speed,
        ttft_s=ttft,
        tpot_s=tpot,
        completion_tokens=tokens if raw.t_first is not None else 0,
        prompt_tokens=raw.prompt_tokens or raw.spec.prompt_tokens,
        error=raw.error,
        retry_after_s=raw.retry_after_s,
        attempts=raw.attempts,
        retry_cut=raw.retry_cut,
        refusals=[(c, None if w is None else w * speed) for c, w in raw.refusals],
    )
