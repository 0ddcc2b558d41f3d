"""A client that hangs up aborts its request and frees its KV blocks within one engine step."""

from __future__ import annotations

import asyncio
import time

import orjson

from emulator.testing import EmulatorHandle, running_emulator

from .conftest import MODEL, chat, words


async def open_request(
    port: int, body: dict[str, object]
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    payload = orjson.dumps(body)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        + b"content-length: %d\r\n\r\n" % len(payload)
        + payload
    )
    await writer.drain()
    return reader, writer


async def hang_up_and_measure(emu: EmulatorHandle, writer: asyncio.StreamWriter) -> int:
    """Close the socket; return how many engine steps ran before the blocks were free."""
    engine = emu.engine
    steps_at_close = engine.stats.num_steps
    writer.close()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if not engine.pool.num_used:
            break
        await asyncio.sleep(0.001)
    assert engine.pool.num_used == 0, "blocks not freed after disconnect"
    return engine.stats.num_steps - steps_at_close


async def test_streaming_disconnect_frees_blocks_within_one_step() -> None:
    async with running_emulator(model=MODEL, speed=1) as emu:
        body = chat(words(1000), max_tokens=5000, ignore_eos=True, stream=True)
        reader, writer = await open_request(emu.port, body)
        received = b""
        while b'"content":" ' not in received:  # first real token arrived
            received += await asyncio.wait_for(reader.read(65536), 10)
        assert emu.engine.pool.num_used >= 63
        assert await hang_up_and_measure(emu, writer) <= 1
        assert emu.engine.stats.request_success["abort"] == 1
        assert not emu.engine.requests and not emu.app.streams


async def test_non_streaming_disconnect_aborts_too() -> None:
    async with running_emulator(model=MODEL, speed=1) as emu:
        reader, writer = await open_request(emu.port, chat(words(300), max_tokens=5000,
                                                           ignore_eos=True))  # fmt: skip
        deadline = time.monotonic() + 10
        while not any(r.num_output for r in emu.engine.requests.values()):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.005)
        assert await hang_up_and_measure(emu, writer) <= 1
        assert emu.engine.stats.request_success["abort"] == 1


async def test_disconnect_while_waiting_in_queue() -> None:
    async with running_emulator(model=MODEL, speed=1, max_num_seqs=1) as emu:
        _, busy = await open_request(emu.port, chat("hog", max_tokens=5000, ignore_eos=True,
                                                    stream=True))  # fmt: skip
        _, queued = await open_request(emu.port, chat("waiting", max_tokens=10, stream=True))
        deadline = time.monotonic() + 10
        while emu.engine.num_waiting < 1:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.005)
        queued.close()
        while emu.engine.num_waiting:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.005)
        assert emu.engine.stats.request_success["abort"] == 1
        busy.close()
