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

from emulator.choices import Choice, ChoiceStream, ResponseBuffer, decide_plan
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
    parse_completion_request,
    parse_json_object,
    service_unavailable,
    usage_dict,
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


class Stream(ResponseBuffer):
    """Per-request bridge between engine events and the response writer."""

    __slots__ = ("app", "params", "req", "templates", "role_sent")

    def __init__(self, app: EmulatorApp, params: ChatParams, templates: ChunkTemplates | None):
        self.app = app
        self.params = params
        self.req: Request | None = None
        self.templates = templates
        self.role_sent = False
        super().__init__()

    def requests(self) -> list[Request]:
        return [self.req] if self.req is not None else []

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
            continuous = self.params.continuous_usage_stats
            if not self.role_sent:
                if continuous:
                    prefilled = orjson.dumps(usage_dict(req.prompt_len, 0, None))
                    chunks.append(templates.role_with_usage(prefilled))
                else:
                    chunks.append(templates.role)
                self.role_sent = True
            piece = _json_pieces()[req.token_ids[-1]]
            usage = None
            if continuous:
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
                        templates.usage_event(req.prompt_len, count, app.cached_tokens_of(req))
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
        enable_prompt_tokens_details: bool = False,
        on_kv_events: Callable[[list[Any]], None] | None = None,
        enable_auto_tool_choice: bool = False,
        tool_call_parser: str | None = None,
    ) -> None:
        self.engine = engine
        # vLLM's --enable-auto-tool-choice / --tool-call-parser: ``tool_choice: "auto"`` is
        # refused without both; "required" and a named function work regardless.
        self.enable_auto_tool_choice = enable_auto_tool_choice
        self.tool_call_parser = tool_call_parser
        self.model = model
        # vLLM's --enable-prompt-tokens-details (off by default): usage carries
        # prompt_tokens_details.cached_tokens only when it is on.
        self.enable_prompt_tokens_details = enable_prompt_tokens_details
        self.driver = EngineDriver(engine, speed, on_kv_events=on_kv_events)
        self.faults = faults or Faults()
        self.tokenizer = Tokenizer()
        self.metrics = MetricsRenderer(engine, model, self.driver)
        self.on_crash = on_crash
        self.crashed = False
        self.streams: set[Stream | ChoiceStream] = set()
        self._watchers: set[asyncio.Task[None]] = set()
        self.created = int(time.time())
        digest = hashlib.sha256(f"{engine.profile.name}/{model}".encode()).hexdigest()[:8]
        self.system_fingerprint = f"vllm-{VLLM_VERSION}-tp{engine.profile.tensor_parallel}-{digest}"
        self._ids = itertools.count()
        _json_pieces()  # build lookup tables now, not inside the first stream's step
        self._routes: dict[str, dict[str, Handler]] = {
            "/v1/chat/completions": {"POST": self._chat},
            "/v1/completions": {"POST": self._completions},
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

    def cached_tokens_of(self, req: Request) -> int | None:
        if not self.enable_prompt_tokens_details:
            return None
        return max(req.num_cached_tokens, 0)

    # -- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        self.driver.start()

    async def close(self) -> None:
        """Abort in-flight requests (vLLM's default --shutdown-timeout 0) and stop the loop."""
        for stream in list(self.streams):
            for req in stream.requests():
                self.driver.abort(req)
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
        if methods is None and scope["path"].startswith("/v1/models/"):
            methods = {"GET": self._model_detail}
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

    async def _json_raw(self, scope: Scope, receive: Receive) -> bytes | None:
        """The body of a JSON request (None when the client left before sending it)."""
        raw = await self._read_body(receive)
        if raw is None:
            return None
        content_type = _header(scope, b"content-type") or b""
        if content_type.split(b";")[0].strip().lower() != JSON:
            raise bad_request("Content-Type must be application/json", "content-type")
        return raw

    async def _json_body(self, scope: Scope, receive: Receive) -> dict[str, Any] | None:
        raw = await self._json_raw(scope, receive)
        return None if raw is None else parse_json_object(raw)

    async def _injected_faults(self) -> None:
        """The latency and refusal a test asked for, before any work is queued."""
        faults = self.faults
        if faults.extra_latency_ms:
            await asyncio.sleep(faults.extra_latency_ms / 1000)
        if faults.refuse_503:
            raise service_unavailable()

    # -- chat ----------------------------------------------------------------------------

    async def _chat(self, scope: Scope, receive: Receive, send: Send) -> None:
        engine = self.engine
        try:
            raw = await self._json_raw(scope, receive)
            if raw is None:
                return
            params = parse_chat_request(
                raw,
                self.model,
                _decoded_header(scope, b"x-request-id"),
                _decoded_header(scope, b"x-vllm-priority"),
            )
            await self._injected_faults()
            if (
                params.tool_choice == "auto"
                and params.tools
                and not (self.enable_auto_tool_choice and self.tool_call_parser)
            ):
                raise bad_request(
                    '"auto" tool choice requires --enable-auto-tool-choice and '
                    "--tool-call-parser to be set",
                    "tool_choice",
                )
            try:
                prompt = self.tokenizer.apply_chat_template(params.messages, tools=params.tools)
            except MessageFormatError as exc:
                raise bad_request(str(exc), exc.param) from None
            limit = engine.max_model_len
            if params.max_tokens is not None and params.max_tokens > limit:
                raise max_tokens_too_large(params.max_tokens, limit)
            if len(prompt) >= limit:
                raise context_overflow(limit, len(prompt))
            plans = [] if params.plain else [decide_plan(params, i) for i in range(params.n)]
        except ApiError as err:
            await send_bytes(send, err.status, err.body())
            return

        if not params.plain:
            choices = [Choice(index=i, req=None, plan=plan, prompt_len=len(prompt))
                       for i, plan in enumerate(plans)]  # fmt: skip
            rich = ChoiceStream(
                self,
                kind="chat",
                response_id="chatcmpl-" + params.request_id,
                created=int(time.time()),
                stream=params.stream,
                include_usage=params.include_usage,
                continuous_usage_stats=params.continuous_usage_stats,
                logprobs=params.top_logprobs if params.logprobs else None,
                choices=choices,
            )
            max_tokens = params.max_tokens if params.max_tokens is not None else limit
            await self._run_choices(
                receive, send, rich, params.request_id, [prompt], max_tokens, params
            )
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

    async def _run_choices(
        self,
        receive: Receive,
        send: Send,
        stream: ChoiceStream,
        request_id: str,
        prompts: list[list[int]],
        max_tokens: int,
        params: Any,
    ) -> None:
        """Submit one engine request per choice (same prompt and salt for a prompt's ``n``
        choices: the prefix cache shares their prompt blocks) and write the response."""
        for choice in stream.choices:
            plan = choice.plan
            # vLLM seeds the i-th of n samples with seed + i, so they differ but repeat.
            seed = None if params.seed is None else params.seed + choice.index
            self.driver_submit_choice(
                stream,
                choice,
                request_id,
                prompts[choice.prompt_index],
                max_tokens,
                params,
                seed,
                None if plan is None else plan.token_ids,
            )
        self.streams.add(stream)
        watcher = asyncio.get_running_loop().create_task(self._watch_disconnect(receive, stream))
        self._watchers.add(watcher)
        watcher.add_done_callback(self._watchers.discard)
        try:
            if stream.streaming:
                await self._write_stream(send, stream)
            else:
                await self._write_json(send, stream, stream.response_id, stream.created)
        finally:
            self.streams.discard(stream)
            for req in stream.requests():
                if not req.finished:
                    self.driver.abort(req)

    def driver_submit_choice(
        self,
        stream: ChoiceStream,
        choice: Choice,
        request_id: str,
        prompt: list[int],
        max_tokens: int,
        params: Any,
        seed: int | None,
        output_token_ids: list[int] | None,
    ) -> None:
        choice.req = self.driver.submit(
            f"{choice.index}_{request_id}-{next(self._ids)}",  # vLLM names children "<i>_<id>"
            prompt,
            max_tokens,
            stream.handle_for(choice.index),
            priority=params.priority,
            cache_salt=params.cache_salt,
            ignore_eos=params.ignore_eos,
            seed=seed,
            min_tokens=params.min_tokens,
            output_token_ids=output_token_ids,
        )

    async def _watch_disconnect(self, receive: Receive, stream: Stream | ChoiceStream) -> None:
        # After the body is read, receive() returns only once the client disconnects or the
        # response completes; the latter is not a disconnect.
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
        if not stream.done or stream.chunks:
            stream.disconnected = True
            stream.done = True
            for req in stream.requests():
                self.driver.abort(req)
            stream.wake()

    @staticmethod
    async def _wait(stream: Stream | ChoiceStream) -> None:
        if stream.chunks or stream.done:
            return
        waiter = asyncio.get_running_loop().create_future()
        stream.waiter = waiter
        try:
            await waiter
        finally:
            stream.waiter = None

    async def _write_stream(self, send: Send, stream: Stream | ChoiceStream) -> None:
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

    async def _write_json(
        self, send: Send, stream: Stream | ChoiceStream, response_id: str, created: int
    ) -> None:
        while not stream.done:
            await self._wait(stream)
        reqs = stream.requests()
        if stream.disconnected or not reqs:
            return
        if stream.error is not None:
            await send_bytes(send, stream.error.status, stream.error.body())
            return
        if any(r.finish_reason not in ("stop", "length") for r in reqs):  # aborted by shutdown
            await send_bytes(send, 503, ApiError(503, "The server is shutting down.",
                                                 "Service Unavailable").body())  # fmt: skip
            return
        if isinstance(stream, ChoiceStream):
            await send_bytes(send, 200, stream.json_body())
            return
        req = reqs[0]
        assert req.finish_reason is not None
        body = chat_completion_body(
            response_id=response_id,
            created=created,
            model=self.model,
            text=Tokenizer.decode_output(req.output_token_ids),
            finish_reason=req.finish_reason,
            prompt_tokens=req.prompt_len,
            completion_tokens=req.num_output,
            cached_tokens=self.cached_tokens_of(req),
            system_fingerprint=self.system_fingerprint,
        )
        await send_bytes(send, 200, body)

    # -- legacy completions --------------------------------------------------------------

    async def _completions(self, scope: Scope, receive: Receive, send: Send) -> None:
        engine = self.engine
        try:
            raw = await self._json_raw(scope, receive)
            if raw is None:
                return
            params = parse_completion_request(
                raw,
                self.model,
                _decoded_header(scope, b"x-request-id"),
                _decoded_header(scope, b"x-vllm-priority"),
            )
            await self._injected_faults()
            limit = engine.max_model_len
            if params.max_tokens > limit:
                raise max_tokens_too_large(params.max_tokens, limit)
            prompts: list[list[int]] = []
            for prompt in params.prompts:
                ids = self.tokenizer.encode_prompt(prompt) if isinstance(prompt, str) else prompt
                if len(ids) >= limit:
                    raise context_overflow(limit, len(ids))
                prompts.append(ids)
        except ApiError as err:
            await send_bytes(send, err.status, err.body())
            return
        choices = [
            Choice(
                index=p * params.n + j,
                req=None,
                plan=None,
                prompt_len=len(ids),
                prompt_index=p,
                echo=prompt if params.echo and isinstance(prompt, str) else "",
            )
            for p, (prompt, ids) in enumerate(zip(params.prompts, prompts, strict=True))
            for j in range(params.n)
        ]
        stream = ChoiceStream(
            self,
            kind="completion",
            response_id="cmpl-" + params.request_id,
            created=int(time.time()),
            stream=params.stream,
            include_usage=params.include_usage,
            continuous_usage_stats=params.continuous_usage_stats,
            logprobs=params.logprobs,
            choices=choices,
        )
        await self._run_choices(
            receive, send, stream, params.request_id, prompts, params.max_tokens, params
        )

    # -- small routes --------------------------------------------------------------------

    def model_card(self) -> dict[str, Any]:
        return {
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

    async def _models(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_bytes(send, 200, orjson.dumps({"object": "list", "data": [self.model_card()]}))

    async def _model_detail(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``GET /v1/models/{id}``: the model's card, or OpenAI's 404 for any other id."""
        model = scope["path"].removeprefix("/v1/models/")
        if model != self.model:
            err = ApiError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
            await send_bytes(send, err.status, err.body())
            return
        await send_bytes(send, 200, orjson.dumps(self.model_card()))

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
