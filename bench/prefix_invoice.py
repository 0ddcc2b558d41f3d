"""Billing shows cache-aware routing: the same conversations, routed by P2C for one tenant and
by cache-aware routing for another, each tenant's invoice drafted from what was metered.

The workload is ``bench.prefix_gateway``'s: conversations of 8 turns, each turn resending the
history plus a new user message, over two shared ~2,700-token system prompts (that bench's
two tenants' prompts; here one tenant sends both), all conversations concurrent. Every
request carries the same ``seed`` and ``ignore_eos``, so the emulator's replies depend on the
prompt alone: both arms send exactly the same prompts and receive replies of exactly the same
length, and only where the prompts were served from differs.

Each arm, one after the other: fresh emulated replicas (``python -m emulator`` with the
platform flags: prefix caching on, ``--enable-prompt-tokens-details``; empty caches),
registered in the control plane's catalog (``seed_demo --replicas``) and pushed to Redis, a
tenant of its own (its own ``cache_salt``, so no arm can hit the other's cache), one gateway
process with ``GATEWAY_ADMISSION_STRATEGY`` = ``p2c`` or ``cache_aware`` sending its usage
events to a Kafka-protocol broker (Tansu). The real consumer (``metering.consumer``) writes
``request_log`` and ``usage``; ``billing.services.invoice_draft_build`` then drafts each
tenant's invoice at the catalog's prices, cached prompt tokens at the cached price.

The model is the demo catalog's 70B (per million tokens: prompt $0.60, cached prompt $0.15,
completion $0.80). At the 8B's prices, a tenth of those, the difference on a workload this
size is about a cent or less: below what an invoice rounded to cents can show.

``python -m bench.prefix_invoice [--sizes 2,8]`` writes bench/results/prefix_invoice.md. The
pieces are shared with tests/metering/test_cache_invoice.py.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import os
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import TYPE_CHECKING

from bench import cluster
from bench.prefix_gateway import Turn, conversations_over, system_prompts
from emulator.profiles import get_profile

if TYPE_CHECKING:
    from billing.models import Invoice
    from tenants.demo import DemoPlan
    from tenants.models import Tenant

RESULTS = Path(__file__).parent / "results"
DB_NAME = "fairway_prefix_invoice"
FAMILY = "llama-70b"
VERSION = "llama-70b-2026-05"  # the demo catalog's 70B (tenants/demo.py)
PROFILE = "llama-70b-tp4-h100"
ARMS = (("P2C", "p2c"), ("cache-aware", "cache_aware"))
REQUEST_SEED = 7


def plan() -> DemoPlan:
    """The arms' plan: standard class, limits no arm reaches (the demo standard plan's four
    concurrent requests would refuse most of the conversations), no base fee."""
    from tenants.demo import DemoPlan

    return DemoPlan(
        "cache-invoice",
        "Cache invoice bench",
        "standard",
        max_context=32_768,
        max_output=1024,
        rpm={FAMILY: 100_000},
        tpm={FAMILY: 100_000_000},
        concurrent_max_requests=256,
    )


@dataclass(frozen=True, slots=True)
class Workload:
    conversations: int
    turns: int = 8
    systems: int = 2

    async def run(self, base_url: str, secret: str) -> list[list[Turn]]:
        return await conversations_over(
            base_url,
            [{"authorization": f"Bearer {secret}"}],
            FAMILY,
            system_prompts(self.systems),
            self.conversations,
            self.turns,
            request_seed=REQUEST_SEED,
            ignore_eos=True,
        )


@dataclass(slots=True)
class Arm:
    label: str
    strategy: str
    tenant: Tenant
    conversations: list[list[Turn]]
    wall_s: float = 0.0
    invoices: list[Invoice] = field(default_factory=list)

    @property
    def turns(self) -> list[Turn]:
        return [t for c in self.conversations for t in c]

    def received(self) -> dict[str, int]:
        """What the clients were told, summed: prompt, cached and completion tokens."""
        turns = self.turns
        return {
            "prompt": sum(t.prompt_tokens for t in turns),
            "cached": sum(t.cached_tokens for t in turns),
            "completion": sum(t.completion_tokens for t in turns),
        }

    @property
    def total(self) -> Decimal:
        return sum((i.total for i in self.invoices), Decimal(0))


@contextlib.contextmanager
def fresh_replicas(count: int, speed: float, workdir: Path) -> Iterator[list[str]]:
    """``count`` emulated 70B replicas with empty prefix caches: their base URLs."""
    profile = get_profile(PROFILE)
    profile_file = cluster.write_profile_file([profile], workdir)
    replicas = cluster.start_replicas(
        profile, profile_file, VERSION, ["shared"] * count, speed, seed=3
    )
    try:
        yield [r.base_url for r in replicas]
    finally:
        cluster.stop_replicas(replicas)


def register_replicas(urls: Sequence[str], keys_out: Path) -> None:
    """The demo catalog with ``urls`` as the 70B's only replicas, pushed to Redis."""
    from django.core.management import call_command

    from tenants.readmodel import read_model

    replicas = f"{VERSION}={','.join(urls)}"
    quiet = io.StringIO()  # its summary of the demo accounts
    call_command("seed_demo", "--replicas", replicas, "--keys-out", str(keys_out), stdout=quiet)
    read_model().rebuild()


