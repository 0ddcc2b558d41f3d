"""Cache-aware routing through REAL gateways: multi-turn conversations over shared system
prompts against emulated replicas (``python -m emulator`` with the platform flags), P2C vs
``GATEWAY_ADMISSION_STRATEGY=cache_aware``, and the same conversations on one replica (every
turn on the replica holding its history: the perfect-affinity reference).

Each conversation streams its turns one after another (the client appends the assistant's
reply and a new user message, as a chat client does); conversations run concurrently. The
shares come from the gateway's own responses (``usage.prompt_tokens_details.cached_tokens``
over ``usage.prompt_tokens``); TTFT is the client's, to the first content chunk. Every arm
starts fresh replicas (empty prefix caches) and a fresh gateway process.

``python -m bench.prefix_gateway [--sizes 2,8]`` writes bench/results/prefix_gateway.md.
``converse`` is shared with the integration test (tests/gateway/test_prefix_gateway.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis

from bench import cluster
from bench.loadgen import SseStream, content_deltas
from bench.stats import percentile
from contracts import schema
from contracts.replica_flags import platform_replica_args
from emulator.profiles import Profile, get_profile
from emulator.testing import SpawnedEmulator
from fairway.embedded import free_port
from gateway.admission import tokens

RESULTS = Path(__file__).parent / "results"
PROFILE = "llama-8b-tp1-h100"
FAMILY = "llama-8b"
VERSION = "llama-8b-bench"
SYSTEM_WORDS = 900
SYSTEM_TOKENS = tokens.text_tokens(" ".join(["s0x123456"] * SYSTEM_WORDS))  # ~3 per word


class Refused(Exception):
    """A 503 (no replica has room): the client waits and sends the turn again."""

    def __init__(self, retry_after_ms: int) -> None:
        super().__init__(retry_after_ms)
        self.retry_after_ms = retry_after_ms


@dataclass(slots=True)
class Turn:
    request_id: str
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float
    reply: str
    refused: int = 0  # 503s before this turn was served
    completion_tokens: int = 0


async def chat_turn(
    client: httpx.AsyncClient,
    url: str,
    headers: dict[str, str],
    model: str,
    messages: list[dict[str, str]],
    max_tokens: int,
    **extra: Any,
) -> Turn:
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }
    t0 = time.perf_counter()
    ttft = float("nan")
    parts: list[str] = []
    usage: dict[str, Any] = {}
    async with client.stream("POST", url, json=body, headers=headers) as resp:
        if resp.status_code == 503:
            await resp.aread()
            raise Refused(int(resp.headers.get("retry-after-ms", "1000")))
        if resp.status_code != 200:
            raise RuntimeError(f"{resp.status_code}: {(await resp.aread())[:300]!r}")
        request_id = resp.headers.get("x-request-id", "")
        async for chunk in SseStream(line.encode() async for line in resp.aiter_lines()):
            if (texts := content_deltas(chunk)) and not parts:
                ttft = time.perf_counter() - t0
            parts += texts
            if chunk.get("usage"):
                usage = chunk["usage"]
    details = usage.get("prompt_tokens_details") or {}
    return Turn(
        request_id,
        int(usage.get("prompt_tokens", 0)),
        int(details.get("cached_tokens") or 0),
        ttft,
        "".join(parts),
        completion_tokens=int(usage.get("completion_tokens", 0)),
    )


def words(rng: random.Random, n: int, tag: str) -> str:
    return " ".join(f"{tag}{rng.randrange(10**6)}" for _ in range(n))


async def converse(
    client: httpx.AsyncClient,
    base_url: str,
    headers: dict[str, str],
    model: str,
    system: str,
    turns: int,
    seed: int,
    *,
    user_words: tuple[int, int] = (40, 120),
    max_tokens: int = 48,
    request_seed: int | None = None,
    **extra: Any,
) -> list[Turn]:
    """One conversation: each turn resends the whole history plus a new user message.
    ``request_seed`` goes on every request as its ``seed``: the emulator then draws the
    replies from the prompt alone, the same on every replica and in every run."""
    rng = random.Random(seed)
    if request_seed is not None:
        extra["seed"] = request_seed
    messages = [{"role": "system", "content": system}]
    out = []
    for k in range(turns):
        messages.append({"role": "user", "content": words(rng, rng.randint(*user_words), "u")})
        refused = 0
        while True:
            try:
                turn = await chat_turn(
                    client,
                    base_url + "/v1/chat/completions",
                    headers,
                    model,
                    messages,
                    max_tokens,
                    **extra,
                )
                break
            except Refused as exc:  # as the openai client does, bounded
                refused += 1
                if refused > 20:
                    raise
                await asyncio.sleep(min(exc.retry_after_ms, 2000) / 1000)
        turn.refused = refused
        messages.append({"role": "assistant", "content": turn.reply})
        out.append(turn)
        del k
    return out


def system_prompts(count: int) -> list[str]:
    """The workload's system prompts (``SYSTEM_WORDS`` words each), the same in every run."""
    rng = random.Random(7)
    return [words(rng, SYSTEM_WORDS, f"s{t}x") for t in range(count)]


