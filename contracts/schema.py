"""The read model: the records the control plane pushes to Redis and the gateway reads.

One schema, two sides. The control plane (Django) imports this module to serialise; the
gateway (no Django) imports it to parse; neither side's code is imported here (``make lint``
checks it).

Redis layout (all keys under the ``fw:cfg:`` prefix):

- ``fw:cfg:version``            integer, bumped on every push
- ``fw:cfg:key:<key_hash>``     KeyRecord JSON (absent once revoked)
- ``fw:cfg:tenant:<tenant_id>`` TenantRecord JSON, limits embedded (one GET per request)
- ``fw:cfg:catalog``            Catalog JSON: model families, versions, replicas
- ``fw:key_last_used``          hash key_id -> unix seconds, written by gateways
- channel ``fw:cfg:changes``    Change JSON, published after every write so that
                                gateways drop their cached copies at once
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal, TypeVar

import orjson

SCHEMA_VERSION = 1

_R = TypeVar("_R")

PREFIX = "fw:cfg:"
VERSION_KEY = PREFIX + "version"
CATALOG_KEY = PREFIX + "catalog"
CHANGES_CHANNEL = PREFIX + "changes"
# Written by every full rebuild: absent, the records cannot be trusted to be complete (a
# restarted or flushed Redis), so an unknown key is "retry" (503), not "revoked" (401).
LOADED_KEY = PREFIX + "loaded"
# Set by a gateway that found LOADED_KEY absent; the control plane rebuilds at once.
REBUILD_REQUEST_KEY = PREFIX + "rebuild_requested"
# Written by gateways (HSET key_id -> unix seconds, batched off the hot path); the
# control plane flushes it into ApiKey.last_used_at.
KEY_LAST_USED_HASH = "fw:key_last_used"

API_KEY_PREFIX = "fw-"

AdmissionClass = Literal["reserved", "standard", "best_effort"]
ADMISSION_CLASSES: tuple[AdmissionClass, ...] = ("reserved", "standard", "best_effort")
Pool = Literal["shared", "reserved"]
Scope = Literal["chat", "models:read"]
SCOPES: tuple[Scope, ...] = ("chat", "models:read")
ChangeKind = Literal["key", "tenant", "catalog", "all"]


def key_redis_key(key_hash: str) -> str:
    return f"{PREFIX}key:{key_hash}"


def tenant_redis_key(tenant_id: str) -> str:
    return f"{PREFIX}tenant:{tenant_id}"


def hash_api_key(secret: str, pepper: bytes) -> str:
    """HMAC-SHA256 of the presented secret with the server-side pepper, hex.

    Both sides hash the same way: the control plane when it stores a key, the
    gateway on every request. The secret itself is never stored anywhere.

    An API key's HMAC input is the secret alone, as it has been since the first key was
    issued: a label here would change every stored digest, and so refuse every issued key.
    Its domain is still apart from the management-API tokens' (``hash_api_token``): an API
    key starts with ``fw-`` and holds no NUL byte (``keyformat.classify``), while every
    token input starts with ``API_TOKEN_DIGEST_LABEL``, so no input is in both.
    """
    return hmac.new(pepper, secret.encode("utf-8"), hashlib.sha256).hexdigest()


# The domain label of management-API token digests, before the token in the HMAC input.
API_TOKEN_DIGEST_LABEL = b"fairway/api-token\0"


def hash_api_token(secret: str, pepper: bytes) -> str:
    """HMAC-SHA256 of a management-API token, labelled, with the API keys' pepper, hex.

    The label keeps the two kinds of digest apart by construction: a token digest is never
    the digest of any API key, and the other way round, whatever secret is presented and
    whichever prefix checks the callers make. Only the control plane computes it; it lives
    here, next to ``hash_api_key``, so that the two HMAC inputs are defined in one place.

    The visible prefixes already keep the plaintexts apart where they are checked: the
    gateway refuses, before hashing, anything that does not start with ``fw-``, which a
    token's ``fwt-`` does not. But the token authentication checks no prefix (the tokens
    carried over from DRF have none), and a digest carries none: the label makes the
    separation a property of the stored digests themselves.
    """
    return hmac.new(
        pepper, API_TOKEN_DIGEST_LABEL + secret.encode("utf-8"), hashlib.sha256
    ).hexdigest()


@dataclass(frozen=True, slots=True)
class KeyLimitRecord:
    """A key's own limits for one model family, enforced on top of its tenant's (both
    apply, so the tighter binds). 0 = the key adds no limit of that kind."""

    rpm: int = 0
    tpm: int = 0
    max_concurrency: int = 0  # requests in flight at once


@dataclass(frozen=True, slots=True)
class KeyRecord:
    key_id: str
    tenant_id: str
    scopes: tuple[str, ...]
    expires_at: int | None = None  # unix seconds, UTC; None = never
    limits: dict[str, KeyLimitRecord] = field(default_factory=dict)  # model family -> limits

    def is_expired(self, now_s: float) -> bool:
        return self.expires_at is not None and now_s >= self.expires_at


@dataclass(frozen=True, slots=True)
class LimitRecord:
    """Per tenant per model family. Plan defaults are resolved before pushing."""

    rpm: int
    tpm: int
    max_context: int
    max_output: int
    kv_seconds_cap: int  # GiB·s of concurrent in-flight KV·seconds
    reserved_kv: int  # GiB·s reserved floor (enterprise); 0 elsewhere


@dataclass(frozen=True, slots=True)
class TenantRecord:
    tenant_id: str
    name: str
    plan: str
    admission_class: AdmissionClass
    suspended: bool
    limits: dict[str, LimitRecord] = field(default_factory=dict)  # model family -> limits

    def limit_for(self, family: str) -> LimitRecord | None:
        return self.limits.get(family)


@dataclass(frozen=True, slots=True)
class ReplicaRecord:
    replica_id: str
    base_url: str
    pool: Pool


@dataclass(frozen=True, slots=True)
class ModelVersionRecord:
    version: str  # e.g. "llama-70b-2026-05": the name replicas serve
    family: str  # e.g. "llama-70b"
    context_length: int
    kv_bytes_per_token: int
    tpot_target_ms: int
    kv_capacity_tokens: int  # KV budget of one replica, in tokens
    replicas: tuple[ReplicaRecord, ...] = ()
    # The replica profile's prefill rate (prompt tokens per second of one replica; 0 =
    # unknown) and the TTFT target: together they say which prompts are long contexts.
    prefill_tokens_per_s: float = 0.0
    ttft_target_ms: int = 1000
    # The share of the threshold prompt's prefill time that is attention (the part that
    # grows with the context; emulator/profiles.py's ``prefill_attention_share``). 0 =
    # unknown (a record from an older control plane): the gateway's configured default.
    prefill_attention_share: float = 0.0
    # Capabilities (absent in older records: off, as before they existed).
    supports_tools: bool = False
    tool_call_parser: str = ""
    supports_structured_output: bool = False
    max_n: int = 1
    supports_logprobs: bool = False
    max_top_logprobs: int = 0


@dataclass(frozen=True, slots=True)
class Catalog:
    families: dict[str, str]  # family -> current version
    versions: dict[str, ModelVersionRecord]

    def resolve(self, model: str) -> ModelVersionRecord | None:
        """An alias resolves to its family's current version; a pinned version stays."""
        version = self.families.get(model, model)
        return self.versions.get(version)


