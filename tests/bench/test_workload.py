"""The workload generator reproduces the design's token shape and is seeded."""

from __future__ import annotations

import numpy as np
import pytest

from bench.workload import (
    DESIGN_OUTPUT,
    DESIGN_PROMPT,
    Fixed,
    LogNormal,
    PromptFactory,
    TenantSpec,
    build_workload,
    poisson_arrivals,
)


def test_design_token_shape_quantiles() -> None:
    rng = np.random.default_rng(7)
    prompts = DESIGN_PROMPT.sample(rng, 100_000)
    outputs = DESIGN_OUTPUT.sample(rng, 100_000)
    assert np.percentile(prompts, 50) == pytest.approx(800, rel=0.03)
    assert np.percentile(prompts, 95) == pytest.approx(6_000, rel=0.05)
    assert np.percentile(outputs, 50) == pytest.approx(300, rel=0.03)
    assert np.percentile(outputs, 95) == pytest.approx(1_200, rel=0.05)
    # The heavy tail the design insists on: p95/p50 = 7.5 on prompts.
    assert DESIGN_PROMPT.quantile(0.95) / DESIGN_PROMPT.quantile(0.5) == pytest.approx(7.5)
    assert prompts.min() >= DESIGN_PROMPT.lo and prompts.max() <= DESIGN_PROMPT.hi


def test_lognormal_rejects_bad_quantiles() -> None:
    with pytest.raises(ValueError):
        LogNormal.from_quantiles(100, 50)


def test_scaled_shape_keeps_sigma() -> None:
    half = DESIGN_PROMPT.scaled(0.5)
    assert half.sigma == DESIGN_PROMPT.sigma
    assert half.quantile(0.5) == pytest.approx(400)
    assert Fixed(128_000).scaled(0.25).value == 32_000


def test_poisson_arrivals_rate_and_gaps() -> None:
    rng = np.random.default_rng(3)
    times = poisson_arrivals(rng, rate=50.0, start=10.0, end=410.0)
    assert times.min() >= 10.0 and times.max() < 410.0
    assert len(times) == pytest.approx(20_000, rel=0.03)
    gaps = np.diff(times)
    # Exponential gaps: coefficient of variation 1.
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.05)


def _tenants(noisy: bool) -> list[TenantSpec]:
    ts = [
        TenantSpec("std-a", "A", "standard", "standard", rate_rps=2.0),
        TenantSpec("ent", "E", "enterprise", "reserved", rate_rps=1.0),
    ]
    if noisy:
        ts.append(
            TenantSpec("noisy", "N", "standard", "standard", 0.5, prompt=Fixed(128_000), noisy=True)
        )
    return ts


def test_workload_is_seeded_and_independent_per_tenant() -> None:
    a = build_workload(_tenants(noisy=True), duration_s=60, seed=11)
    b = build_workload(_tenants(noisy=True), duration_s=60, seed=11)
    assert a.requests == b.requests
    # Removing the noisy tenant leaves every other tenant's requests identical.
    quiet = build_workload(_tenants(noisy=False), duration_s=60, seed=11)
    assert quiet.requests == a.without_noisy().requests
    assert [r.at_s for r in a.requests] == sorted(r.at_s for r in a.requests)
    assert all(r.prompt_tokens == 128_000 for r in a.requests if r.tenant_id == "noisy")
    c = build_workload(_tenants(noisy=True), duration_s=60, seed=12)
    assert c.requests != a.requests


def test_prompt_factory_lengths_and_unique_prefixes() -> None:
    from emulator.tokenizer import Tokenizer

    tok = Tokenizer()
    pf = PromptFactory(seed=1)
    wl = build_workload(_tenants(noisy=True), duration_s=20, seed=5)
    specs = wl.requests[:20]
    texts = [pf.prompt(r) for r in specs]
    for r, t in zip(specs, texts, strict=True):
        # Exact against the emulator's tokenizer, chat template included.
        assert tok.count_text(t) + 7 == r.prompt_tokens
    # Distinct leading words per request: no accidental prefix-cache sharing.
    assert len({" ".join(t.split()[:3]) for t in texts}) == len(texts)
