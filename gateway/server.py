"""One gateway process: its components and their explicit lifecycle.

``Gateway`` owns everything a worker process holds (Redis client, read model, replica
registry, upstream pool, usage producer, admission) and starts/stops it in order.
``GatewayServer`` runs it under uvicorn (uvloop + httptools) on a given socket:

- startup: connect Redis, load the catalog and subscribe to changes, take a first scrape
  of every replica, start the usage producer (which adopts spools left by dead processes)
  and admission;
- SIGTERM/SIGINT: ``/readyz`` turns 503 and new chat requests get 503 ``shutting_down``
  at once; uvicorn closes the listener and idle connections and lets in-flight streams
  finish, up to ``drain_deadline_s``; past it, remaining requests are cancelled (their
  terminal handlers still bill them);
- shutdown: wait for terminal handlers' background work, stop admission and scraper, stop
  the usage producer (spooling whatever Kafka did not acknowledge), close Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import socket
from collections.abc import Coroutine
from typing import Any, TypeVar

import uvicorn
from redis.asyncio import Redis

from gateway.admission import AdmissionController
from gateway.auth import Authenticator, LastUsedRecorder
from gateway.config import GatewayConfig
from gateway.idempotency import IdempotencyStore
from gateway.limits import connect
from gateway.metrics import GatewayMetrics
from gateway.readmodel import ReadModel
from gateway.replicas import ReplicaRegistry
from gateway.router import Router
from gateway.upstream import UpstreamClient
from gateway.usage import UsageProducer

log = logging.getLogger("gateway.server")
T = TypeVar("T")


class Gateway:
    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.metrics = GatewayMetrics()
        # Fast-failing and blocking (gateway.limits.connect): a burst of cold lookups
        # queues for a connection instead of failing, and an outage is seen in one timeout
        # instead of redis-py's retry backoff, so stale-if-error answers promptly (§8).
        self.redis: Redis = connect(
            config.redis_url,
            timeout_s=config.redis_timeout_s,
            max_connections=config.redis_max_connections,
            health_check_interval=10,
        )
        self.readmodel = ReadModel(self.redis, config, self.metrics)
        self.last_used = LastUsedRecorder(self.redis, config.last_used_flush_s)
        self.auth = Authenticator(self.readmodel, config.key_pepper, self.last_used)
        self.registry = ReplicaRegistry(config, self.metrics)
        self.router = Router(self.registry, config=config.admission)
        self.admission = AdmissionController(
            redis=self.redis,
            registry=self.registry,
            router=self.router,
            config=config,
            metrics=self.metrics,
        )
        self.upstream = UpstreamClient(config)
        self.idempotency = IdempotencyStore(
            self.redis, config.idempotency_ttl_s, config.idempotency_inflight_ttl_s
        )
        self.usage = UsageProducer(
            spool_dir=config.spool_dir,
            bootstrap=config.kafka_bootstrap,
            topic=config.usage_topic,
            metrics=self.metrics,
            instance_id=config.instance_id,
        )
        self.draining = False
        self.started = False
        # Streams whose first token has not reached the client yet (exchange.Exchange):
        # while any exist, mid-stream relays give way to them for one event-loop turn.
        self.awaiting_first_token = 0
        self._background: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        """Run ``coro`` to completion even if the request that started it is cancelled;
        shutdown waits for it."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("background task failed: %r", task.exception())

    async def startup(self) -> None:
        await self.redis.ping()
        await self.upstream.start()
        self.usage.start()
        await self.readmodel.start()
        self.readmodel.on_catalog(self.registry.sync)
        await self.registry.start()
        await self.last_used.start()
        await self.admission.start()
        # Everything allocated so far (modules, catalog, clients) lives as long as the
        # process: move it out of the collector's reach, so that a full collection under
        # load scans only what requests allocate (a gen-2 pass over the imported world
        # took 30-50 ms here — a stall of every stream in flight).
        gc.collect()
        gc.freeze()
        self.started = True
        log.info(
            "gateway %s ready: %d model versions, %d healthy replicas",
            self.config.instance_id,
            len(self.readmodel.catalog.versions),
            sum(1 for v in self.readmodel.catalog.versions for _ in self.registry.healthy(v)),
        )

    async def shutdown(self) -> None:
        self.draining = True
        if self._background:
            await asyncio.wait(set(self._background), timeout=5.0)
        with contextlib.suppress(Exception):
            await self.admission.stop()
        with contextlib.suppress(Exception):
            await self.last_used.stop()
        with contextlib.suppress(Exception):
            await self.registry.stop()
        with contextlib.suppress(Exception):
            await self.readmodel.stop()
        with contextlib.suppress(Exception):
            await self.upstream.aclose()
        # Blocking join of the producer thread: run it off the event loop.
        await asyncio.to_thread(self.usage.stop, 10.0)
        self.usage.close()
        with contextlib.suppress(Exception):
            await self.redis.aclose()
        log.info("gateway %s stopped", self.config.instance_id)


class _Uvicorn(uvicorn.Server):
    """uvicorn's server, telling the gateway the moment a drain begins."""

    def __init__(self, config: uvicorn.Config, gateway: Gateway) -> None:
        super().__init__(config)
        self._gateway = gateway

    def handle_exit(self, sig: int, frame: Any) -> None:
        self._gateway.draining = True
        super().handle_exit(sig, frame)
        # uvicorn re-raises the signal after shutting down (dying by it); a completed
        # drain is a clean exit, so report 0 instead.
        self._captured_signals.clear()


class GatewayServer:
    def __init__(
        self, config: GatewayConfig, *, log_level: str = "info", access_log: bool = False
    ) -> None:
        from gateway.app import GatewayApp

        self.config = config
        self.gateway = Gateway(config)
        self.app = GatewayApp(self.gateway)
        self._log_level = log_level
        self._access_log = access_log
        self._server: _Uvicorn | None = None

    def uvicorn_config(self, **kwargs: Any) -> uvicorn.Config:
        return uvicorn.Config(
            self.app,
            loop="uvloop",
            http="httptools",
            lifespan="on",
            log_level=self._log_level,
            access_log=self._access_log,
            timeout_graceful_shutdown=int(self.config.drain_deadline_s) or 1,
            timeout_keep_alive=30,
            server_header=False,
            # No X-Forwarded-* rewriting: nothing here reads the client address, and the
            # middleware is one more coroutine layer on every request.
            proxy_headers=False,
            **kwargs,
        )

    async def serve(
        self, *, sock: socket.socket | None = None, host: str = "127.0.0.1", port: int = 8080
    ) -> None:
        if sock is not None:
            config = self.uvicorn_config()
            self._server = _Uvicorn(config, self.gateway)
            await self._server.serve(sockets=[sock])
        else:
            config = self.uvicorn_config(host=host, port=port)
            self._server = _Uvicorn(config, self.gateway)
            await self._server.serve()

    def run(
        self, sock: socket.socket | None = None, host: str = "127.0.0.1", port: int = 8080
    ) -> None:
        import uvloop

        uvloop.run(self.serve(sock=sock, host=host, port=port))

    def request_stop(self) -> None:
        """Begin the graceful drain (what SIGTERM does), e.g. from a test."""
        self.gateway.draining = True
        if self._server is not None:
            self._server.should_exit = True

    @property
    def started(self) -> bool:
        return self._server is not None and self._server.started
