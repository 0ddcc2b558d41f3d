"""Settings that name a file per model, read the same way by the gateway
(``GATEWAY_TOKENIZER_FILES``, ``GATEWAY_CHAT_TEMPLATES``) and by the control plane's
deployment tools (``catalog.tokenizer_fetch``, which fetches those files for it)."""

from __future__ import annotations

import orjson


def model_paths(name: str, raw: str) -> dict[str, str]:
    """``{"model": "/path", ...}`` or ``model=/path,model2=/path2`` (setting ``name``);
    ValueError naming the setting when it is neither."""
    raw = raw.strip()
    if not raw:
        return {}
    if raw.startswith("{"):
        try:
            files = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise ValueError(f"{name} is not valid JSON: {exc}") from exc
        if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
            raise ValueError(f"{name} must map model names to file paths")
        return files
    files = {}
    for item in filter(None, (part.strip() for part in raw.split(","))):
        model, sep, path = item.partition("=")
        if not sep or not model.strip() or not path.strip():
            raise ValueError(f"{name}: {item!r} is not model=path")
        files[model.strip()] = path.strip()
    return files