async def conversations_over(
    base_url: str,
    auths: Sequence[dict[str, str]],
    model: str,
    systems: Sequence[str],
    conversations: int,
    turns: int,
    first_seed: int = 1000,
    **options: Any,
) -> list[list[Turn]]:
    """``conversations`` concurrent conversations (seeded ``first_seed``, +1, …): conversation ``c``
    over ``systems[c % len(systems)]``, sent with ``auths[c % len(auths)]``; ``options``
    go to ``converse``."""
    async with httpx.AsyncClient(timeout=300) as http:
        return list(
            await asyncio.gather(
                *(
                    converse(
                        http,
                        base_url,
                        auths[c % len(auths)],
                        model,
                        systems[c % len(systems)],
                        turns,
                        seed=first_seed + c,
                        **options,
                    )
                    for c in range(conversations)
                )
            )
        )


@dataclass(slots=True)
class ArmResult:
    label: str
    replicas: int
    turns: list[Turn] = field(default_factory=list)
    wall_s: float = 0.0
    load: float = 0.0

    @property
    def share(self) -> float:
        p = sum(t.prompt_tokens for t in self.turns)
        return sum(t.cached_tokens for t in self.turns) / p if p else float("nan")

    def ttft(self, q: float) -> float:
        vals = [t.ttft_s for t in self.turns if t.ttft_s == t.ttft_s]
        return percentile(vals, q)


def seed_read_model(
    client: redis.Redis, replica_urls: Sequence[str], tenants: int
) -> list[cluster.TenantSeed]:
    profile = get_profile(PROFILE)
    limit = schema.LimitRecord(
        rpm=1_000_000,
        tpm=1_000_000_000,
        max_context=32_768,
        max_output=1024,
        kv_seconds_cap=10_000_000,
        reserved_kv=0,
    )
    seeds = [
        cluster.TenantSeed(
            schema.TenantRecord(
                tenant_id=f"tenant-{i}",
                name=f"tenant-{i}",
                plan="standard",
                admission_class="standard",
                suspended=False,
                limits={FAMILY: limit},
            ),
            cluster.api_key_for(f"prefix-{i}"),
        )
        for i in range(tenants)
    ]
    version = schema.ModelVersionRecord(
        version=VERSION,
        family=FAMILY,
        context_length=profile.max_model_len,
        kv_bytes_per_token=profile.kv_bytes_per_token,
        tpot_target_ms=profile.tpot_target_ms,
        kv_capacity_tokens=profile.kv_capacity_tokens,
        replicas=tuple(
            schema.ReplicaRecord(f"r{i}", url, "shared") for i, url in enumerate(replica_urls)
        ),
    )
    catalog = schema.Catalog(families={FAMILY: VERSION}, versions={VERSION: version})
    cluster.seed_read_model(client, seeds, catalog)
    return seeds


async def run_arm(
    label: str,
    redis_url: str,
    replica_urls: Sequence[str],
    strategy: str,
    conversations: int,
    turns: int,
    tenants: int,
    workdir: Path,
    *,
    workers: int = 1,
    kv_events: Sequence[str] = (),
) -> ArmResult:
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    seeds = seed_read_model(client, replica_urls, tenants)
    client.close()
    env = {"GATEWAY_ADMISSION_STRATEGY": strategy}
    if kv_events:
        env["GATEWAY_PREFIX_KV_EVENTS"] = ",".join(
            f"r{i}={endpoint}" for i, endpoint in enumerate(kv_events)
        )
    gw = cluster.start_gateway(redis_url, workers, env, workdir, timeout=90)
    out = ArmResult(label, len(replica_urls), load=os.getloadavg()[0])
    t0 = time.perf_counter()
    try:
        results = await conversations_over(
            gw.base_url,
            [{"authorization": f"Bearer {s.secret}"} for s in seeds],
            VERSION,
            system_prompts(tenants),
            conversations,
            turns,
        )
    finally:
        gw.stop()
    out.wall_s = time.perf_counter() - t0
    out.turns = [t for conv in results for t in conv]
    return out


def start_replicas(
    profile: Profile, profile_file: Path, count: int, speed: float, event_ports: Sequence[int]
) -> list[cluster.Replica]:
    """Fresh replicas (empty prefix caches); with ``event_ports``, each publishes its KV
    events on its port (vLLM's ``--kv-events-config``)."""
    if not event_ports:
        return cluster.start_replicas(
            profile, profile_file, VERSION, ["shared"] * count, speed, seed=3
        )
    out = []
    try:
        for i, port in enumerate(event_ports):
            config = json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}"})
            proc = SpawnedEmulator(
                profile.name,
                VERSION,
                speed,
                extra_args=["--profile-file", str(profile_file), *platform_replica_args()],
                seed=3 + i,
                log_level="error",
                ready_timeout=60.0,
                kv_events_config=config,
            ).start()
            out.append(cluster.Replica(f"r{i}", "shared", proc))
    except BaseException:
        cluster.stop_replicas(out)
        raise
    return out


