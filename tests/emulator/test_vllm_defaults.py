"""Where the emulator follows vLLM's defaults rather than what the platform needs.

Each behaviour here was read from vLLM's source; the emulator pins vLLM 0.33.0 (what its
``/version`` reports). The platform's own flags (``contracts.replica_flags``) are tested
last.
"""

from __future__ import annotations

import asyncio
import socket
import time

import httpx
import msgpack
import pytest
import zmq

from contracts.replica_flags import platform_replica_args
from emulator.__main__ import build_parser
from emulator.engine import EngineConfig
from emulator.kv import AllBlocksCleared, BlockRemoved, BlockStored
from emulator.kv_events import MASK64, KVEventsConfig, encode_batch
from emulator.profiles import get_profile
from emulator.replica_flags import platform_engine_config
from emulator.service import EmulatorService
from emulator.testing import running_emulator
from emulator.tokenizer import Tokenizer

from .conftest import MODEL, chat, parse_sse, run_until_idle, small_engine, words


def prompt(index: int, length: int) -> list[int]:
    base = 10_000 + index * length
    return list(range(base, base + length))


# -- scheduling policy ------------------------------------------------------------------------


def test_default_policy_is_fcfs_and_ignores_priority() -> None:
    """vLLM 0.33 ``SchedulerConfig.policy`` defaults to "fcfs": the waiting queue is arrival
    order and a request's ``priority`` changes nothing."""
    assert EngineConfig().scheduling_policy == "fcfs"
    assert build_parser().parse_args([]).scheduling_policy == "fcfs"
    engine = small_engine(max_num_seqs=1)
    first = engine.add_request("first", prompt(0, 20), 3, priority=5, ignore_eos=True)
    urgent = engine.add_request("urgent", prompt(1, 20), 3, priority=-1, ignore_eos=True)
    run_until_idle(engine)
    assert first.first_token_time < urgent.first_token_time


def test_priority_policy_only_when_asked_for() -> None:
    """``--scheduling-policy priority``: a heap on (priority, arrival), lower first."""
    assert build_parser().parse_args(["--scheduling-policy", "priority"]).scheduling_policy == (
        "priority"
    )
    engine = small_engine(max_num_seqs=1, scheduling_policy="priority")
    first = engine.add_request("first", prompt(0, 20), 3, priority=5, ignore_eos=True)
    urgent = engine.add_request("urgent", prompt(1, 20), 3, priority=-1, ignore_eos=True)
    run_until_idle(engine)
    assert urgent.first_token_time < first.first_token_time


# -- prompt_tokens_details --------------------------------------------------------------------


async def test_cached_tokens_only_with_enable_prompt_tokens_details() -> None:
    """vLLM 0.33 sends ``usage.prompt_tokens_details`` only with
    ``--enable-prompt-tokens-details`` (off by default): without it, streaming usage chunks
    leave it out and non-streaming bodies carry ``null``."""
    text = words(300)
    for enabled in (False, True):
        async with (
            running_emulator(model=MODEL, speed=50, enable_prompt_tokens_details=enabled) as emu,
            httpx.AsyncClient(base_url=emu.base_url, timeout=30) as client,
        ):
            body = chat(text, max_tokens=2, stream=True, stream_options={"include_usage": True})
            await client.post("/v1/chat/completions", json=body)  # warm the prefix cache
            streamed = parse_sse((await client.post("/v1/chat/completions", json=body)).content)
            usage = streamed[-2]["usage"]
            plain = await client.post("/v1/chat/completions", json=chat(text, max_tokens=2))
            details = plain.json()["usage"]["prompt_tokens_details"]
            if enabled:
                assert usage["prompt_tokens_details"] == {"cached_tokens": 304}
                assert details["cached_tokens"] == 304
            else:
                assert "prompt_tokens_details" not in usage
                assert details is None
                assert "prompt_tokens_details" in plain.json()["usage"]


# -- the admission gate -----------------------------------------------------------------------


