"""KV-cache-aware routing vs P2C: multi-turn conversations over shared system prompts, and
one tenant churning unique long prompts.

Replicas are the emulator's own ``emulator.engine.Engine`` (8B profile: paged KV, prefix
cache with schedule-time caching, chunked prefill) stepped in virtual time; the router is the
gateway's own ``gateway.admission.router.Router`` over ``gateway.admission`` policy modules
(imported, not copied), fed by a scrape every 250 ms as the gateway's scraper feeds it. Each request
carries the ``PrefixQuery`` the gateway would build (block hashes of its tokens, salted per tenant).

Workload: tenants each with a system prompt shared by their conversations; a conversation
is ``turns`` turns, each turn's prompt = the previous prompt + the model's reply + a new
user message; the next turn arrives a think time after the reply ends. Conversations start
as a Poisson process. The churn scenario adds one tenant sending unique long prompts.

Arms:

* ``P2C``: the gateway's default before this change;
* ``cache-aware``: ``strategy=cache_aware``, the index fed by the router's own dispatches;
* ``cache-aware, N gateways``: N routers (one per gateway process, requests spread over
  them round robin: per request, the worst case), each with its own dispatch-fed index;
* ``cache-aware, N gateways, per connection``: the same N routers, each request through the
  process its client's keep-alive connection was accepted by (``ClientConnections``): the
  gateway's ``--workers`` share one listening socket, so a process is chosen per connection,
  not per request;
* ``cache-aware, N gateways + KV events``: the same, each index also fed by every
  replica's KV-cache events (what the ZMQ subscriber applies);
* ``perfect affinity``: each tenant pinned to one replica (tenant i -> replica i mod n) —
  with tenants of equal size, exactly n independent single-replica runs, each conversation
  always on the replica holding its history and its system prompt: the reference share.

``python -m bench.prefix_routing`` writes bench/results/prefix_routing.md;
``--hash-cost`` measures the gateway's per-request hashing cost.
"""

from __future__ import annotations

import argparse
import heapq
import os
import random
import sys
import time
from collections.abc import Hashable
from dataclasses import dataclass, field, replace
from decimal import Decimal
from pathlib import Path

import numpy as np

from bench.sim import SimRegistry, VirtualFleet, feed, replica_records, sim_version
from bench.stats import percentile as pct
from billing.pricing import token_cost
from contracts import schema
from emulator.engine import Engine, Request, StepResult
from emulator.kv import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, get_hasher
from emulator.profiles import get_profile
from emulator.replica_flags import platform_engine_config
from gateway.admission.config import AdmissionConfig
from gateway.admission.prefix import PrefixIndex, PrefixQuery, make_query, query_from_tokens
from gateway.admission.replicas import ReplicaState
from gateway.admission.router import Router
from tenants.demo import MODELS as DEMO_MODELS

RESULTS = Path(__file__).parent / "results"
VERSION = "llama-8b-sim"
PROFILE = "llama-8b-tp1-h100"
# The 8B version's catalog prices as the demo seed writes them (USD per million tokens).
_PRICED = next(m for m in DEMO_MODELS if m.family == "llama-8b")
PRICE_PROMPT: Decimal = _PRICED.price_prompt_per_mtok
PRICE_CACHED: Decimal = _PRICED.price_cached_prompt_per_mtok
PRICE_COMPLETION: Decimal = _PRICED.price_completion_per_mtok


@dataclass(frozen=True, slots=True)
class SimConfig:
    replicas: int = 8
    tenants_per_replica: int = 2
    system_tokens: int = 2000  # per tenant, shared by its conversations
    user_tokens: tuple[int, int] = (50, 400)  # uniform per turn
    turns: int = 8
    think_s: float = 4.0  # mean, exponential
    conv_rate_per_replica: float = 0.6  # conversation starts per second per replica
    max_tokens: int = 300
    duration_s: float = 90.0
    warmup_s: float = 20.0
    scrape_s: float = 0.25
    kv_capacity_tokens: int = 120_000  # a scaled KV budget, so eviction happens in the run
    seed: int = 11
    # churn: one more tenant sending unique prompts of this many tokens at this rate
    churn_rate_per_replica: float = 0.0
    churn_tokens: int = 12_000


