"""``GET /v1/models`` and ``GET /v1/models/{id}``: the model families and pinned versions
the caller's tenant may use, from the read model's catalog and the tenant's limits."""

from __future__ import annotations

import orjson

from contracts.schema import Catalog, LimitRecord
from gateway.errors import NotFound
from gateway.identity.auth import Authenticator
from gateway.identity.readmodel import ReadModelCache
from gateway.serving.http import JSON, Send, send_bytes

MAX_MODEL_ID = 256


class ModelsList:
    def __init__(self, auth: Authenticator, readmodel: ReadModelCache) -> None:
        self.auth = auth
        self.readmodel = readmodel

    async def __call__(
        self,
        send: Send,
        authorization: bytes | None,
        headers: dict[str, str],
        client: str | None,
    ) -> None:
        principal = await self.auth.authenticate(authorization, "models:read", client)
        catalog = self.readmodel.catalog
        allowed = principal.tenant.limits
        data = [
            _family_card(catalog, family)
            for family in sorted(catalog.families)
            if family in allowed
        ]
        data.extend(
            _version_card(catalog, v.version, allowed[v.family])
            for v in sorted(catalog.versions.values(), key=lambda v: v.version)
            if v.family in allowed
        )
        body = orjson.dumps({"object": "list", "data": data})
        await send_bytes(send, 200, body, JSON, headers)

    async def retrieve(
        self,
        send: Send,
        model_id: str,
        authorization: bytes | None,
        headers: dict[str, str],
        client: str | None,
    ) -> None:
        """One model as ``GET /v1/models`` lists it; a model that is not in the catalog and
        one the tenant may not use get the same 404 (the catalog is not the public's)."""
        principal = await self.auth.authenticate(authorization, "models:read", client)
        catalog = self.readmodel.catalog
        allowed = principal.tenant.limits
        card: dict[str, object] | None = None
        if model_id in catalog.families and model_id in allowed:
            card = _family_card(catalog, model_id)
        else:
            version = catalog.versions.get(model_id)
            if version is not None and version.family in allowed:
                card = _version_card(catalog, model_id, allowed[version.family])
        if card is None:
            raise NotFound(
                f"The model `{model_id[:MAX_MODEL_ID]}` does not exist or you do not have "
                "access to it.",
                param="model",
                code="model_not_found",
            )
        await send_bytes(send, 200, orjson.dumps(card), JSON, headers)


def _family_card(catalog: Catalog, family: str) -> dict[str, object]:
    versions = sorted(v.version for v in catalog.versions.values() if v.family == family)
    return _model_card(family, {"current_version": catalog.families[family], "versions": versions})


def _version_card(catalog: Catalog, version: str, limit: LimitRecord) -> dict[str, object]:
    v = catalog.versions[version]
    return _model_card(
        v.version,
        {
            "family": v.family,
            "context_length": min(v.context_length, limit.max_context),
            "max_output": limit.max_output,
        },
    )


def _model_card(model_id: str, extra: dict[str, object]) -> dict[str, object]:
    return {"id": model_id, "object": "model", "created": 0, "owned_by": "fairway", **extra}
