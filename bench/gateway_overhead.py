"""Scenario 2 — gateway overhead: what does putting Fairway's gateway in the path cost?

The same offered load (an open-loop Poisson schedule) is sent straight to an emulated
replica and through ``python -m gateway`` in front of that replica, with everything on:
API-key auth, validation, admission (quota in Redis, routing), the upstream relay, and one
usage event per request to the embedded Kafka-compatible broker through the fsync'd spool.

Three arms, interleaved in short slices (direct, hop, gateway, then the reverse order) so
that whatever else runs on the machine weighs on all of them alike:

- direct: the client talks to the replica;
- one extra hop: the client talks to a byte-forwarding TCP proxy (uvloop, no parsing) in
  front of the replica — the floor that *any* component in the path pays on this machine
  (two more loopback hops and process wake-ups per direction), measured, not assumed;
- via the gateway.

Two measures of the gateway's added latency:

- client side: the difference of the latency distributions (via the gateway − direct), per
  quantile, for streaming (time to first token, and to the end of the stream) and JSON
  requests, with the ratio to the same run's direct figure;
- server side: the gateway's ``fairway_gateway_added_seconds`` histogram — its time before
  the upstream request leaves plus its time from the upstream's first token (SSE) or last
  event (JSON) to the client's socket — which is blind to the extra hop and to the wait for
  the event loop, but not to other processes' noise.

Then a sweep with one gateway worker raises the streaming rate until the client-side p99
time to first token through the gateway passes 100 ms: the highest rate one worker
sustains. CPU per request is the gateway processes' user+system CPU over the requests they
served.

Everything runs on this machine's cores (replica, gateway, proxy, load generator, Redis and
broker share them), so these are the figures of this box under whatever else it was
running (the load average is in the report), not those of a dedicated host. The load
generator is one asyncio process at ~20 % of a core at 200 streams/s: not the bottleneck.

``python -m bench.gateway_overhead`` writes bench/results/gateway_overhead.md (< 3 min).
``--tools`` runs the same scenario with a tool-calling request (one function tool,
``tool_choice: "required"``: the reply is a streamed tool call, its first delta the "first
token") against a replica started with tool calling, and writes
bench/results/gateway_overhead_tools.md.

``--gateway-env KEY=VALUE`` (repeatable) sets a variable for every gateway of the run, the
other checkout's too (``GATEWAY_ADMISSION_STRATEGY=cache_aware`` measures cache-aware
routing); ``--prompt-words N`` adds N words to every prompt after its unique first words, so
that its first block is the request's own (nothing for cache-aware routing to follow) and
its length is what hashing it would cost.

``--against DIR`` compares this tree's gateway with another commit's (a throwaway
``git worktree add --detach DIR SHA``) in one sitting: for each ``--workers`` setting, three
arms take turns slice by slice — direct, this gateway, the other checkout's gateway (its own
code, its read model written by its own ``seed``) — cycling through the six orders of the
three, and the report gives each gateway's added latency, their difference, and that
difference slice by slice, whose spread is the run's noise. No extra-hop arm and no rate
sweep; it writes bench/results/gateway_overhead_ab.md (``--out`` elsewhere)::

    git worktree add --detach /tmp/gw-base 55fd0e7
    PYTHONPATH=$PWD .venv/bin/python -m bench.gateway_overhead --against /tmp/gw-base
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import math
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import httpx
import numpy as np
import orjson
import redis

from bench import cluster
from bench.prom_parse import bucket_sums
from bench.stats import percentile
from contracts import schema
from contracts.replica_flags import platform_replica_args
from emulator.testing import SpawnedEmulator, spawn_emulator
from fairway.embedded import EmbeddedServices
from gateway.admission.replicas import histogram_quantile

RESULTS = Path(__file__).parent / "results"
PROFILE = "llama-8b-tp1-h100"
FAMILY = "llama-8b"
VERSION = "llama-8b-2026-05"
TENANT = "bench-overhead"
TTFT_LIMIT_S = 0.100
# --tools: what each request adds (set once at start), and the tool it declares.
EXTRA_FIELDS: dict[str, object] = {}
BENCH_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup_order",
            "description": "Find an order by its number and the customer's postcode",
            "parameters": {
                "type": "object",
                "properties": {"number": {"type": "integer"}, "postcode": {"type": "string"}},
                "required": ["number", "postcode"],
            },
        },
    }
]
ADDED = "fairway_gateway_added_seconds_bucket"
# --prompt-words: what follows every prompt's unique first words (set once at start).
PROMPT_PAD: list[str] = [""]


# -- load -------------------------------------------------------------------------------


@dataclass(slots=True)
class Sample:
    status: int = 0
    ttft: float | None = None  # first content token (streaming) or the whole body (JSON)
    total: float | None = None
    error: str | None = None


def quantile_of(samples: Sequence[Sample], attr: str, q: float) -> float:
    values = [
        v for s in samples if s.status == 200 and s.error is None
        if (v := getattr(s, attr)) is not None
    ]  # fmt: skip
    return percentile(values, q * 100)


@dataclass(slots=True)
class Arm:
    name: str
    rate: float
    stream: bool
    samples: list[Sample] = field(default_factory=list)
    cuts: list[int] = field(default_factory=list)  # len(samples) at the end of each slice
    cpu_s: float = 0.0  # gateway CPU seconds over the arm
    wall_s: float = 0.0
    added: dict[float, float] = field(default_factory=dict)  # server-side histogram delta

    @property
    def ok(self) -> list[Sample]:
        return [s for s in self.samples if s.status == 200 and s.error is None]

    @property
    def errors(self) -> int:
        return len(self.samples) - len(self.ok)

    def quantile(self, attr: str, q: float) -> float:
        return quantile_of(self.samples, attr, q)

    def slice_quantiles(self, attr: str, q: float) -> list[float]:
        """The quantile of each slice's requests alone, in slice order."""
        return [
            quantile_of(self.samples[a:b], attr, q) for a, b in itertools.pairwise([0, *self.cuts])
        ]

    def add_probe(self, probe: GatewayProbe) -> None:
        self.cpu_s += probe.cpu
        for le, count in probe.added.items():
            self.added[le] = self.added.get(le, 0.0) + count

    def added_quantile(self, q: float) -> float:
        bounds = tuple(sorted(self.added))
        value = histogram_quantile(q, bounds, (self.added[b] for b in bounds)) if bounds else None
        return float("nan") if value is None else value