@dataclass(frozen=True, slots=True)
class Arm:
    label: str
    strategy: str  # "p2c" | "cache_aware" | "pinned"
    gateways: int = 1
    kv_events: bool = False
    tenant_replicas: int = 0
    tenant_cache_share: float = 0.0  # the emulator-only per-tenant share of the prefix cache
    # the conversation key (the gateway's, ``prefix.conversation_block``), else the key at
    # ``PLACEMENT_BLOCK`` the gateway used before it (a query without the first user message)
    conversation_key: bool = True
    # ``AdmissionConfig.affinity_conversation_shared``: a conversation goes where the scrape
    # says (the same in every gateway process), else (before) a process follows its own record
    conversation_shared: bool = True
    # ``affinity_conversation_first_turns``: a conversation's first turn goes to the better of
    # two (the gateway's), else (before) to its conversation's replica as every later turn does
    first_turns: bool = True
    # ``affinity_conversation_latest``: a turn follows the one before it when this process
    # placed that one (the gateway's), else (before) goes to its conversation's replica
    latest: bool = True
    # How requests reach the N gateway processes: "" per request, round robin (the worst
    # case); "pool": each client holds ``pool`` keep-alive connections, a request on a random
    # one of them; "httpx": the openai SDK's pool (``ClientConnections``)
    connections: str = ""
    pool: int = 0
    recycle: int = 0  # a connection is closed after this many requests (0: never)
    keepalive_s: float = 0.0  # an idle connection is closed after this long (0: never)
    # whose pool a request goes out on: its tenant's (an application's backend) or its
    # conversation's (a client per end user's session)
    clients: str = "tenant"


@dataclass(slots=True)
class _Connection:
    process: int
    uses: int = 0
    busy: int = 0
    idle_since: float = 0.0


class ClientConnections:
    """Clients' keep-alive connections to N gateway processes sharing one listening socket
    (``gateway/serving/supervisor.py``): the process that accepts a connection serves every
    request sent on it, so a process is drawn per connection (at random, as the kernel's
    accept queue and a load balancer's least-connections pick are, to the client), not
    per request.

    A client is a tenant (``Arm.clients``): in this workload a tenant is an application whose
    backend sends all its conversations' turns with its API key through one SDK client; or,
    the most a client can do for affinity, a conversation (an SDK client per end user's
    session). Two pool models:

    * ``pool`` > 0: ``pool`` connections per client, opened on its first request; a request
      takes a random one of them (busy or not: as HTTP/2 multiplexes, and pessimistic
      against HTTP/1.1 pools, which reuse the first idle one);
    * ``pool`` == 0 (``httpx``, the openai SDK's pool, httpcore 1.0): a request takes the
      first idle connection in the order they were opened, else opens a new one (HTTP/1.1:
      one request at a time on a connection); the SDK's limits (1,000 connections) never
      bind here.

    Either way a connection is reopened (on a fresh random process) after ``recycle``
    requests, and when it has been idle longer than ``keepalive_s`` (the SDK's
    ``keepalive_expiry`` is 5 s; the gateway's server keeps idle connections 30 s).
    """

    def __init__(
        self,
        processes: int,
        rng: random.Random,
        *,
        pool: int = 0,
        recycle: int = 0,
        keepalive_s: float = 0.0,
    ) -> None:
        self.processes = processes
        self.pool = pool
        self.recycle = recycle
        self.keepalive_s = keepalive_s
        self._rng = rng
        self._clients: dict[Hashable, list[_Connection]] = {}
        self.opened = 0
        self.requests = 0

    def _open(self) -> _Connection:
        self.opened += 1
        return _Connection(self._rng.randrange(self.processes))

    def _expired(self, conn: _Connection, now: float) -> bool:
        idle = conn.busy == 0 and self.keepalive_s > 0 and now - conn.idle_since > self.keepalive_s
        return idle or (self.recycle > 0 and conn.uses >= self.recycle)

    def acquire(self, client: Hashable, now: float) -> _Connection:
        """The connection the client's next request goes out on (``release`` it when the
        response ends)."""
        conns = self._clients.setdefault(client, [])
        if self.pool > 0:
            if not conns:
                conns.extend(self._open() for _ in range(self.pool))
            i = self._rng.randrange(self.pool)
            if self._expired(conns[i], now):
                conns[i] = self._open()
            conn = conns[i]
        else:
            conns[:] = [c for c in conns if not self._expired(c, now)]
            idle = next((c for c in conns if c.busy == 0), None)
            if idle is None:
                idle = self._open()
                conns.append(idle)
            conn = idle
        self.requests += 1
        conn.uses += 1
        conn.busy += 1
        return conn

    def release(self, conn: _Connection, now: float) -> None:
        conn.busy -= 1
        if conn.busy == 0:
            conn.idle_since = now


