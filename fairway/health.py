"""Liveness and readiness of the control plane (probes and container health checks).

``/healthz``: the process answers (no dependency checked: a restart would not fix a
database outage). ``/readyz``: PostgreSQL answers a query and Redis a PING, each bounded
by its client's timeout; 503 with the failing parts otherwise, so a load balancer stops
sending requests that could only fail.
"""

from __future__ import annotations

from collections.abc import Callable

from django.db import connection
from django.http import HttpRequest, HttpResponseBase, JsonResponse
from django.views.decorators.http import require_GET

from tenants.readmodel import read_model


@require_GET
def healthz(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"status": "ok"})


@require_GET
def readyz(request: HttpRequest) -> JsonResponse:
    problems: list[str] = []
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
    except Exception as exc:  # noqa: BLE001 - any failure means not ready
        problems.append(f"database: {type(exc).__name__}")
    try:
        read_model().redis.ping()
    except Exception as exc:  # noqa: BLE001
        problems.append(f"redis: {type(exc).__name__}")
    status = 503 if problems else 200
    body = {"status": "ready" if not problems else "not ready", "problems": problems}
    return JsonResponse(body, status=status)


class HealthMiddleware:
    """Answers the probes before host validation and the HTTPS redirect: kubelet and the
    container health check call the pod by its IP over plain HTTP, which ALLOWED_HOSTS and
    SECURE_SSL_REDIRECT would (rightly) refuse for any other path."""

    PATHS = {"/healthz": healthz, "/readyz": readyz}

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponseBase]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponseBase:
        view = self.PATHS.get(request.path_info)
        if view is not None:
            response: HttpResponseBase = view(request)
            return response
        return self.get_response(request)
