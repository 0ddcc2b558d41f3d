"""Processes and read-model seeding for the admission integration tests.

Real everything: gateway processes (``python -m gateway``), emulated replicas
(``emulator.testing``), Redis. The read model is written straight into Redis with
``gateway.schema`` (as the control plane does), so these tests need no Django.
"""

from __future__ import annotations

import secrets
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from gateway import schema
from gateway.config import DEV_KEY_PEPPER
from tests.support import launch_gateway


@dataclass
class Tenant:
    tenant_id: str
    secret: str

    @property
    def auth(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.secret}"}


@dataclass
class ReadModel:
    """Writes catalog, tenants and keys, announcing each change like the control plane."""

    client: redis.Redis
    versions: dict[str, schema.ModelVersionRecord] = field(default_factory=dict)

    def _announce(self, kind: schema.ChangeKind, ident: str) -> None:
        version = int(self.client.incr(schema.VERSION_KEY))
        self.client.publish(
            schema.CHANGES_CHANNEL,
            schema.dumps(schema.Change(kind=kind, ident=ident, version=version)),
        )

    def add_version(self, version: schema.ModelVersionRecord) -> None:
        self.versions[version.version] = version
        catalog = schema.Catalog(
            families={v.family: v.version for v in self.versions.values()},
            versions=dict(self.versions),
        )
        self.client.set(schema.CATALOG_KEY, schema.dumps(catalog))
        self._announce("catalog", "")

    def tenant(self, cls: schema.AdmissionClass, limits: dict[str, schema.LimitRecord]) -> Tenant:
        tenant_id = "t-" + secrets.token_hex(6)
        secret = schema.API_KEY_PREFIX + secrets.token_urlsafe(32)
        key_hash = schema.hash_api_key(secret, DEV_KEY_PEPPER.encode())
        plan = {"reserved": "enterprise", "standard": "standard", "best_effort": "free"}[cls]
        self.client.set(
            schema.tenant_redis_key(tenant_id),
            schema.dumps(
                schema.TenantRecord(
                    tenant_id=tenant_id,
                    name=tenant_id,
                    plan=plan,
                    admission_class=cls,
                    suspended=False,
                    limits=limits,
                )
            ),
        )
        self.client.set(
            schema.key_redis_key(key_hash),
            schema.dumps(
                schema.KeyRecord(
                    key_id="k-" + secrets.token_hex(6), tenant_id=tenant_id, scopes=("chat",)
                )
            ),
        )
        self._announce("tenant", tenant_id)
        self._announce("key", key_hash)
        return Tenant(tenant_id, secret)


@dataclass
class GatewayProc:
    process: subprocess.Popen[bytes]
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill9(self) -> None:
        self.process.kill()
        self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)


def spawn_gateway(
    tmp: Path, redis_url: str, env: dict[str, str] | None = None, ready_timeout: float = 40.0
) -> GatewayProc:
    """One single-process gateway (``--workers 1``: a kill -9 kills all of it)."""
    launched = launch_gateway(
        tmp,
        redis_url,
        env={"GATEWAY_DRAIN_DEADLINE_S": "5", **(env or {})},
        ready_timeout=ready_timeout,
    )
    return GatewayProc(launched.process, launched.port, launched.log_path)


def chat_body(model: str, prompt_words: int, max_tokens: int, **extra: Any) -> dict[str, Any]:
    """A chat request whose prompt is ``prompt_words + 7`` tokens for the emulator and the
    gateway's estimate alike (one token per short word, plus template overhead)."""
    return {
        "model": model,
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": " ".join(["tok"] * prompt_words)}],
        **extra,
    }


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        if head != name and not head.startswith(name + "{"):
            continue
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total