@dataclass(slots=True)
class Comparison:
    stream: bool
    direct: Arm
    via: Arm
    hop: Arm | None
    other: Arm | None = None  # --against: the other checkout's gateway
    load_start: float = 0.0
    load_end: float = 0.0

    def added(self, attr: str, q: float, arm: Arm | None = None) -> float:
        return (arm or self.via).quantile(attr, q) - self.direct.quantile(attr, q)


def body(i: int, stream: bool, max_tokens: int) -> bytes:
    # A unique prompt per request: no prefix-cache hits to tilt either arm.
    return orjson.dumps(
        {
            "model": VERSION,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": stream,
            "messages": [
                {"role": "user", "content": f"request {i}: tell me a short story{PROMPT_PAD[0]}"}
            ],
            **EXTRA_FIELDS,
        }
    )


async def one(
    session: aiohttp.ClientSession,
    url: str,
    data: bytes,
    headers: dict[str, str],
    stream: bool,
    sample: Sample,
) -> None:
    clock = time.perf_counter  # uvloop's loop.time() only has millisecond resolution
    t0 = clock()
    try:
        async with session.post(url, data=data, headers=headers) as resp:
            sample.status = resp.status
            if not stream or resp.status != 200:
                await resp.read()
                sample.ttft = sample.total = clock() - t0
                return
            async for line in resp.content:
                if sample.ttft is None and (
                    (b'"content":"' in line and b'"content":""' not in line)
                    or b'"tool_calls":[' in line
                ):
                    sample.ttft = clock() - t0
                if line.startswith(b"data: [DONE]"):
                    break
                if line.startswith(b'data: {"error"'):
                    sample.error = line[:200].decode()
            sample.total = clock() - t0
    except (aiohttp.ClientError, TimeoutError) as exc:
        sample.error = f"{type(exc).__name__}: {exc}"[:200]


async def offer(
    session: aiohttp.ClientSession,
    url: str,
    headers: dict[str, str],
    rate: float,
    duration_s: float,
    stream: bool,
    max_tokens: int,
    seed: int,
) -> list[Sample]:
    """Open loop: requests leave on a Poisson schedule whatever happened to earlier ones."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, size=int(rate * duration_s * 1.5) + 10))
    arrivals = arrivals[arrivals < duration_s]
    samples = [Sample() for _ in arrivals]
    headers = {"content-type": "application/json", **headers}
    tasks = []
    t0 = time.perf_counter()
    for i, (at, sample) in enumerate(zip(arrivals, samples, strict=True)):
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        data = body(seed * 1_000_000 + i, stream, max_tokens)
        tasks.append(asyncio.create_task(one(session, url, data, headers, stream, sample)))
    await asyncio.gather(*tasks)
    return samples


def session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=None),
        timeout=aiohttp.ClientTimeout(total=60, sock_connect=5),
    )


# -- one extra hop: a byte-forwarding proxy ------------------------------------------------


class _Upstream(asyncio.Protocol):
    def __init__(self, client: asyncio.Transport) -> None:
        self.client = client

    def data_received(self, data: bytes) -> None:
        self.client.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.client.close()


class _Client(asyncio.Protocol):
    """Forwards bytes both ways, nothing else: no parsing, no buffering beyond the socket."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.upstream: asyncio.Transport | None = None
        self.early: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        asyncio.get_running_loop().create_task(self._connect())

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            client = self.transport
            upstream, _ = await loop.create_connection(
                lambda: _Upstream(client),  # type: ignore[arg-type]
                "127.0.0.1",
                self.target,
            )
        except OSError:
            self.transport.close()
            return
        self.upstream = upstream
        for data in self.early:
            upstream.write(data)
        self.early.clear()

    def data_received(self, data: bytes) -> None:
        if self.upstream is None:
            self.early.append(data)
        else:
            self.upstream.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.upstream is not None:
            self.upstream.close()