def test_whole_sequence_must_fit_by_default() -> None:
    """vLLM 0.33 admits a waiting request only if its whole sequence fits in free blocks
    (``scheduler_reserve_full_isl``, default on; ``allocate_slots(full_sequence_must_fit)``).
    """
    engine = small_engine(kv_capacity_tokens=21 * 16, max_num_batched_tokens=64)  # 20 usable
    engine.add_request("holder", prompt(0, 160), 400, ignore_eos=True)  # 10 blocks, growing
    for _ in range(3):
        engine.step()
    long = engine.add_request("long", prompt(1, 200), 1, ignore_eos=True)  # 13 blocks
    engine.step()
    assert long.first_scheduled_time < 0  # its first 64-token chunk would have fit
    assert engine.stats.num_preemptions == 0


def test_first_chunk_gate_of_older_releases_admits_and_then_preempts() -> None:
    """vLLM v0.11.x (no full-sequence gate): a request is admitted once its first chunk
    fits; the later chunks run out of blocks and preempt (recompute) the last running one."""
    engine = small_engine(
        kv_capacity_tokens=21 * 16, max_num_batched_tokens=64, reserve_full_prompt=False
    )
    parse = build_parser().parse_args
    assert parse([]).scheduler_reserve_full_isl  # vLLM 0.33's default: the full gate
    assert not parse(["--no-scheduler-reserve-full-isl"]).scheduler_reserve_full_isl
    assert not parse(["--admit-on-first-chunk"]).scheduler_reserve_full_isl  # the older alias
    engine.add_request("holder", prompt(0, 160), 400, ignore_eos=True)
    for _ in range(3):
        engine.step()
    long = engine.add_request("long", prompt(1, 200), 1, ignore_eos=True)
    engine.step()
    assert long.first_scheduled_time >= 0
    for _ in range(20):
        engine.step()
    assert engine.stats.num_preemptions >= 1


# -- schedule-time block caching --------------------------------------------------------------


def test_same_prefix_requests_in_one_step_share_blocks() -> None:
    """vLLM caches a request's full blocks when they are scheduled (``allocate_slots`` ->
    ``cache_blocks``), so a same-prefix request admitted later in the same step hits them:
    two identical 2,000-token prompts -> 1,984 cached tokens for the second (block size 16,
    the hit capped below the prompt's last token)."""
    engine = small_engine()
    a = engine.add_request("a", prompt(0, 2000), 1, ignore_eos=True)
    b = engine.add_request("b", prompt(0, 2000), 1, ignore_eos=True)
    result = engine.step()
    assert {r.request_id for r in result.emitted} == {"a", "b"}  # one step, both prefilled
    assert a.num_cached_tokens == 0
    assert b.num_cached_tokens == 1984
    assert result.num_scheduled_tokens == 2000 + 16
    assert engine.stats.prefix_cache_hits == 1984


def test_a_block_two_requests_compute_in_one_step_is_cached_twice() -> None:
    """vLLM's block pool does not de-duplicate: both copies are registered under the hash,
    a lookup returns the first, and each copy is evicted and reported on its own."""
    engine = small_engine(kv_capacity_tokens=9 * 16, enable_kv_cache_events=True)  # 8 usable
    a = engine.add_request("a", prompt(0, 32), 2, ignore_eos=True)
    b = engine.add_request("b", prompt(0, 32), 2, ignore_eos=True)
    engine.step()
    # b's hit is capped at 31 tokens -> 1 block; it computes block 1 itself, as a does.
    assert b.num_cached_tokens == 16
    pool = engine.pool
    h0, h1 = a.block_hashes[:2]
    assert pool.cached[h1] == a.blocks[1]
    assert pool.duplicates[h1] == [b.blocks[1]] and b.blocks[1] != a.blocks[1]
    assert b.blocks[0] == a.blocks[0]
    a0, first_a1 = a.blocks[0], a.blocks[1]
    events = engine.take_kv_events()
    assert events == [
        BlockStored([h0, h1], None, prompt(0, 32), 16),
        BlockStored([h1], h0, prompt(0, 32)[16:], 16),
    ]
    pool.check_invariants()
    run_until_idle(engine)
    assert pool.lookup([h0, h1], 2) == [a0, first_a1]  # the first registered copy
    # Fill the cache with other prompts: every cached block is evicted, each copy reported.
    engine.add_request("c", prompt(5, 8 * 16 - 1), 1, ignore_eos=True)
    run_until_idle(engine)
    removed = [e.block_hashes[0] for e in engine.take_kv_events() if isinstance(e, BlockRemoved)]
    assert removed.count(h1) == 2 and removed.count(h0) == 1
    assert h1 not in pool.cached and h1 not in pool.duplicates
    pool.check_invariants()