@dataclass(slots=True)
class Result:
    arm: Arm
    prompt: int = 0
    cached: int = 0
    completion: int = 0
    ttft: list[float] = field(default_factory=list)
    by_tenant: dict[int, list[int]] = field(default_factory=dict)  # tenant -> [prompt, cached]
    ttft_by_tenant: dict[int, list[float]] = field(default_factory=dict)
    max_occ: float = 0.0
    over_ceiling: int = 0
    rejected: int = 0
    requests: int = 0
    wall_s: float = 0.0
    index_blocks: int = 0
    connections: int = 0  # opened over the run (per-connection arms)
    connection_requests: int = 0  # sent on them, warm-up included
    # later turns (after the warm-up), and those through the process of the turn before
    later_turns: int = 0
    same_process: int = 0

    @property
    def share(self) -> float:
        return self.cached / self.prompt if self.prompt else float("nan")

    def cost(self, cached_at_cached_price: bool = True) -> Decimal:
        cached = self.cached if cached_at_cached_price else 0
        return (
            token_cost(self.prompt - cached, PRICE_PROMPT)
            + token_cost(cached, PRICE_CACHED)
            + token_cost(self.completion, PRICE_COMPLETION)
        )


def salt(tenant: int) -> str:
    return f"{tenant:064x}"


@dataclass(slots=True)
class Conversation:
    tenant: int
    turn: int
    history: list[int]  # tokens so far (prompt of the last turn + its reply)
    rng: random.Random
    first_user: tuple[int, int] | None = None  # its first user message's (start, end)
    replies: int = 0  # the model's replies in the history (the assistant turns resent)
    number: int = 0  # the conversation's, in order of start
    process: int = -1  # the gateway process its last turn went through


def event_maps(events: list[KVEvent]) -> list[dict[str, object]]:
    out: list[dict[str, object]] = []
    for e in events:
        if isinstance(e, BlockStored):
            out.append({"type": "BlockStored", "block_hashes": e.block_hashes})
        elif isinstance(e, BlockRemoved):
            out.append({"type": "BlockRemoved", "block_hashes": e.block_hashes})
        elif isinstance(e, AllBlocksCleared):
            out.append({"type": "AllBlocksCleared"})
    return out