async def forward(listen: int, target: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Client(target), "127.0.0.1", listen)
    print("FORWARDING", flush=True)
    await server.serve_forever()


class Hop:
    """The forwarder as its own process (its own core time, like the gateway's)."""

    def __init__(self, target_url: str) -> None:
        self.port = cluster.free_port()
        target = int(target_url.rsplit(":", 1)[1])
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.gateway_overhead", "--forward", str(self.port),
             str(target)],
            cwd=cluster.ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != b"FORWARDING":
            self.stop()
            raise RuntimeError("the forwarder did not start")
        self.base_url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


# -- measuring the gateway ------------------------------------------------------------------


def process_tree(pid: int) -> list[int]:
    pids = [pid]
    with contextlib.suppress(OSError):
        for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
            pids += process_tree(int(child))
    return pids


def cpu_seconds(pids: Sequence[int]) -> float:
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / os.sysconf("SC_CLK_TCK")


def added_buckets(base_url: str) -> dict[float, float]:
    return bucket_sums(httpx.get(base_url + "/metrics", timeout=10).text, ADDED)


class GatewayProbe:
    """CPU and server-side histogram deltas of a gateway across measured slices."""

    def __init__(self, gw: cluster.Gateway) -> None:
        self.gw = gw
        self.pids = process_tree(gw.proc.pid)

    def __enter__(self) -> GatewayProbe:
        # The scrape before the CPU reading: rendering /metrics is not a request's cost.
        self.hist0 = added_buckets(self.gw.base_url)
        self.cpu0 = cpu_seconds(self.pids)
        return self

    def __exit__(self, *exc: object) -> None:
        self.cpu = cpu_seconds(self.pids) - self.cpu0
        hist1 = added_buckets(self.gw.base_url)
        self.added = {le: hist1[le] - self.hist0.get(le, 0.0) for le in hist1}


@dataclass(slots=True)
class Leg:
    """One arm of an interleaved comparison: where its requests go, and the gateway whose
    CPU and own-time histogram are read around each of its slices (none: not a gateway)."""

    arm: Arm
    url: str
    headers: dict[str, str]
    gw: cluster.Gateway | None = None


@dataclass(frozen=True, slots=True)
class Other:
    """--against: the other checkout's gateway and the key its read model holds."""

    gw: cluster.Gateway
    auth: dict[str, str]


async def interleaved(
    s: aiohttp.ClientSession,
    direct_url: str,
    gw: cluster.Gateway,
    auth: dict[str, str],
    args: argparse.Namespace,
    stream: bool,
    hop: Hop | None = None,
    other: Other | None = None,
) -> Comparison:
    """The arms in turn slice by slice, each slice the same Poisson schedule (same seed), so
    drift and noise weigh on all alike: direct, hop, gateway then the reverse order; with
    ``other``, direct, this and the other gateway through all six orders in turn, so that
    each is first, second and last equally often."""
    mode = "SSE" if stream else "JSON"
    cmp = Comparison(
        stream=stream,
        direct=Arm(f"{mode} direct", args.rate, stream),
        via=Arm(f"{mode} via gateway", args.rate, stream),
        hop=Arm(f"{mode} one extra hop", args.rate, stream) if hop is not None else None,
        other=Arm(f"{mode} via the other gateway", args.rate, stream) if other else None,
        load_start=os.getloadavg()[0],
    )
    path = "/v1/chat/completions"
    legs = [Leg(cmp.direct, direct_url, {})]
    if hop is not None and cmp.hop is not None:
        legs.append(Leg(cmp.hop, hop.base_url + path, {}))
    legs.append(Leg(cmp.via, gw.base_url + path, auth, gw))
    if other is not None and cmp.other is not None:
        legs.append(Leg(cmp.other, other.gw.base_url + path, other.auth, other.gw))
    orders = (
        list(itertools.permutations(legs))
        if other is not None
        else [legs, legs[::-1]]
    )  # fmt: skip
    for k in range(args.slices):
        for leg in orders[k % len(orders)]:
            started = time.perf_counter()
            probe = GatewayProbe(leg.gw) if leg.gw is not None else None
            with probe or contextlib.nullcontext():
                leg.arm.samples += await offer(
                    s, leg.url, leg.headers, args.rate, args.slice_s, stream, args.max_tokens,
                    seed=2 * k + 1,
                )  # fmt: skip
            leg.arm.wall_s += time.perf_counter() - started
            leg.arm.cuts.append(len(leg.arm.samples))
            if probe is not None:
                leg.arm.add_probe(probe)
    cmp.load_end = os.getloadavg()[0]
    return cmp


