"""Where a gateway worker's CPU goes under steady streaming load, and how two commits differ.

The set-up of ``bench.gateway_overhead`` (one emulated replica at real-time pacing, its
read model seeded into an embedded Redis, usage events through the fsync'd spool) with
``python -m gateway --workers 1`` in front of it, loaded with an open-loop Poisson stream
of chat completions at a fixed rate (the same schedule in every window):

1. idle: the worker's CPU with no requests (its background loops), in ms per second;
2. unprofiled: the worker's user+system CPU over the requests it served, ms per request;
3. profiled: ``py-spy record`` attached to the worker (sampling, non-blocking, idle frames
   left out), folded into ms of sampled time per request per function: self time and
   inclusive time (a function's frames plus everything it called). Sampled time counts
   threads waiting in system calls too, so its total is above the CPU figure; ``--gil``
   samples only the thread holding the GIL (Python's own CPU).

``--against PATH`` runs a second gateway from another checkout (e.g. a throwaway
``git worktree add /tmp/old <sha>``) beside this one, against the same replica and
schedule, its read model seeded by that checkout's own ``bench.gateway_overhead.seed``;
the windows alternate between the two (this, other, other, this, ...) for ``--rounds``
rounds, so the machine's other load weighs on both alike, and the profiles are printed as
a difference (this − other) per function.

Run from the repository root (py-spy in the venv: ``.venv/bin/pip install py-spy``)::

    PYTHONPATH=$PWD .venv/bin/python -m bench.gateway_profile --rate 300 --seconds 10
    PYTHONPATH=$PWD .venv/bin/python -m bench.gateway_profile --against /tmp/old --rounds 3

``--cprofile`` instead runs each gateway under ``python -m cProfile`` for one window and
prints, per function, calls per request and CPU per request (cProfile's own cost inflates
the times, alike for both; the call counts are exact, so a function the other commit does
not call, or calls less, stands out whatever the machine is doing).

``--out DIR`` keeps py-spy's folded stacks (``DIR/<name>.stacks``) for a flame graph, and
cProfile's stats (``DIR/<name>.pstats``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import pstats
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import cluster
from bench.gateway_overhead import cpu_seconds, offer, process_tree, seed, session, testbed

SAMPLE_HZ = 500
ZERO = (0.0, 0.0)
Starter = Callable[[Sequence[str]], cluster.Gateway]  # python args -> a started gateway
PROJECT = ("gateway/", "fairway/")  # frames shown with their path under the repository


def frame_name(frame: str) -> str:
    """py-spy's ``func (path/to/file.py:123)`` as ``gateway/file.py:func`` (no line)."""
    func, _, where = frame.partition(" (")
    path = where.rsplit(":", 1)[0]
    for marker in PROJECT:
        at = path.rfind(marker)
        if at >= 0:
            return f"{path[at:]}:{func}"
    return f"{Path(path).name}:{func}" if path else func


def fold(stacks_text: str) -> tuple[Counter[str], Counter[str], int]:
    """Self and inclusive sample counts per function from py-spy's raw (folded) output."""
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    for line in stacks_text.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        # The leading entries name the process and thread, not frames.
        frames = [
            frame_name(f) for f in stack.split(";") if not f.startswith(("process ", "thread "))
        ]
        if not frames:
            continue
        total += count
        own[frames[-1]] += count
        for name in set(frames):
            inclusive[name] += count
    return own, inclusive, total


@dataclass
class Subject:
    """One gateway under test: where it runs from, and what it measured."""

    name: str
    gw: cluster.Gateway
    auth: dict[str, str]
    idle_ms_per_s: float = 0.0
    cpu_ms_per_req: list[float] = field(default_factory=list)
    own: Counter[str] = field(default_factory=Counter)
    inclusive: Counter[str] = field(default_factory=Counter)
    profiled: int = 0
    samples: int = 0

    @property
    def url(self) -> str:
        return self.gw.base_url + "/v1/chat/completions"

    def per_request(self, count: int) -> float:
        return count * 1000.0 / SAMPLE_HZ / max(self.profiled, 1)


async def load(subject: Subject, args: argparse.Namespace) -> int:
    async with session() as s:
        samples = await offer(
            s, subject.url, subject.auth, args.rate, args.seconds, True, args.max_tokens, 7
        )
    return sum(1 for x in samples if x.status == 200 and x.error is None)


def user_system(pids: list[int]) -> tuple[float, float]:
    """User and system CPU seconds of ``pids`` (system: the kernel's side of the sockets)."""
    user = system = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            user, system = user + int(fields[11]), system + int(fields[12])
    tick = os.sysconf("SC_CLK_TCK")
    return user / tick, system / tick