def run_arm(cfg: SimConfig, arm: Arm) -> Result:
    started = time.perf_counter()
    profile = get_profile(PROFILE)
    n = cfg.replicas
    engine_cfg = platform_engine_config(
        kv_capacity_tokens=cfg.kv_capacity_tokens,
        enable_kv_cache_events=arm.kv_events,
        tenant_cache_share=arm.tenant_cache_share,
    )
    engines = [Engine(profile, engine_cfg, seed=cfg.seed + i) for i in range(n)]
    records = replica_records(n)
    version = sim_version(
        VERSION,
        "llama-8b",
        profile,
        records,
        kv_capacity_tokens=engines[0].kv_capacity_tokens,
        prefill_tokens_per_s=profile.prefill_tokens_per_s,
    )
    states = [ReplicaState(record=r, version=VERSION) for r in records]
    acfg = AdmissionConfig(
        strategy="cache_aware" if arm.strategy == "cache_aware" else "p2c",
        affinity_tenant_replicas=arm.tenant_replicas,
        # the gateway's own rule (gateway/config.py): new prefixes by rendezvous unless KV
        # events feed the index
        affinity_rendezvous=not arm.kv_events,
        affinity_conversation_shared=arm.conversation_shared,
        affinity_conversation_first_turns=arm.first_turns,
        affinity_conversation_latest=arm.latest,
    )
    out = Result(arm)
    ceiling = acfg.standard_max_occupancy

    def stepped(i: int, res: StepResult) -> None:
        rec = records[i]
        feed(routers, rec, res)
        for req in res.finished:
            finish(req)
        if arm.kv_events:
            events = engines[i].take_kv_events()
            if events:
                maps = event_maps(events)
                for r in routers:
                    r.index.apply_events(rec.replica_id, maps)

    def scraped(t: float) -> None:
        if t >= cfg.warmup_s:
            for s in states:
                out.max_occ = max(out.max_occ, s.kv_usage)
                out.over_ceiling += s.kv_usage > ceiling

    fleet = VirtualFleet(engines, states, cfg.scrape_s, stepped, scraped)
    routers = [
        Router(
            SimRegistry(VERSION, states),
            random.Random(cfg.seed * 31 + g),
            config=acfg,
            clock=fleet.clock,
            index=PrefixIndex(clock=fleet.clock),
        )
        for g in range(arm.gateways)
    ]

    rng = random.Random(cfg.seed)
    tenants = cfg.tenants_per_replica * n
    systems = [
        [(1 << 40) + (t << 24) + i for i in range(cfg.system_tokens)] for t in range(tenants)
    ]
    churn_tenant = tenants  # the extra tenant, when churning
    fresh = [1 << 50]

    def new_tokens(k: int) -> list[int]:
        start = fresh[0]
        fresh[0] += k
        return list(range(start, start + k))

    # event heap: (time, seq, kind, payload)
    heap: list[tuple[float, int, str, object]] = []
    seq = [0]

    def push(t: float, kind: str, payload: object) -> None:
        seq[0] += 1
        heapq.heappush(heap, (t, seq[0], kind, payload))

    t = 0.0
    while True:
        t += rng.expovariate(cfg.conv_rate_per_replica * n)
        if t >= cfg.duration_s:
            break
        tenant = rng.randrange(tenants)
        conv = Conversation(tenant, 0, list(systems[tenant]), random.Random(rng.getrandbits(32)))
        conv.number = seq[0]  # the pushes so far: one per conversation
        push(t, "turn", conv)
    if cfg.churn_rate_per_replica > 0:
        t = 0.0
        while True:
            t += rng.expovariate(cfg.churn_rate_per_replica * n)
            if t >= cfg.duration_s:
                break
            push(t, "churn", None)

    live: dict[str, tuple[Request, int, Conversation | None, float, _Connection | None]] = {}
    ids = [0]
    dispatch_turn = [0]
    conns = (
        ClientConnections(
            arm.gateways,
            random.Random(cfg.seed * 97 + 5),
            pool=arm.pool,
            recycle=arm.recycle,
            keepalive_s=arm.keepalive_s,
        )
        if arm.connections
        else None
    )

    def finish(req: Request) -> None:
        entry = live.pop(req.request_id, None)
        if entry is None:
            return
        _, tenant, conv, arrived, conn = entry
        if conns is not None and conn is not None:
            conns.release(conn, req.finish_time)
        if arrived >= cfg.warmup_s:
            cached = max(0, req.num_cached_tokens)
            out.prompt += req.prompt_len
            out.cached += cached
            out.completion += req.num_output
            bt = out.by_tenant.setdefault(tenant, [0, 0])
            bt[0] += req.prompt_len
            bt[1] += cached
            if req.ttft is not None:
                out.ttft.append(req.ttft)
                out.ttft_by_tenant.setdefault(tenant, []).append(req.ttft)
        if conv is not None and conv.turn < cfg.turns:
            conv.history = list(req.token_ids)  # prompt + the reply, as the client resends it
            conv.replies += 1
            push(req.finish_time + conv.rng.expovariate(1.0 / cfg.think_s), "turn", conv)

    def dispatch(t_at: float, tenant: int, tokens: list[int], conv: Conversation | None) -> None:
        conn = None
        if conns is not None:
            client: Hashable = tenant
            if arm.clients == "conversation" and conv is not None:
                client = ("c", conv.number)
            conn = conns.acquire(client, t_at)
        g = conn.process if conn is not None else dispatch_turn[0] % arm.gateways
        dispatch_turn[0] += 1
        if conv is not None:
            if conv.replies > 0 and t_at >= cfg.warmup_s:
                out.later_turns += 1
                out.same_process += conv.process == g
            conv.process = g
        router = routers[g]
        kv_bytes = len(tokens) * profile.kv_bytes_per_token
        query: PrefixQuery | None = None
        if arm.strategy == "cache_aware":
            first = conv.first_user if conv is not None and arm.conversation_key else None
            query = query_from_tokens(
                f"t{tenant}",
                tokens,
                salt(tenant),
                profile.block_size,
                first_user=first,
                turns=conv.replies if conv is not None else 0,
            )
        if arm.strategy == "pinned":
            replica: schema.ReplicaRecord | None = records[tenant % n]
        else:
            replica = router.choose(version, "standard", kv_bytes, prefix=query)
        if replica is None:
            if conns is not None and conn is not None:
                conns.release(conn, t_at)
            if t_at >= cfg.warmup_s:
                out.rejected += 1
            if conv is not None:  # the client retries the turn a little later
                push(t_at + 1.0, "turn", conv)
            return
        idx = int(replica.replica_id[1:])
        ids[0] += 1
        rid = f"q{ids[0]}"
        req = engines[idx].add_request(
            rid, tokens, cfg.max_tokens, priority=1, arrival_time=t_at, cache_salt=salt(tenant)
        )
        router.on_dispatch(replica, rid, kv_bytes, prefix=query)
        live[rid] = (req, tenant, conv, t_at, conn)
        if t_at >= cfg.warmup_s:
            out.requests += 1

    while heap:
        t_ev, _, kind, payload = heapq.heappop(heap)
        if t_ev >= cfg.duration_s:
            break
        fleet.run_to(t_ev)
        if kind == "turn":
            assert isinstance(payload, Conversation)
            conv = payload
            conv.turn += 1
            user = new_tokens(conv.rng.randint(*cfg.user_tokens))
            if conv.first_user is None:
                # The first user message's span. These prompts have no chat template: its
                # end is put one token early, where a templated message's end-of-turn token
                # is, so that the first turn (whose last token is never cached) can hash
                # the key's block as the templated one does.
                start = len(conv.history)
                conv.first_user = (start, start + len(user) - 1)
            dispatch(t_ev, conv.tenant, conv.history + user, conv)
        else:
            dispatch(t_ev, churn_tenant, new_tokens(cfg.churn_tokens), None)
    fleet.finish(cfg.duration_s)
    out.index_blocks = max(len(r.index) for r in routers)
    if conns is not None:
        out.connections, out.connection_requests = conns.opened, conns.requests
    out.wall_s = time.perf_counter() - started
    return out