def test_reset_prefix_cache_clears_all_and_is_refused_while_blocks_are_held() -> None:
    engine = small_engine(enable_kv_cache_events=True)
    live = engine.add_request("live", prompt(0, 40), 5, ignore_eos=True)
    engine.step()
    assert not engine.reset_prefix_cache()
    run_until_idle(engine)
    assert live.finished and engine.pool.cached
    engine.take_kv_events()
    assert engine.reset_prefix_cache()
    assert not engine.pool.cached
    assert engine.take_kv_events() == [AllBlocksCleared()]


# -- KV-cache events over ZMQ -----------------------------------------------------------------


def test_events_are_off_by_default() -> None:
    """vLLM's ``KVEventsConfig.enable_kv_cache_events`` defaults to False."""
    assert build_parser().parse_args([]).kv_events_config is None
    engine = small_engine()
    engine.add_request("a", prompt(0, 64), 2, ignore_eos=True)
    run_until_idle(engine)
    assert engine.take_kv_events() == []
    assert KVEventsConfig().resolved_publisher == "null"
    assert KVEventsConfig(enable_kv_cache_events=True).resolved_publisher == "zmq"
    with pytest.raises(ValueError, match="unknown"):
        KVEventsConfig.from_json('{"enable_kv_cache_events": true, "bogus": 1}')


def test_batch_encoding_is_vllms_msgpack_layout() -> None:
    """``KVEventBatch`` as vLLM encodes it with msgspec: the batch an array
    ``[ts, events, data_parallel_rank]``, each event a map tagged ``type`` with its required
    fields always present and defaults left out; hashes as unsigned 64-bit ints."""
    stored = BlockStored([-5, 7], None, list(range(32)), 16, cache_salt="tenant-a")
    removed = BlockRemoved([-5])
    raw = msgpack.unpackb(
        encode_batch(12.5, [stored, removed, AllBlocksCleared()]), strict_map_key=False
    )
    assert raw[0] == 12.5 and raw[2] == 0
    first, second, third = raw[1]
    assert list(first) == [
        "type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
        "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
    ]  # fmt: skip
    assert first["block_hashes"] == [-5 & MASK64, 7]
    assert first["parent_block_hash"] is None and first["medium"] == "GPU"
    assert first["extra_keys"] == [["tenant-a"], None]
    assert second == {"type": "BlockRemoved", "block_hashes": [-5 & MASK64], "medium": "GPU",
                      "group_idx": 0}  # fmt: skip
    assert third == {"type": "AllBlocksCleared"}
    plain = msgpack.unpackb(encode_batch(1.0, [BlockStored([1], 9, [1] * 16, 16)]))
    # vLLM's to_event_extra_keys: one entry per block, nil without a salt (an empty one too)
    assert plain[1][0]["extra_keys"] == [None] and plain[1][0]["parent_block_hash"] == 9
    empty = msgpack.unpackb(encode_batch(1.0, [BlockStored([1], None, [1] * 16, 16, "")]))
    assert empty[1][0]["extra_keys"] == [None]