async def main_async(args: argparse.Namespace) -> int:
    command = "python -m bench.prefix_gateway " + " ".join(sys.argv[1:])
    profile = get_profile(PROFILE)
    load0 = os.getloadavg()
    rows: list[ArmResult] = []
    workdir = cluster.workdir()
    profile_file = cluster.write_profile_file([profile], workdir)
    with cluster.bench_redis() as redis_url:
        for size in (int(s) for s in args.sizes.split(",")):
            arms = [
                ("P2C", size, "p2c", 1, False),
                ("cache-aware", size, "cache_aware", 1, False),
                ("cache-aware, 2 gateway workers", size, "cache_aware", 2, False),
                ("cache-aware, 2 gateway workers + KV events", size, "cache_aware", 2, True),
                ("one replica (perfect affinity)", 1, "p2c", 1, False),
            ]
            for label, count, strategy, workers, events in arms:
                # the reference: one replica with one replica's share of the conversations
                share = 1 if count == 1 else size
                ports = [free_port() for _ in range(count)] if events else []
                replicas = start_replicas(profile, profile_file, count, args.speed, ports)
                try:
                    res = await run_arm(
                        label,
                        redis_url,
                        [r.base_url for r in replicas],
                        strategy,
                        args.conversations_per_replica * share,
                        args.turns,
                        args.tenants_per_replica * share,
                        workdir,
                        workers=workers,
                        kv_events=[f"tcp://127.0.0.1:{p}" for p in ports],
                    )
                finally:
                    cluster.stop_replicas(replicas)
                res.replicas = size
                print(
                    f"{size} replicas, {label}: cached {res.share:.1%}, TTFT p50 "
                    f"{res.ttft(50) * 1000:.0f} ms, {res.wall_s:.0f} s",
                    flush=True,
                )
                rows.append(res)
    load1 = os.getloadavg()
    lines = [
        "# Cache-aware routing through real gateways",
        "",
        f"Command: `{command}`. Machine load average {load0[0]:.1f} at start, {load1[0]:.1f} "
        "at the end (2 cores shared with other work: TTFTs are loopback wall-clock and "
        "CPU-bound, compare arms of one run only).",
        "",
        f"Replicas: `python -m emulator --profile {PROFILE}` at speed {args.speed:g} with the "
        "platform flags (prefix caching on, `--enable-prompt-tokens-details`); one gateway "
        "process, or one supervisor with 2 worker processes (each its own index; with KV "
        "events each worker subscribes to every replica's ZMQ publisher). Per replica "
        f"{args.conversations_per_replica} conversations of {args.turns} "
        f"turns over {args.tenants_per_replica} tenants, each tenant a ~{SYSTEM_TOKENS:,}-token "
        "system prompt shared by its conversations, user messages 40-120 words (~3 tokens "
        "each), replies up to 48 tokens; all conversations concurrent. Shares are the "
        "gateway's reported cached tokens over prompt tokens, all turns counted (the first "
        "turns' misses included). The reference runs one replica's share of the "
        "conversations (the same per-replica load) on one replica: every turn on the replica "
        "holding its history. A 503 (no replica with room) is retried after its retry-after.",
        "",
        "| replicas | routing | cached share | vs one replica | TTFT p50 | TTFT p95 | requests |"
        " 503s retried | wall | load at start |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for size in sorted({r.replicas for r in rows}):
        group = [r for r in rows if r.replicas == size]
        ref = group[-1]  # the one-replica arm
        lines.extend(
            f"| {size} | {r.label} | {r.share:.1%} | {(r.share - ref.share) * 100:+.1f} pt | "
            f"{r.ttft(50) * 1000:.0f} ms | {r.ttft(95) * 1000:.0f} ms | {len(r.turns)} | "
            f"{sum(t.refused for t in r.turns)} | {r.wall_s:.0f} s | {r.load:.1f} |"
            for r in group
        )
    lines.append("")
    Path(args.out).write_text("\n".join(lines))  # noqa: ASYNC240 - once, at the end
    print("\n".join(lines))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="2,8")
    ap.add_argument("--speed", type=float, default=5.0)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--conversations-per-replica", type=int, default=8)
    ap.add_argument("--tenants-per-replica", type=int, default=2)
    ap.add_argument("--out", default=str(RESULTS / "prefix_gateway.md"))
    return asyncio.run(main_async(ap.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
