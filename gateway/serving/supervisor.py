"""``--workers N``: N gateway processes sharing one listening socket.

uvicorn's own supervisor builds a stock ``uvicorn.Server`` in each child; this one runs a
``GatewayServer`` instead, so each worker owns its ``Gateway`` and its lifecycle. The parent
binds the socket once (children inherit it, as uvicorn does), turns on Prometheus'
multiprocess mode (a scrape lands on a random worker; the files sum all of them),
restarts a worker that dies after it started, and on SIGTERM/SIGINT forwards SIGTERM to
every worker and waits for their drains.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import time
from multiprocessing.process import BaseProcess
from pathlib import Path

log = logging.getLogger("gateway.supervisor")

STARTUP_FAILURE = 3  # uvicorn's exit code when lifespan startup fails


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def worker_main(
    sock: socket.socket,
    log_level: str,
    access_log: bool,
    metrics_sock: socket.socket | None = None,
) -> None:
    from fairway import logs as fairway_logs
    from gateway.config import GatewayConfig
    from gateway.serving.server import GatewayServer

    fairway_logs.configure(log_level)  # LOG_FORMAT=json: JSON lines with the request id
    # The replica scraper's client would log every scrape (4 Hz per replica) at INFO.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))
    server = GatewayServer(GatewayConfig.from_env(), log_level=log_level, access_log=access_log)
    server.run(sock=sock, metrics_sock=metrics_sock)


class Supervisor:
    def __init__(
        self,
        *,
        host: str,
        port: int,
        workers: int,
        drain_deadline_s: float,
        log_level: str = "info",
        access_log: bool = False,
        metrics_port: int | None = None,
    ) -> None:
        self.host, self.port, self.workers = host, port, workers
        self.metrics_port = metrics_port
        self.drain_deadline_s = drain_deadline_s
        self.log_level, self.access_log = log_level, access_log
        self._ctx = multiprocessing.get_context("spawn")
        self._procs: list[BaseProcess] = []
        self._stopping = False
        self._prom_dir: Path | None = None

    def _spawn(self, sock: socket.socket, metrics_sock: socket.socket | None) -> BaseProcess:
        proc = self._ctx.Process(
            target=worker_main,
            name="gateway-worker",
            args=(sock, self.log_level, self.access_log, metrics_sock),
        )
        proc.start()
        log.info("started worker pid=%s", proc.pid)
        return proc

    def _on_signal(self, _signum: int, _frame: object) -> None:
        self._stopping = True

    def run(self) -> int:
        if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            self._prom_dir = Path(tempfile.mkdtemp(prefix="fairway-gateway-prom-"))
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(self._prom_dir)
        sock = bind_socket(self.host, self.port)
        # Shared like the API socket: any worker answers a scrape with every worker's series.
        metrics_sock = bind_socket(self.host, self.metrics_port) if self.metrics_port else None
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        log.info("gateway listening on %s:%s with %d workers", self.host, self.port, self.workers)
        code = 0
        try:
            self._procs = [self._spawn(sock, metrics_sock) for _ in range(self.workers)]
            while not self._stopping:
                time.sleep(0.2)
                for i, proc in enumerate(self._procs):
                    if proc.is_alive() or self._stopping:
                        continue
                    self._mark_dead(proc)
                    if proc.exitcode == STARTUP_FAILURE:
                        log.error("worker pid=%s failed to start; stopping", proc.pid)
                        self._stopping = True
                        code = STARTUP_FAILURE
                        break
                    log.warning("worker pid=%s died (exit %s); restarting", proc.pid, proc.exitcode)
                    self._procs[i] = self._spawn(sock, metrics_sock)
        finally:
            # Our copy of the listener goes first: once the workers close theirs, new
            # connections are refused instead of queueing where nobody accepts them.
            sock.close()
            if metrics_sock is not None:
                metrics_sock.close()
            self._stop_all()
            if self._prom_dir is not None:
                shutil.rmtree(self._prom_dir, ignore_errors=True)
        return code

    def _mark_dead(self, proc: BaseProcess) -> None:
        if proc.pid is None:
            return
        with contextlib.suppress(Exception):
            from prometheus_client import multiprocess

            multiprocess.mark_process_dead(proc.pid)

    def _stop_all(self) -> None:
        for proc in self._procs:
            if proc.is_alive() and proc.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGTERM)
        # Drain deadline, then the shutdown's own bounded steps (usage flush ≤ 10 s).
        deadline = time.monotonic() + self.drain_deadline_s + 20.0
        for proc in self._procs:
            proc.join(max(0.1, deadline - time.monotonic()))
            if proc.is_alive():
                log.error("worker pid=%s did not stop in time; killing it", proc.pid)
                proc.kill()
                proc.join(5)
            self._mark_dead(proc)
