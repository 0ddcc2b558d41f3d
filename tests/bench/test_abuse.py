"""A tiny run of the abuse scenario: real gateway, replicas and the bench's own Redis."""

from __future__ import annotations

from bench.abuse import PHASES, Config, execute, report


def test_abuse_smoke_reports_every_phase_and_spares_the_good_tenant() -> None:
    cfg = Config(
        random_keys=200, idem_keys=60, slowloris=10, cjk_requests=20, phase_s=3.0,
        baseline_s=2.0, good_rps=2.0, header_timeout_s=0.5,
    )  # fmt: skip
    run = execute(cfg, [], ["(test)"])
    text = report(run)
    names = [ph.name for ph in run.phases]
    assert names == ["baseline", *PHASES, "baseline_after"]
    for name in names:
        assert f"| {name} |" in text
    # The well-behaved tenant was served throughout, and only with 200s.
    assert run.good
    assert all(g.status == 200 and g.error is None for g in run.good), [
        (g.status, g.error) for g in run.good if g.status != 200 or g.error
    ]
    figures = {ph.name: ph.figures for ph in run.phases}
    # Random keys: past its burst the address is refused without a lookup (429).
    assert figures["random_keys"]["statuses"].get("429", 0) > 0
    assert set(figures["random_keys"]["statuses"]) <= {"401", "429"}
    # The refused tenant's idempotency records stay far under the key count it sent.
    assert figures["idempotency"]["idem_keys"] < figures["idempotency"]["sent"]
    # The head deadline closed slow-loris connections.
    assert figures["slowloris"]["closed"] > 0
    # The CJK tenant was refused on tokens, and asked for at least a token per character.
    assert any(k.startswith("429") for k in figures["cjk_flood"]["statuses"])
    assert figures["cjk_flood"]["estimate_per_request"] >= cfg.cjk_chars
