"""KV-cache event publishing in vLLM's wire format (``--kv-events-config``), off by default.

What a subscriber (a KV-aware router) sees is what vLLM 0.33 sends:

* a ZMQ PUB socket on ``endpoint`` (default ``tcp://*:5557``; bound when the address has a
  wildcard or is ``ipc://``/``inproc://``, connected otherwise);
* one three-frame message per engine step that changed the cache:
  ``(topic, sequence number as 8 bytes big-endian, payload)``, sequence numbers from 0;
* the payload a msgpack array ``[ts, events, data_parallel_rank]`` (wall-clock seconds, the
  step's events in order, rank 0);
* each event a msgpack map tagged with its class name under ``"type"``; fields with a default
  are left out when they hold it, required ones are always present (``None`` as nil):

  - ``BlockStored``: ``block_hashes`` (unsigned 64-bit ints), ``parent_block_hash`` (nil for
    a chain's first block), ``token_ids``, ``block_size``, ``lora_id``, ``medium`` ("GPU"),
    ``lora_name``, then ``extra_keys`` (one entry per block: the bare cache salt on a
    salted first block, nil elsewhere), ``group_idx`` 0 and ``kv_cache_spec_kind``
    ``"full_attention"``;
  - ``BlockRemoved``: ``block_hashes``, ``medium``, ``group_idx``;
  - ``AllBlocksCleared``: no fields.

* with ``replay_endpoint`` a ROUTER socket answers ``[identity, b"", start_seq]`` with every
  buffered ``(seq, payload)`` from ``start_seq`` on, then ``(-1 as 8 signed bytes, b"")``.

Block hashes are the engine's hash scheme's (``contracts.blockhash.get_hasher``), as unsigned
64-bit ints: with vLLM's ``sha256``/``sha256_cbor`` the digest's last 8 bytes, as vLLM sends
them by default; ``hash_bytes`` sends the 32-byte digests instead, as vLLM does with
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`` (a subscriber that keys on
``int.from_bytes(digest, "big") & MASK64`` reads both alike). vLLM 0.33.0's own msgspec types
decode these batches to the same events as its own encoder's
(``tests/gateway/test_vllm_vectors.py``); the bytes differ only in map header widths.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, fields
from itertools import count
from typing import Any

import msgpack
import zmq

from emulator.kv import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

logger = logging.getLogger("emulator.kv_events")

MASK64 = (1 << 64) - 1
MEDIUM_GPU = "GPU"
END_SEQ = (-1).to_bytes(8, "big", signed=True)


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """vLLM's ``KVEventsConfig`` fields and defaults."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" when events are enabled, else "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @property
    def resolved_publisher(self) -> str:
        if self.publisher is not None:
            return self.publisher
        return "zmq" if self.enable_kv_cache_events else "null"

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        try:
            raw = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"--kv-events-config is not JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise ValueError("--kv-events-config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = set(raw) - known
        if unknown:
            raise ValueError(f"unknown --kv-events-config fields: {sorted(unknown)}")
        config = cls(**raw)
        if config.resolved_publisher not in ("null", "zmq"):
            raise ValueError(f"unknown event publisher {config.publisher!r}")
        return config


def external_hash(h: int, hash_bytes: bool = False) -> int | bytes:
    """A block hash as events carry it: the 32-byte digest (vLLM's schemes), or an unsigned
    64-bit int (the emulator's)."""
    return h.to_bytes(32, "big") if hash_bytes else h & MASK64


def _event_dict(event: KVEvent, hash_bytes: bool = False) -> dict[str, Any]:
    if isinstance(event, BlockStored):
        out: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": [external_hash(h, hash_bytes) for h in event.block_hashes],
            "parent_block_hash": (
                None
                if event.parent_block_hash is None
                else external_hash(event.parent_block_hash, hash_bytes)
            ),
            "token_ids": list(event.token_ids),
            "block_size": event.block_size,
            "lora_id": None,
            "medium": MEDIUM_GPU,
            "lora_name": None,
        }
        # one entry per block, as vLLM's to_event_extra_keys: the bare salt on a salted first
        # block (vLLM: ``if cache_salt``, so an empty salt is none), nil elsewhere
        extra: list[Any] = [None] * len(event.block_hashes)
        if event.cache_salt and extra:
            extra[0] = [event.cache_salt]
        out["extra_keys"] = extra
        out["group_idx"] = 0
        out["kv_cache_spec_kind"] = "full_attention"
        return out
    if isinstance(event, BlockRemoved):
        return {
            "type": "BlockRemoved",
            "block_hashes": [external_hash(h, hash_bytes) for h in event.block_hashes],
            "medium": MEDIUM_GPU,
            "group_idx": 0,
        }
    if isinstance(event, AllBlocksCleared):
        return {"type": "AllBlocksCleared"}
    raise TypeError(f"not a KV event: {event!r}")


def encode_batch(
    ts: float, events: Sequence[KVEvent], data_parallel_rank: int = 0, hash_bytes: bool = False
) -> bytes:
    """One step's events as vLLM's msgpack ``KVEventBatch`` (``hash_bytes``: digests)."""
    body = [ts, [_event_dict(e, hash_bytes) for e in events], data_parallel_rank]
    return msgpack.packb(body, use_bin_type=True)


class ZmqEventPublisher:
    """PUB socket (plus an optional ROUTER for replay) fed from a queue by one thread, so the
    engine loop never waits on encoding or on the network."""

    def __init__(self, config: KVEventsConfig, hash_bytes: bool = False) -> None:
        self.config = config
        self.hash_bytes = hash_bytes
        self._queue: queue.Queue[tuple[float, list[KVEvent]] | None] = queue.Queue(
            maxsize=config.max_queue_size
        )
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        endpoint = config.endpoint
        if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
            self._pub.bind(endpoint)
        else:
            self._pub.connect(endpoint)
        self._replay: zmq.Socket[bytes] | None = None
        if config.replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.bind(config.replay_endpoint)
        self._topic = config.topic.encode("utf-8")
        self._seq = count()
        self._running = True
        self.dropped = 0
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        """The PUB socket's address (with the port a ``:*`` or ``:0`` bind picked)."""
        return str(self._pub.getsockopt_string(zmq.LAST_ENDPOINT))

    def publish(self, events: list[KVEvent]) -> None:
        if not events or not self._running:
            return
        try:
            self._queue.put_nowait((time.time(), events))
        except queue.Full:  # vLLM blocks here; the emulator's engine loop must not
            self.dropped += 1

    def shutdown(self, timeout: float = 1.0) -> None:
        if not self._running:
            return
        self._running = False
        self._queue.put(None)
        self._thread.join(timeout)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()

    def _run(self) -> None:
        pub = self._pub
        while True:
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._serve_replay()
                except zmq.ZMQError:
                    logger.exception("kv-events replay failed")
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if item is None:
                return
            ts, events = item
            seq = next(self._seq)
            payload = encode_batch(ts, events, hash_bytes=self.hash_bytes)
            try:
                pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            except zmq.ZMQError:
                logger.exception("kv-events publish failed")
            self._buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            logger.warning("ignoring a malformed replay request of %d frames", len(frames))
            return
        client, _empty, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))


def make_publisher(
    config: KVEventsConfig | None, hash_bytes: bool = False
) -> ZmqEventPublisher | None:
    """A publisher when events are enabled with the zmq publisher; None otherwise."""
    if config is None or not config.enable_kv_cache_events:
        return None
    if config.resolved_publisher == "null":
        return None
    return ZmqEventPublisher(config, hash_bytes)