def seed(redis_url: str, replica_url: str, tools: bool = False) -> str:
    client = redis.Redis.from_url(redis_url)
    limit = schema.LimitRecord(
        rpm=10_000_000,
        tpm=10_000_000_000,
        max_context=8192,
        max_output=1024,
        kv_seconds_cap=10_000_000,
        reserved_kv=0,
    )
    tenant = schema.TenantRecord(
        tenant_id=TENANT,
        name=TENANT,
        plan="standard",
        admission_class="standard",
        suspended=False,
        limits={FAMILY: limit},
    )
    version = schema.ModelVersionRecord(
        version=VERSION,
        family=FAMILY,
        context_length=131_072,
        kv_bytes_per_token=128 * 1024,
        tpot_target_ms=50,
        kv_capacity_tokens=440_000,
        replicas=(schema.ReplicaRecord("r0", replica_url, "shared"),),
        supports_tools=tools,
        tool_call_parser="llama3_json" if tools else "",
    )
    catalog = schema.Catalog(families={FAMILY: VERSION}, versions={VERSION: version})
    seed_tenant = cluster.TenantSeed(tenant, cluster.api_key_for(TENANT))
    cluster.seed_read_model(client, [seed_tenant], catalog)
    client.close()
    return seed_tenant.secret


# -- report -------------------------------------------------------------------------------


def ms(value: float) -> str:
    return "n/a" if value != value else f"{value * 1000:.2f}"  # noqa: PLR0124 - NaN check


def per_request(arm: Arm) -> str:
    return f"{arm.cpu_s / max(1, len(arm.ok)) * 1000:.2f} ms"


TARGET_P50_MS = 2.0
TARGET_P99_MS = 10.0


def ratio(via: float, direct: float) -> str:
    return "n/a" if via != via or direct != direct or direct <= 0 else f"{via / direct:.2f}×"  # noqa: PLR0124


def heading(
    args: argparse.Namespace, title: str, took_s: float, load: tuple[float, float]
) -> list[str]:
    """The title, the command as run, the machine and its load."""
    command = shlex.join(["python", "-m", "bench.gateway_overhead", *args.argv])
    return [
        f"# {title}" + (": a tool-calling request" if args.tools else ""),
        "",
        f"Command: `{command}` (took {took_s:.0f} s). Machine: "
        f"{os.cpu_count()} cores, {platform.python_implementation()} "
        f"{platform.python_version()}; 1-minute load average {load[0]:.1f} at the start, "
        f"{load[1]:.1f} at the end (other work on the machine shares its cores).",
        "",
    ]