ARMS = (
    Arm("P2C", "p2c"),
    Arm("cache-aware", "cache_aware"),
    Arm("cache-aware, 4 gateways", "cache_aware", gateways=4),
    Arm("cache-aware, 4 gateways + KV events", "cache_aware", gateways=4, kv_events=True),
    Arm("perfect affinity (tenant pinned)", "pinned"),
)


def before_after(
    one: str,
    before: str,
    after: str,
    *,
    conversation_key: bool = True,
    shared: bool = True,
    first_turns: bool = True,
    latest: bool = True,
) -> tuple[Arm, ...]:
    """1 gateway, 4 gateways, 4 gateways + KV events: each with a rule as before (the
    ``conversation_key``, ``shared``, ``first_turns`` or ``latest`` given) and as now, then
    perfect affinity."""
    arms: list[Arm] = []
    for label, gateways, events in (
        (one, 1, False),
        ("4 gateways", 4, False),
        ("4 gateways + KV events", 4, True),
    ):
        now = Arm(f"{label}, {after}", "cache_aware", gateways=gateways, kv_events=events)
        old = replace(
            now,
            conversation_key=conversation_key,
            conversation_shared=shared,
            first_turns=first_turns,
            latest=latest,
        )
        arms += [replace(old, label=f"{label}, {before} (before)"), now]
    return (*arms, Arm("perfect affinity (tenant pinned)", "pinned"))


# ``--key-arms``: the conversation key (the gateway's) against the key at ``PLACEMENT_BLOCK``
# the gateway used before it, in the same run.
KEY_ARMS = before_after("cache-aware", "key at block 3", "conversation key", conversation_key=False)
# ``--shared-arms``: a conversation placed on the scrape (``_place_conversation``, the
# gateway's default) against a process following its own record of it, in the same run.
SHARED_ARMS = before_after("1 gateway", "own record", "shared placement", shared=False)
# ``--first-arms``: a first turn to the better of its pair against its conversation's replica
FIRST_ARMS = before_after(
    "1 gateway",
    "first turn at its replica",
    "first turn better of two",
    first_turns=False,
    latest=False,
)
# ``--latest-arms``: a turn follows the one before it when this process placed that one,
# against going to its conversation's replica (both with first turns the better of two)
LATEST_ARMS = before_after("1 gateway", "conversation's replica", "latest turn", latest=False)