@pytest.mark.parametrize(
    ("algo", "int_block_hashes", "digests"),
    [("sha256", True, False), ("sha256", False, True), ("emulator", False, False)],
)
def test_vllm_schemes_publish_int_hashes_unless_told_otherwise(
    algo: str, int_block_hashes: bool, digests: bool
) -> None:
    """vLLM 0.33's VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES (default 1): the digest's low 64 bits
    as an int; with 0, the 32-byte digest. The emulator's own hash is an int either way."""
    service = EmulatorService(
        get_profile("llama-8b-tp1-h100"),
        MODEL,
        config=EngineConfig(prefix_caching_hash_algo=algo),
        kv_events=KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:*"),
        int_block_hashes=int_block_hashes,
    )
    publisher = service.kv_events
    assert publisher is not None
    try:
        assert publisher.hash_bytes is digests
    finally:
        publisher.shutdown()


def _free_tcp_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_replica_publishes_block_events_over_zmq() -> None:
    """``--kv-events-config`` with the zmq publisher: PUB frames ``(topic, seq, payload)``
    and a ROUTER that replays buffered batches from a sequence number, then ``-1``."""
    port, replay_port = _free_tcp_port(), _free_tcp_port()
    config = KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint=f"tcp://*:{port}",
        replay_endpoint=f"tcp://*:{replay_port}",
        topic="kv@test",
    )
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@test")
    sub.connect(f"tcp://127.0.0.1:{port}")
    replay = ctx.socket(zmq.DEALER)  # one request, many replies
    replay.connect(f"tcp://127.0.0.1:{replay_port}")
    texts = [words(100, seed=3 + attempt) for attempt in range(50)]
    try:
        async with (
            running_emulator(model=MODEL, speed=50, kv_events=config) as emu,
            httpx.AsyncClient(base_url=emu.base_url, timeout=30) as client,
        ):
            # PUB drops what is sent before the subscription reaches it: send until one
            # batch arrives (bounded), then check the first batch through replay.
            live = None
            for text in texts:
                body = chat(text, max_tokens=1)
                assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
                if await asyncio.to_thread(sub.poll, 200):
                    live = sub.recv_multipart()
                    break
            assert live is not None, "no KV event batch reached the subscriber"
            topic, seq, payload = live
            assert topic == b"kv@test" and len(seq) == 8
            replay.send_multipart((b"", (0).to_bytes(8, "big")))
            replayed = []
            for _ in range(100):
                assert await asyncio.to_thread(replay.poll, 5000), "replay did not answer"
                empty, seq_bytes, batch = replay.recv_multipart()
                assert empty == b""
                if seq_bytes == (-1).to_bytes(8, "big", signed=True):
                    assert batch == b""
                    break
                replayed.append((seq_bytes, batch))
            assert replayed and int.from_bytes(replayed[0][0], "big") == 0
            ts, events, rank = msgpack.unpackb(replayed[0][1])
            assert rank == 0 and abs(ts - time.time()) < 60
            stored = events[0]
            expected = Tokenizer().apply_chat_template([{"role": "user", "content": texts[0]}])
            blocks = len(expected) // 16
            assert stored["type"] == "BlockStored" and stored["parent_block_hash"] is None
            assert stored["token_ids"] == expected[: blocks * 16]
            assert len(stored["block_hashes"]) == blocks
            assert all(0 <= h <= MASK64 for h in stored["block_hashes"])
    finally:
        sub.close(linger=0)
        replay.close(linger=0)
        ctx.term()


# -- what the platform runs -------------------------------------------------------------------


def test_platform_replicas_turn_on_what_the_gateway_needs() -> None:
    args = build_parser().parse_args(platform_replica_args())
    assert args.scheduling_policy == "priority"
    assert args.enable_prompt_tokens_details
    forgot = build_parser().parse_args(platform_replica_args(omit=["--scheduling-policy"]))
    assert forgot.scheduling_policy == "fcfs" and forgot.enable_prompt_tokens_details
    assert platform_engine_config().scheduling_policy == "priority"
    assert platform_engine_config(enable_prefix_caching=False).enable_prefix_caching is False
    with pytest.raises(ValueError):
        platform_replica_args(omit=["--no-such-flag"])