def render(
    args: argparse.Namespace,
    comparisons: dict[int, list[Comparison]],
    sweep: list[Arm],
    sustained: float | None,
    limit_found: bool,
    took_s: float,
    load: tuple[float, float],
) -> str:
    lines = [
        *heading(args, "Gateway overhead", took_s, load),
        f"One emulated replica (`{PROFILE}`, `--speed 1`: real-time token pacing, "
        f"{args.max_tokens} output tokens per request with `ignore_eos`), loaded straight, "
        "through a byte-forwarding TCP proxy (the floor of one extra hop on this machine) and "
        "through `python -m gateway` in front of it with API-key auth, validation, admission "
        "(quota in Redis, routing), relay and a usage event per request to the embedded "
        "Kafka-compatible broker through the fsync'd spool. Open-loop Poisson arrivals; the "
        f"arms alternate in {args.slices} slices of {args.slice_s:.0f} s each (order reversed "
        "every slice), every arm replaying the same arrival schedule.",
        "",
        "Client side: via the gateway − direct, per quantile, and via ÷ direct (the same "
        "run's baseline). Server side: the gateway's own time in each request "
        "(`fairway_gateway_added_seconds`: before the upstream send, plus first token — or, "
        "for JSON, the end — to the client's socket); the client side also pays the extra "
        "loopback hop and the waits for the event loop and for a core on a machine this busy.",
        "",
        "CPU per request is the gateway processes' user+system CPU over the requests they "
        "served; it moves with the machine's other load. Where it goes, and two commits "
        "compared side by side in one sitting: `python -m bench.gateway_profile --against "
        "DIR` ([gateway_cpu_trace.md](gateway_cpu_trace.md)).",
        "",
        "## Targets: added time to first token at 200 streaming requests/s",
        "",
        f"p50 ≤ {TARGET_P50_MS:.0f} ms and p99 ≤ {TARGET_P99_MS:.0f} ms, client side.",
        "",
        "| gateway | added TTFT p50 | p99 | of which one extra hop (p50 / p99) | server-side "
        "own time p50 / p99 | load average | met? |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for workers, cmps in comparisons.items():
        for c in cmps:
            if not c.stream:
                continue
            p50, p99 = c.added("ttft", 0.5), c.added("ttft", 0.99)
            hop = (
                f"{ms(c.hop.quantile('ttft', 0.5) - c.direct.quantile('ttft', 0.5))} / "
                f"{ms(c.hop.quantile('ttft', 0.99) - c.direct.quantile('ttft', 0.99))}"
                if c.hop is not None
                else "n/a"
            )
            met = [
                f"p50 {'yes' if p50 * 1000 <= TARGET_P50_MS else 'no'}",
                f"p99 {'yes' if p99 * 1000 <= TARGET_P99_MS else 'no'}",
            ]
            lines.append(
                f"| `--workers {workers}` | {ms(p50)} ms | {ms(p99)} ms | {hop} ms | "
                f"{ms(c.via.added_quantile(0.5))} / {ms(c.via.added_quantile(0.99))} ms | "
                f"{c.load_start:.1f} → {c.load_end:.1f} | {', '.join(met)} |"
            )
    for workers, cmps in comparisons.items():
        lines += comparison(args, workers, cmps)
    lines += sweep_section(args, sweep, sustained, limit_found)
    return "\n".join(lines) + "\n"


def comparison(args: argparse.Namespace, workers: int, cmps: list[Comparison]) -> list[str]:
    lines = [
        "",
        f"## Added latency at {args.rate:.0f} requests/s, gateway `--workers {workers}`",
        "",
        "| mode | measure | direct (ms) | one extra hop (ms) | via gateway (ms) | "
        "added by the gateway (ms) | via ÷ direct |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for c in cmps:
        measures = [("ttft", "time to first token")] if c.stream else []
        measures.append(("total", "end of stream" if c.stream else "whole JSON response"))
        for attr, label in measures:
            for q, qn in ((0.5, "p50"), (0.99, "p99")):
                d, g = c.direct.quantile(attr, q), c.via.quantile(attr, q)
                h = ms(c.hop.quantile(attr, q)) if c.hop is not None else "—"
                lines.append(
                    f"| {'SSE' if c.stream else 'JSON'} | {label} {qn} | {ms(d)} | {h} "
                    f"| {ms(g)} | **{ms(g - d)}** | {ratio(g, d)} |"
                )
    lines += [
        "",
        "| mode | requests (direct / hop / via) | errors (direct / hop / via) | server-side "
        "own time p50 | p99 | gateway CPU per request | load average |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for c in cmps:
        hop_n = str(len(c.hop.samples)) if c.hop is not None else "—"
        hop_e = str(c.hop.errors) if c.hop is not None else "—"
        lines.append(
            f"| {'SSE' if c.stream else 'JSON'} | {len(c.direct.samples)} / {hop_n} / "
            f"{len(c.via.samples)} | {c.direct.errors} / {hop_e} / {c.via.errors} | "
            f"{ms(c.via.added_quantile(0.5))} ms | {ms(c.via.added_quantile(0.99))} ms | "
            f"{per_request(c.via)} | {c.load_start:.1f} → {c.load_end:.1f} |"
        )
    return lines


def sweep_section(
    args: argparse.Namespace, sweep: list[Arm], sustained: float | None, limit_found: bool
) -> list[str]:
    lines = [
        "",
        "## Highest streaming rate one gateway worker sustains",
        "",
        f"`--workers 1`, rising offered rate, {args.sweep_s:.0f} s per step; a step passes "
        f"while the client-side p99 time to first token through the gateway stays ≤ "
        f"{TTFT_LIMIT_S * 1000:.0f} ms with no errors.",
        "",
        "| offered req/s | completed | errors | TTFT p50 (ms) | TTFT p99 (ms) | server-side "
        "added p99 (ms) | CPU per request | worker CPU busy |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    lines.extend(
        f"| {arm.rate:.0f} | {len(arm.ok)} | {arm.errors} | {ms(arm.quantile('ttft', 0.5))} "
        f"| {ms(arm.quantile('ttft', 0.99))} | {ms(arm.added_quantile(0.99))} "
        f"| {per_request(arm)} | {arm.cpu_s / max(arm.wall_s, 1e-9) * 100:.0f} % |"
        for arm in sweep
    )
    if not sustained:
        verdict = "No step passed."
    elif limit_found:
        verdict = (
            f"**Sustained: {sustained:.0f} streaming requests/s per worker** (the last step "
            f"that passed; the next, {sustained + args.sweep_step:.0f}/s, did not)."
        )
    else:
        verdict = (
            f"**Sustained: at least {sustained:.0f} streaming requests/s per worker** (the "
            "run's time budget ended before any step failed)."
        )
    return [*lines, "", verdict]


# -- report: --against ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Spread:
    """This gateway − the other, slice by slice (the direct arm cancels out): how far the
    run's noise moves the comparison."""

    diffs: list[float]  # seconds, slice order; slices where either side had no sample left out

    @classmethod
    def of(cls, this: Arm, other: Arm, attr: str, q: float) -> Spread:
        pairs = zip(this.slice_quantiles(attr, q), other.slice_quantiles(attr, q), strict=True)
        return cls([a - b for a, b in pairs if a == a and b == b])  # noqa: PLR0124 - NaNs out

    def interval(self, level: float = 0.95, resamples: int = 4000) -> tuple[float, float]:
        """Bootstrap interval of the mean difference, the slices resampled."""
        if len(self.diffs) < 2:
            return math.nan, math.nan
        d = np.asarray(self.diffs)
        means = d[np.random.default_rng(0).integers(0, len(d), (resamples, len(d)))].mean(axis=1)
        tail = (1 - level) / 2 * 100
        return percentile(means, tail), percentile(means, 100 - tail)

    def cells(self) -> str:
        """``median (min … max) | [low, high] | k of n`` for a table row."""
        if not self.diffs:
            return "n/a | n/a | n/a"
        low, high = self.interval()
        higher = sum(1 for d in self.diffs if d > 0)
        return (
            f"{sms(percentile(self.diffs, 50))} ({sms(min(self.diffs))} … "
            f"{sms(max(self.diffs))}) | [{sms(low)}, {sms(high)}] | "
            f"{higher} of {len(self.diffs)}"
        )


def sms(value: float) -> str:
    """Signed milliseconds."""
    return "n/a" if value != value else f"{value * 1000:+.2f}"  # noqa: PLR0124 - NaN check


def ab_rows(c: Comparison, measures: Sequence[tuple[str, str]]) -> list[str]:
    assert c.other is not None
    rows = []
    for attr, label in measures:
        for q, qn in ((0.5, "p50"), (0.99, "p99")):
            this, other = c.added(attr, q), c.added(attr, q, c.other)
            rows.append(
                f"| {'SSE' if c.stream else 'JSON'} | {label} {qn} | "
                f"{ms(c.direct.quantile(attr, q))} | {ms(this)} | {ms(other)} | "
                f"**{sms(this - other)}** | {Spread.of(c.via, c.other, attr, q).cells()} |"
            )
    return rows


AB_HEADER = [
    "| mode | measure | direct (ms) | this: added (ms) | other: added (ms) | this − other (ms) "
    "| per slice: median (min … max) | 95 % interval of the slices' mean | this higher in |",
    "|---|---|---:|---:|---:|---:|---:|---:|---:|",
]


def render_ab(
    args: argparse.Namespace,
    comparisons: dict[int, list[Comparison]],
    took_s: float,
    load: tuple[float, float],
) -> str:
    lines = [
        *heading(args, "Gateway overhead, A/B", took_s, load),
        f"- **this**: the tree the command ran from, `{cluster.describe_tree(cluster.ROOT)}`;",
        f"- **other**: `{args.label}`, from `{args.against}`, run with its own code, its read "
        "model written by its own `bench.gateway_overhead.seed` into its own Redis DB.",
        "",
        f"One emulated replica (`{PROFILE}`, `--speed 1`, {args.max_tokens} output tokens per "
        "request with `ignore_eos`) loaded straight and through each gateway (same "
        "`--workers`, same embedded Redis and broker, usage through the fsync'd spool). "
        f"Open-loop Poisson arrivals at {args.rate:.0f} requests/s; the three arms take turns "
        f"in {args.slices} slices of {args.slice_s:g} s each, going through the six orders of "
        "the three in turn (each arm first, second and last alike every six slices), every "
        "arm replaying the slice's arrival schedule.",
        "",
        "Added = via that gateway − direct, per quantile, over all slices. **this − other** "
        "is the difference of the two added figures. The same difference taken over each "
        "slice's requests alone shows how much the machine's noise moves it: its median and "
        "range over the slices, a bootstrap 95 % interval of its mean (slices resampled), and "
        "in how many slices this gateway was the slower. A difference whose interval holds "
        "zero, or that goes either way from slice to slice, is not a change this run can "
        "resolve. No extra-hop arm and no per-worker rate sweep here: the normal run "
        "(without `--against`) has them.",
        "",
        f"## Summary: added time to first token at {args.rate:.0f} streaming requests/s",
        "",
        "| gateway | this: added p50 / p99 (ms) | other: added p50 / p99 (ms) | this − other "
        "p50 / p99 (ms) | per slice, this − other p50: median (min … max) | 95 % interval "
        "of the slices' mean | this higher in |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    streams = [(w, c) for w, cmps in comparisons.items() for c in cmps if c.stream]
    lines += [ab_summary(workers, c) for workers, c in streams]
    lines += [row for w, cmps in comparisons.items() for row in ab_comparison(args, w, cmps)]
    return "\n".join(lines) + "\n"


def ab_summary(workers: int, c: Comparison) -> str:
    assert c.other is not None
    this = [c.added("ttft", q) for q in (0.5, 0.99)]
    other = [c.added("ttft", q, c.other) for q in (0.5, 0.99)]
    return (
        f"| `--workers {workers}` | {ms(this[0])} / {ms(this[1])} | {ms(other[0])} / "
        f"{ms(other[1])} | **{sms(this[0] - other[0])}** / {sms(this[1] - other[1])} | "
        f"{Spread.of(c.via, c.other, 'ttft', 0.5).cells()} |"
    )


def ab_comparison(args: argparse.Namespace, workers: int, cmps: list[Comparison]) -> list[str]:
    lines = ["", f"## `--workers {workers}`, {args.rate:.0f} requests/s", "", *AB_HEADER]
    for c in cmps:
        measures = [("ttft", "time to first token")] if c.stream else []
        measures.append(("total", "end of stream" if c.stream else "whole JSON response"))
        lines += ab_rows(c, measures)
    lines += [
        "",
        "| mode | requests (direct / this / other) | errors (direct / this / other) | "
        "server-side own time p50, this / other | p99, this / other | gateway CPU per "
        "request, this / other | load average |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for c in cmps:
        assert c.other is not None
        d, t, o = c.direct, c.via, c.other
        lines.append(
            f"| {'SSE' if c.stream else 'JSON'} | {len(d.samples)} / {len(t.samples)} / "
            f"{len(o.samples)} | {d.errors} / {t.errors} / {o.errors} | "
            f"{ms(t.added_quantile(0.5))} / {ms(o.added_quantile(0.5))} ms | "
            f"{ms(t.added_quantile(0.99))} / {ms(o.added_quantile(0.99))} ms | "
            f"{per_request(t)} / {per_request(o)} | {c.load_start:.1f} → {c.load_end:.1f} |"
        )
    for c in cmps:
        if c.stream and c.other is not None:
            diffs = ", ".join(sms(v) for v in Spread.of(c.via, c.other, "ttft", 0.5).diffs)
            lines += ["", f"This − other, TTFT p50 per slice (ms, in slice order): {diffs}."]
    return lines


# -- main ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Testbed:
    redis_url: str
    env: dict[str, str]  # the gateways' extra environment (the broker's address)
    workdir: Path
    replica: SpawnedEmulator


@contextlib.contextmanager
def testbed(tools: bool) -> Iterator[Testbed]:
    """Embedded Redis and broker, and one emulated replica (tool calling with ``tools``)."""
    services = EmbeddedServices()
    try:
        redis_url = services.start_redis()
        env = {"KAFKA_BOOTSTRAP": services.start_kafka()}
        tool_flags = (
            {"enable_auto_tool_choice": True, "tool_call_parser": "llama3_json"} if tools else {}
        )
        with spawn_emulator(
            PROFILE,
            VERSION,
            1.0,
            log_level="error",
            extra_args=platform_replica_args(),
            **tool_flags,
        ) as replica:
            yield Testbed(redis_url, env, cluster.workdir(), replica)
    finally:
        services.stop()


async def compare_all(
    bed: Testbed,
    auth: dict[str, str],
    args: argparse.Namespace,
    hop: Hop | None = None,
    other: cluster.Checkout | None = None,
) -> dict[int, list[Comparison]]:
    """Per ``--workers`` setting, SSE then JSON, interleaved (see ``interleaved``)."""
    direct_url = bed.replica.base_url + "/v1/chat/completions"
    comparisons: dict[int, list[Comparison]] = {}
    for workers in args.workers:
        gateways = [cluster.start_gateway(bed.redis_url, workers, bed.env, bed.workdir)]
        try:
            peer = None
            if other is not None:
                gateways.append(other.start_gateway(workers, bed.env, bed.workdir))
                peer = Other(gateways[-1], {"authorization": f"Bearer {other.key}"})
            async with session() as s:
                # Warm every path (connections, caches, first-touch costs).
                warm = [(direct_url, {}), (gateways[0].base_url + "/v1/chat/completions", auth)]
                if hop is not None:
                    warm.append((hop.base_url + "/v1/chat/completions", {}))
                if peer is not None:
                    warm.append((peer.gw.base_url + "/v1/chat/completions", peer.auth))
                for url, headers in warm:
                    await offer(s, url, headers, 50, min(1.0, args.slice_s), True, 4, seed=99)
                cmps = []
                for stream in (True, False):
                    arms = ["direct", "one extra hop" if hop and stream else "", "via the gateway",
                            "via the other checkout's gateway" if peer else ""]  # fmt: skip
                    print(
                        f"--workers {workers}, {'SSE' if stream else 'JSON'} at "
                        f"{args.rate:.0f} req/s: {', '.join(a for a in arms if a)}, in turn",
                        flush=True,
                    )
                    cmps.append(
                        await interleaved(
                            s, direct_url, gateways[0], auth, args, stream,
                            hop=hop if stream else None, other=peer,
                        )
                    )  # fmt: skip
                comparisons[workers] = cmps
        finally:
            for gw in gateways:
                gw.stop()
    return comparisons


async def sweep_one_worker(
    bed: Testbed, auth: dict[str, str], args: argparse.Namespace, started: float
) -> tuple[list[Arm], float | None, bool]:
    """Rising streaming rates through one worker until the TTFT p99 limit or an error."""
    one = cluster.start_gateway(bed.redis_url, 1, bed.env, bed.workdir)
    via_url = one.base_url + "/v1/chat/completions"
    sweep: list[Arm] = []
    sustained = None
    limit_found = False
    try:
        async with session() as s:
            await offer(s, via_url, auth, 50, 1.0, True, 4, seed=98)
            rate = args.sweep_start
            while rate <= args.sweep_max and time.perf_counter() - started < args.budget_s:
                print(f"sweep: {rate:.0f} req/s through one worker", flush=True)
                arm = Arm(f"sweep {rate:.0f}", rate, True)
                t0 = time.perf_counter()
                with GatewayProbe(one) as probe:
                    arm.samples = await offer(
                        s, via_url, auth, rate, args.sweep_s, True, args.max_tokens, seed=7
                    )
                arm.wall_s = time.perf_counter() - t0
                arm.add_probe(probe)
                sweep.append(arm)
                if arm.errors or arm.quantile("ttft", 0.99) > TTFT_LIMIT_S:
                    limit_found = True
                    break
                sustained = rate
                rate += args.sweep_step
    finally:
        one.stop()
    return sweep, sustained, limit_found


async def main_async(args: argparse.Namespace) -> str:
    """The report's text."""
    started = time.perf_counter()
    load_start = os.getloadavg()[0]
    with testbed(args.tools) as bed:
        bed.env.update(args.gateway_env)
        auth = {"authorization": f"Bearer {seed(bed.redis_url, bed.replica.base_url, args.tools)}"}
        if args.against is not None:
            other = cluster.Checkout.seeded(
                args.against, bed.redis_url, bed.replica.base_url, tools=args.tools
            )
            comparisons = await compare_all(bed, auth, args, other=other)
            report = render_ab(
                args, comparisons, time.perf_counter() - started, (load_start, os.getloadavg()[0])
            )
        else:
            hop = Hop(bed.replica.base_url)
            try:
                comparisons = await compare_all(bed, auth, args, hop=hop)
            finally:
                hop.stop()
            sweep, sustained, limit_found = await sweep_one_worker(bed, auth, args, started)
            report = render(
                args,
                comparisons,
                sweep,
                sustained,
                limit_found,
                time.perf_counter() - started,
                (load_start, os.getloadavg()[0]),
            )
    return report


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.gateway_overhead")
    parser.add_argument("--rate", type=float, default=200.0, help="requests/s of the comparison")
    parser.add_argument(
        "--slices",
        type=int,
        help="turns of the arms (default 8; 12 with --against: a multiple of 6 gives each "
        "of the three arms each place in the order alike)",
    )
    parser.add_argument("--slice-s", type=float, default=2.0)
    parser.add_argument(
        "--workers",
        type=lambda v: [int(w) for w in v.split(",")],
        default=[2, 1],
        help="gateway worker counts to compare, e.g. 2,1",
    )
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument(
        "--gateway-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an environment variable for every gateway, the other checkout's too "
        "(e.g. GATEWAY_ADMISSION_STRATEGY=cache_aware); repeatable",
    )
    parser.add_argument(
        "--prompt-words",
        type=int,
        default=0,
        help="words added to every prompt after its unique start (a longer prompt whose "
        "first block nobody holds)",
    )
    parser.add_argument(
        "--tools",
        action="store_true",
        help="requests declare a tool and require a call (tool-calling overhead)",
    )
    parser.add_argument("--sweep-start", type=float, default=200.0)
    parser.add_argument("--sweep-step", type=float, default=100.0)
    parser.add_argument("--sweep-max", type=float, default=1000.0)
    parser.add_argument("--sweep-s", type=float, default=5.0)
    parser.add_argument(
        "--budget-s",
        type=float,
        default=240.0,
        help="start no sweep step once the whole run has taken this long (< 5 min in all)",
    )
    parser.add_argument(
        "--against",
        type=Path,
        metavar="DIR",
        help="another checkout (git worktree add --detach DIR SHA) whose gateway to compare "
        "with this one's, interleaved in the same run; no extra-hop arm and no rate sweep",
    )
    parser.add_argument(
        "--label", help="the other checkout's name in the report (default: its HEAD commit)"
    )
    parser.add_argument(
        "--out",
        type=Path,
        help="report file (default: bench/results/gateway_overhead[_tools][_ab].md)",
    )
    parser.add_argument(
        "--forward",
        nargs=2,
        type=int,
        metavar=("LISTEN", "TARGET"),
        help=argparse.SUPPRESS,  # internal: run the one-extra-hop forwarder
    )
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    env: dict[str, str] = {}
    for item in args.gateway_env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            parser.error(f"--gateway-env {item!r}: want KEY=VALUE")
        env[key] = value
    args.gateway_env = env
    if args.prompt_words < 0:
        parser.error("--prompt-words must be at least 0")
    if args.slices is None:
        args.slices = 8 if args.against is None else 12
    if args.against is not None:
        args.against = args.against.resolve()
        if not (args.against / "gateway").is_dir():
            parser.error(f"--against {args.against}: not a checkout (no gateway/ in it)")
        args.label = args.label or cluster.describe_tree(args.against)
    if args.out is None:
        name = "gateway_overhead" + ("_tools" if args.tools else "")
        args.out = RESULTS / f"{name}{'_ab' if args.against is not None else ''}.md"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.tools:
        EXTRA_FIELDS.update(tools=BENCH_TOOLS, tool_choice="required")
    if args.prompt_words:
        PROMPT_PAD[0] = "".join(f" w{k}" for k in range(args.prompt_words))
    import uvloop

    if args.forward:
        uvloop.run(forward(*args.forward))
        return 0
    report = uvloop.run(main_async(args))
    out: Path = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report)
    print(report)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