def open_tenant(label: str) -> tuple[Tenant, str]:
    """A new tenant on ``plan()`` with an API key (its secret), pushed to Redis."""
    from catalog.models import ModelFamily
    from tenants import services
    from tenants.demo import MODELS, plan_limits
    from tenants.models import Plan
    from tenants.readmodel import read_model

    spec = plan()
    owned = Plan.objects.filter(name=spec.name).first()
    if owned is None:
        owned = services.plan_create(
            name=spec.name, admission_class=spec.admission_class, display_name=spec.display_name
        )
        model = next(m for m in MODELS if m.version == VERSION)
        services.plan_limit_set(
            plan=owned,
            family=ModelFamily.objects.get(name=FAMILY),
            **plan_limits(spec, model),
        )
    tenant = services.tenant_create(name=f"{label}-{uuid.uuid4().hex[:6]}", plan=owned)
    _, secret = services.api_key_create(tenant=tenant, name=label)
    read_model().rebuild()
    return tenant, secret


GatewayFactory = Callable[[dict[str, str]], AbstractContextManager[str]]


def run_arm(
    label: str,
    strategy: str,
    replica_urls: Sequence[str],
    workload: Workload,
    keys_out: Path,
    gateway: GatewayFactory,
) -> Arm:
    """One arm on ``replica_urls``: a new tenant, a gateway from ``gateway(env)`` (a context
    of its base URL, the usage topic the caller's) routing by ``strategy``, the workload."""
    register_replicas(replica_urls, keys_out)
    tenant, secret = open_tenant(f"cache-invoice-{strategy}")
    t0 = time.perf_counter()
    with gateway({"GATEWAY_ADMISSION_STRATEGY": strategy}) as base_url:
        conversations = asyncio.run(workload.run(base_url, secret))
    return Arm(label, strategy, tenant, conversations, time.perf_counter() - t0)


def metered_requests(arms: Sequence[Arm]) -> int:
    from django.db.models import Sum

    from metering.models import Usage

    total = Usage.objects.filter(tenant__in=[a.tenant for a in arms]).aggregate(n=Sum("requests"))
    return int(total["n"] or 0)


def draft_invoices(tenant: Tenant) -> list[Invoice]:
    """The tenant's draft invoice for every month its usage falls in."""
    from billing.periods import month_start
    from billing.services import invoice_draft_build
    from metering.models import Usage

    hours = Usage.objects.filter(tenant=tenant).values_list("hour", flat=True)
    drafts = (
        invoice_draft_build(tenant=tenant, period_start=month)
        for month in sorted({month_start(h) for h in hours})
    )
    return [i for i in drafts if i is not None]


# -- the report --------------------------------------------------------------------------


@dataclass(slots=True)
class Billed:
    """One token type's usage lines of an arm's invoices, summed."""

    tokens: int = 0
    price: Decimal = Decimal(0)  # per million tokens
    exact: Decimal = Decimal(0)
    amount: Decimal = Decimal(0)  # as invoiced: each line rounded to cents

    def cell(self) -> str:
        price = f"{self.price:.2f}" if self.price == round(self.price, 2) else f"{self.price:f}"
        return f"{self.tokens:,} × ${price}/M = ${self.exact.normalize():f} → {money(self.amount)}"


