"""A client that hangs up aborts its request and frees its KV blocks within one engine step.

Counted are the steps the engine's clock had not yet reached when the client hung up: a
loaded machine leaves the engine loop behind the wall clock, and while it catches up it runs
steps that were due before the hang-up, one per event-loop turn, as the close travels
(client close, the server's EOF, the watcher task). Those were owed before the client left;
a step due after it must not run for the request."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson

from emulator.testing import EmulatorHandle, running_emulator
from tests.support import wait_until_async

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
    """Close the socket; return how many engine steps due after the hang-up (by the engine's
    model clock) ran before the blocks were free."""
    engine, driver = emu.engine, emu.app.driver
    starts: list[float] = []
    step = engine.step

    def recording_step() -> Any:
        starts.append(engine.now)
        return step()

    engine.step = recording_step  # type: ignore[method-assign]
    try:
        hung_up_at = driver.model_now()
        writer.close()
        await wait_until_async(lambda: not engine.pool.num_used, 5, 0.001, "blocks freed")
    finally:
        del engine.step  # back to the class's method
    return sum(start >= hung_up_at for start in starts)


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
        await wait_until_async(
            lambda: any(r.num_output for r in emu.engine.requests.values()), 10, 0.005
        )
        assert await hang_up_and_measure(emu, writer) <= 1
        assert emu.engine.stats.request_success["abort"] == 1


async def test_disconnect_while_waiting_in_queue() -> None:
    async with running_emulator(model=MODEL, speed=1, max_num_seqs=1) as emu:
        _, busy = await open_request(emu.port, chat("hog", max_tokens=5000, ignore_eos=True,
                                                    stream=True))  # fmt: skip
        _, queued = await open_request(emu.port, chat("waiting", max_tokens=10, stream=True))
        await wait_until_async(lambda: emu.engine.num_waiting >= 1, 10, 0.005, "one queued")
        queued.close()
        await wait_until_async(lambda: not emu.engine.num_waiting, 10, 0.005, "queue empty")
        assert emu.engine.stats.request_success["abort"] == 1
        busy.close()
