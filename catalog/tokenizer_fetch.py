"""Fetch the models' tokenizer files for the gateway, once, before it starts.

The gateway's cache-aware index hashes a chat prompt's token ids as vLLM does only with
the model's own ``tokenizer.json`` and ``tokenizer_config.json`` (its chat template):
``GATEWAY_TOKENIZER_FILES`` and ``GATEWAY_CHAT_TEMPLATES`` name where they lie. On
Kubernetes the gateway pod's init container runs ``python -m catalog.tokenizer_fetch``: for
every file those two settings name it downloads the file of the same name from the model's
Hugging Face repository (``TOKENIZER_REPOS``: ``version=org/repo,...``, generated with the
replicas from the catalog's ``weights``, the repository the replicas' ``vllm serve`` loads),
with ``HF_TOKEN`` for gated weights, into that path. The gateway itself never downloads: a
missing or broken file stops it at start (``gateway/config.py``).

``HF_ENDPOINT`` (Hugging Face's own variable) points it at a mirror;
``TOKENIZER_REVISION`` pins a revision (default ``main``, what vLLM loads without
``--revision``).
"""

from __future__ import annotations

import os
import sys
import urllib.request
from collections.abc import Mapping
from pathlib import Path

from contracts.settings import model_paths

SETTINGS = ("GATEWAY_TOKENIZER_FILES", "GATEWAY_CHAT_TEMPLATES")
DEFAULT_ENDPOINT = "https://huggingface.co"


def plan(env: Mapping[str, str]) -> list[tuple[str, Path]]:
    """(url, path) for every file the gateway's settings name."""
    repos = model_paths("TOKENIZER_REPOS", env.get("TOKENIZER_REPOS", ""))
    endpoint = (env.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")
    revision = env.get("TOKENIZER_REVISION") or "main"
    files: list[tuple[str, Path]] = []
    for setting in SETTINGS:
        for model, raw_path in model_paths(setting, env.get(setting, "")).items():
            if model not in repos:
                raise ValueError(f"{setting}: {model}: TOKENIZER_REPOS names no repository")
            path = Path(raw_path)
            files.append((f"{endpoint}/{repos[model]}/resolve/{revision}/{path.name}", path))
    return files


def fetch(env: Mapping[str, str], timeout_s: float = 60.0) -> list[Path]:
    token = env.get("HF_TOKEN", "")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    written: list[Path] = []
    for url, path in plan(env):
        if not url.startswith(("https://", "http://")):
            raise ValueError(f"{url}: not an http(s) URL")
        request = urllib.request.Request(url, headers=headers)  # noqa: S310 - checked above
        with urllib.request.urlopen(request, timeout=timeout_s) as response:  # noqa: S310
            data = response.read()
        path.parent.mkdir(parents=True, exist_ok=True)
        part = path.with_name(path.name + ".part")
        part.write_bytes(data)
        part.replace(path)
        written.append(path)
    return written


def main() -> int:
    try:
        written = fetch(os.environ)
    except (OSError, ValueError) as exc:
        print(f"tokenizer_fetch: {exc}", file=sys.stderr)
        return 1
    for path in written:
        print(f"tokenizer_fetch: wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
