"""Responses with more than the fast path's one plain text choice.

``n`` choices, tool calls, structured output and logprobs on ``/v1/chat/completions``, and the
legacy ``/v1/completions``, all go through ``ChoiceStream``: one engine request per choice
(vLLM's v1 engine fans ``n`` out the same way; the shared prompt blocks come from the prefix
cache), events formatted per token as dicts. The plain single-choice chat stream keeps its
pre-serialised byte templates in ``emulator.server`` (the SSE throughput path).

What a choice says is decided before it runs (``decide_plan``): under ``tool_choice`` ``auto``
the model calls a tool unless the conversation's last message is a tool result (then it
answers in text), otherwise with probability 3/4 drawn from the request's content, so the same
request gets the same answer on every replica; ``required`` and a named function always call.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson

from emulator.engine import Request
from emulator.logprobs import chat_entry, legacy_entry
from emulator.protocol import (
    DONE_EVENT,
    ApiError,
    ChatParams,
    bad_request,
    error_event,
    generation_error,
    usage_dict,
)
from emulator.structured import (
    OutputPlan,
    SchemaError,
    conforming_instance,
    object_for_json_mode,
    plan_json,
    plan_tool_calls,
    request_rng,
)
from emulator.tokenizer import output_vocab

if TYPE_CHECKING:
    from emulator.server import EmulatorApp

AUTO_TOOL_CALL_PROBABILITY = 0.75
PARALLEL_CALL_PROBABILITY = 0.3


def decide_plan(params: ChatParams, choice: int) -> OutputPlan | None:
    """The decided output of choice ``choice``, or None for free text (the engine's words).
    Raises ApiError when a schema cannot be satisfied."""
    rng = request_rng(params.messages, params.tools, params.response_format, params.seed, choice)
    tools = params.tools or []
    choice_kind = params.tool_choice
    if tools and choice_kind != "none":
        last_role = (
            params.messages[-1].get("role") if isinstance(params.messages[-1], dict) else None
        )
        if isinstance(choice_kind, dict):
            name = choice_kind["function"]["name"]
            picked = [next(i for i, t in enumerate(tools) if t["function"]["name"] == name)]
            finish = "stop"  # vLLM: a named tool choice finishes with "stop"
        elif choice_kind == "required" or (
            last_role != "tool" and rng.random() < AUTO_TOOL_CALL_PROBABILITY
        ):
            picked = [rng.randrange(len(tools))]
            if (
                params.parallel_tool_calls
                and len(tools) > 1
                and rng.random() < PARALLEL_CALL_PROBABILITY
            ):
                picked.append((picked[0] + 1 + rng.randrange(len(tools) - 1)) % len(tools))
            finish = "tool_calls"
        else:
            picked = []
            finish = "stop"
        if picked:
            calls = []
            for index in picked:
                function = tools[index]["function"]
                schema = function.get("parameters") or {"type": "object", "properties": {}}
                try:
                    calls.append((function["name"], conforming_instance(schema, rng)))
                except SchemaError as exc:
                    raise bad_request(str(exc), f"tools.{index}.function.parameters") from None
            return plan_tool_calls(calls, rng, finish)
    fmt = params.response_format
    if fmt is None or fmt["type"] == "text":
        return None
    if fmt["type"] == "json_object":
        return plan_json(object_for_json_mode(rng))
    try:
        return plan_json(conforming_instance(fmt["schema"], rng))
    except SchemaError as exc:
        raise bad_request(str(exc), "response_format.json_schema.schema") from None


@dataclass(slots=True)
class Choice:
    index: int
    req: Request | None
    plan: OutputPlan | None
    prompt_len: int
    prompt_index: int = 0
    echo: str = ""  # /v1/completions echo: the prompt text, sent first
    text_offset: int = 0  # legacy logprobs: characters so far
    role_sent: bool = False
    finished: bool = False

    def token_text(self, position: int) -> str:
        req = self.req
        assert req is not None
        if self.plan is not None:
            return self.plan.texts[position]
        return output_vocab()[req.token_ids[req.prompt_len + position]]

    def text(self) -> str:
        req = self.req
        assert req is not None
        return "".join(self.token_text(i) for i in range(req.num_output))


class _ChoiceHandle:
    """The engine request's ``handle``: routes its steps to the stream with its index."""

    __slots__ = ("stream", "index")

    def __init__(self, stream: ChoiceStream, index: int) -> None:
        self.stream = stream
        self.index = index

    def on_step(self, req: Request) -> None:
        self.stream.on_choice_step(self.index, req)


class ResponseBuffer:
    """What the response writer and the disconnect watcher share with a request's engine
    events: the chunks produced so far, a waiter to wake, and how it ended."""

    __slots__ = ("chunks", "waiter", "done", "disconnected", "error")

    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.waiter: asyncio.Future[None] | None = None
        self.done = False  # nothing more will be produced (finished, failed, or dropped)
        self.disconnected = False
        self.error: ApiError | None = None

    def wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def close(self) -> None:
        """End the response without more events (server shutdown)."""
        self.done = True
        self.wake()


class ChoiceStream(ResponseBuffer):
    """Per-request bridge like ``server.Stream``, for several choices and richer chunks.

    ``kind`` is ``"chat"`` or ``"completion"``; ``logprobs`` is the number of alternatives
    per token (chat ``top_logprobs``, legacy ``logprobs``) or None when not asked for.
    """

    def __init__(
        self,
        app: EmulatorApp,
        *,
        kind: str,
        response_id: str,
        created: int,
        stream: bool,
        include_usage: bool,
        continuous_usage_stats: bool,
        logprobs: int | None,
        choices: list[Choice],
    ) -> None:
        self.app = app
        self.kind = kind
        self.response_id = response_id
        self.created = created
        self.streaming = stream
        self.include_usage = include_usage
        self.continuous = continuous_usage_stats
        self.logprobs = logprobs
        self.choices = choices
        super().__init__()

    def requests(self) -> list[Request]:
        return [c.req for c in self.choices if c.req is not None]

    def handle_for(self, index: int) -> _ChoiceHandle:
        return _ChoiceHandle(self, index)

    # -- events ---------------------------------------------------------------------------

    def _envelope(self, choices: list[dict[str, Any]], **extra: Any) -> bytes:
        body: dict[str, Any] = {
            "id": self.response_id,
            "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
            "created": self.created,
            "model": self.app.model,
            "choices": choices,
            **extra,
        }
        return b"data: " + orjson.dumps(body) + b"\n\n"

    def _logprobs_for(self, choice: Choice, position: int, text: str) -> Any:
        top = self.logprobs
        if top is None:
            return None
        if self.kind == "chat":
            return {"content": [chat_entry(text, position, choice.index, top)]}
        lp, alternatives = legacy_entry(text, position, choice.index, top)
        entry = {
            "text_offset": [choice.text_offset],
            "token_logprobs": [lp],
            "tokens": [text],
            "top_logprobs": [alternatives],
        }
        return entry

    def on_choice_step(self, index: int, req: Request) -> None:
        if self.done:
            return
        choice = self.choices[index]
        app = self.app
        faults = app.faults
        count = req.num_output
        finish_reason = req.finish_reason
        if finish_reason is not None and finish_reason not in ("stop", "length"):
            return  # aborted while its last step was in flight: the abort path owns it
        fail_after = faults.fail_after_tokens
        failing = fail_after is not None and count >= fail_after and finish_reason is None
        if self.streaming and not (failing and fail_after is not None and count > fail_after):
            self._stream_token(choice, req, finish_reason)
        if finish_reason is not None:
            choice.finished = True
            if all(c.finished for c in self.choices):
                if self.streaming:
                    if self.include_usage:
                        self.chunks.append(
                            self._envelope(
                                [], usage=self.usage(), system_fingerprint=app.system_fingerprint
                            )
                        )
                    self.chunks.append(DONE_EVENT)
                self.done = True
        if failing:
            for other in self.requests():
                app.driver.abort(other, "error")
            self.error = generation_error()
            if self.streaming:
                self.chunks.append(error_event(self.error))
                self.chunks.append(DONE_EVENT)
            self.done = True
        crash_after = faults.crash_after_tokens
        if crash_after is not None and count >= crash_after:
            app.schedule_crash()
        self.wake()

    def _stream_token(self, choice: Choice, req: Request, finish_reason: str | None) -> None:
        position = req.num_output - 1
        text = choice.token_text(position)
        chunks = self.chunks
        if self.kind == "chat":
            if not choice.role_sent:
                chunks.append(
                    self._envelope(
                        [
                            {
                                "index": choice.index,
                                "delta": {"role": "assistant", "content": ""},
                                "logprobs": None,
                                "finish_reason": None,
                            }
                        ],
                        # vLLM: the role chunk carries the prompt's count, none generated
                        **(
                            {"usage": usage_dict(choice.prompt_len, 0, None)}
                            if self.continuous
                            else {}
                        ),
                    )
                )
                choice.role_sent = True
            delta: dict[str, Any] | None
            if choice.plan is not None:
                delta = choice.plan.deltas[position]
            else:
                delta = {"content": text}
            if delta is None and finish_reason is None:
                return  # the tool parser holds this token back
            event: dict[str, Any] = {
                "index": choice.index,
                "delta": delta or {},
                "logprobs": self._logprobs_for(choice, position, text),
                "finish_reason": None,
            }
        else:
            prefix = "" if choice.role_sent else choice.echo
            choice.role_sent = True
            choice.text_offset += len(prefix)
            event = {
                "index": choice.index,
                "text": prefix + text,
                "logprobs": self._logprobs_for(choice, position, text),
                "finish_reason": None,
                "stop_reason": None,
            }
            choice.text_offset += len(text)
        extra: dict[str, Any] = {}
        if finish_reason is not None:
            event["finish_reason"] = self.finish_reason(choice, finish_reason)
            event["stop_reason"] = None
        if self.continuous:
            extra["usage"] = usage_dict(choice.prompt_len, req.num_output, None)
        chunks.append(self._envelope([event], **extra))

    # -- results --------------------------------------------------------------------------

    @staticmethod
    def finish_reason(choice: Choice, engine_reason: str) -> str:
        plan = choice.plan
        if plan is not None and engine_reason == "stop":
            return plan.complete_finish
        return engine_reason

    def usage(self) -> dict[str, Any]:
        """Prompt tokens once per prompt, completion tokens summed over every choice."""
        prompts: dict[int, Choice] = {}
        completion = 0
        for choice in self.choices:
            prompts.setdefault(choice.prompt_index, choice)
            completion += choice.req.num_output if choice.req is not None else 0
        prompt_tokens = sum(c.prompt_len for c in prompts.values())
        cached: int | None = None
        if self.app.enable_prompt_tokens_details:
            # What the first choice of each prompt found cached: the prompt is billed once.
            cached = sum(
                max(c.req.num_cached_tokens, 0) for c in prompts.values() if c.req is not None
            )
        return usage_dict(prompt_tokens, completion, cached)

    def _chat_choice(self, choice: Choice) -> dict[str, Any]:
        req = choice.req
        assert req is not None and req.finish_reason is not None
        finish = self.finish_reason(choice, req.finish_reason)
        plan = choice.plan
        message: dict[str, Any] = {
            "role": "assistant",
            "content": choice.text(),
            "refusal": None,
            "annotations": None,
            "audio": None,
            "function_call": None,
            "reasoning": None,
        }
        if plan is not None and plan.tool_calls and req.num_output == len(plan.texts):
            message["content"] = None
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
                for call in plan.tool_calls
            ]
        logprobs = None
        if self.logprobs is not None:
            logprobs = {
                "content": [
                    chat_entry(choice.token_text(i), i, choice.index, self.logprobs)
                    for i in range(req.num_output)
                ]
            }
        return {
            "index": choice.index,
            "message": message,
            "logprobs": logprobs,
            "finish_reason": finish,
            "stop_reason": None,
            "token_ids": None,
            "routed_experts": None,
            "weight_versions": None,
        }

    def _completion_choice(self, choice: Choice) -> dict[str, Any]:
        req = choice.req
        assert req is not None and req.finish_reason is not None
        texts = [choice.token_text(i) for i in range(req.num_output)]
        logprobs = None
        if self.logprobs is not None:
            offset = len(choice.echo)
            offsets: list[int] = []
            token_lps: list[float] = []
            tops: list[dict[str, float]] = []
            for i, text in enumerate(texts):
                lp, alternatives = legacy_entry(text, i, choice.index, self.logprobs)
                offsets.append(offset)
                token_lps.append(lp)
                tops.append(alternatives)
                offset += len(text)
            logprobs = {
                "text_offset": offsets,
                "token_logprobs": token_lps,
                "tokens": texts,
                "top_logprobs": tops,
            }
        return {
            "index": choice.index,
            "text": choice.echo + "".join(texts),
            "logprobs": logprobs,
            "finish_reason": req.finish_reason,
            "stop_reason": None,
            "prompt_logprobs": None,
            "prompt_token_ids": None,
            "token_ids": None,
        }

    def json_body(self) -> bytes:
        usage = self.usage()
        details = usage.get("prompt_tokens_details")
        if details is None:
            usage["prompt_tokens_details"] = None
        else:
            details.update(created_cache_tokens=None, multimodal_tokens=None)
        usage["completion_tokens_details"] = None
        if self.kind == "chat":
            return orjson.dumps(
                {
                    "id": self.response_id,
                    "object": "chat.completion",
                    "created": self.created,
                    "model": self.app.model,
                    "choices": [self._chat_choice(c) for c in self.choices],
                    "service_tier": None,
                    "system_fingerprint": self.app.system_fingerprint,
                    "usage": usage,
                    "prompt_logprobs": None,
                    "prompt_token_ids": None,
                    "prompt_text": None,
                    "kv_transfer_params": None,
                    "ec_transfer_params": None,
                    "metrics": None,
                }
            )
        return orjson.dumps(
            {
                "id": self.response_id,
                "object": "text_completion",
                "created": self.created,
                "model": self.app.model,
                "choices": [self._completion_choice(c) for c in self.choices],
                "service_tier": None,
                "system_fingerprint": self.app.system_fingerprint,
                "usage": usage,
                "kv_transfer_params": None,
            }
        )
