"""Django middleware of the control plane (kept out of ``fairway.logs``, which the gateway
imports and which must stay free of Django)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.core.signals import request_finished

from fairway.logs import accept_request_id, request_id_var


class RequestIdMiddleware:
    """Django: the request id for the request's log lines and the response's X-Request-Id."""

    def __init__(self, get_response: Callable[[Any], Any]) -> None:
        self.get_response = get_response
        request_finished.connect(clear_request_id, dispatch_uid="fairway.logs.clear_request_id")

    def __call__(self, request: Any) -> Any:
        rid = accept_request_id(request.headers.get("X-Request-Id"))
        request.request_id = rid
        # Not reset on the way out: Django logs the response ("Not Found: ...") after the
        # middleware returns. Cleared when the response is closed (request_finished).
        request_id_var.set(rid)
        response = self.get_response(request)
        response["X-Request-Id"] = rid
        return response


def clear_request_id(**_: Any) -> None:
    """``request_finished`` receiver: the thread's next log lines belong to no request."""
    request_id_var.set(None)
