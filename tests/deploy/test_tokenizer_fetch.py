"""catalog.tokenizer_fetch: the gateway pod's init container, against a loopback server
standing in for Hugging Face."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from catalog import tokenizer_fetch
from tests.support import ROOT

FILES = {
    "/org/tiny/resolve/main/tokenizer.json": b'{"model": {}}',
    "/org/tiny/resolve/main/tokenizer_config.json": b'{"chat_template": "x"}',
}


@pytest.fixture
def hub() -> Iterator[tuple[str, list[str | None]]]:
    seen: list[str | None] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            seen.append(self.headers.get("Authorization"))
            body = FILES.get(self.path)
            self.send_response(200 if body is not None else 404)
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", seen
    finally:
        server.shutdown()
        server.server_close()


def _env(endpoint: str, tmp_path: Path, repo: str = "org/tiny") -> dict[str, str]:
    return {
        "HF_ENDPOINT": endpoint,
        "HF_TOKEN": "hf_test",
        "TOKENIZER_REPOS": f"tiny-2026-01={repo}",
        "GATEWAY_TOKENIZER_FILES": f"tiny-2026-01={tmp_path}/tiny/tokenizer.json",
        "GATEWAY_CHAT_TEMPLATES": f"tiny-2026-01={tmp_path}/tiny/tokenizer_config.json",
    }


def test_fetches_every_file_the_gateway_settings_name(
    hub: tuple[str, list[str | None]], tmp_path: Path
) -> None:
    endpoint, seen = hub
    written = tokenizer_fetch.fetch(_env(endpoint, tmp_path))
    assert [p.name for p in written] == ["tokenizer.json", "tokenizer_config.json"]
    for path in written:
        assert path.read_bytes() == FILES[f"/org/tiny/resolve/main/{path.name}"]
    assert seen == ["Bearer hf_test", "Bearer hf_test"]
    assert not list(tmp_path.glob("**/*.part"))


def test_a_missing_file_fails_the_init_container(
    hub: tuple[str, list[str | None]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    endpoint, _ = hub
    for key, value in _env(endpoint, tmp_path, repo="org/gone").items():
        monkeypatch.setenv(key, value)
    assert tokenizer_fetch.main() == 1
    assert not (tmp_path / "tiny" / "tokenizer.json").exists()


def test_a_model_without_a_repository_is_refused(tmp_path: Path) -> None:
    env = _env("http://127.0.0.1:9", tmp_path)
    env["TOKENIZER_REPOS"] = "other=org/other"
    with pytest.raises(ValueError, match="TOKENIZER_REPOS names no repository"):
        tokenizer_fetch.plan(env)


def test_the_init_container_command_runs_without_django(
    hub: tuple[str, list[str | None]], tmp_path: Path
) -> None:
    """What the gateway pod's init container runs, as a process of its own."""
    endpoint, _ = hub
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    env.update(_env(endpoint, tmp_path), PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, "-m", "catalog.tokenizer_fetch"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "tiny" / "tokenizer_config.json").read_bytes() == FILES[
        "/org/tiny/resolve/main/tokenizer_config.json"
    ]
    assert "wrote" in done.stdout
