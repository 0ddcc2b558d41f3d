"""The gateway's configuration: dev defaults, production secrets, timeouts. No I/O."""

from __future__ import annotations

import pytest

from contracts.defaults import DEFAULT_REDIS_URL, DEV_KEY_PEPPER
from gateway.config import ConfigError, GatewayConfig

PRODUCTION = {
    "FAIRWAY_ENV": "production",
    "FAIRWAY_KEY_PEPPER": "p" * 32,
    "FAIRWAY_CACHE_SALT_KEY": "s" * 32,
    "REDIS_URL": "redis://redis.internal:6379/0",
    "KAFKA_BOOTSTRAP": "kafka.internal:9092",
}


def test_production_refuses_missing_or_dev_secrets() -> None:
    with pytest.raises(ConfigError, match="FAIRWAY_KEY_PEPPER"):
        GatewayConfig.from_env({"FAIRWAY_ENV": "production", "FAIRWAY_CACHE_SALT_KEY": "x"})
    with pytest.raises(ConfigError, match="development"):
        GatewayConfig.from_env(
            {
                "FAIRWAY_ENV": "production",
                "FAIRWAY_KEY_PEPPER": DEV_KEY_PEPPER,
                "FAIRWAY_CACHE_SALT_KEY": "y",
            }
        )
    config = GatewayConfig.from_env(PRODUCTION)
    assert config.key_pepper == b"p" * 32 and config.production


def test_production_refuses_an_implicit_or_malformed_store_and_no_broker() -> None:
    bare = {k: v for k, v in PRODUCTION.items() if k not in ("REDIS_URL", "KAFKA_BOOTSTRAP")}
    with pytest.raises(ConfigError) as refused:
        GatewayConfig.from_env(bare)
    # Every problem in one message, so one restart fixes them all.
    assert "REDIS_URL" in str(refused.value) and "KAFKA_BOOTSTRAP" in str(refused.value)
    for role in ("REDIS_URL", "READMODEL_REDIS_URL", "LIMITS_REDIS_URL", "IDEMPOTENCY_REDIS_URL"):
        for bad in ("redis.internal:6379", "http://redis.internal", "redis://"):
            with pytest.raises(ConfigError, match=f"{role} must be a redis://"):
                GatewayConfig.from_env({**PRODUCTION, role: bad})
    split = GatewayConfig.from_env(
        {
            **PRODUCTION,
            "LIMITS_REDIS_URL": "rediss://limits.internal:6380/0",
            "IDEMPOTENCY_REDIS_URL": "unix:///run/redis/idem.sock",
        }  # fmt: skip
    )
    assert split.redis_urls()["limits"] == "rediss://limits.internal:6380/0"
    # Development keeps its conveniences: the local Redis, no broker.
    assert GatewayConfig.from_env({}).redis_url == DEFAULT_REDIS_URL


def test_config_parses_timeouts_and_rejects_garbage() -> None:
    config = GatewayConfig.from_env(
        {"GATEWAY_UPSTREAM_READ_TIMEOUT_S": "7.5", "KAFKA_BOOTSTRAP": "127.0.0.1:1"}
    )
    assert config.upstream.read == 7.5 and config.kafka_bootstrap == "127.0.0.1:1"
    assert config.key_pepper == DEV_KEY_PEPPER.encode()
    with pytest.raises(ConfigError):
        GatewayConfig.from_env({"GATEWAY_MAX_BODY_BYTES": "lots"})
    with pytest.raises(ConfigError):
        GatewayConfig.from_env({"GATEWAY_DRAIN_DEADLINE_S": "-1"})
    spool = GatewayConfig.from_env(
        {
            "GATEWAY_SPOOL_UNHEALTHY_S": "2.5",
            "GATEWAY_SPOOL_UNHEALTHY_EVENTS": "50",
            "GATEWAY_SPOOL_SEGMENT_BYTES": "4096",
        }
    )
    assert (spool.spool_unhealthy_s, spool.spool_unhealthy_events) == (2.5, 50)
    assert spool.spool_segment_bytes == 4096
    with pytest.raises(ConfigError):
        GatewayConfig.from_env({"GATEWAY_SPOOL_UNHEALTHY_EVENTS": "0"})


def test_each_redis_role_defaults_to_redis_url() -> None:
    shared = "redis://redis.internal:6379/3"
    config = GatewayConfig.from_env({"REDIS_URL": shared})
    assert config.redis_urls() == {"readmodel": shared, "limits": shared, "idempotency": shared}
    split = GatewayConfig.from_env(
        {
            "REDIS_URL": shared,
            "LIMITS_REDIS_URL": "redis://limits.internal:6379/0",
            "IDEMPOTENCY_REDIS_URL": "rediss://idem.internal:6380/0",
        }
    )
    assert split.redis_urls() == {
        "readmodel": shared,
        "limits": "redis://limits.internal:6379/0",
        "idempotency": "rediss://idem.internal:6380/0",
    }
