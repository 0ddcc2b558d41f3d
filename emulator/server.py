"""The HTTP face of the emulator: a minimal ASGI app with vLLM's routes and shapes.

No framework: routing is a dict lookup and responses are pre-serialised bytes, because one
process must stream >= 20,000 SSE tokens/s on one core. Each request has a ``Stream``; the
engine driver calls ``Stream.on_step`` after every step, which formats that step's events
into bytes and wakes the request's task, which writes them with one ``send``. A second task
per request waits on ``receive()`` for the client's disconnect and aborts the engine request
at once, freeing its KV blocks (vLLM does the same via ``http.disconnect``).

Emulator-only routes live under ``/_emulator/`` (faults, state); everything else is vLLM's.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import time
from collections.abc import Awaitable, Callable
from functools import cache
from typing import Any

import orjson

from emulator.driver import EngineDriver
from emulator.engine import Engine, Request
from emulator.faults import Faults
from emulator.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from emulator.metrics import MetricsRenderer
from emulator.protocol import (
    DONE_EVENT,
    VLLM_VERSION,
    ApiError,
    ChatParams,
    ChunkTemplates,
    bad_request,
    chat_completion_body,
    context_overflow,
    error_event,
    generation_error,
    max_tokens_too_large,
    not_found_model,
    parse_chat_request,
    parse_json_object,
    service_unavailable,
)
from emulator.tokenizer import MessageFormatError, Tokenizer, output_vocab

logger = logging.getLogger("emulator.server")

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
Handler = Callable[[Scope, Receive, Send], Awaitable[None]]

MAX_BODY_BYTES = 64 * 1024 * 1024
JSON = b"application/json"
SSE = b"text/event-stream; charset=utf-8"


@cache
def _json_pieces() -> tuple[bytes, ...]:
    """Each output token's text, already a JSON string literal."""
    return tuple(orjson.dumps(word) for word in output_vocab())


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return value
    return None


def _decoded_header(scope: Scope, name: bytes) -> str | None:
    value = _header(scope, name)
    return value.decode("latin-1") if value is not None else None


async def send_bytes(send: Send, status: int, body: bytes, content_type: bytes = JSON) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", content_type),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


class Stream:
    """Per-request bridge between engine events and the response writer."""

    __slots__ = (
        "app",
        "params",
        "req",
        "templates",
        "chunks",
        "waiter",
        "done",
        "disconnected",
        "role_sent",
        "error",
    )

    def __init__(self, app: EmulatorApp, params: ChatParams, templates: ChunkTemplates | None):
        self.app = app
        self.params = params
        self.req: Request | None = None
        self.templates = templates
        self.chunks: list[bytes] = []
        self.waiter: asyncio.Future[None] | None = None
        self.done = False  # nothing more will be produced (finished, failed, or dropped)
        self.disconnected = False
        self.role_sent = False
        self.error: ApiError | None = None

    def wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def close(self) -> None:
        """End the response without more events (server shutdown)."""
        self.done = True
        self.wake()

    def on_step(self, req: Request) -> None:
        if self.done:
            return
        app = self.app
        faults = app.faults
        count = req.num_output
        finish_reason = req.finish_reason
        if finish_reason is not None and finish_reason not in ("stop", "length"):
            return  # aborted while its last step was in flight: the abort path owns the stream
        finishing = finish_reason is not None
        fail_after = faults.fail_after_tokens
        failing = fail_after is not None and count >= fail_after and not finishing
        templates = self.templates
        if templates is not None:
            chunks = self.chunks
            if not self.role_sent:
                chunks.append(templates.role)
                self.role_sent = True
            piece = _json_pieces()[req.token_ids[-1]]
            usage = None
            if self.params.continuous_usage_stats:
                usage = orjson.dumps(
                    {
                        "prompt_tokens": req.prompt_len,
                        "total_tokens": req.prompt_len + count,
                        "completion_tokens": count,
                    }
                )
            if finish_reason is not None:
                chunks.append(templates.final(piece, finish_reason, usage))
                if self.params.include_usage:
                    chunks.append(
                        templates.usage_event(req.prompt_len, count, max(req.num_cached_tokens, 0))
                    )
                chunks.append(DONE_EVENT)
                self.done = True
            elif not failing or count == fail_after:
                chunks.append(templates.token(piece, usage))
        elif finishing:
            self.done = True
        if failing:
            app.driver.abort(req, "error")
            self.error = generation_error()
            if templates is not None:
                self.chunks.append(error_event(self.error))
                self.chunks.append(DONE_EVENT)
            self.done = True
        crash_after = faults.crash_after_tokens
        if crash_after is not None and count >= crash_after:
            app.schedule_crash()
        self.wake()


