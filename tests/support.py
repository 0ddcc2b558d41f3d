"""Helpers shared by the suites: free ports, waiting, a flushed Redis DB, gateway processes."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import httpx
import redis

ROOT = Path(__file__).resolve().parents[1]
T = TypeVar("T")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def flushed_redis(url: str) -> Iterator[redis.Redis]:
    """A client of the tests' Redis DB, emptied before and after (FLUSHDB, never FLUSHALL)."""
    client = redis.Redis.from_url(url)
    client.flushdb()
    try:
        yield client
    finally:
        client.flushdb()
        client.close()


def wait_until(
    predicate: Callable[[], T], timeout: float, interval: float = 0.02, what: str = ""
) -> T:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")
        time.sleep(interval)


@dataclass(frozen=True)
class LaunchedGateway:
    process: subprocess.Popen[bytes]
    port: int
    spool_dir: Path
    log_path: Path


def launch_gateway(
    tmp: Path,
    redis_url: str,
    *,
    workers: int = 1,
    env: dict[str, str] | None = None,
    spool_dir: Path | None = None,
    ready_timeout: float = 30.0,
) -> LaunchedGateway:
    """Start ``python -m gateway`` on a free loopback port and wait for ``/readyz``.

    The child gets no KAFKA_BOOTSTRAP unless ``env`` names one (usage events then stay in
    its spool), and never the caller's Prometheus multiprocess directory.
    """
    port = free_port()
    spool = spool_dir or tmp / f"spool-{port}"
    log_path = tmp / f"gateway-{port}.log"
    child_env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PROMETHEUS_MULTIPROC_DIR", "KAFKA_BOOTSTRAP")
    }
    child_env.update(
        {
            "REDIS_URL": redis_url,
            "GATEWAY_SPOOL_DIR": str(spool),
            "FAIRWAY_ENV": "development",
            "PYTHONPATH": str(ROOT),
            **(env or {}),
        }
    )
    argv = [sys.executable, "-m", "gateway", "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--workers", str(workers), "--log-level", "info"]
    with open(log_path, "ab") as logfile:
        process = subprocess.Popen(
            argv, cwd=ROOT, env=child_env, stdout=logfile, stderr=subprocess.STDOUT
        )

    def ready() -> bool:
        if process.poll() is not None:
            log = log_path.read_text(errors="replace")
            raise AssertionError(f"gateway exited with {process.returncode}:\n{log}")
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200
        return False

    try:
        wait_until(ready, ready_timeout, interval=0.1, what="gateway /readyz")
    except BaseException:
        process.kill()
        process.wait(timeout=10)
        raise
    return LaunchedGateway(process, port, spool, log_path)
