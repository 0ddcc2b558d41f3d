"""One error shape for the management API, close to OpenAI's:

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_output",
               "code": "invalid", "fields": {"max_output": ["..."]}}}

``param`` names the first offending field (dotted for nested input), ``fields`` carries every
field error so a form can show them all. Django ValidationErrors raised by services
(``full_clean``) become 400s with the same shape, and a lost race on a unique constraint
becomes a 409, so no user input ends in a 500.
"""

from __future__ import annotations

from typing import Any

from django.core.exceptions import NON_FIELD_ERRORS, ObjectDoesNotExist
from django.core.exceptions import PermissionDenied as DjangoPermissionDenied
from django.core.exceptions import ValidationError as DjangoValidationError
from django.db import IntegrityError
from django.http import Http404, HttpRequest, JsonResponse
from rest_framework import exceptions, status
from rest_framework.fields import get_error_detail
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

NON_FIELD = "non_field_errors"

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    406: "invalid_request_error",
    409: "conflict_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
}


class Conflict(exceptions.APIException):
    status_code = status.HTTP_409_CONFLICT
    default_detail = "The request conflicts with the current state of the resource."
    default_code = "conflict"


def error_body(
    *,
    message: str,
    status_code: int,
    code: str | None,
    param: str | None = None,
    fields: dict[str, list[str]] | None = None,
) -> dict[str, Any]:
    error: dict[str, Any] = {
        "message": message,
        "type": _TYPES.get(status_code, "server_error" if status_code >= 500 else "api_error"),
        "param": param,
        "code": code,
    }
    if fields:
        error["fields"] = fields
    return {"error": error}


def _flatten(detail: Any, prefix: str = "") -> list[tuple[str, str, str]]:
    """(field path, message, code) for every leaf of a DRF error detail."""
    out: list[tuple[str, str, str]] = []
    if isinstance(detail, dict):
        for key, value in detail.items():
            if key in (NON_FIELD, NON_FIELD_ERRORS):
                out.extend(_flatten(value, prefix))
                continue
            path = f"{prefix}.{key}" if prefix else str(key)
            out.extend(_flatten(value, path))
    elif isinstance(detail, list):
        for item in detail:
            out.extend(_flatten(item, prefix))
    else:
        code = getattr(detail, "code", None) or "invalid"
        out.append((prefix or NON_FIELD, str(detail), str(code)))
    return out


def _translate(exc: Exception) -> Exception:
    if isinstance(exc, DjangoValidationError):
        if not hasattr(exc, "error_dict"):
            # Non-field errors keep their codes (a service's ``code="too_many_keys"``).
            return exceptions.ValidationError(get_error_detail(exc))
        return exceptions.ValidationError(get_error_detail(DjangoValidationError(exc.message_dict)))
    if isinstance(exc, Http404 | ObjectDoesNotExist):
        return exceptions.NotFound()
    if isinstance(exc, DjangoPermissionDenied):
        return exceptions.PermissionDenied(str(exc) or None)
    if isinstance(exc, IntegrityError):
        return Conflict()
    return exc


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    exc = _translate(exc)
    response = drf_exception_handler(exc, context)
    if response is None:
        return None  # a bug, not user input: let Django log it and answer 500
    if isinstance(exc, exceptions.ValidationError):
        leaves = _flatten(exc.detail)
        fields: dict[str, list[str]] = {}
        for path, message, _ in leaves:
            fields.setdefault(path, []).append(message)
        path, message, code = leaves[0] if leaves else (NON_FIELD, "Invalid input.", "invalid")
        param = None if path == NON_FIELD else path
        text = f"{param}: {message}" if param else message
        response.data = error_body(
            message=text, status_code=response.status_code, code=code, param=param, fields=fields
        )
    elif isinstance(exc, exceptions.APIException):
        codes = exc.get_codes()
        code = codes if isinstance(codes, str) else exc.default_code
        response.data = error_body(
            message=str(exc.detail), status_code=response.status_code, code=str(code)
        )
    return response


def api_not_found(request: HttpRequest, *args: Any, **kwargs: Any) -> JsonResponse:
    """Unknown paths under /api/ answer in the API's error shape, not Django's HTML page."""
    body = error_body(
        message=f"Unknown API path: {request.path}", status_code=404, code="not_found"
    )
    return JsonResponse(body, status=404)
