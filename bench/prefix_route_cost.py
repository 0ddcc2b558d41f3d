"""Cache-aware routing's CPU per request on the gateway's event loop: before the upstream
request leaves (``make_query`` + ``Router.choose`` + ``Router.on_dispatch``) and after it
(the callbacks ``on_dispatch`` leaves on the loop), by prompt, against P2C.

The router is the gateway's own (``gateway.admission.router.Router``) over 4 replicas that
are scraped at 10 % occupancy; every request is dispatched and, 40 requests later, gets
its first token and finishes (a steady in-flight count). Prompts:

- *under one block*: no cacheable block;
- *one block*: ``bench.gateway_overhead``'s default prompt (17 tokens: one block);
- *N words, nobody holds it*: a unique first word, then N words (a long prompt whose first
  block no replica holds: nothing to follow; 3,000 words are 5,010 tokens);
- *N words, held*: the same long prompt every time (the index follows it to its end).

``python -m bench.prefix_route_cost`` writes bench/results/prefix_route_cost.md for this tree;
``--against DIR`` runs the same measurement with another checkout's gateway code (``git
worktree add --detach DIR SHA``) and reports both. In-process timings on a shared machine:
medians of many requests, to compare the two trees' rows of one run, not as absolute figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Literal

RESULTS = Path(__file__).parent / "results"
CASES = ("under one block", "one block", "{n} words, nobody holds it", "{n} words, held")


def _content(case: str, i: int, words: int) -> str:
    if case == "under one block":
        return "hi"
    if case == "one block":
        return f"request {i}: tell me a short story"
    pad = " ".join(f"w{k}" for k in range(words))
    return pad if case.endswith("held") else f"request {i}: {pad}"


async def _measure(
    strategy: Literal["p2c", "cache_aware"], case: str, n: int, words: int
) -> tuple[float, float]:
    """Median µs per request before the send, and after it (the deferred callbacks)."""
    from bench.sim import SimRegistry, replica_records
    from contracts import schema
    from gateway.admission.config import AdmissionConfig
    from gateway.admission.prefix import make_query
    from gateway.admission.replicas import ReplicaState
    from gateway.admission.router import Router

    records = replica_records(4)
    states = [ReplicaState(record=r, version="v") for r in records]
    version = schema.ModelVersionRecord("v", "f", 131_072, 131_072, 50, 500_000, replicas=())
    router = Router(
        SimRegistry("v", states), random.Random(1), config=AdmissionConfig(strategy=strategy)
    )
    before: list[float] = []
    after: list[float] = []
    picks = []
    for i in range(n):
        if i % 50 == 0:  # the scraper's view: fresh, 10 % occupied
            for s in states:
                s.healthy, s.scraped_at, s.kv_usage = True, time.monotonic(), 0.1
        messages = [{"role": "user", "content": _content(case, i, words)}]
        t0 = time.perf_counter()
        q = make_query("t", messages, "s" * 64, 16) if strategy == "cache_aware" else None
        pick = router.choose(version, "standard", 1000, prefix=q)
        assert pick is not None
        router.on_dispatch(pick, f"q{i}", 1000, prefix=q)
        t1 = time.perf_counter()
        await asyncio.sleep(0)  # the callbacks on_dispatch left on the loop run here
        t2 = time.perf_counter()
        before.append(t1 - t0)
        after.append(t2 - t1)
        picks.append(pick)
        if i >= 40:
            router.on_first_token(picks[i - 40], f"q{i - 40}")
            router.on_finish(picks[i - 40], f"q{i - 40}")
    return statistics.median(before) * 1e6, statistics.median(after) * 1e6


def measure(words: int, n: int) -> dict[str, dict[str, tuple[float, float]]]:
    out: dict[str, dict[str, tuple[float, float]]] = {}
    for case in CASES:
        label = case.format(n=words)
        count = n if "words" not in case else max(50, n // 10)
        out[label] = {
            s: asyncio.run(_measure(s, case, count, words)) for s in ("p2c", "cache_aware")
        }
    return out


def table(results: dict[str, dict[str, dict[str, tuple[float, float]]]]) -> str:
    trees = list(results)
    head = "| prompt | P2C before the send |"
    for t in trees:
        head += f" cache-aware before / after the send, {t} |"
    lines = [head, "|---|" + "---:|" * (1 + len(trees))]
    for label in results[trees[0]]:
        p2c = results[trees[0]][label]["p2c"][0]
        row = f"| {label} | {p2c:.0f} µs |"
        for t in trees:
            b, a = results[t][label]["cache_aware"]
            row += f" {b:.0f} / {a:.0f} µs |"
        lines.append(row)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.prefix_route_cost")
    ap.add_argument("--words", type=int, default=3000, help="words of the long prompts")
    ap.add_argument("--requests", type=int, default=3000, help="requests per short case")
    ap.add_argument("--against", type=Path, metavar="DIR", help="another checkout to compare")
    ap.add_argument("--label", default=None, help="the other checkout's name in the table")
    ap.add_argument("--out", type=Path, default=RESULTS / "prefix_route_cost.md")
    ap.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # internal
    args = ap.parse_args(argv)
    if args.json:
        print(json.dumps(measure(args.words, args.requests)))
        return 0
    load_start = os.getloadavg()[0]
    results = {"this tree": measure(args.words, args.requests)}
    if args.against is not None:
        # The other checkout's gateway code, measured by this file (it imports only what
        # every checkout has: make_query, Router and bench.sim).
        env = {**os.environ, "PYTHONPATH": str(args.against.resolve())}
        done = subprocess.run(
            [sys.executable, __file__, "--json", "--words", str(args.words)]
            + ["--requests", str(args.requests)],
            cwd=args.against,
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        results[args.label or str(args.against)] = json.loads(done.stdout)
    command = shlex.join(["python", "-m", "bench.prefix_route_cost", *(argv or sys.argv[1:])])
    text = "\n".join(
        [
            "# Cache-aware routing's cost per request, in process",
            "",
            f"Command: `{command}`. Machine: {os.cpu_count()} cores, 1-minute load average "
            f"{load_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end (shared with "
            "other work). Medians of per-request wall time on the event loop; the long-prompt "
            "rows are fewer requests. See the module's docstring for what runs.",
            "",
            table(results),
            "",
        ]
    )
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