def connection_arms(
    pools: tuple[int, ...] = (1, 4), recycle: int = 0, keepalive_s: float = 0.0
) -> tuple[Arm, ...]:
    """``--connection-arms``: 1 gateway; 4 gateways with requests spread per request (the
    worst case); per connection with ``pools`` connections per client (a request on a random
    one) and with the openai SDK's pool (the first idle connection, 5 s keep-alive), a pool
    per tenant and one per conversation; then perfect affinity. ``recycle``/``keepalive_s``
    apply to the fixed pools."""
    each = f"{', recycled every ' + str(recycle) if recycle else ''}" + (
        f", {keepalive_s:g} s keep-alive" if keepalive_s else ""
    )
    four = Arm("4 gateways, per request", "cache_aware", gateways=4)
    return (
        Arm("1 gateway", "cache_aware"),
        four,
        *(
            replace(
                four,
                label=f"4 gateways, per connection, {k} per client{each}",
                connections="pool",
                pool=k,
                recycle=recycle,
                keepalive_s=keepalive_s,
            )
            for k in pools
        ),
        replace(
            four,
            label="4 gateways, per connection, openai SDK pool (first idle, 5 s keep-alive)",
            connections="httpx",
            keepalive_s=5.0,
        ),
        replace(
            four,
            label="4 gateways, per connection, an openai SDK pool per conversation",
            connections="httpx",
            keepalive_s=5.0,
            clients="conversation",
        ),
        Arm("perfect affinity (tenant pinned)", "pinned"),
    )


