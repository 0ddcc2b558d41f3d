"""The body the gateway sends a replica: streaming with usage, salt, priority. No I/O."""

from __future__ import annotations

import orjson

from gateway.config import GatewayConfig
from gateway.endpoints.validation import KNOWN, NOT_FORWARDED, parse_chat
from gateway.upstream.client import UpstreamClient
from tests.gateway.test_validation import GOOD, VERSION


def test_upstream_body_always_streams_with_usage_salt_and_priority() -> None:
    client = UpstreamClient(GatewayConfig())
    req = parse_chat(orjson.dumps({**GOOD, "temperature": 0.2}))
    body = orjson.loads(
        client.build_body(req, VERSION, max_tokens=9, priority=2, tenant_id="tenant-a")
    )
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["model"] == "v1" and body["max_tokens"] == 9 and body["priority"] == 2
    assert body["temperature"] == 0.2
    salt = body["cache_salt"]
    assert 0 < len(salt) <= 128 and not set(salt) & set("/@\\\0")
    assert salt == client.cache_salt("tenant-a") != client.cache_salt("tenant-b")
    # Keyed: the salt is not a plain hash of the tenant id anyone could compute.
    other = UpstreamClient(GatewayConfig(cache_salt_key=b"another key"))
    assert other.cache_salt("tenant-a") != salt


def test_streams_ask_for_continuous_usage_unless_switched_off() -> None:
    """A stream's body asks for per-chunk usage (the relay strips it); a JSON request's
    does not (its relay parses every chunk anyway and has no client to cut off)."""

    def options(config: GatewayConfig, **fields: object) -> object:
        req = parse_chat(orjson.dumps({**GOOD, **fields}))
        body = UpstreamClient(config).build_body(
            req, VERSION, max_tokens=9, priority=2, tenant_id="t"
        )
        return orjson.loads(body)["stream_options"]

    both = {"include_usage": True, "continuous_usage_stats": True}
    assert options(GatewayConfig(), stream=True) == both
    assert options(GatewayConfig(), stream=True, stream_options={"include_usage": False}) == both
    assert options(GatewayConfig()) == {"include_usage": True}
    off = GatewayConfig.from_env({"GATEWAY_CONTINUOUS_USAGE": "0"})
    assert not off.continuous_usage and GatewayConfig.from_env({}).continuous_usage
    assert options(off, stream=True) == {"include_usage": True}


def test_bookkeeping_fields_are_accepted_and_never_reach_the_replica() -> None:
    """Every field of ``NOT_FORWARDED`` parses on chat (with a value it accepts) and is
    absent from the replica's body; ``user`` and ``prompt_cache_key`` only steer routing."""
    accepted = {
        "user": "u1",
        "metadata": {"a": "b"},
        "store": False,
        "service_tier": "auto",
        "prompt_cache_key": "conversation-7",
    }
    assert set(accepted) == NOT_FORWARDED and NOT_FORWARDED <= KNOWN
    req = parse_chat(orjson.dumps({**GOOD, **accepted}))
    body = orjson.loads(
        UpstreamClient(GatewayConfig()).build_body(
            req, VERSION, max_tokens=9, priority=2, tenant_id="t"
        )
    )
    assert not NOT_FORWARDED & body.keys()
    assert not NOT_FORWARDED & req.sampling.keys()
    assert req.cache_hint == "conversation-7"