async def measure(subject: Subject, args: argparse.Namespace) -> None:
    pids = process_tree(subject.gw.proc.pid)  # with --workers N: the supervisor and workers
    user0, system0 = user_system(pids)
    served = await load(subject, args)
    user1, system1 = user_system(pids)
    per = 1000 / max(served, 1)
    subject.cpu_ms_per_req.append((user1 - user0 + system1 - system0) * per)
    print(
        f"  {subject.name}: {served} streams, {subject.cpu_ms_per_req[-1]:.3f} ms CPU per "
        f"request (user {(user1 - user0) * per:.3f}, system {(system1 - system0) * per:.3f}; "
        f"load average {os.getloadavg()[0]:.1f})",
        flush=True,
    )


async def profile(subject: Subject, args: argparse.Namespace, out: Path) -> None:
    stacks = out / f"{subject.name}.stacks"
    recorder = await asyncio.create_subprocess_exec(
        args.spy, "record", "--pid", str(subject.gw.proc.pid), "--rate", str(SAMPLE_HZ),
        "--format", "raw", "--nonblocking", "--output", str(stacks),
        "--duration", str(int(args.seconds + 2)), *(["--gil"] if args.gil else []),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    await asyncio.sleep(1.0)  # py-spy attaches before the window opens
    subject.profiled = await load(subject, args)
    async with asyncio.timeout(args.seconds + 30):
        _, err = await recorder.communicate()
    if recorder.returncode != 0 or not stacks.exists():  # noqa: ASYNC240 - once, at the end
        raise RuntimeError(f"py-spy failed: {err.decode(errors='replace')[-2000:]}")
    subject.own, subject.inclusive, subject.samples = fold(stacks.read_text())  # noqa: ASYNC240


async def cprofile(
    name: str, auth: dict[str, str], start: Starter, args: argparse.Namespace, out: Path
) -> dict[str, tuple[float, float]]:
    """{function: (calls, own CPU ms) per request} over one window under cProfile."""
    stats_path = out / f"{name}.pstats"
    subject = Subject(name, start(["-m", "cProfile", "-o", str(stats_path)]), auth)
    try:
        async with session() as client:
            await offer(client, subject.url, auth, 50, 2.0, True, 4, seed=99)
        served = max(1, await load(subject, args))
    finally:
        subject.gw.stop(timeout=30)  # SIGTERM: a graceful exit, which writes the stats
    stats: Any = pstats.Stats(str(stats_path))
    per: dict[str, tuple[float, float]] = {}
    for (path, _line, func), (_cc, ncalls, tottime, _ct, _callers) in stats.stats.items():
        key = frame_name(f"{func} ({path}:0)")
        calls, ms = per.get(key, (0.0, 0.0))
        per[key] = (calls + ncalls / served, ms + tottime * 1000 / served)
    return per


def cprofile_report(results: dict[str, dict[str, tuple[float, float]]], top: int) -> None:
    """The top functions of each gateway by own time, and any function the two call a
    different number of times per request."""
    names: set[str] = set()
    for per in results.values():
        names |= {n for n, _ in sorted(per.items(), key=lambda kv: -kv[1][1])[:top]}
    cols = list(results.values())
    if len(cols) == 2:
        a, b = cols
        names |= {
            n for n in a.keys() | b.keys() if abs(a.get(n, ZERO)[0] - b.get(n, ZERO)[0]) >= 0.5
        }
    header = "".join(f"{s[:8] + ' calls':>15}{s[:8] + ' ms':>12}" for s in results)
    print(f"\ncProfile, per request (own time, cProfile's overhead included)\n{header}  function")
    for n in sorted(names, key=lambda n: -max(c.get(n, ZERO)[1] for c in cols)):
        row = "".join(f"{c.get(n, ZERO)[0]:15.2f}{c.get(n, ZERO)[1]:12.4f}" for c in cols)
        print(f"{row}  {n}")


def report(subjects: list[Subject], args: argparse.Namespace) -> None:
    print("\nworker CPU per request (ms), each window; idle CPU (ms per second)")
    for s in subjects:
        windows = ", ".join(f"{v:.3f}" for v in s.cpu_ms_per_req)
        print(
            f"  {s.name}: median {statistics.median(s.cpu_ms_per_req):.3f} [{windows}]; "
            f"idle {s.idle_ms_per_s:.1f}"
        )
    if not args.profile:
        return
    for s in subjects:
        print(
            f"\n{s.name}: {s.samples} samples at {SAMPLE_HZ} Hz over {s.profiled} requests = "
            f"{s.per_request(s.samples):.3f} ms sampled per request"
        )
    for title, attr, only_project in (
        ("self time", "own", False),
        ("inclusive time, project code", "inclusive", True),
    ):
        names: set[str] = set()
        for s in subjects:
            counts: Counter[str] = getattr(s, attr)
            names |= {n for n, _ in counts.most_common(args.top)}
        if only_project:
            names = {n for n in names if n.startswith(PROJECT)}
        cols = [getattr(s, attr) for s in subjects]

        def value(i: int, name: str, cols: list[Counter[str]] = cols) -> float:
            return subjects[i].per_request(cols[i][name])

        header = "".join(f"{s.name[:10]:>11}" for s in subjects)
        diff = len(subjects) == 2
        print(f"\n{title}, ms per request\n{header}{'   this−other' if diff else ''}  function")
        order = sorted(names, key=lambda n: -max(value(i, n) for i in range(len(subjects))))
        for name in order:
            row = "".join(f"{value(i, name):11.3f}" for i in range(len(subjects)))
            delta = f"{value(0, name) - value(1, name):+13.3f}" if diff else ""
            print(f"{row}{delta}  {name}")


async def run(args: argparse.Namespace) -> int:
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="fairway-profile-"))
    out.mkdir(parents=True, exist_ok=True)
    subjects: list[Subject] = []
    with testbed(tools=False) as bed:
        redis_url, env, replica = bed.redis_url, bed.env, bed.replica
        try:
            key = seed(redis_url, replica.base_url)
            starts = {"this": lambda extra: cluster.start_gateway(
                redis_url, args.workers, env, cluster.workdir(), python_args=extra
            )}  # fmt: skip
            keys = {"this": key}
            if args.against:
                other = cluster.Checkout.seeded(args.against, redis_url, replica.base_url)
                keys["other"] = other.key
                starts["other"] = lambda extra: other.start_gateway(
                    args.workers, env, cluster.workdir(), python_args=extra
                )
            if args.cprofile:
                results = {}
                for name, start in starts.items():
                    print(f"cProfile: {name}", flush=True)
                    auth = {"authorization": f"Bearer {keys[name]}"}
                    results[name] = await cprofile(name, auth, start, args, out)
                cprofile_report(results, args.top)
                return 0
            for name, start in starts.items():
                auth = {"authorization": f"Bearer {keys[name]}"}
                subjects.append(Subject(name, start(()), auth))
            for s in subjects:
                async with session() as client:  # warm connections, caches, first touches
                    await offer(client, s.url, s.auth, 50, 2.0, True, 4, seed=99)
            for s in subjects:
                pids = process_tree(s.gw.proc.pid)
                cpu0 = cpu_seconds(pids)
                await asyncio.sleep(args.idle_seconds)
                s.idle_ms_per_s = (cpu_seconds(pids) - cpu0) * 1000 / args.idle_seconds
            for k in range(args.rounds):
                print(f"round {k + 1} of {args.rounds}: {args.rate:.0f} streams/s", flush=True)
                for s in subjects if k % 2 == 0 else subjects[::-1]:
                    await measure(s, args)
            if args.profile:
                for s in subjects:
                    print(f"profiling {s.name}", flush=True)
                    await profile(s, args, out)
            report(subjects, args)
            return 0
        finally:
            for s in subjects:
                s.gw.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gateway_profile")
    parser.add_argument("--rate", type=float, default=300.0, help="streaming requests/s")
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each window")
    parser.add_argument("--rounds", type=int, default=2, help="unprofiled windows per gateway")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--workers", type=int, default=1, help="gateway workers (profiles need 1)")
    parser.add_argument("--idle-seconds", type=float, default=5.0)
    parser.add_argument("--against", help="another checkout whose gateway to compare with")
    parser.add_argument(
        "--no-profile", dest="profile", action="store_false", help="CPU figures only"
    )
    parser.add_argument("--gil", action="store_true", help="sample the GIL holder only")
    parser.add_argument("--cprofile", action="store_true", help="calls and time under cProfile")
    parser.add_argument("--top", type=int, default=25, help="functions per table and gateway")
    parser.add_argument("--out", help="folder for py-spy's folded stacks (default: a temp dir)")
    args = parser.parse_args(argv)
    if args.workers != 1 and (args.profile or args.cprofile):
        parser.error("profiles attach to one worker: --workers 1, or --no-profile")
    args.spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if args.profile and not args.cprofile and not Path(args.spy).exists():
        parser.error("py-spy is not installed: .venv/bin/pip install py-spy")
    args.against = Path(args.against).resolve() if args.against else None
    import uvloop

    return uvloop.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
