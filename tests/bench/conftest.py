"""Fixtures for the benchmark smoke tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def bench_redis_url(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """Point the benchmarks at the test Redis (the session's DB, flushed between arms)."""
    monkeypatch.setenv("BENCH_REDIS_URL", redis_url)
    return redis_url
