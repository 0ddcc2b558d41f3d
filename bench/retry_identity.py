"""What R6's identity of retries costs, and why its marks are shared
(gateway/admission/retrymemory.py).

    python -m bench.retry_identity [--calls 200000] [--waits 1,4,6,30]

1. The process memory's hot path: ``RetryMemory.take`` for a tenant-key with no mark (every
   request of a tenant without a recent failure), the body digest a tenant-key with a mark
   pays (4 KiB and 256 KiB bodies), ``failed``; and the memory's size at 50,000 entries.
2. The shared mark's round trip (``SharedRetryMarks.take``, the one a request claiming a
   retry pays when this process cannot place it) against the machine's Redis.
3. Whether the official openai SDK sends its retry on the connection of the failed attempt:
   a loopback server answers 503 with ``retry-after-ms`` = each wait, then 200, and counts
   the connections. A retry on a new connection may reach any gateway process.

Writes bench/results/retry_identity.md (``--out``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import threading
import time
import tracemalloc
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import openai
import orjson

from gateway.admission.retrymemory import RequestPrint, RetryMemory, SharedRetryMarks
from gateway.redis_client import connect

RESULTS = Path(__file__).parent / "results"
COMPLETION = (
    b'{"id":"c","object":"chat.completion","created":0,"model":"m","choices":[{"index":0,'
    b'"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],'
    b'"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}'
)


def _per_call_ns(fn: Any, calls: int) -> float:
    start = time.perf_counter_ns()
    for _ in range(calls):
        fn()
    return (time.perf_counter_ns() - start) / calls


def memory_costs(calls: int) -> list[tuple[str, str]]:
    mem = RetryMemory(50_000, 60.0)
    mem.failed(RequestPrint("t-other", "k", b"x"))
    clean = RequestPrint("t-a", "k-1", b"x" * 4096)
    rows = [
        (
            "`take`, tenant-key without a mark",
            f"{_per_call_ns(lambda: mem.take(clean), calls):.0f} ns",
        )
    ]
    for size in (4096, 262_144):
        body = os.urandom(size)

        def digest(body: bytes = body) -> None:
            RequestPrint("t-a", "k-1", body).digest  # noqa: B018 - the cost measured

        n = max(100, calls // (size // 1024))
        text = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": body.hex()}]})
        parse_us = _per_call_ns(lambda text=text: orjson.loads(text), n) / 1000
        rows.append(
            (f"(reference: parsing a {len(text) // 1024} KiB JSON body)", f"{parse_us:.1f} µs")
        )
        rows.append(
            (f"body digest, {size // 1024} KiB", f"{_per_call_ns(digest, n) / 1000:.1f} µs")
        )
    prints = [RequestPrint("t-a", "k-1", b"%d" % i) for i in range(calls)]
    for p in prints:
        p.digest  # noqa: B018 - digests outside the timing
    it = iter(prints)
    rows.append(
        ("`failed` (digest known)", f"{_per_call_ns(lambda: mem.failed(next(it)), calls):.0f} ns")
    )
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    full = RetryMemory(50_000, 60.0)
    for i in range(50_000):
        full.failed(RequestPrint(f"t-{i % 500}", f"k-{i % 7}", b"%d" % i))
    size = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    rows.append(("memory at 50,000 entries (tracemalloc)", f"{size / 2**20:.1f} MiB"))
    return rows


async def shared_costs(url: str, calls: int) -> list[tuple[str, str]]:
    client = connect(url, timeout_s=2)
    marks = SharedRetryMarks(client, 60.0)
    p = RequestPrint("t-bench", "k", b"body")
    await marks.take(p)  # load the script
    start = time.perf_counter()
    for _ in range(calls):
        await marks.take(p)
    take_us = (time.perf_counter() - start) / calls * 1e6
    start = time.perf_counter()
    for _ in range(calls):
        await marks.failed(p)
    fail_us = (time.perf_counter() - start) / calls * 1e6
    await client.delete(p.shared_key())
    await client.aclose()
    return [
        (
            "shared `take` (no mark: a claimed retry it cannot confirm), one await",
            f"{take_us:.0f} µs",
        ),
        ("shared `failed` (off the response path)", f"{fail_us:.0f} µs"),
    ]


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, wait_ms: int) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.wait_ms = wait_ms
        self.ports: list[int] = []  # the client port of each request, in order


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, *args: object) -> None:
        pass

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self.server.ports.append(self.client_address[1])
        first = len(self.server.ports) == 1
        body = (
            b'{"error":{"message":"busy","type":"server_error","code":"x"}}'
            if first
            else COMPLETION
        )
        self.send_response(503 if first else 200)
        if first:
            self.send_header("retry-after-ms", str(self.server.wait_ms))
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def sdk_connection(wait_ms: int) -> bool:
    """Whether the openai SDK's retry after a 503 with ``retry-after-ms: wait_ms`` came on
    the failed attempt's connection."""
    server = _Server(wait_ms)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{server.server_address[1]}/v1", api_key="k", max_retries=1
        )
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        client.close()
        return len(set(server.ports)) == 1
    finally:
        server.shutdown()
        server.server_close()


def report(
    rows: list[tuple[str, str]], reuse: list[tuple[int, bool]], args: argparse.Namespace
) -> str:
    lines = [
        "# Identity of retries: cost and connection reuse\n",
        f"Command: `python -m bench.retry_identity --calls {args.calls} --waits "
        f"{','.join(f'{w:g}' for w in args.waits)}`. Machine: {os.cpu_count()} cores, shared with "
        f"other work (load average {os.getloadavg()[0]:.1f} at the end). One run.\n",
        "| what | cost |",
        "|---|---:|",
        *(f"| {what} | {cost} |" for what, cost in rows),
        "",
        f"The openai SDK ({openai.__version__}, default client) retrying once after a 503 with "
        "`retry-after-ms`:\n",
        "| retry-after | retry on the failed attempt's connection |",
        "|---:|---|",
        *(f"| {w:g} s | {'yes' if same else 'no (a new connection)'} |" for w, same in reuse),
    ]
    return "\n".join(lines) + "\n"


def main(args: argparse.Namespace) -> str:
    rows = memory_costs(args.calls)
    url = (
        os.environ.get("BENCH_REDIS_URL")
        or os.environ.get("REDIS_URL")
        or "redis://127.0.0.1:6379/15"
    )
    rows += asyncio.run(shared_costs(url, max(100, args.calls // 100)))
    reuse = [(w, sdk_connection(int(w * 1000))) for w in args.waits]
    text = report(rows, reuse, args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "retry_identity.md").write_text(text)
    print(text)
    return text


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=200_000)
    parser.add_argument(
        "--waits", type=lambda s: [float(x) for x in s.split(",")], default=[1.0, 4.0, 6.0, 30.0]
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    main(parser.parse_args())