@dataclass(frozen=True, slots=True)
class Change:
    kind: ChangeKind
    ident: str  # key hash, tenant id, or "" for catalog/all
    version: int


# -- serialisation ---------------------------------------------------------------------


def dumps(record: Any) -> bytes:
    payload = asdict(record)
    payload["schema"] = SCHEMA_VERSION
    return orjson.dumps(payload)


def _load(raw: bytes | str) -> dict[str, Any]:
    data: dict[str, Any] = orjson.loads(raw)
    data.pop("schema", None)
    return data


def _known(cls: type[_R], data: dict[str, Any]) -> _R:
    """``cls`` from the fields it knows. A field a newer control plane added is left out
    (added fields are optional, with a default), so gateways and the control plane may be
    upgraded in either order; a missing field without a default still fails."""
    names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    return cls(**{k: v for k, v in data.items() if k in names})


def load_key(raw: bytes | str) -> KeyRecord:
    data = _load(raw)
    data["scopes"] = tuple(data["scopes"])
    data["limits"] = {
        fam: _known(KeyLimitRecord, lim) for fam, lim in data.get("limits", {}).items()
    }
    return _known(KeyRecord, data)


def load_tenant(raw: bytes | str) -> TenantRecord:
    data = _load(raw)
    data["limits"] = {fam: _known(LimitRecord, lim) for fam, lim in data["limits"].items()}
    return _known(TenantRecord, data)


def load_catalog(raw: bytes | str) -> Catalog:
    data = _load(raw)
    versions = {}
    for name, v in data["versions"].items():
        v["replicas"] = tuple(_known(ReplicaRecord, r) for r in v["replicas"])
        versions[name] = _known(ModelVersionRecord, v)
    return Catalog(families=dict(data["families"]), versions=versions)


def load_change(raw: bytes | str) -> Change:
    return _known(Change, _load(raw))
