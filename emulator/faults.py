"""Fault knobs for tests. Emulator-only: real vLLM has none of these.

Set them on the command line (``--fail-after-tokens`` ...), on the in-process handle
(``handle.faults.refuse_503 = True``), or at runtime over HTTP with
``POST /_emulator/faults`` and a JSON object of the fields to change (``null`` clears a
count); ``GET /_emulator/faults`` shows them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from emulator.protocol import bad_request


@dataclass(slots=True)
class Faults:
    # Each request ends with a generation error after emitting this many tokens: a mid-stream
    # ``data: {"error": ...}`` then ``[DONE]`` (streaming) or a 500 (non-streaming).
    fail_after_tokens: int | None = None
    # The process dies (``os._exit``) once any stream has streamed this many tokens; in-process
    # servers instead drop every connection and stop listening.
    crash_after_tokens: int | None = None
    # Chat completions answer 503 "Service Unavailable" before doing any work.
    refuse_503: bool = False
    # Wall-clock delay before a chat completion is processed (not scaled by --speed).
    extra_latency_ms: int = 0
    # /health answers 503, as vLLM does when its engine is dead.
    unhealthy: bool = False

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def update(self, changes: dict[str, Any]) -> None:
        """Apply a partial update, validating every field before changing any."""
        staged: dict[str, Any] = {}
        for name, value in changes.items():
            if name in ("fail_after_tokens", "crash_after_tokens"):
                if value is not None and (
                    isinstance(value, bool) or not isinstance(value, int) or value < 0
                ):
                    raise bad_request(f"{name} must be a non-negative integer or null", name)
            elif name == "extra_latency_ms":
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise bad_request(f"{name} must be a non-negative integer", name)
            elif name in ("refuse_503", "unhealthy"):
                if not isinstance(value, bool):
                    raise bad_request(f"{name} must be a boolean", name)
            else:
                raise bad_request(f"unknown fault knob {name!r}", name)
            staged[name] = value
        for name, value in staged.items():
            setattr(self, name, value)
