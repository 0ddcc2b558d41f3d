"""``python -m bench``: every benchmark scenario end to end, results in bench/results/.

Each scenario runs as its own ``python -m bench.<module>`` child (a clean interpreter,
its own processes, its own exit status) with its own progress bars; this runner prints
the plan, times each scenario, and finally writes bench/results/README.md — the headline
tables and links to every scenario's report.

    python -m bench                        # all scenarios
    python -m bench --only noisy_neighbour,fleet_sim
    python -m bench --list
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).parent / "results"


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str  # bench.<module>
    title: str
    report: str  # file in bench/results/ the README links
    args: tuple[str, ...] = ()


# Order: the emulator's own check, then the headline; the simulation (no processes) last.
SCENARIOS: tuple[Scenario, ...] = (
    Scenario("emulator_bench", "0 · Emulator SSE throughput and cliff", "emulator_sse.md"),
    Scenario("noisy_neighbour", "1 · Noisy neighbour (headline)", "noisy_neighbour.md"),
    Scenario("gateway_overhead", "2 · Gateway overhead", "gateway_overhead.md"),
    Scenario("herd", "3 · Routing herd", "herd.md"),
    Scenario("fleet_sim", "4 · Fleet-scale simulation", "fleet_sim.md"),
    Scenario("ingest", "5 · Usage ingestion (Kafka → PostgreSQL)", "ingest.md"),
    Scenario("prefix_routing", "6 · KV-cache-aware routing (simulation)", "prefix_routing.md"),
    Scenario("prefix_gateway", "7 · KV-cache-aware routing (real gateways)", "prefix_gateway.md"),
    Scenario("faults", "8 · Faults (clients and end-to-end usage)", "faults.md"),
    Scenario("abuse", "9 · Abuse (a well-behaved tenant under four attacks)", "abuse.md"),
    Scenario("redis_cluster", "10 · Admission on a Redis Cluster", "redis_cluster.md"),
    Scenario("prefix_invoice", "12 · KV-cache-aware routing on the invoice", "prefix_invoice.md"),
)


def available() -> list[Scenario]:
    here = Path(__file__).parent
    return [s for s in SCENARIOS if (here / f"{s.name}.py").exists()]


def run_scenario(s: Scenario, extra: list[str]) -> tuple[int, float]:
    started = time.perf_counter()
    print(f"\n=== {s.title}: python -m bench.{s.name} {' '.join(extra)}".rstrip(), flush=True)
    proc = subprocess.run(  # noqa: S603 - our own module, fixed argv
        [sys.executable, "-m", f"bench.{s.name}", *s.args, *extra], cwd=ROOT, check=False
    )
    took = time.perf_counter() - started
    print(f"=== {s.name}: exit {proc.returncode} in {took:.0f} s", flush=True)
    return proc.returncode, took


RUNS = RESULTS / "runs.json"


def record_runs(ran: dict[str, tuple[int, float]]) -> dict[str, dict[str, object]]:
    """Merge this invocation's scenarios into bench/results/runs.json (so that a partial
    ``--only`` run keeps the other scenarios' last status in the index)."""
    runs: dict[str, dict[str, object]] = {}
    if RUNS.exists():
        with contextlib.suppress(ValueError):
            runs = json.loads(RUNS.read_text())
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    for name, (code, took) in ran.items():
        runs[name] = {"exit": code, "seconds": round(took, 1), "at": stamp}
    RESULTS.mkdir(parents=True, exist_ok=True)
    RUNS.write_text(json.dumps(runs, indent=2, sort_keys=True) + "\n")
    return runs


def write_index(ran: dict[str, tuple[int, float]], total_s: float) -> Path:
    runs = record_runs(ran)
    all_s = sum(float(str(r["seconds"])) for r in runs.values())
    md = [
        "# Benchmark results\n",
        f"Produced by `python -m bench` (or `make bench`) on {os.cpu_count()} CPU cores, "
        f"Python {platform.python_version()}: all scenarios in {all_s / 60:.1f} min (the sum "
        "of the table below; the last invocation took "
        f"{total_s / 60:.1f} min). Every figure of a scenario is measured in one run of it; "
        "ratios are against a baseline of the same run. What each "
        "scenario does and why the scaling preserves the design's ratios: "
        "[bench/README.md](../README.md).\n",
    ]
    compare = RESULTS / "design_vs_realistic.md"
    if compare.exists():  # written by hand when the emulator's timing model changed
        md.append(compare.read_text())
    isolation = RESULTS / "isolation.md"
    if isolation.exists():  # written by hand from the several-flooders runs
        md.append(isolation.read_text())
    headlines: tuple[tuple[str, str, tuple[str, ...]], ...] = (
        (
            "noisy_neighbour_headline.md",
            "## Headline — noisy neighbour (scenario 1)\n",
            (
                "![TTFT and KV occupancy per arm](noisy_neighbour.png)\n",
                "Targets and per-tenant tables: [noisy_neighbour.md](noisy_neighbour.md).\n",
            ),
        ),
        (
            "fleet_sim_headline.md",
            "## Fleet-scale simulation (scenario 4)\n",
            ("Cliff, herd and retry-storm tables: [fleet_sim.md](fleet_sim.md).\n",),
        ),
    )
    for name, title, links in headlines:
        if (RESULTS / name).exists():
            md += [title, (RESULTS / name).read_text(), *links]
    md.append("## Scenarios\n")
    md.append("| scenario | command | report | exit | minutes | run at |")
    md.append("|---|---|---|---|---|---|")
    for s in SCENARIOS:
        run = runs.get(s.name)
        if run is None:
            continue
        link = f"[{s.report}]({s.report})" if (RESULTS / s.report).exists() else "—"
        minutes = float(run["seconds"]) / 60  # type: ignore[arg-type]
        md.append(
            f"| {s.title} | `python -m bench.{s.name}` | {link} | {run['exit']} | "
            f"{minutes:.1f} | {run['at']} |"
        )
    path = RESULTS / "README.md"
    path.write_text("\n".join(md) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    ap.add_argument("--only", help="comma-separated scenario modules")
    ap.add_argument("--list", action="store_true")
    args = ap.parse_args(argv)
    scenarios = available()
    if args.list:
        for s in scenarios:
            print(f"{s.name:18} {s.title}")
        return 0
    if args.only:
        wanted = [w.strip() for w in args.only.split(",") if w.strip()]
        unknown = set(wanted) - {s.name for s in scenarios}
        if unknown:
            ap.error(f"unknown or missing scenarios: {sorted(unknown)}")
        scenarios = [s for s in scenarios if s.name in wanted]
    print(
        f"[bench] {len(scenarios)} scenario(s): {', '.join(s.name for s in scenarios)}; "
        f"{os.cpu_count()} cores; results in {RESULTS.relative_to(ROOT)}/",
        flush=True,
    )
    started = time.perf_counter()
    ran: dict[str, tuple[int, float]] = {}
    for s in scenarios:
        ran[s.name] = run_scenario(s, [])
    total = time.perf_counter() - started
    index = write_index(ran, total)
    print(f"\n[bench] done in {total / 60:.1f} min; index {index.relative_to(ROOT)}", flush=True)
    return 0 if all(code == 0 for code, _ in ran.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
