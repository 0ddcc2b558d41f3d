"""Shared helpers for the emulator tests (no Redis/Kafka needed here)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import pytest

from emulator.engine import Engine, EngineConfig
from emulator.profiles import get_profile
from emulator.testing import EmulatorHandle, running_emulator

MODEL = "llama-8b-test"


def _word4(k: int) -> str:
    k = (k * 2654435761) % 26**4  # odd, not a multiple of 13: a bijection on 26**4
    return "".join(chr(97 + (k // 26**j) % 26) for j in range(4))


def words(n: int, seed: int = 0) -> str:
    """n distinct 4-letter words (one token each under the emulator's rules); the seed picks
    a different sequence."""
    return " ".join(_word4(seed * 1_000_003 + i) for i in range(n))


def chat(content: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}


def parse_sse(raw: bytes) -> list[Any]:
    """Decode an SSE body into JSON events; ``[DONE]`` becomes the string "[DONE]"."""
    events: list[Any] = []
    for block in raw.split(b"\n\n"):
        if not block.strip():
            continue
        assert block.startswith(b"data: "), block
        payload = block[len(b"data: ") :]
        events.append("[DONE]" if payload == b"[DONE]" else orjson.loads(payload))
    return events


def small_engine(**overrides: Any) -> Engine:
    """An 8B-profile engine with a tiny KV cache, for scheduler/property tests."""
    seed = overrides.pop("seed", 0)
    profile = overrides.pop("profile", "llama-8b-tp1-h100")
    return Engine(get_profile(profile), EngineConfig(**overrides), seed=seed)


def run_until_idle(engine: Engine, max_steps: int = 100_000) -> None:
    for _ in range(max_steps):
        if not engine.has_work():
            return
        engine.step()
    raise AssertionError("engine did not drain")


@pytest.fixture
async def emu() -> AsyncIterator[EmulatorHandle]:
    """A replica as the platform runs it: usage carries cached_tokens (the vLLM defaults have
    their own tests in test_vllm_defaults.py)."""
    async with running_emulator(
        profile="llama-8b-tp1-h100", model=MODEL, speed=20, enable_prompt_tokens_details=True
    ) as handle:
        yield handle


@pytest.fixture
async def client(emu: EmulatorHandle) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=emu.base_url, timeout=30) as http:
        yield http