def usage_lines(arm: Arm) -> dict[str, Billed]:
    """The arm's invoices' usage lines by the names of ``Arm.received``: prompt (the prompt
    tokens not cached), cached, completion."""
    from billing.models import LineKind, TokenType

    names = {
        str(TokenType.PROMPT): "prompt",
        str(TokenType.CACHED): "cached",
        str(TokenType.COMPLETION): "completion",
    }
    out = {name: Billed() for name in names.values()}
    for invoice in arm.invoices:
        for line in invoice.lines.filter(kind=LineKind.USAGE):
            billed = out[names[line.token_type]]
            billed.tokens += line.tokens
            billed.price = line.unit_price_per_mtok
            billed.exact += line.amount_exact
            billed.amount += line.amount
    return out


def money(amount: Decimal) -> str:
    return f"${amount:,.2f}"


def invoice_table(arms: Sequence[Arm]) -> list[str]:
    """The arms' invoices side by side (the first arm the baseline of the saving)."""
    base = arms[0]
    lines = [
        "| | " + " | ".join(f"{a.label} (tenant {a.tenant.name})" for a in arms) + " |",
        "|---|" + "---|" * len(arms),
    ]

    def row(name: str, cells: Sequence[str]) -> None:
        lines.append(f"| {name} | " + " | ".join(cells) + " |")

    received = [a.received() for a in arms]
    billed = [usage_lines(a) for a in arms]
    row("requests", [f"{len(a.turns):,}" for a in arms])
    row("prompt tokens (clients' usage)", [f"{r['prompt']:,}" for r in received])
    row("cached prompt tokens (clients' usage)", [f"{r['cached']:,}" for r in received])
    row("cached share", [f"{r['cached'] / r['prompt']:.1%}" for r in received])
    row("completion tokens (clients' usage)", [f"{r['completion']:,}" for r in received])
    for kind, name in (
        ("prompt", "line: prompt tokens not cached"),
        ("cached", "line: cached prompt tokens"),
        ("completion", "line: completion tokens"),
    ):
        row(name, [b[kind].cell() for b in billed])
    row(
        "lines bill the clients' usage",
        [
            "yes"
            if (b["prompt"].tokens, b["cached"].tokens, b["completion"].tokens)
            == (r["prompt"] - r["cached"], r["cached"], r["completion"])
            else "NO"
            for b, r in zip(billed, received, strict=True)
        ],
    )
    exact = [sum((x.exact for x in b.values()), Decimal(0)) for b in billed]
    row("total before rounding", [f"${e.normalize():f}" for e in exact])
    row("invoice total", [money(a.total) for a in arms])
    row(
        "total before rounding per million prompt tokens",
        [f"${e * 1_000_000 / r['prompt']:.4f}" for e, r in zip(exact, received, strict=True)],
    )
    row(
        f"saving vs {base.label}",
        [
            "—"
            if a is base
            else f"{money(base.total - a.total)} on the invoice; "
            f"${(exact[0] - e).normalize():f} ({(exact[0] - e) / exact[0]:.1%}) before rounding"
            for a, e in zip(arms, exact, strict=True)
        ],
    )
    row("wall (gateway start to its drained stop)", [f"{a.wall_s:.1f} s" for a in arms])
    return lines


