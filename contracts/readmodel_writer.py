"""A Django-free writer of the read model, for the tests and the benchmarks.

It writes ``contracts.schema`` records straight into Redis and announces each change the
way the control plane's push does (write, bump ``VERSION_KEY``, publish a ``Change``), so a
gateway under test cannot tell it from the control plane. The control plane's own writer
(``tenants/readmodel.py``) diffs against the database; this one writes what it is given.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from contracts import schema
from contracts.defaults import DEV_KEY_PEPPER
from contracts.publish import publish_change


class ReadModelWriter:
    def __init__(self, client: Any, *, pepper: bytes = DEV_KEY_PEPPER.encode()) -> None:
        self.client = client  # a sync redis.Redis
        self.pepper = pepper

    def key_hash(self, secret: str) -> str:
        return schema.hash_api_key(secret, self.pepper)

    def mark_loaded(self) -> None:
        """As the control plane's full rebuild leaves it: the records are complete."""
        self.client.set(schema.LOADED_KEY, "1")

    def announce(self, kind: schema.ChangeKind, ident: str) -> int:
        version = int(self.client.incr(schema.VERSION_KEY))
        publish_change(self.client, kind, ident, version)
        return version

    def put_catalog(self, catalog: schema.Catalog) -> None:
        self.client.set(schema.CATALOG_KEY, schema.dumps(catalog))

    def put_tenant(self, record: schema.TenantRecord) -> None:
        self.client.set(schema.tenant_redis_key(record.tenant_id), schema.dumps(record))

    def put_key(self, secret: str, record: schema.KeyRecord) -> str:
        """Store the key under the hash of ``secret``; returns that hash."""
        key_hash = self.key_hash(secret)
        self.client.set(schema.key_redis_key(key_hash), schema.dumps(record))
        return key_hash

    def delete_key(self, key_hash: str) -> None:
        self.client.delete(schema.key_redis_key(key_hash))

    def put_all(
        self,
        keys: Iterable[tuple[str, schema.KeyRecord]],
        tenants: Iterable[schema.TenantRecord],
        catalog: schema.Catalog,
    ) -> int:
        """Keys (secret, record), tenants and the catalog in one pipeline, marked loaded and
        announced as one "all" change, as a full rebuild does. Returns the new version."""
        pipe = self.client.pipeline()
        for secret, key in keys:
            pipe.set(schema.key_redis_key(self.key_hash(secret)), schema.dumps(key))
        for tenant in tenants:
            pipe.set(schema.tenant_redis_key(tenant.tenant_id), schema.dumps(tenant))
        pipe.set(schema.CATALOG_KEY, schema.dumps(catalog))
        pipe.set(schema.LOADED_KEY, "1")
        pipe.incr(schema.VERSION_KEY)
        version = int(pipe.execute()[-1])
        publish_change(self.client, "all", "", version)
        return version
