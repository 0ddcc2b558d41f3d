"""The operations surface is not public: /metrics needs the metrics token (and is not
served in production without one), /readyz tells the public ready or not and nothing more,
the per-tenant request series are bounded, and rendering runs off the event loop. Real
gateway processes, and the app in-process for the last."""

from __future__ import annotations

import threading
from collections.abc import Callable, MutableMapping
from typing import Any, cast

import httpx
import pytest

from console import metrics as console_metrics
from gateway.config import GatewayConfig
from gateway.metrics import OTHER_TENANTS, GatewayMetrics
from gateway.serving.app import GatewayApp
from tests.gateway.conftest import GatewayProcess, ReadModelSeeder
from tests.support import free_port

TOKEN = "m" * 40


@pytest.fixture
def started(
    gateways: Callable[..., GatewayProcess], seeder: ReadModelSeeder, replica: object
) -> Callable[..., GatewayProcess]:
    seeder.set_replicas([("r1", replica.base_url)])  # type: ignore[attr-defined]
    return lambda **env: gateways(None, extra_env=env)


def test_metrics_and_readiness_details_need_the_token(
    started: Callable[..., GatewayProcess],
) -> None:
    gw = started(GATEWAY_METRICS_TOKEN=TOKEN)
    with httpx.Client(base_url=gw.base_url, timeout=10) as client:
        assert client.get("/metrics").status_code == 404
        wrong = {"authorization": "Bearer " + "x" * 40}
        assert client.get("/metrics", headers=wrong).status_code == 404
        ok = client.get("/metrics", headers={"authorization": f"Bearer {TOKEN}"})
        assert ok.status_code == 200 and "fairway_gateway_requests" in ok.text
        public = client.get("/readyz")
        assert public.status_code == 200 and public.json() == {"status": "ready"}
        detailed = client.get("/readyz", headers={"authorization": f"Bearer {TOKEN}"})
        assert detailed.json()["status"] == "ready" and detailed.json()["problems"] == []
        assert detailed.json()["dependencies"]["redis"] is True
    # The console scrapes with the token.
    (scrape,) = console_metrics.scrape_many([gw.base_url + "/metrics"], token=TOKEN)
    assert scrape.ok and scrape.first("fairway_gateway_inflight_requests") is not None


def test_production_without_a_token_does_not_serve_metrics(
    started: Callable[..., GatewayProcess],
) -> None:
    gw = started(
        FAIRWAY_ENV="production",
        FAIRWAY_KEY_PEPPER="p" * 32,
        FAIRWAY_CACHE_SALT_KEY="c" * 32,
        # Production requires a broker; none answers here, so events wait in the spool.
        KAFKA_BOOTSTRAP="127.0.0.1:1",
    )
    with httpx.Client(base_url=gw.base_url, timeout=10) as client:
        assert client.get("/metrics").status_code == 404
        assert "problems" not in client.get("/readyz").json()


def test_tenant_series_are_bounded() -> None:
    metrics = GatewayMetrics(max_tenant_labels=2)
    labels = [metrics.tenant_label(f"t-{i}") for i in range(5)]
    assert labels == ["t-0", "t-1", OTHER_TENANTS, OTHER_TENANTS, OTHER_TENANTS]
    assert metrics.tenant_label("t-1") == "t-1"  # a tenant keeps its own series


async def test_metrics_are_rendered_off_the_event_loop() -> None:
    """Rendering sums every worker's files in multiprocess mode (blocking disk work): it runs
    in a thread, not on the event loop that serves the requests."""
    metrics = GatewayMetrics()
    render = metrics.render
    threads: list[int] = []

    def recorded() -> bytes:
        threads.append(threading.get_ident())
        return render()

    metrics.render = recorded  # type: ignore[method-assign]
    unused = cast(Any, None)  # /metrics touches none of the endpoints or hooks
    app = GatewayApp(
        config=GatewayConfig(), metrics=metrics, chat=unused, completions=unused,
        models=unused, readiness=unused, startup=unused, shutdown=unused,
    )  # fmt: skip
    sent: list[MutableMapping[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "GET", "path": "/metrics", "headers": []}
    await app(scope, receive, send)
    assert sent[0]["status"] == 200
    assert b"fairway_gateway_requests" in b"".join(m.get("body", b"") for m in sent)
    assert threads and threads[0] != threading.get_ident()


@pytest.mark.parametrize("workers", [1, 2])
def test_a_metrics_port_takes_the_operations_surface_off_the_api_port(
    gateways: Callable[..., GatewayProcess],
    seeder: ReadModelSeeder,
    replica: object,
    workers: int,
) -> None:
    seeder.set_replicas([("r1", replica.base_url)])  # type: ignore[attr-defined]
    metrics_port = free_port()
    gw = gateways(
        None,
        workers=workers,
        extra_env={"GATEWAY_METRICS_TOKEN": TOKEN, "GATEWAY_METRICS_PORT": str(metrics_port)},
    )
    operator = {"authorization": f"Bearer {TOKEN}"}
    with httpx.Client(base_url=gw.base_url, timeout=10) as api:
        # The API port: no metrics and no readiness details, whatever the caller presents.
        assert api.get("/metrics", headers=operator).status_code == 404
        ready = api.get("/readyz", headers=operator)
        assert (ready.status_code, ready.json()) == (200, {"status": "ready"})
        assert api.get("/healthz").status_code == 200
        assert api.get("/v1/models").status_code == 401  # the API is still here
    with httpx.Client(base_url=f"http://127.0.0.1:{metrics_port}", timeout=10) as internal:
        assert internal.get("/metrics").status_code == 404  # the token still applies
        scraped = internal.get("/metrics", headers=operator)
        assert scraped.status_code == 200 and "fairway_gateway_ready" in scraped.text
        detailed = internal.get("/readyz", headers=operator).json()
        assert detailed["status"] == "ready" and detailed["dependencies"]["redis"] is True
        assert internal.get("/healthz").status_code == 200
        # ... and nothing of the API: it is not a way around the load balancer.
        assert internal.get("/v1/models", headers=operator).status_code == 404
        chat = internal.post("/v1/chat/completions", json={}, headers=operator)
        assert chat.status_code == 404
    # The console scrapes the metrics port.
    (scrape,) = console_metrics.scrape_many(
        [f"http://127.0.0.1:{metrics_port}/metrics"], token=TOKEN
    )
    assert scrape.ok and scrape.first("fairway_gateway_inflight_requests") is not None
