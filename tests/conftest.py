"""Session-wide backing services for the whole suite.

Real services only: the machine's PostgreSQL and Redis when they answer (as in CI),
embedded ones otherwise, and an embedded Kafka-protocol broker (Tansu) per session
unless KAFKA_BOOTSTRAP points at one.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import redis
from hypothesis import settings

from fairway.embedded import EmbeddedServices
from tests.support import flushed_redis

# Property tests draw the same examples on every run, so a red CI is reproducible and never a
# draw of luck; HYPOTHESIS_PROFILE=explore draws fresh examples when hunting for new failures.
settings.register_profile("ci", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session")
def services() -> Iterator[EmbeddedServices]:
    svc = EmbeddedServices()
    yield svc
    svc.stop()


@pytest.fixture(scope="session")
def redis_url(services: EmbeddedServices) -> str:
    return services.redis_url()


@pytest.fixture(scope="session")
def kafka_bootstrap(services: EmbeddedServices) -> str:
    return services.kafka_bootstrap()


@pytest.fixture(scope="module")
def rdb(redis_url: str) -> Iterator[redis.Redis]:
    """The Redis DB for one test module, emptied before and after it."""
    with flushed_redis(redis_url) as client:
        yield client
