"""HTTP pieces of the usage and costs reports: OpenAI-style bearer tokens, exact-decimal
JSON and the usage CSV."""

from __future__ import annotations

import csv
import io
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import orjson
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from drf_spectacular.plumbing import build_bearer_security_scheme_object
from rest_framework.authentication import SessionAuthentication
from rest_framework.renderers import BaseRenderer, JSONRenderer

from tenants.authentication import ExpiringTokenAuthentication


class BearerTokenAuthentication(ExpiringTokenAuthentication):
    """The control plane's API token (expiring like everywhere else), sent as
    ``Authorization: Bearer`` (OpenAI's admin clients send it that way)."""

    keyword = "Bearer"


# Token first, as everywhere in the API: a 401 then names the Token scheme.
AUTHENTICATION = [ExpiringTokenAuthentication, BearerTokenAuthentication, SessionAuthentication]


class BearerTokenScheme(OpenApiAuthenticationExtension):
    target_class = BearerTokenAuthentication
    name = "bearerTokenAuth"

    def get_security_definition(self, auto_schema: Any) -> dict[str, Any]:
        return dict(build_bearer_security_scheme_object("Authorization", "Bearer"))


def _decimal_text(value: Decimal) -> str:
    text = format(value, "f")  # fixed point, exactly the stored digits
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return text


def _json_default(value: Any) -> Any:
    if isinstance(value, Decimal) and value.is_finite():
        return orjson.Fragment(_decimal_text(value).encode("ascii"))
    raise TypeError(f"cannot serialise {type(value).__name__}")


class ExactJSONRenderer(JSONRenderer):
    """JSON with Decimals as exact numbers (DRF's own encoder goes through float)."""

    def render(
        self,
        data: Any,
        accepted_media_type: str | None = None,
        renderer_context: dict[str, Any] | None = None,
    ) -> bytes:
        if data is None:
            return b""
        return orjson.dumps(data, default=_json_default)


CSV_COLUMNS = (
    "start_time",
    "end_time",
    "start_time_iso",
    "model",
    "api_key_id",
    "num_model_requests",
    "input_tokens",
    "input_cached_tokens",
    "output_tokens",
)


class UsageCsvRenderer(BaseRenderer):
    """One row per result of a usage page (empty buckets have none). Values are integers,
    UUIDs, ISO times and catalog model names, so no cell can start a spreadsheet formula."""

    media_type = "text/csv"
    format = "csv"
    charset = "utf-8"

    def render(
        self,
        data: Any,
        accepted_media_type: str | None = None,
        renderer_context: dict[str, Any] | None = None,
    ) -> bytes:
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\r\n")
        writer.writerow(CSV_COLUMNS)
        for bucket in data["data"]:
            iso = datetime.fromtimestamp(bucket["start_time"], tz=UTC).strftime(
                "%Y-%m-%dT%H:%M:%SZ"
            )
            for result in bucket["results"]:
                row = {**result, **bucket, "start_time_iso": iso}
                writer.writerow(["" if row[c] is None else row[c] for c in CSV_COLUMNS])
        return out.getvalue().encode("utf-8")
