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
import datetime as dt
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


def write_index(ran: dict[str, tuple[int, float]], total_s: float) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    md = [
        "# Benchmark results\n",
        f"Produced by `python -m bench` (or `make bench`) on "
        f"{dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} CPU cores, "
        f"Python {platform.python_version()}; {total_s / 60:.1f} min in all. Every figure is "
        "measured in that one run; ratios are against a baseline of the same run. What each "
        "scenario does and why the scaling preserves the design's ratios: "
        "[bench/README.md](../README.md).\n",
    ]
    headline = RESULTS / "noisy_neighbour_headline.md"
    if headline.exists():
        md.append("## Headline — noisy neighbour (scenario 1)\n")
        md.append(headline.read_text())
        md.append("![TTFT and KV occupancy per arm](noisy_neighbour.png)\n")
        md.append("Targets and per-tenant tables: [noisy_neighbour.md](noisy_neighbour.md).\n")
    md.append("## Scenarios\n")
    md.append("| scenario | command | report | exit | minutes |")
    md.append("|---|---|---|---|---|")
    for s in SCENARIOS:
        if s.name not in ran:
            continue
        code, took = ran[s.name]
        link = f"[{s.report}]({s.report})" if (RESULTS / s.report).exists() else "—"
        md.append(f"| {s.title} | `python -m bench.{s.name}` | {link} | {code} | {took / 60:.1f} |")
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
