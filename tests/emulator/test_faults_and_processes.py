"""Fault knobs (CLI, handle, admin endpoint) and the subprocess helper."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import httpx
import pytest

from emulator.testing import EmulatorHandle, running_emulator, spawn_emulator

from .conftest import MODEL, chat, parse_sse


async def test_fail_after_tokens_mid_stream(client: httpx.AsyncClient, emu: EmulatorHandle) -> None:
    emu.faults.fail_after_tokens = 3
    body = chat("hi", max_tokens=50, ignore_eos=True, stream=True)
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200
    events = parse_sse(response.content)
    assert [e["choices"][0]["delta"].get("content") is not None for e in events[:4]] == [True] * 4
    assert events[-2] == {
        "error": {
            "message": "Internal server error during generation",
            "type": "InternalServerError",
            "param": None,
            "code": 500,
        }
    }
    assert events[-1] == "[DONE]"
    assert len(events) == 1 + 3 + 2  # role, 3 tokens, error, [DONE]
    response = await client.post("/v1/chat/completions", json=chat("hi", max_tokens=50,
                                                                   ignore_eos=True))  # fmt: skip
    assert response.status_code == 500
    assert response.json()["error"]["type"] == "InternalServerError"
    assert emu.engine.stats.request_success["error"] == 2
    assert emu.engine.pool.num_used == 0 and not emu.engine.requests


async def test_admin_endpoint_flips_faults(client: httpx.AsyncClient) -> None:
    knobs = (await client.post("/_emulator/faults", json={"refuse_503": True})).json()
    assert knobs["refuse_503"] is True and knobs["fail_after_tokens"] is None
    assert (await client.post("/v1/chat/completions", json=chat("x"))).status_code == 503
    await client.post("/_emulator/faults", json={"refuse_503": False, "unhealthy": True})
    assert (await client.get("/health")).status_code == 503
    response = await client.post("/_emulator/faults", json={"bogus": 1})
    assert response.status_code == 400 and response.json()["error"]["param"] == "bogus"
    response = await client.post("/_emulator/faults", json={"fail_after_tokens": -1})
    assert response.status_code == 400
    assert (await client.get("/_emulator/faults")).json()["unhealthy"] is True
    state = (await client.get("/_emulator/state")).json()
    assert state["kv_blocks_used"] == 0 and state["model"] == MODEL


async def test_in_process_crash_drops_connections() -> None:
    async with running_emulator(model=MODEL, speed=20, crash_after_tokens=3) as emu:
        async with httpx.AsyncClient(base_url=emu.base_url, timeout=10) as client:
            body = chat("hi", max_tokens=100, ignore_eos=True, stream=True)
            received = b""
            with pytest.raises(httpx.HTTPError):
                async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                    async for chunk in response.aiter_bytes():
                        received += chunk
            assert b"[DONE]" not in received and received.count(b'"content"') >= 3
            await emu.wait_crashed()
            with pytest.raises(httpx.ConnectError):
                await client.get("/health")


def test_subprocess_emulator_serves_and_crashes_on_demand() -> None:
    with spawn_emulator("llama-70b-tp4-h100", model="llama-70b-2026-05", speed=20,
                        crash_after_tokens=4, max_num_seqs=64) as emu:  # fmt: skip
        assert httpx.get(emu.base_url + "/health", timeout=5).status_code == 200
        models = httpx.get(emu.base_url + "/v1/models", timeout=5).json()
        assert models["data"][0]["id"] == "llama-70b-2026-05"
        body = chat("hi", max_tokens=100, ignore_eos=True, stream=True, model="llama-70b-2026-05")
        received = b""
        with pytest.raises(httpx.HTTPError):
            with httpx.stream("POST", emu.base_url + "/v1/chat/completions", json=body,
                              timeout=10) as response:  # fmt: skip
                for chunk in response.iter_bytes():
                    received += chunk
        assert b"[DONE]" not in received and b'"content"' in received
        assert emu.process is not None and emu.process.wait(timeout=10) == 70


def test_subprocess_emulator_stops_cleanly_and_rejects_bad_profiles() -> None:
    with spawn_emulator("llama-8b-tp1-h100", speed=5) as emu:
        response = httpx.post(emu.base_url + "/v1/chat/completions", timeout=10,
                              json={"messages": [{"role": "user", "content": "hi"}],
                                    "max_tokens": 2})  # fmt: skip
        assert response.json()["model"] == "llama-8b-tp1-h100"  # model defaults to the profile
    assert emu.returncode == 0
    result = subprocess.run(
        [sys.executable, "-m", "emulator", "--profile", "nope", "--port", "0"],
        capture_output=True, timeout=30, check=False,
    )  # fmt: skip
    assert result.returncode == 2 and b"unknown profile" in result.stderr


async def test_shutdown_aborts_in_flight_requests() -> None:
    async with running_emulator(model=MODEL, speed=1) as emu:
        async with httpx.AsyncClient(base_url=emu.base_url, timeout=10) as client:
            body = chat("hi", max_tokens=5000, ignore_eos=True)
            pending = asyncio.create_task(client.post("/v1/chat/completions", json=body))
            received = b""
            async with client.stream(
                "POST", "/v1/chat/completions", json=dict(body, stream=True)
            ) as response:
                async for chunk in response.aiter_bytes():
                    received += chunk
                    if emu.engine.num_running == 2 and b'"content":" ' in received:
                        await emu.service.stop()
            assert b"[DONE]" not in received
            answer = await pending
            assert answer.status_code == 503
            assert emu.engine.pool.num_used == 0 and not emu.engine.requests
            assert emu.engine.stats.request_success["abort"] == 2
