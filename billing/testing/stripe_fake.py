"""A small stateful Stripe-compatible HTTP server of our own, for tests and local runs.

Stripe itself cannot be reached from here, and stripe-mock (Stripe's own mock) cannot be
installed here and is stateless anyway: it would not remember an invoice item, replay an
idempotent request or let a test delete an item to plant a discrepancy. This fake
implements exactly the endpoints Fairway calls, in Stripe's wire format:

- requests are form-encoded (``metadata[k]=v``), responses JSON; errors are
  ``{"error": {"type", "code", "message", "param"}}`` with Stripe's status codes;
- ``Authorization: Bearer <key>`` is required (401 otherwise);
- ``Idempotency-Key`` on POST: the same key with the same parameters returns the stored
  response (header ``Idempotent-Replayed: true``); the same key with different parameters
  is a 400 ``idempotency_error``. A response is stored before it is sent, as in Stripe;
- fault injection: ``fail_next(n)`` answers the next n requests 500 without applying
  them; ``delay_next(n, seconds)`` applies the next n requests and answers only after
  ``seconds`` (past the client's timeout, the client sees a timeout while the object
  exists);
- ``send_webhook`` posts a signed event (``Stripe-Signature: t=…,v1=…``) to an endpoint.

Endpoints: POST /v1/customers; POST /v1/invoices, GET /v1/invoices/{id},
POST /v1/invoices/{id}/finalize|void|pay; POST /v1/invoiceitems, GET /v1/invoiceitems
(?invoice=, limit, starting_after).
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import json
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import httpx

Json = dict[str, Any]


class StripeFakeError(Exception):
    def __init__(self, status: int, type_: str, message: str, code: str = "", param: str = ""):
        super().__init__(message)
        self.status, self.type, self.code, self.param = status, type_, code, param

    def body(self) -> Json:
        error: Json = {"type": self.type, "message": str(self)}
        if self.code:
            error["code"] = self.code
        if self.param:
            error["param"] = self.param
        return {"error": error}


def _missing(kind: str, ident: str) -> StripeFakeError:
    return StripeFakeError(
        404, "invalid_request_error", f"No such {kind}: '{ident}'", "resource_missing", "id"
    )


def parse_form(pairs: list[tuple[str, str]]) -> Json:
    """``a[b][c]=v`` -> {"a": {"b": {"c": "v"}}}; ``a[0]=v`` -> {"a": {"0": "v"}}."""
    out: Json = {}
    for key, value in pairs:
        parts = re.findall(r"[^\[\]]+", key)
        node = out
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return out


@dataclass
class RecordedRequest:
    method: str
    path: str
    params: Json
    idempotency_key: str | None
    stripe_version: str | None
    outcome: str  # "applied", "replayed", "failed (injected)", "error <status>"


@dataclass
class FakeState:
    customers: dict[str, Json] = field(default_factory=dict)
    invoices: dict[str, Json] = field(default_factory=dict)
    items: dict[str, Json] = field(default_factory=dict)  # insertion order = creation order
    idempotency: dict[str, tuple[str, int, Json]] = field(default_factory=dict)
    requests: list[RecordedRequest] = field(default_factory=list)
    fail_remaining: int = 0
    fail_status: int = 500
    fail_path: str | None = None
    delay_remaining: int = 0
    delay_s: float = 0.0
    delay_path: str | None = None


class StripeFake:
    """Start with ``with StripeFake() as fake:``; ``fake.url`` is the API base."""

    def __init__(self, api_key: str = "sk_test_fairway_fake", host: str = "127.0.0.1"):
        self.api_key = api_key
        self.state = FakeState()
        self.lock = threading.RLock()
        self._ids = itertools.count(1)
        self._server = ThreadingHTTPServer((host, 0), self._handler_class())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> StripeFake:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> StripeFake:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- test controls ------------------------------------------------------------------
    def fail_next(self, n: int, status: int = 500, path: str | None = None) -> None:
        """Answer the next ``n`` requests (to ``path`` only, if given) with ``status``,
        without applying them."""
        with self.lock:
            self.state.fail_remaining, self.state.fail_status = n, status
            self.state.fail_path = path

    def delay_next(self, n: int, seconds: float, path: str | None = None) -> None:
        """Apply the next ``n`` requests (to ``path`` only, if given) but answer each only
        after ``seconds``."""
        with self.lock:
            self.state.delay_remaining, self.state.delay_s = n, seconds
            self.state.delay_path = path

    def delete_item(self, item_id: str) -> None:
        """Remove an item behind our back (a discrepancy for reconciliation to find)."""
        with self.lock:
            item = self.state.items.pop(item_id)
            invoice = self.state.invoices.get(item.get("invoice") or "")
            if invoice is not None:
                self._recompute(invoice)

    def items_for(self, invoice_id: str) -> list[Json]:
        with self.lock:
            return [i for i in self.state.items.values() if i.get("invoice") == invoice_id]

    def requests_to(self, method: str, path: str) -> list[RecordedRequest]:
        with self.lock:
            return [r for r in self.state.requests if r.method == method and r.path == path]

    def pay_invoice(self, invoice_id: str) -> Json:
        """The customer pays (what Stripe does when a card is charged)."""
        with self.lock:
            invoice = self.state.invoices[invoice_id]
            invoice["status"] = "paid"
            invoice["amount_paid"] = invoice["amount_due"]
            return dict(invoice)

    def send_webhook(
        self, url: str, secret: str, event_type: str, obj: Json, *, event_id: str | None = None
    ) -> httpx.Response:
        """POST a signed event as Stripe does (the same id twice = a redelivery)."""
        event = {
            "id": event_id or f"evt_{self._next()}",
            "object": "event",
            "api_version": None,
            "created": int(time.time()),
            "data": {"object": obj},
            "livemode": False,
            "pending_webhooks": 1,
            "request": {"id": None, "idempotency_key": None},
            "type": event_type,
        }
        payload = json.dumps(event)
        return httpx.post(
            url,
            content=payload,
            headers={
                "Content-Type": "application/json",
                "Stripe-Signature": sign(payload, secret),
            },
            timeout=10,
        )

    # -- the API ------------------------------------------------------------------------
    def _next(self) -> str:
        return f"{next(self._ids):08d}"

    def _now(self) -> int:
        return int(time.time())

    def _recompute(self, invoice: Json) -> None:
        total = sum(
            int(i["amount"]) for i in self.state.items.values() if i.get("invoice") == invoice["id"]
        )
        invoice["subtotal"] = invoice["total"] = invoice["amount_due"] = total
        invoice["amount_remaining"] = total - int(invoice.get("amount_paid", 0))

    def _invoice(self, ident: str) -> Json:
        invoice = self.state.invoices.get(ident)
        if invoice is None:
            raise _missing("invoice", ident)
        return invoice

    def handle(self, method: str, path: str, params: Json) -> tuple[int, Json]:
        """Apply one request to the state (under the lock)."""
        if method == "POST" and path == "/v1/customers":
            customer = {
                "id": f"cus_{self._next()}",
                "object": "customer",
                "created": self._now(),
                "name": params.get("name"),
                "email": params.get("email"),
                "metadata": params.get("metadata", {}),
                "livemode": False,
            }
            self.state.customers[customer["id"]] = customer
            return 200, customer
        if method == "POST" and path == "/v1/invoices":
            customer_id = params.get("customer", "")
            if customer_id not in self.state.customers:
                raise _missing("customer", customer_id)
            invoice = {
                "id": f"in_{self._next()}",
                "object": "invoice",
                "created": self._now(),
                "customer": customer_id,
                "currency": params.get("currency", "usd"),
                "status": "draft",
                "number": None,
                "auto_advance": params.get("auto_advance") == "true",
                "collection_method": params.get("collection_method", "charge_automatically"),
                "description": params.get("description"),
                "metadata": params.get("metadata", {}),
                "amount_paid": 0,
                "livemode": False,
            }
            self._recompute(invoice)
            self.state.invoices[invoice["id"]] = invoice
            return 200, invoice
        match = re.fullmatch(r"/v1/invoices/([^/]+)(?:/(finalize|void|pay))?", path)
        if match:
            invoice = self._invoice(match.group(1))
            action = match.group(2)
            if method == "GET" and action is None:
                return 200, invoice
            if method == "POST" and action == "finalize":
                if invoice["status"] != "draft":
                    raise StripeFakeError(
                        400,
                        "invalid_request_error",
                        "This invoice is already finalized, you can't re-finalize a "
                        "non-draft invoice.",
                        "invoice_not_editable",
                    )
                invoice["status"] = "open"
                invoice["number"] = f"FAKE-{invoice['id'][3:]}"
                return 200, invoice
            if method == "POST" and action == "void":
                if invoice["status"] != "open":
                    raise StripeFakeError(
                        400,
                        "invalid_request_error",
                        f"You can only void open invoices (this one is {invoice['status']}).",
                        "invoice_not_open",
                    )
                invoice["status"] = "void"
                return 200, invoice
            if method == "POST" and action == "pay":
                if invoice["status"] != "open":
                    raise StripeFakeError(
                        400,
                        "invalid_request_error",
                        f"Invoice is {invoice['status']}; only open invoices can be paid.",
                        "invoice_not_open",
                    )
                invoice["status"] = "paid"
                invoice["amount_paid"] = invoice["amount_due"]
                invoice["paid_out_of_band"] = params.get("paid_out_of_band") == "true"
                return 200, invoice
        if method == "POST" and path == "/v1/invoiceitems":
            invoice_id = params.get("invoice", "")
            invoice = self._invoice(invoice_id)
            if invoice["status"] != "draft":
                raise StripeFakeError(
                    400,
                    "invalid_request_error",
                    "Invoice items can only be added to draft invoices.",
                    "invoice_not_editable",
                    "invoice",
                )
            if params.get("customer") != invoice["customer"]:
                raise StripeFakeError(
                    400,
                    "invalid_request_error",
                    "The invoice belongs to another customer.",
                    param="customer",
                )
            try:
                amount = int(params["amount"])
            except (KeyError, ValueError):
                raise StripeFakeError(
                    400, "invalid_request_error", "Invalid integer: amount", param="amount"
                ) from None
            item = {
                "id": f"ii_{self._next()}",
                "object": "invoiceitem",
                "amount": amount,
                "currency": params.get("currency", invoice["currency"]),
                "customer": invoice["customer"],
                "invoice": invoice_id,
                "description": params.get("description"),
                "metadata": params.get("metadata", {}),
                "date": self._now(),
                "livemode": False,
            }
            self.state.items[item["id"]] = item
            self._recompute(invoice)
            return 200, item
        if method == "GET" and path == "/v1/invoiceitems":
            items = [
                i
                for i in self.state.items.values()
                if not params.get("invoice") or i.get("invoice") == params["invoice"]
            ]
            items.reverse()  # Stripe lists newest first
            after = params.get("starting_after")
            if after:
                ids = [i["id"] for i in items]
                items = items[ids.index(after) + 1 :] if after in ids else []
            limit = int(params.get("limit", 10))
            return 200, {
                "object": "list",
                "url": "/v1/invoiceitems",
                "data": items[:limit],
                "has_more": len(items) > limit,
            }
        raise StripeFakeError(
            404,
            "invalid_request_error",
            f"Unrecognized request URL ({method}: {path}).",
        )

    def dispatch(
        self, method: str, path: str, params: Json, headers: dict[str, str]
    ) -> tuple[int, Json, dict[str, str], float]:
        """(status, body, extra headers, seconds to wait before answering)."""
        key = headers.get("idempotency-key")
        record = RecordedRequest(
            method, path, params, key, headers.get("stripe-version"), outcome="applied"
        )
        with self.lock:
            self.state.requests.append(record)
            if headers.get("authorization") != f"Bearer {self.api_key}":
                record.outcome = "error 401"
                return (
                    401,
                    StripeFakeError(
                        401, "invalid_request_error", "Invalid API Key provided."
                    ).body(),
                    {},
                    0.0,
                )
            if self.state.fail_remaining > 0 and self.state.fail_path in (None, path):
                self.state.fail_remaining -= 1
                record.outcome = "failed (injected)"
                return (
                    self.state.fail_status,
                    StripeFakeError(
                        self.state.fail_status, "api_error", "fake: injected failure"
                    ).body(),
                    {},
                    0.0,
                )
            delay = 0.0
            if self.state.delay_remaining > 0 and self.state.delay_path in (None, path):
                self.state.delay_remaining -= 1
                delay = self.state.delay_s
            fingerprint = json.dumps([method, path, params], sort_keys=True)
            if method == "POST" and key:
                stored = self.state.idempotency.get(key)
                if stored is not None:
                    if stored[0] != fingerprint:
                        record.outcome = "error 400"
                        return (
                            400,
                            StripeFakeError(
                                400,
                                "idempotency_error",
                                "Keys for idempotent requests can only be used with the same "
                                f"parameters they were first used with. Try using a key other "
                                f"than '{key}' if you meant to execute a different request.",
                            ).body(),
                            {},
                            delay,
                        )
                    record.outcome = "replayed"
                    return stored[1], stored[2], {"Idempotent-Replayed": "true"}, delay
            try:
                status, body = self.handle(method, path, params)
            except StripeFakeError as exc:
                status, body = exc.status, exc.body()
                record.outcome = f"error {status}"
            body = json.loads(json.dumps(body))  # a snapshot, not the live object
            if method == "POST" and key and status < 500:
                self.state.idempotency[key] = (fingerprint, status, body)
            return status, body, {}, delay

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                pass

            def _serve(self, method: str) -> None:
                split = urlsplit(self.path)
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length).decode() if length else ""
                pairs = parse_qsl(raw if method == "POST" else split.query, keep_blank_values=True)
                headers = {k.lower(): v for k, v in self.headers.items()}
                status, body, extra, delay = fake.dispatch(
                    method, split.path, parse_form(pairs), headers
                )
                if delay:
                    time.sleep(delay)  # the fault being injected: answer after the timeout
                data = json.dumps(body).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.send_header("Request-Id", f"req_{fake._next()}")
                    for name, value in extra.items():
                        self.send_header(name, value)
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (timed out) — the work is done all the same

            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                self._serve("GET")

            def do_POST(self) -> None:  # noqa: N802
                self._serve("POST")

            def do_DELETE(self) -> None:  # noqa: N802
                self._serve("DELETE")

        return Handler


def sign(payload: str, secret: str, timestamp: int | None = None) -> str:
    """Stripe's webhook signature scheme: HMAC-SHA256 over ``"{t}.{payload}"``."""
    ts = int(time.time()) if timestamp is None else timestamp
    mac = hmac.new(secret.encode(), f"{ts}.{payload}".encode(), hashlib.sha256).hexdigest()
    return f"t={ts},v1={mac}"
