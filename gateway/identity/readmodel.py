"""The control plane's pushed read model, as seen by one gateway process.

Keys and tenants are read from Redis on first use and cached in-process, so the hot path
makes no Redis call for a known key. Correctness comes from the change channel: every
write by the control plane is followed by a ``Change`` on ``fw:cfg:changes``, and the
listener drops the named entry at once (a revoked key is refused within 1 s, in practice
within milliseconds). Two safety nets cover lost messages: the read-model version is
polled every second, and while the channel is not subscribed entries are trusted for only
half a second. Reconnecting drops everything, since changes may have been missed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from contracts import schema
from gateway.config import GatewayConfig
from gateway.errors import Unavailable, jittered_retry_after
from gateway.metrics import GatewayMetrics

log = logging.getLogger("gateway.readmodel")

T = TypeVar("T")

EMPTY_CATALOG = schema.Catalog(families={}, versions={})
# Unknown keys are remembered briefly so a burst of bad keys does not become a burst of
# Redis reads; short, because a key created a moment ago must start working promptly.
NEGATIVE_TTL_S = 1.0
# After a failed read, the store is not asked again for this long: misses are answered
# from the last known record at once (or refused, for a record never seen).
STORE_PROBE_S = 1.0
# A rebuild request lives this long: one per gateway per interval while the model is missing.
REBUILD_REQUEST_TTL_S = 10


def not_loaded() -> Unavailable:
    return Unavailable(
        "The gateway's configuration is being reloaded; retry shortly.",
        code="configuration_loading",
        headers=jittered_retry_after(1, 2),
    )


class _Cache(Generic[T]):
    """Entries expire by deadline; ``epoch`` guards against storing a stale read.

    A lookup that started before an invalidation must not write its (possibly revoked)
    result back afterwards: the epoch taken before the read must still be current.

    Both maps are bounded LRUs. Negative entries (an identifier the store does not hold)
    live apart from the records, with their own smaller bound: anyone can mint unknown
    identifiers, and they must neither grow the process nor push real records out.
    """

    def __init__(self, max_entries: int = 100_000, max_negative: int = 10_000) -> None:
        self.entries: OrderedDict[str, tuple[float, T | None]] = OrderedDict()
        self.negative: OrderedDict[str, float] = OrderedDict()
        self.epoch = 0
        self._max = max_entries
        self._max_negative = max_negative

    def get(self, ident: str, now: float) -> tuple[bool, T | None]:
        entry = self.entries.get(ident)
        if entry is None:
            expires = self.negative.get(ident)
            if expires is not None and expires > now:
                return True, None
            return False, None
        if entry[0] <= now:
            return False, None
        self.entries.move_to_end(ident)
        return True, entry[1]

    def last_known(self, ident: str) -> tuple[float, T | None] | None:
        """The entry even if expired (``None``: never cached or dropped by a change)."""
        entry = self.entries.get(ident)
        if entry is None and ident in self.negative:
            return self.negative[ident], None
        return entry

    def put(self, ident: str, value: T | None, expires: float, epoch: int) -> None:
        if epoch != self.epoch:
            return
        if value is None:
            self.entries.pop(ident, None)
            self.negative[ident] = expires
            self.negative.move_to_end(ident)
            while len(self.negative) > self._max_negative:
                self.negative.popitem(last=False)
            return
        self.negative.pop(ident, None)
        self.entries[ident] = (expires, value)
        self.entries.move_to_end(ident)
        while len(self.entries) > self._max:
            self.entries.popitem(last=False)

    def drop(self, ident: str) -> None:
        self.epoch += 1
        self.entries.pop(ident, None)
        self.negative.pop(ident, None)

    def clear(self) -> None:
        self.epoch += 1
        self.entries.clear()
        self.negative.clear()


class ReadModelCache:
    def __init__(self, redis: Redis, config: GatewayConfig, metrics: GatewayMetrics) -> None:
        self._redis = redis
        self._config = config
        self._metrics = metrics
        self._keys: _Cache[schema.KeyRecord] = _Cache(
            config.auth_cache_max_entries, config.auth_negative_cache_max
        )
        self._tenants: _Cache[schema.TenantRecord] = _Cache(
            config.auth_cache_max_entries, config.auth_negative_cache_max
        )
        self._catalog: schema.Catalog = EMPTY_CATALOG
        self._version = -1
        self._subscribed = False
        self._tasks: list[asyncio.Task[None]] = []
        self._catalog_listeners: list[Callable[[schema.Catalog], None]] = []
        self._tenant_listeners: list[Callable[[str | None], None]] = []
        self._loading: dict[tuple[str, str], tuple[int, asyncio.Future[Any]]] = {}
        self._store_down_until = 0.0  # monotonic
        # The hit counters, resolved once: they are bumped twice per request.
        self._hits = {k: metrics.auth_cache.labels(k, "hit") for k in ("key", "tenant")}

    # -- lifecycle ---------------------------------------------------------------------
    async def start(self) -> None:
        await self.reload_catalog()
        self._tasks = [
            asyncio.create_task(self._listen(), name="readmodel-listen"),
            asyncio.create_task(self._poll_version(), name="readmodel-poll"),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            # A cancellation that meets redis-py's own read timeout in the pubsub wait can
            # come out as that timeout, which the listener takes for a lost channel and
            # resubscribes: ask again until the task is really gone.
            while not task.done():
                await asyncio.wait({task}, timeout=0.5)
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []

    def on_catalog(self, listener: Callable[[schema.Catalog], None]) -> None:
        self._catalog_listeners.append(listener)
        listener(self._catalog)

    def on_tenant_change(self, listener: Callable[[str | None], None]) -> None:
        """Call ``listener(tenant_id)`` when a tenant's record changes (None: all may have)."""
        self._tenant_listeners.append(listener)

    @property
    def subscribed(self) -> bool:
        return self._subscribed

    @property
    def version(self) -> int:
        """The newest read-model version this process has seen (-1 before the first)."""
        return self._version

    @property
    def catalog(self) -> schema.Catalog:
        return self._catalog

    # -- lookups -----------------------------------------------------------------------
    async def key(self, key_hash: str) -> schema.KeyRecord | None:
        return await self._lookup(
            self._keys, "key", key_hash, schema.key_redis_key(key_hash), schema.load_key
        )

    def cached_key(self, key_hash: str) -> schema.KeyRecord | None:
        """A key this process holds and still trusts, without asking the store."""
        hit, value = self._keys.get(key_hash, time.monotonic())
        return value if hit else None

    async def tenant(self, tenant_id: str) -> schema.TenantRecord | None:
        return await self._lookup(
            self._tenants,
            "tenant",
            tenant_id,
            schema.tenant_redis_key(tenant_id),
            schema.load_tenant,
        )

    async def _lookup(
        self,
        cache: _Cache[T],
        kind: str,
        ident: str,
        redis_key: str,
        load: Callable[[bytes | str], T],
    ) -> T | None:
        now = time.monotonic()
        hit, value = cache.get(ident, now)
        if hit:
            self._hits[kind].inc()
            return value
        self._metrics.auth_cache.labels(kind, "miss").inc()
        # Single flight: concurrent misses of one entry share one read — unless the cache
        # was invalidated since that read began (it may return what was just revoked).
        epoch = cache.epoch
        flight = self._loading.get((kind, ident))
        if flight is None or flight[0] != epoch:
            reading = self._load(cache, kind, ident, redis_key, load, epoch)
            task: asyncio.Future[Any] = asyncio.ensure_future(reading)
            flight = (epoch, task)
            self._loading[(kind, ident)] = flight
            task.add_done_callback(functools.partial(self._landed, (kind, ident)))
        # Shielded: a waiter that goes away (client disconnect) leaves the read to the rest.
        result: T | None = await asyncio.shield(flight[1])
        return result

    def _landed(self, key: tuple[str, str], task: asyncio.Future[Any]) -> None:
        if self._loading.get(key, (0, None))[1] is task:
            del self._loading[key]
        if not task.cancelled():
            task.exception()  # retrieved here, in case every waiter has gone

    async def _load(
        self,
        cache: _Cache[T],
        kind: str,
        ident: str,
        redis_key: str,
        load: Callable[[bytes | str], T],
        epoch: int,
    ) -> T | None:
        known = cache.last_known(ident)
        down = time.monotonic() < self._store_down_until
        try:
            if down:
                # Failed within the last probe interval: do not make every request wait for
                # its own timeout (a store that drops packets costs one per request).
                raise RedisConnectionError("the configuration store failed moments ago")
            if known is None:
                raw = await self._redis.get(redis_key)
            else:
                # An expired entry is only a safety net's refresh (changes are pushed): with
                # the answer on hand, a slow store is not waited for long.
                async with asyncio.timeout(self._config.stale_refresh_timeout_s):
                    raw = await self._redis.get(redis_key)
        except (RedisError, TimeoutError) as exc:
            unreachable = isinstance(exc, RedisConnectionError | RedisTimeoutError | TimeoutError)
            if unreachable and not down:
                self._store_down_until = time.monotonic() + STORE_PROBE_S
                log.warning("configuration store unreachable (%r); serving cached records", exc)
            if known is None:
                raise
            # Stale-if-error (docs/design.md §8): the store is unreachable, and nothing can change a
            # record while it is down (the control plane writes through it), so the last known one
            # stands; without this a Redis outage would refuse all traffic, not just fail
            # the limits open/closed as designed. It stands for another probe interval (a
            # change announced meanwhile still drops it: the epoch guards the put).
            self._metrics.auth_cache.labels(kind, "stale").inc()
            cache.put(ident, known[1], time.monotonic() + STORE_PROBE_S, epoch)
            return known[1]
        record: T | None = None
        if raw is not None:
            try:
                record = load(raw)
            except (ValueError, TypeError, KeyError) as exc:
                # A record we cannot parse is treated as absent (refuse rather than guess).
                log.error("unparseable %s record %s: %r", kind, ident[:16], exc)
        if record is None and not await self._model_loaded():
            # Not "revoked": the store lost its records (restart, flush). Known entries keep
            # being served from this process; unknown ones are told to retry, not cached.
            raise not_loaded()
        if record is None:
            ttl = NEGATIVE_TTL_S
        elif self._subscribed:
            ttl = self._config.cache_ttl_s
        else:
            ttl = self._config.cache_ttl_unsubscribed_s
        cache.put(ident, record, time.monotonic() + ttl, epoch)
        return record

    async def _model_loaded(self) -> bool:
        """Whether the control plane's last full rebuild is still in the store; when it is
        not, ask for one (a flag the control plane's beat checks every few seconds)."""
        if await self._redis.exists(schema.LOADED_KEY):
            return True
        with contextlib.suppress(RedisError):
            if await self._redis.set(
                schema.REBUILD_REQUEST_KEY,
                self._config.instance_id,
                nx=True,
                ex=REBUILD_REQUEST_TTL_S,
            ):
                log.warning("read model not loaded (store restarted or flushed?); rebuild asked")
        return False

    # -- invalidation ------------------------------------------------------------------
    def apply(self, change: schema.Change) -> bool:
        """Drop what ``change`` names; True when the catalog must be reloaded."""
        self._version = max(self._version, change.version)
        self._metrics.readmodel_invalidations.labels(change.kind).inc()
        if change.kind == "key":
            self._keys.drop(change.ident)
        elif change.kind == "tenant":
            self._tenants.drop(change.ident)
            for listener in self._tenant_listeners:
                listener(change.ident)
        elif change.kind == "catalog":
            return True
        else:
            self.invalidate_all()
            return True
        return False

    def invalidate_all(self) -> None:
        self._keys.clear()
        self._tenants.clear()
        for listener in self._tenant_listeners:
            listener(None)

    async def reload_catalog(self) -> None:
        raw = await self._redis.get(schema.CATALOG_KEY)
        if raw is None and self._catalog.versions and not await self._model_loaded():
            # The store lost its records (a restart, a flush), not the fleet its replicas:
            # keep routing on the catalog we have (and its replicas' health) until the
            # control plane's rebuild, which this asked for, announces a new one.
            log.warning("catalog absent from a store that is not loaded; keeping ours")
            return
        if raw is None:
            catalog = EMPTY_CATALOG
        else:
            try:
                catalog = schema.load_catalog(raw)
            except (ValueError, TypeError, KeyError) as exc:
                log.error("unparseable catalog, keeping the previous one: %r", exc)
                return
        self._catalog = catalog
        for listener in self._catalog_listeners:
            listener(catalog)

    async def _listen(self) -> None:
        backoff = 0.05
        while True:
            pubsub = self._redis.pubsub()
            try:
                await pubsub.subscribe(schema.CHANGES_CHANNEL)
                while (await pubsub.get_message(timeout=1.0)) is None:
                    pass  # the first message is the subscribe confirmation
                # Anything may have changed while we were not listening.
                self._subscribed = True
                self.invalidate_all()
                await self.reload_catalog()
                backoff = 0.05
                while True:
                    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                    if message is not None:
                        await self._on_message(message)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - any failure: resubscribe
                log.warning("change channel lost (%r); resubscribing", exc)
            finally:
                self._subscribed = False
                with contextlib.suppress(Exception):
                    await pubsub.aclose()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 2.0)

    async def _on_message(self, message: dict[str, Any]) -> None:
        try:
            change = schema.load_change(message["data"])
        except (ValueError, TypeError, KeyError) as exc:
            log.error("unparseable change message, dropping all cached entries: %r", exc)
            self.invalidate_all()
            await self.reload_catalog()
            return
        if self.apply(change):
            await self.reload_catalog()

    async def _poll_version(self) -> None:
        """Catch a change whose message was lost: the version moved past what we saw."""
        while True:
            await asyncio.sleep(self._config.version_poll_s)
            try:
                raw = await self._redis.get(schema.VERSION_KEY)
            except Exception as exc:  # noqa: BLE001
                log.debug("version poll failed: %r", exc)
                continue
            version = int(raw) if raw is not None else 0
            if version != self._version:
                if self._version >= 0:
                    log.info(
                        "read model moved %s -> %s unannounced; dropping caches",
                        self._version,
                        version,
                    )
                    self.invalidate_all()
                    with contextlib.suppress(Exception):
                        await self.reload_catalog()
                self._version = version
