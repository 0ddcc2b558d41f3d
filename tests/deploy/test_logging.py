"""LOG_FORMAT=json: one JSON object per line, each carrying the request id it belongs to."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from fairway import logs
from tests.billing.test_stripe_sync import celery_broker  # noqa: F401 - a fixture
from tests.support import ROOT, free_port, wait_http_ok, wait_until


@pytest.fixture
def json_logs(monkeypatch: pytest.MonkeyPatch) -> Iterator[io.StringIO]:
    monkeypatch.setenv("LOG_FORMAT", "json")
    stream = io.StringIO()
    root = logging.getLogger()
    handler = logs.handler(stream)
    root.addHandler(handler)
    old_level = root.level
    root.setLevel(logging.INFO)
    yield stream
    root.removeHandler(handler)
    root.setLevel(old_level)


def _lines(stream: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


async def test_concurrent_requests_keep_their_own_id(json_logs: io.StringIO) -> None:
    log = logging.getLogger("test.requests")

    async def request(rid: str) -> None:
        logs.request_id_var.set(rid)
        for step in range(3):
            log.info("step %d", step, extra={"step": step})
            await asyncio.sleep(0)

    await asyncio.gather(*(request(f"r{i}") for i in range(5)))
    log.warning("outside any request")
    lines = _lines(json_logs)
    assert len(lines) == 16
    for line in lines[:-1]:
        assert line["msg"] == f"step {line['step']}" and str(line["request_id"]).startswith("r")
    assert sorted(str(x["request_id"]) for x in lines[:-1]) == sorted(
        f"r{i}" for i in range(5) for _ in range(3)
    )
    assert lines[-1]["request_id"] is None and lines[-1]["level"] == "WARNING"
    assert str(lines[-1]["ts"]).endswith("+00:00")


def test_exceptions_are_one_json_line(json_logs: io.StringIO) -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        logging.getLogger("test").exception("failed")
    (line,) = _lines(json_logs)
    assert line["msg"] == "failed" and "ValueError: boom" in str(line["exc"])


@pytest.mark.django_db
def test_control_plane_lines_carry_the_request_id(json_logs: io.StringIO, client: object) -> None:
    from django.test import Client

    assert isinstance(client, Client)
    response = client.get("/no-such-page", headers={"X-Request-Id": "req-abc.1"})
    assert response.status_code == 404 and response["X-Request-Id"] == "req-abc.1"
    lines = _lines(json_logs)
    assert lines and all(line["request_id"] == "req-abc.1" for line in lines)
    assert any("Not Found" in str(line["msg"]) for line in lines)
    # No (or a malformed) id from the caller: a fresh one, returned and logged.
    response = client.get("/no-such-page", headers={"X-Request-Id": "bad id with spaces"})
    fresh = response["X-Request-Id"]
    assert fresh != "bad id with spaces" and len(fresh) == 32
    assert _lines(json_logs)[-1]["request_id"] == fresh


@pytest.mark.django_db
def test_health_endpoints_answer_probes_by_ip(client: object) -> None:
    from django.test import Client

    assert isinstance(client, Client)
    # A probe's Host is the pod IP, not an allowed host: still answered.
    assert client.get("/healthz", HTTP_HOST="10.1.2.3").status_code == 200
    ready = client.get("/readyz", HTTP_HOST="10.1.2.3")
    assert ready.status_code == 200 and ready.json()["problems"] == []


def test_gateway_lines_are_json_with_the_request_id(tmp_path: Path, redis_url: str) -> None:
    port = free_port()
    log_path = tmp_path / "gateway.log"
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PROMETHEUS_MULTIPROC_DIR", "KAFKA_BOOTSTRAP")
    }
    env.update(
        LOG_FORMAT="json",
        REDIS_URL=redis_url,
        GATEWAY_SPOOL_DIR=str(tmp_path / "spool"),
        FAIRWAY_ENV="development",
        PYTHONPATH=str(ROOT),
    )
    argv = [sys.executable, "-m", "gateway", "--host", "127.0.0.1", "--port", str(port)]
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(
            [*argv, "--workers", "1", "--access-log"], cwd=ROOT, env=env, stdout=out, stderr=out
        )
    try:
        base = f"http://127.0.0.1:{port}"

        wait_http_ok(proc, f"{base}/healthz", log_path)
        ids = [httpx.get(f"{base}/v1/models", timeout=5).headers["x-request-id"] for _ in range(3)]
        # A caller's id (nginx sends one) is echoed, and logged beside the gateway's own.
        echoed = httpx.get(f"{base}/healthz", headers={"X-Request-Id": "lb-42"}, timeout=5)
        assert echoed.headers["x-request-id"] == "lb-42"
        wait_until(lambda: all(i in log_path.read_text() for i in ids), 10, what="access lines")
        wait_until(lambda: "lb-42" in log_path.read_text(), 10, what="the caller's id")
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    lines = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
    access = [line for line in lines if line["logger"] == "uvicorn.access"]
    assert sorted(str(a["request_id"]) for a in access if "/v1/models" in str(a["msg"])) == sorted(
        ids
    )
    (lb,) = [a for a in access if a.get("client_request_id") == "lb-42"]
    assert "/healthz" in str(lb["msg"]) and len(str(lb["request_id"])) == 32
    assert any(line["logger"].startswith("gateway") for line in lines)  # startup/shutdown too


@pytest.mark.django_db(transaction=True)
def test_celery_task_lines_carry_the_task_id(
    celery_broker: object,  # noqa: F811
    redis_url: str,
    tmp_path: Path,
) -> None:
    from tenants.tasks import readmodel_rebuild
    from tests.billing.test_stripe_sync import _database_url

    log_path = tmp_path / "worker.log"
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    env.update(
        LOG_FORMAT="json",
        PYTHONPATH=str(ROOT),
        DJANGO_SETTINGS_MODULE="fairway.settings.local",
        DATABASE_URL=_database_url(),
        REDIS_URL=redis_url,
    )
    argv = [sys.executable, "-m", "celery", "-A", "fairway.celery", "worker", "--pool", "solo"]
    argv += [
        "--loglevel",
        "INFO",
        "--without-gossip",
        "--without-mingle",
        "-n",
        f"logs-{os.getpid()}@%h",
    ]
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: "ready" in log_path.read_text(), 60, interval=0.1, what="worker ready")
        task_id = readmodel_rebuild.delay().id
        wait_until(
            lambda: "succeeded" in log_path.read_text(), 60, interval=0.1, what="the task to run"
        )
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    lines = [json.loads(ln) for ln in log_path.read_text().splitlines() if ln.startswith("{")]
    task_lines = [ln for ln in lines if ln["request_id"] == task_id]
    assert any("succeeded" in str(ln["msg"]) for ln in task_lines), lines[-5:]
    # Every log record of the worker is a JSON line (celery's banner is printed, not logged).
    assert any(ln["logger"].startswith("celery") for ln in lines)


def test_control_plane_server_lines_are_json_with_the_request_id(
    tmp_path: Path, redis_url: str
) -> None:
    """gunicorn as docker/entrypoint.sh runs it (``--config python:fairway.gunicorn_conf``):
    its own start-up lines and one access line per request are JSON too, each access line
    with the id the response carries."""
    assert (
        "--config python:fairway.gunicorn_conf" in (ROOT / "docker" / "entrypoint.sh").read_text()
    )
    port = free_port()
    out, err = tmp_path / "stdout.log", tmp_path / "stderr.log"
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    env.update(
        LOG_FORMAT="json",
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        DJANGO_SETTINGS_MODULE="fairway.settings.test",
        REDIS_URL=redis_url,
        HOME=str(tmp_path),  # gunicorn's control socket
    )
    argv = [sys.executable, "-m", "gunicorn", "fairway.wsgi:application"]
    argv += ["--config", "python:fairway.gunicorn_conf", "--bind", f"127.0.0.1:{port}"]
    with open(out, "wb") as stdout, open(err, "wb") as stderr:
        proc = subprocess.Popen(
            [*argv, "--workers", "1"], cwd=ROOT, env=env, stdout=stdout, stderr=stderr
        )
    try:
        base = f"http://127.0.0.1:{port}"

        wait_http_ok(proc, f"{base}/healthz", err)
        assert httpx.get(f"{base}/healthz", headers={"X-Request-Id": "probe-1"}).status_code == 200
        missing = httpx.get(f"{base}/no-such-page", headers={"X-Request-Id": "req-404"})
        assert missing.status_code == 404
        wait_until(lambda: "req-404" in out.read_text(), 10, what="the access line")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    lines = [
        json.loads(line)
        for path in (out, err)
        for line in path.read_text().splitlines()
        if line.strip()
    ]  # every line parses as JSON
    access = {
        str(line["request_id"]): line for line in lines if line["logger"] == "gunicorn.access"
    }
    assert "GET /healthz" in str(access["probe-1"]["msg"])
    assert '"GET /no-such-page HTTP/1.1" 404' in str(access["req-404"]["msg"])
    assert any(line["logger"] == "gunicorn.error" for line in lines)  # start-up and shutdown
    (not_found,) = [line for line in lines if line["logger"] == "django.request"]
    assert not_found["request_id"] == "req-404"