# -- the bench -----------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="2,8", help="replicas per arm, comma-separated")
    ap.add_argument("--speed", type=float, default=5.0)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--conversations-per-replica", type=int, default=8)
    ap.add_argument("--out", default=str(RESULTS / "prefix_invoice.md"))
    ap.add_argument("--append", action="store_true", help="add this run to --out's runs")
    ap.add_argument("--db-name", default=DB_NAME, help="PostgreSQL database (dropped at exit)")
    args = ap.parse_args(argv)
    command = " ".join(
        ["python -m bench.prefix_invoice", *(sys.argv[1:] if argv is None else argv)]
    )

    from bench.faults import own_database
    from bench.ingest import setup_django
    from fairway.embedded import EmbeddedServices, ensure_topic

    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load0 = os.getloadavg()
    services = EmbeddedServices()
    workdir = cluster.workdir()
    sections: list[list[str]] = []
    try:
        with own_database(args.db_name) as url:
            os.environ["DATABASE_URL"] = url
            setup_django(services)  # migrates; REDIS_URL = BENCH_REDIS_URL, else DB 15
            from metering.consumer import ConsumerConfig, UsageConsumer

            bootstrap = services.start_kafka()
            topic = "usage.v1"
            ensure_topic(bootstrap, topic, 3)
            consumer = UsageConsumer(ConsumerConfig(bootstrap=bootstrap, topic=topic))
            consumer.start()

            @contextlib.contextmanager
            def gateway(env: dict[str, str]) -> Iterator[str]:
                extra = {"KAFKA_BOOTSTRAP": bootstrap, "GATEWAY_USAGE_TOPIC": topic, **env}
                gw = cluster.start_gateway(os.environ["REDIS_URL"], 1, extra, workdir)
                try:
                    yield gw.base_url
                finally:
                    gw.stop(30)  # drains: every usage event produced

            try:
                for size in (int(s) for s in args.sizes.split(",")):
                    workload = Workload(args.conversations_per_replica * size, args.turns)
                    arms = []
                    for label, strategy in ARMS:
                        with fresh_replicas(size, args.speed, workdir) as urls:
                            arm = run_arm(
                                label, strategy, urls, workload, workdir / "keys.json", gateway
                            )
                        print(f"{size} replicas, {label}: {len(arm.turns)} requests", flush=True)
                        arms.append(arm)
                    expected = sum(len(a.turns) for a in arms)
                    deadline = time.monotonic() + 120
                    while metered_requests(arms) < expected:
                        if time.monotonic() > deadline:
                            raise RuntimeError(f"{metered_requests(arms)} of {expected} metered")
                        time.sleep(0.2)
                    for a in arms:
                        a.invoices = draft_invoices(a.tenant)
                    sections.append(
                        [
                            f"## {size} replicas",
                            "",
                            f"{workload.conversations} conversations of {workload.turns} turns "
                            f"over {workload.systems} system prompts per arm.",
                            "",
                            *invoice_table(arms),
                            "",
                        ]
                    )
                    print("\n".join(sections[-1]), flush=True)
            finally:
                consumer.stop()
    finally:
        services.stop()
    load1 = os.getloadavg()
    run = [
        f"Run {started}. Command: `{command}`. Machine load average {load0[0]:.1f} at start, "
        f"{load1[0]:.1f} at the end (2 shared cores). Replicas at speed {args.speed:g}.",
        "",
        *(line for section in sections for line in section),
    ]
    out = Path(args.out)
    if args.append and out.exists():
        text = out.read_text().rstrip("\n") + "\n\n---\n\n" + "\n".join(run)
    else:
        text = "\n".join([*HEADER, "", *run])
    out.write_text(text)
    print(text)
    return 0


HEADER = [
    "# Cache-aware routing on the invoice",
    "",
    f"Replicas: `python -m emulator --profile {PROFILE}` with the platform flags (prefix "
    "caching on, `--enable-prompt-tokens-details`), fresh for each arm; one gateway process "
    "per arm (`GATEWAY_ADMISSION_STRATEGY` = `p2c` or `cache_aware`) sending usage events to "
    "the embedded Kafka-protocol broker (Tansu); the real consumer writes `usage`; "
    "`billing.services.invoice_draft_build` drafts each arm's tenant's invoice at the demo "
    "catalog's 70B prices. The workload is `bench.prefix_gateway`'s (user messages 40-120 "
    "words, replies 48 tokens, every request with `seed` and `ignore_eos`, so both arms send "
    "the same prompts). Token counts are what the clients' `usage` objects said; the invoice "
    "lines are the tokens the consumer metered, `tokens × price / 1,000,000` exact, then "
    "rounded to cents once per line (the invoice total is the sum of the rounded lines).",
]


if __name__ == "__main__":
    sys.exit(main())