def table(runs: list[tuple[SimConfig, list[Result]]]) -> list[str]:
    lines = [
        "| replicas | routing | cached share of prompt tokens | vs perfect affinity | "
        "TTFT p50 | TTFT p95 | max replica occupancy | scrapes above 0.85 | 503 | requests "
        "| billed (cached at cached price) | same tokens, no cache discount | saved | wall |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for cfg, results in runs:
        ref = next(r for r in results if r.arm.strategy == "pinned")
        for r in results:
            lines.append(  # noqa: PERF401 - one row per arm, kept readable
                f"| {cfg.replicas} | {r.arm.label} | {r.share:.1%} | "
                f"{(r.share - ref.share) * 100:+.1f} pt | {pct(r.ttft, 50) * 1000:.0f} ms | "
                f"{pct(r.ttft, 95) * 1000:.0f} ms | {r.max_occ:.2f} | {r.over_ceiling} | "
                f"{r.rejected} | {r.requests} | ${r.cost():.4f} | ${r.cost(False):.4f} | "
                f"{1 - r.cost() / r.cost(False):.0%} | {r.wall_s:.0f} s |"
            )
    return lines


def churn_table(quiet: list[Result], loud: list[Result], churn_tenant: int) -> list[str]:
    lines = [
        "| routing | others' cached share, quiet | with churn | others' TTFT p50 / p95 quiet "
        "| with churn | churn tenant's TTFT p50 |",
        "|---|---|---|---|---|---|",
    ]
    for q, c in zip(quiet, loud, strict=True):

        def others(r: Result) -> tuple[float, list[float]]:
            p = sum(v[0] for k, v in r.by_tenant.items() if k != churn_tenant)
            h = sum(v[1] for k, v in r.by_tenant.items() if k != churn_tenant)
            tt = [x for k, v in r.ttft_by_tenant.items() if k != churn_tenant for x in v]
            return (h / p if p else float("nan")), tt

        qs, qt = others(q)
        cs, ct = others(c)
        churn_ttft = c.ttft_by_tenant.get(churn_tenant, [])
        lines.append(
            f"| {c.arm.label} | {qs:.1%} | {cs:.1%} | {pct(qt, 50) * 1000:.0f} / "
            f"{pct(qt, 95) * 1000:.0f} ms | {pct(ct, 50) * 1000:.0f} / {pct(ct, 95) * 1000:.0f} "
            f"ms | {pct(churn_ttft, 50) * 1000:.0f} ms |"
        )
    return lines


def hash_cost(samples: int = 200) -> list[str]:
    """Per-request CPU of ``make_query`` (tokenize + chain hash) by prompt length, with the
    emulator's chain hash and with vLLM's ``sha256`` (pickle) and ``sha256_cbor``."""
    algos = ("emulator", "sha256", "sha256_cbor")
    lines = [
        "| prompt tokens | " + " | ".join(f"tokenize + {a} hash (median)" for a in algos) + " |",
        "|---|" + "---|" * len(algos),
    ]
    rng = random.Random(5)
    for words in (100, 1_000, 8_000, 30_000):
        msgs = [
            {
                "role": "system",
                "content": " ".join(f"s{rng.randrange(10**6)}" for _ in range(words)),
            },
            {"role": "user", "content": "question"},
        ]
        cells = []
        for algo in algos:
            hasher = get_hasher(algo, "0")
            times = []
            for i in range(samples if words < 10_000 else 20):
                msgs[1]["content"] = f"question {i}"
                t0 = time.perf_counter()
                q = make_query("t", msgs, "s" * 64, 16, hasher=hasher)
                times.append(time.perf_counter() - t0)
            cells.append(f"{np.median(times) * 1e6:,.0f} µs")
        lines.append(f"| {q.prompt_tokens:,} | " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="2,8,44")
    ap.add_argument("--duration", type=float, default=None, help="seconds simulated per arm")
    ap.add_argument("--no-churn", action="store_true")
    ap.add_argument("--hash-cost", action="store_true", help="only the hashing cost")
    ap.add_argument(
        "--key-arms",
        action="store_true",
        help="the conversation key against the key at block 3, 1 and 4 gateways (no churn, "
        "no hashing cost)",
    )
    ap.add_argument(
        "--shared-arms",
        action="store_true",
        help="a conversation placed on the scrape alone against a process's own record, 1 and "
        "4 gateways (no churn, no hashing cost)",
    )
    ap.add_argument(
        "--first-arms",
        action="store_true",
        help="a conversation's first turn to the better of its pair against its conversation's "
        "replica, 1 and 4 gateways (no churn, no hashing cost)",
    )
    ap.add_argument(
        "--latest-arms",
        action="store_true",
        help="a turn following the one before it when this process placed that one against "
        "its conversation's replica, 1 and 4 gateways (no churn, no hashing cost)",
    )
    ap.add_argument(
        "--connection-arms",
        action="store_true",
        help="4 gateways reached per request (the worst case) against per connection "
        "(clients' keep-alive pools), with 1 gateway and perfect affinity (no churn, no "
        "hashing cost)",
    )
    ap.add_argument(
        "--pools", default="1,4", help="--connection-arms: connections per client, comma list"
    )
    ap.add_argument(
        "--recycle",
        type=int,
        default=0,
        help="--connection-arms: a pool's connection is reopened after this many requests",
    )
    ap.add_argument(
        "--keepalive",
        type=float,
        default=0.0,
        help="--connection-arms: a pool's connection idle this many seconds is reopened",
    )
    ap.add_argument("--seed", type=int, default=None, help="the workload's and routers' seed")
    ap.add_argument("--system-tokens", type=int, default=None, help="each tenant's system prompt")
    ap.add_argument("--out", default=str(RESULTS / "prefix_routing.md"))
    args = ap.parse_args(argv)
    command = "python -m bench.prefix_routing " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    if args.hash_cost:
        print("\n".join(hash_cost()))
        return 0
    load = os.getloadavg()
    # a before/after comparison (``before_after``) when one is asked for, else every arm
    comparisons = (
        (args.key_arms, KEY_ARMS),
        (args.shared_arms, SHARED_ARMS),
        (args.first_arms, FIRST_ARMS),
        (args.latest_arms, LATEST_ARMS),
        (
            args.connection_arms,
            connection_arms(
                tuple(int(k) for k in args.pools.split(",")), args.recycle, args.keepalive
            ),
        ),
    )
    arms = next((chosen for asked, chosen in comparisons if asked), ARMS)
    runs: list[tuple[SimConfig, list[Result]]] = []
    for size in (int(x) for x in args.sizes.split(",")):
        cfg = SimConfig(replicas=size)
        if args.duration:
            cfg = replace(cfg, duration_s=args.duration)
        if args.seed is not None:
            cfg = replace(cfg, seed=args.seed)
        if args.system_tokens is not None:
            cfg = replace(cfg, system_tokens=args.system_tokens)
        results = []
        for arm in arms:
            if size < 4 and arm.gateways > 1:
                arm = replace(arm, gateways=2, label=arm.label.replace("4 gateways", "2 gateways"))
            r = run_arm(cfg, arm)
            opened = f", {r.connections} connections" if arm.connections else ""
            print(
                f"{size} replicas, {arm.label}: share {r.share:.1%}{opened}, {r.wall_s:.0f} s",
                flush=True,
            )
            results.append(r)
        runs.append((cfg, results))
    cfg0 = runs[0][0]
    lines = [
        "# KV-cache-aware routing vs P2C (virtual time, emulator engines)",
        "",
        f"Command: `{command}`; machine load average at start {load[0]:.1f} (2 cores, shared; "
        "virtual time, so load changes the wall time only).",
        "",
        f"Per replica: {cfg0.tenants_per_replica} tenants, each with a {cfg0.system_tokens:,}"
        f"-token system prompt; {cfg0.conv_rate_per_replica:g} conversation starts/s of "
        f"{cfg0.turns} turns (user messages {cfg0.user_tokens[0]}-{cfg0.user_tokens[1]} tokens, "
        f"replies up to {cfg0.max_tokens}, think time {cfg0.think_s:g} s mean). Replicas: "
        f"`{PROFILE}` with a {cfg0.kv_capacity_tokens:,}-token KV budget (scaled so that "
        "eviction happens within the run), prefix caching on, platform flags. "
        f"{cfg0.duration_s:g} s simulated per arm, requests arriving in the first "
        f"{cfg0.warmup_s:g} s excluded. Cost: the demo catalog's 8B prices (prompt "
        f"${PRICE_PROMPT}, cached prompt ${PRICE_CACHED}, completion ${PRICE_COMPLETION} per "
        "million tokens) through `billing.pricing.token_cost`, unrounded; the second cost "
        "column bills every prompt token at the prompt price (a replica without "
        "`--enable-prompt-tokens-details`).",
        "",
        *table(runs),
        "",
    ]
    if args.connection_arms:
        lines += [
            "| replicas | routing | connections opened | requests per connection | later turns "
            "through the process of the turn before |",
            "|---|---|---|---|---|",
            *(
                f"| {c.replicas} | {r.arm.label} | {r.connections or '—'} | "
                + (f"{r.connection_requests / r.connections:.1f}" if r.connections else "—")
                + f" | {r.same_process / r.later_turns if r.later_turns else float('nan'):.0%} |"
                for c, results in runs
                for r in results
                if r.arm.gateways > 1
            ),
            "",
        ]
    if arms is not ARMS:
        Path(args.out).write_text("\n".join(lines))
        print("\n".join(lines))
        return 0
    if not args.no_churn:
        size = 8
        base = SimConfig(replicas=size)
        if args.duration:
            base = replace(base, duration_s=args.duration)
        loud_cfg = replace(base, churn_rate_per_replica=0.15)
        churn_arms = (
            Arm("P2C", "p2c"),
            Arm("cache-aware", "cache_aware"),
            Arm("cache-aware, tenant placement (2 replicas)", "cache_aware", tenant_replicas=2),
            Arm("P2C + replica tenant share 0.25", "p2c", tenant_cache_share=0.25),
            Arm("cache-aware + replica tenant share 0.25", "cache_aware", tenant_cache_share=0.25),
        )
        quiet = [run_arm(base, a) for a in churn_arms]
        loud = [run_arm(loud_cfg, a) for a in churn_arms]
        lines += [
            "## Churn: one tenant floods unique long prompts",
            "",
            f"{size} replicas, the workload above plus one tenant sending unique "
            f"{loud_cfg.churn_tokens:,}-token prompts at {loud_cfg.churn_rate_per_replica * size:g}"
            "/s (never reused). The other tenants' cached share and TTFT against the same run "
            "without the churning tenant.",
            "",
            *churn_table(quiet, loud, base.tenants_per_replica * size),
            "",
        ]
    lines += ["## Gateway cost of hashing a request", "", *hash_cost(), ""]
    Path(args.out).write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