class EmulatorApp:
    """ASGI application. Owns the engine driver; call ``start()`` inside the serving loop."""

    def __init__(
        self,
        engine: Engine,
        model: str,
        *,
        speed: float = 1.0,
        faults: Faults | None = None,
        on_crash: Callable[[], None] | None = None,
    ) -> None:
        self.engine = engine
        self.model = model
        self.driver = EngineDriver(engine, speed)
        self.faults = faults or Faults()
        self.tokenizer = Tokenizer()
        self.metrics = MetricsRenderer(engine, model, self.driver)
        self.on_crash = on_crash
        self.crashed = False
        self.streams: set[Stream] = set()
        self._watchers: set[asyncio.Task[None]] = set()
        self.created = int(time.time())
        digest = hashlib.sha256(f"{engine.profile.name}/{model}".encode()).hexdigest()[:8]
        self.system_fingerprint = f"vllm-{VLLM_VERSION}-tp{engine.profile.tensor_parallel}-{digest}"
        self._ids = itertools.count()
        _json_pieces()  # build lookup tables now, not inside the first stream's step
        self._routes: dict[str, dict[str, Handler]] = {
            "/v1/chat/completions": {"POST": self._chat},
            "/v1/models": {"GET": self._models},
            "/health": {"GET": self._health},
            "/ping": {"GET": self._health, "POST": self._health},
            "/version": {"GET": self._version},
            "/tokenize": {"POST": self._tokenize},
            "/metrics": {"GET": self._metrics},
            "/metrics/": {"GET": self._metrics},
            "/_emulator/faults": {"GET": self._faults, "POST": self._faults},
            "/_emulator/state": {"GET": self._state},
        }

    # -- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        self.driver.start()

    async def close(self) -> None:
        """Abort in-flight requests (vLLM's default --shutdown-timeout 0) and stop the loop."""
        for stream in list(self.streams):
            if stream.req is not None:
                self.driver.abort(stream.req)
            stream.close()
        await self.driver.stop()

    def schedule_crash(self) -> None:
        if self.crashed:
            return
        self.crashed = True
        # After the current callbacks, so the stream that hit the threshold writes first.
        asyncio.get_running_loop().call_soon(self._crash)

    def _crash(self) -> None:
        logger.warning("crash fault triggered")
        if self.on_crash is not None:
            self.on_crash()

    # -- ASGI ----------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        methods = self._routes.get(scope["path"])
        if methods is None:
            await send_bytes(send, 404, b'{"detail":"Not Found"}')
            return
        handler = methods.get(scope["method"])
        if handler is None:
            await send_bytes(send, 405, b'{"detail":"Method Not Allowed"}')
            return
        await handler(scope, receive, send)

    @staticmethod
    async def _read_body(receive: Receive) -> bytes | None:
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            body = message.get("body", b"")
            size += len(body)
            if size > MAX_BODY_BYTES:
                raise bad_request(f"request body larger than {MAX_BODY_BYTES} bytes", "body")
            chunks.append(body)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _json_body(self, scope: Scope, receive: Receive) -> dict[str, Any] | None:
        raw = await self._read_body(receive)
        if raw is None:
            return None
        content_type = _header(scope, b"content-type") or b""
        if content_type.split(b";")[0].strip().lower() != JSON:
            raise bad_request("Content-Type must be application/json", "content-type")
        return parse_json_object(raw)

    # -- chat ----------------------------------------------------------------------------

    async def _chat(self, scope: Scope, receive: Receive, send: Send) -> None:
        engine = self.engine
        try:
            raw = await self._read_body(receive)
            if raw is None:
                return
            content_type = _header(scope, b"content-type") or b""
            if content_type.split(b";")[0].strip().lower() != JSON:
                raise bad_request("Content-Type must be application/json", "content-type")
            params = parse_chat_request(
                raw,
                self.model,
                _decoded_header(scope, b"x-request-id"),
                _decoded_header(scope, b"x-vllm-priority"),
            )
            faults = self.faults
            if faults.extra_latency_ms:
                await asyncio.sleep(faults.extra_latency_ms / 1000)
            if faults.refuse_503:
                raise service_unavailable()
            try:
                prompt = self.tokenizer.apply_chat_template(params.messages)
            except MessageFormatError as exc:
                raise bad_request(str(exc), exc.param) from None
            limit = engine.max_model_len
            if params.max_tokens is not None and params.max_tokens > limit:
                raise max_tokens_too_large(params.max_tokens, limit)
            if len(prompt) >= limit:
                raise context_overflow(limit, len(prompt))
        except ApiError as err:
            await send_bytes(send, err.status, err.body())
            return

        response_id = "chatcmpl-" + params.request_id
        created = int(time.time())
        templates = (
            ChunkTemplates(
                response_id, created, self.model, self.system_fingerprint, params.include_usage
            )
            if params.stream
            else None
        )
        stream = Stream(self, params, templates)
        max_tokens = params.max_tokens if params.max_tokens is not None else limit
        req = self.driver.submit(
            f"{params.request_id}-{next(self._ids)}",
            prompt,
            max_tokens,
            stream,
            priority=params.priority,
            cache_salt=params.cache_salt,
            ignore_eos=params.ignore_eos,
            seed=params.seed,
            min_tokens=params.min_tokens,
        )
        stream.req = req
        self.streams.add(stream)
        # Ends by itself: receive() returns once the response completes or the client leaves.
        watcher = asyncio.get_running_loop().create_task(self._watch_disconnect(receive, stream))
        self._watchers.add(watcher)
        watcher.add_done_callback(self._watchers.discard)
        try:
            if params.stream:
                await self._write_stream(send, stream)
            else:
                await self._write_json(send, stream, response_id, created)
        finally:
            self.streams.discard(stream)
            if not req.finished:
                self.driver.abort(req)

    async def _watch_disconnect(self, receive: Receive, stream: Stream) -> None:
        # After the body is read, receive() returns only once the client disconnects or the
        # response completes; the latter is not a disconnect.
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
        if not stream.done or stream.chunks:
            stream.disconnected = True
            stream.done = True
            if stream.req is not None:
                self.driver.abort(stream.req)
            stream.wake()

    @staticmethod
    async def _wait(stream: Stream) -> None:
        if stream.chunks or stream.done:
            return
        waiter = asyncio.get_running_loop().create_future()
        stream.waiter = waiter
        try:
            await waiter
        finally:
            stream.waiter = None

    async def _write_stream(self, send: Send, stream: Stream) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", SSE)],
            }
        )
        chunks = stream.chunks
        while True:
            await self._wait(stream)
            if stream.disconnected:
                return
            body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
            chunks.clear()
            done = stream.done
            await send({"type": "http.response.body", "body": body, "more_body": not done})
            if done:
                return

    async def _write_json(self, send: Send, stream: Stream, response_id: str, created: int) -> None:
        while not stream.done:
            await self._wait(stream)
        req = stream.req
        if stream.disconnected or req is None:
            return
        if stream.error is not None:
            await send_bytes(send, stream.error.status, stream.error.body())
            return
        if req.finish_reason not in ("stop", "length"):  # aborted by shutdown
            await send_bytes(send, 503, ApiError(503, "The server is shutting down.",
                                                 "Service Unavailable").body())  # fmt: skip
            return
        body = chat_completion_body(
            response_id=response_id,
            created=created,
            model=self.model,
            text=Tokenizer.decode_output(req.output_token_ids),
            finish_reason=req.finish_reason,
            prompt_tokens=req.prompt_len,
            completion_tokens=req.num_output,
            cached_tokens=max(req.num_cached_tokens, 0),
            system_fingerprint=self.system_fingerprint,
        )
        await send_bytes(send, 200, body)

    # -- small routes --------------------------------------------------------------------

    async def _models(self, scope: Scope, receive: Receive, send: Send) -> None:
        card = {
            "id": self.model,
            "object": "model",
            "created": self.created,
            "owned_by": "vllm",
            "root": self.engine.profile.hf_model,
            "parent": None,
            "max_model_len": self.engine.max_model_len,
            "permission": [
                {
                    "id": f"modelperm-{self.system_fingerprint[-8:]}",
                    "object": "model_permission",
                    "created": self.created,
                    "allow_create_engine": False,
                    "allow_sampling": True,
                    "allow_logprobs": True,
                    "allow_search_indices": False,
                    "allow_view": True,
                    "allow_fine_tuning": False,
                    "organization": "*",
                    "group": None,
                    "is_blocking": False,
                }
            ],
        }
        await send_bytes(send, 200, orjson.dumps({"object": "list", "data": [card]}))

    async def _health(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_bytes(send, 503 if self.faults.unhealthy else 200, b"")

    async def _version(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_bytes(send, 200, orjson.dumps({"version": VLLM_VERSION}))

    async def _metrics(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_bytes(send, 200, self.metrics.render(), METRICS_CONTENT_TYPE)

    async def _tokenize(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            body = await self._json_body(scope, receive)
            if body is None:
                return
            model = body.get("model")
            if model and model != self.model:
                raise not_found_model(str(model))
            want_strs = body.get("return_token_strs") is True
            tokenizer = self.tokenizer
            try:
                if "messages" in body:
                    messages = body["messages"]
                    if not isinstance(messages, list):
                        raise bad_request("messages must be a list", "messages")
                    add_gen = body.get("add_generation_prompt", True) is not False
                    tokens = tokenizer.apply_chat_template(messages, add_gen)
                    strs = tokenizer.chat_token_strs(messages, add_gen) if want_strs else None
                elif isinstance(body.get("prompt"), str):
                    special = body.get("add_special_tokens", True) is not False
                    tokens = tokenizer.encode_prompt(body["prompt"], special)
                    strs = (
                        tokenizer.prompt_token_strs(body["prompt"], special) if want_strs else None
                    )
                else:
                    raise bad_request("either 'prompt' (a string) or 'messages' is required")
            except MessageFormatError as exc:
                raise bad_request(str(exc), exc.param) from None
        except ApiError as err:
            await send_bytes(send, err.status, err.body())
            return
        payload = {
            "count": len(tokens),
            "max_model_len": self.engine.max_model_len,
            "tokens": tokens,
            "token_strs": strs,
        }
        await send_bytes(send, 200, orjson.dumps(payload))

    async def _faults(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["method"] == "POST":
            try:
                body = await self._json_body(scope, receive)
                if body is None:
                    return
                self.faults.update(body)
            except ApiError as err:
                await send_bytes(send, err.status, err.body())
                return
        await send_bytes(send, 200, orjson.dumps(self.faults.as_dict()))

    def state(self) -> dict[str, Any]:
        engine = self.engine
        pool = engine.pool
        return {
            "model": self.model,
            "profile": engine.profile.name,
            "model_time": engine.now,
            "speed": self.driver.speed,
            "num_running": engine.num_running,
            "num_waiting": engine.num_waiting,
            "num_gpu_blocks": engine.num_gpu_blocks,
            "kv_blocks_used": pool.num_used,
            "kv_blocks_free": pool.num_free,
            "kv_cache_usage": engine.kv_usage(),
            "num_preemptions": engine.stats.num_preemptions,
            "live_requests": len(engine.requests),
            "open_streams": len(self.streams),
            "clock_resyncs": self.driver.clock_resyncs,
        }

    async def _state(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_bytes(send, 200, orjson.dumps(self.state()))


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
