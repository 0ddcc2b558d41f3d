"""One gateway process: its components and their explicit lifecycle.

``Gateway`` owns everything a worker process holds (Redis client, read model, replica
registry, upstream pool, usage producer, admission), starts/stops it in order and composes
the ASGI app: each endpoint is handed the components it uses (the request pipeline its
services, the exchange its own), so nothing reaches back into this object.
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
from typing import Any

import uvicorn
from redis.asyncio import Redis

from fairway import logs as fairway_logs
from gateway.admission.controller import AdmissionController
from gateway.admission.idempotency import IdempotencyStore
from gateway.admission.prefix import KVEventSubscriber, PrefixIndex
from gateway.admission.replicas import ReplicaRegistry
from gateway.admission.retrymemory import RetryIdentity, RetryMemory, SharedRetryMarks
from gateway.admission.router import Router
from gateway.admission.tokens import CountingPool
from gateway.config import GatewayConfig
from gateway.endpoints.chat import ChatCompletions
from gateway.endpoints.completions import Completions
from gateway.endpoints.models import ModelsList
from gateway.endpoints.pipeline import PipelineServices, RequestPipeline
from gateway.identity.auth import Authenticator, FailureLimiter, LastUsedRecorder
from gateway.identity.readmodel import ReadModelCache
from gateway.lifecycle import Lifecycle
from gateway.metrics import GatewayMetrics
from gateway.redis_client import connect
from gateway.serving.app import GatewayApp, Readiness
from gateway.serving.connections import RecentRefusals, TenantConnections, header_protocol
from gateway.upstream.client import UpstreamClient
from gateway.upstream.exchange import ExchangeServices, FirstTokens
from gateway.usage.producer import UsageProducer

log = logging.getLogger("gateway.server")

# Redis is probed in the background (each probe bounded by the client's own timeout), so
# /readyz answers from memory at once even while Redis is frozen.
DEPENDENCY_PROBE_S = 1.0


class Gateway:
    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.metrics = GatewayMetrics(config.metrics_tenant_labels)
        urls = config.redis_urls()
        self.redis: Redis = self._shared_client(urls["readmodel"])
        # Idempotency records share the read model's client when they share its Redis.
        self.idempotency_redis: Redis = (
            self.redis
            if urls["idempotency"] == urls["readmodel"]
            else self._shared_client(urls["idempotency"])
        )
        # The limits store gets its own client whatever its URL: short timeouts and no
        # redis-py backoff, so that docs/design.md §8's fallback answers in milliseconds when
        # the store is gone (the shared client waits seconds).
        self.limits_redis: Redis = connect(
            urls["limits"],
            timeout_s=config.admission_redis_timeout_s,
            cluster=config.redis_cluster,
            tls=config.redis_tls,
        )
        self.readmodel = ReadModelCache(self.redis, config, self.metrics)
        self.last_used = LastUsedRecorder(self.redis, config.last_used_flush_s)
        self.auth = Authenticator(
            self.readmodel,
            config.key_pepper,
            self.last_used,
            previous_pepper=config.key_pepper_previous,
            failures=FailureLimiter(
                config.auth_failure_burst,
                config.auth_failure_per_s,
                config.auth_failure_addresses,
            ),
            legacy_keys=config.legacy_api_keys,
        )
        self.registry = ReplicaRegistry(config, self.metrics)
        self.prefix_index = PrefixIndex(
            max_blocks_per_replica=config.prefix_index_blocks, ttl_s=config.prefix_index_ttl_s
        )
        self.router = Router(self.registry, config=config.admission, index=self.prefix_index)
        # One SUB socket per replica that publishes KV-cache events (GATEWAY_PREFIX_KV_EVENTS).
        self.kv_events = [
            KVEventSubscriber(self.prefix_index, rid, endpoint)
            for rid, endpoint in config.prefix_kv_events.items()
        ]
        self.admission = AdmissionController(
            registry=self.registry,
            router=self.router,
            config=config,
            metrics=self.metrics,
            client=self.limits_redis,
        )
        self.upstream = UpstreamClient(config)
        self.idempotency = IdempotencyStore(
            self.idempotency_redis,
            config.idempotency_ttl_s,
            config.idempotency_inflight_ttl_s,
            refused_ttl_s=config.idempotency_refused_ttl_s,
            max_records=config.idempotency_max_records,
            max_bytes=config.idempotency_max_bytes,
        )
        self.usage = UsageProducer(
            spool_dir=config.spool_dir,
            bootstrap=config.kafka_bootstrap,
            topic=config.usage_topic,
            metrics=self.metrics,
            instance_id=config.instance_id,
            segment_bytes=config.spool_segment_bytes,
            unhealthy_after_s=config.spool_unhealthy_s,
            unhealthy_events=config.spool_unhealthy_events,
            max_unwritten_events=config.spool_max_unwritten_events,
        )
        # The last background probe's failure per role (None: it answered).
        self.redis_problems: dict[str, str | None] = dict.fromkeys(urls)
        for role in urls:  # every role's series from the start: 0 until the first probe
            self.metrics.redis_up.labels(role).set(0)
        self._probe: asyncio.Task[None] | None = None
        self.tenant_connections = TenantConnections(config.tenant_max_concurrent)
        self.counting = CountingPool()
        self.recent_refusals = RecentRefusals()
        # New limits for a tenant: what its old ones refused is asked again at once.
        self.readmodel.on_tenant_change(self.recent_refusals.forget)
        self.lifecycle = Lifecycle()
        # R6's identity of retries: this process's memory of retryable failures, and their
        # marks beside the idempotency records for a retry that reaches another process.
        adm = config.admission
        self.retries = RetryIdentity(
            RetryMemory(adm.retry_memory_entries, adm.retry_memory_ttl_s),
            SharedRetryMarks(self.idempotency_redis, adm.retry_memory_ttl_s)
            if adm.retry_memory_shared
            else None,
            self.lifecycle.spawn,
        )
        # The endpoints get the components they use, not this object.
        self.exchange_services = ExchangeServices(
            config=config,
            metrics=self.metrics,
            upstream=self.upstream,
            registry=self.registry,
            router=self.router,
            admission=self.admission,
            idempotency=self.idempotency,
            usage=self.usage,
            lifecycle=self.lifecycle,
            first_tokens=FirstTokens(),
        )
        self.pipeline = RequestPipeline(
            PipelineServices(
                auth=self.auth,
                readmodel=self.readmodel,
                tenant_connections=self.tenant_connections,
                recent_refusals=self.recent_refusals,
                exchange=self.exchange_services,
                retries=self.retries,
                counting=self.counting,
            )
        )

    def _shared_client(self, url: str) -> Redis:
        # Fast-failing and blocking (gateway/redis_client.py): a burst of cold lookups
        # queues for a connection instead of failing, and an outage is seen in one timeout
        # instead of redis-py's retry backoff, so stale-if-error (docs/design.md §8) answers
        # promptly.
        return connect(
            url,
            timeout_s=self.config.redis_timeout_s,
            max_connections=self.config.redis_max_connections,
            health_check_interval=10,
            cluster=self.config.redis_cluster,
            tls=self.config.redis_tls,
        )

    def _role_clients(self) -> dict[str, Redis]:
        return {
            "readmodel": self.redis,
            "idempotency": self.idempotency_redis,
            "limits": self.limits_redis,
        }

    def _stores(self) -> list[tuple[tuple[str, ...], Redis]]:
        """Each distinct Redis (by URL): the roles it serves and one client of it (the read
        model's first), so one store is probed once and reported once."""
        urls = self.config.redis_urls()
        by_url: dict[str, list[str]] = {}
        for role in self._role_clients():
            by_url.setdefault(urls[role], []).append(role)
        clients = self._role_clients()
        return [(tuple(roles), clients[roles[0]]) for roles in by_url.values()]

    @staticmethod
    def _store_name(roles: tuple[str, ...]) -> str:
        # "redis" for the read model's store, as before roles had their own URLs.
        return "redis" if "readmodel" in roles else f"redis ({', '.join(roles)})"

    @property
    def draining(self) -> bool:
        return self.lifecycle.draining

    @property
    def started(self) -> bool:
        return self.lifecycle.started

    def begin_drain(self) -> None:
        """New generation requests get 503 ``shutting_down`` and /readyz turns 503."""
        self.lifecycle.draining = True

    def app(self) -> GatewayApp:
        """The ASGI app over this process's components."""
        return GatewayApp(
            config=self.config,
            metrics=self.metrics,
            chat=ChatCompletions(self.pipeline, self.config, self.upstream),
            completions=Completions(self.pipeline),
            models=ModelsList(self.auth, self.readmodel),
            readiness=self.readiness,
            startup=self.startup,
            shutdown=self.shutdown,
        )

    def readiness(self) -> Readiness:
        """Whether this process can serve (``problems``), and which of its dependencies
        are down while it serves on (``degraded``); see ``Readiness``."""
        problems = []
        if self.lifecycle.draining:
            problems.append("draining")
        if not self.lifecycle.started:
            problems.append("starting")
        elif not self.readmodel.catalog.versions:
            problems.append("read model not loaded")
        if not self.registry.any_healthy():
            problems.append("no replica reachable")
        if (backlog := self.usage.backlog_problem()) is not None:
            problems.append(backlog)
        spool_problem = self.usage.spool_problem()
        broker_problem = self.usage.broker_problem()
        redis_problems = [
            f"{self._store_name(roles)}: {problem}"
            for roles, _ in self._stores()
            if (problem := self.redis_problems[roles[0]]) is not None
        ]
        degraded = [
            *redis_problems,
            *(p for p in (spool_problem, broker_problem) if p is not None),
        ]
        self.metrics.spool_writable.set(0 if spool_problem else 1)
        self.metrics.ready.set(0 if problems else 1)
        return Readiness(
            problems=problems,
            degraded=degraded,
            dependencies={
                # The read model's store, then any role kept apart from it.
                "redis": self.redis_problems["readmodel"] is None,
                **{
                    f"redis_{role}": self.redis_problems[role] is None
                    for roles, _ in self._stores()
                    if "readmodel" not in roles
                    for role in roles
                },
                "usage_spool_writable": spool_problem is None,
                "usage_broker": broker_problem is None,
            },
        )

    async def _probe_dependencies(self) -> None:
        stores = self._stores()
        while True:
            for roles, client in stores:
                try:
                    await client.ping()
                    problem = None
                except Exception as exc:  # noqa: BLE001 - any failure: that store is down for us
                    problem = repr(exc)
                if problem != self.redis_problems[roles[0]]:
                    log.warning("%s %s", self._store_name(roles), problem or "answers again")
                for role in roles:
                    self.redis_problems[role] = problem
                    self.metrics.redis_up.labels(role).set(0 if problem else 1)
            self.metrics.ready.set(0 if self.readiness().problems else 1)
            await asyncio.sleep(DEPENDENCY_PROBE_S)

    async def startup(self) -> None:
        await self.redis.ping()
        await self.upstream.start()
        self.usage.start()
        await self.readmodel.start()
        for sub in self.kv_events:
            sub.start()
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
        self.lifecycle.started = True
        self._probe = asyncio.create_task(self._probe_dependencies(), name="dependency-probe")
        log.info(
            "gateway %s ready: %d model versions, %d healthy replicas",
            self.config.instance_id,
            len(self.readmodel.catalog.versions),
            sum(1 for v in self.readmodel.catalog.versions for _ in self.registry.healthy(v)),
        )

    async def shutdown(self) -> None:
        self.begin_drain()
        if self._probe is not None:
            self._probe.cancel()
        await self.lifecycle.wait_background(5.0)
        with contextlib.suppress(Exception):
            await self.admission.stop()
        with contextlib.suppress(Exception):
            await self.last_used.stop()
        for sub in self.kv_events:
            with contextlib.suppress(Exception):
                await sub.stop()
        with contextlib.suppress(Exception):
            await self.registry.stop()
        with contextlib.suppress(Exception):
            await self.readmodel.stop()
        with contextlib.suppress(Exception):
            await self.upstream.aclose()
        self.counting.close()
        # Blocking join of the producer thread: run it off the event loop.
        await asyncio.to_thread(self.usage.stop, 10.0)
        self.usage.close()
        for client in {id(c): c for c in self._role_clients().values()}.values():
            with contextlib.suppress(Exception):
                await client.aclose()
        log.info("gateway %s stopped", self.config.instance_id)


class _Uvicorn(uvicorn.Server):
    """uvicorn's server, telling the gateway the moment a drain begins."""

    def __init__(self, config: uvicorn.Config, gateway: Gateway) -> None:
        super().__init__(config)
        self._gateway = gateway

    def handle_exit(self, sig: int, frame: Any) -> None:
        self._gateway.begin_drain()
        super().handle_exit(sig, frame)
        # uvicorn re-raises the signal after shutting down (dying by it); a completed
        # drain is a clean exit, so report 0 instead.
        self._captured_signals.clear()


class GatewayServer:
    def __init__(
        self, config: GatewayConfig, *, log_level: str = "info", access_log: bool = False
    ) -> None:
        self.config = config
        self.gateway = Gateway(config)
        self.app = self.gateway.app()
        self._log_level = log_level
        self._access_log = access_log
        self._server: _Uvicorn | None = None

    def uvicorn_config(self, **kwargs: Any) -> uvicorn.Config:
        return uvicorn.Config(
            self.app,
            loop="uvloop",
            http=header_protocol(self.config.header_timeout_s),
            # Past this many open connections and requests, uvicorn answers 503 at once.
            limit_concurrency=self.config.limit_concurrency,
            lifespan="on",
            log_level=self._log_level,
            access_log=self._access_log,
            # JSON logs: uvicorn's loggers go through the root handler (fairway.logs)
            # instead of its own plain-text configuration.
            log_config=None if fairway_logs.json_enabled() else uvicorn.config.LOGGING_CONFIG,
            timeout_graceful_shutdown=int(self.config.drain_deadline_s) or 1,
            timeout_keep_alive=30,
            server_header=False,
            # No X-Forwarded-* rewriting: nothing here reads the client address, and the
            # middleware is one more coroutine layer on every request.
            proxy_headers=False,
            **kwargs,
        )

    async def serve(
        self,
        *,
        sock: socket.socket | None = None,
        host: str = "127.0.0.1",
        port: int = 8080,
        metrics_sock: socket.socket | None = None,
    ) -> None:
        if sock is not None:
            # One uvicorn server on both listeners (one lifecycle and drain); the app tells
            # them apart by the port a request arrived on (serving/app.py).
            config = self.uvicorn_config()
            self._server = _Uvicorn(config, self.gateway)
            await self._server.serve(
                sockets=[sock] if metrics_sock is None else [sock, metrics_sock]
            )
        else:
            config = self.uvicorn_config(host=host, port=port)
            self._server = _Uvicorn(config, self.gateway)
            await self._server.serve()

    def run(
        self,
        sock: socket.socket | None = None,
        host: str = "127.0.0.1",
        port: int = 8080,
        metrics_sock: socket.socket | None = None,
    ) -> None:
        import uvloop

        uvloop.run(self.serve(sock=sock, host=host, port=port, metrics_sock=metrics_sock))

    @property
    def started(self) -> bool:
        return self._server is not None and self._server.started
