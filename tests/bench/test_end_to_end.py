"""Tiny end-to-end runs of the benchmark scenarios (real processes, seconds not minutes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import fleet_sim, herd
from bench.nn_report import write_report
from bench.noisy_neighbour import ARMS, NNConfig, run


@pytest.mark.slow
def test_noisy_neighbour_all_arms_smoke(bench_redis_url: str, tmp_path: Path) -> None:
    results = run(NNConfig.smoke(), ARMS, tmp_path, "test", write_report)
    assert set(results) == set(ARMS)
    for arm, res in results.items():
        tenants = {o.tenant_id for o in res.outcomes}
        assert ("noisy" in tenants) == (arm != "quiet"), arm
        done = [o for o in res.outcomes if o.completed]
        assert done, f"arm {arm}: nothing completed"
        # Model-time TPOT per real token of a 70B replica: tens of milliseconds.
        # (generous upper bound: a starved CI box stretches wall-clock gaps)
        assert all(0.01 < o.tpot_s < 2.0 for o in done if o.tpot_s is not None), arm
        assert any(tr.occupancy for tr in res.traces.values()), arm
    # Through the gateway every request carries its tenant's class; direct arm a has none
    # of the gateway's refusals.
    assert not any(o.status in (429, 503) for o in results["a"].outcomes)
    report = (tmp_path / "noisy_neighbour.md").read_text()
    for arm in ("quiet baseline", "(a)", "(b)", "(c)", "## Targets"):
        assert arm in report
    assert (tmp_path / "noisy_neighbour.png").stat().st_size > 10_000
    assert (tmp_path / "noisy_neighbour_headline.md").exists()


@pytest.mark.slow
def test_noisy_neighbour_several_flooders_smoke(bench_redis_url: str, tmp_path: Path) -> None:
    from bench.nn_multi import run_multi

    path = run_multi(NNConfig.smoke(), [2], [7], tmp_path, "test", arms=["c"])
    report = path.read_text()
    assert path.name == "noisy_neighbour_multi.md"
    assert "| 2 | 7 | c |" in report  # the summary row with its six verdicts
    assert "`noisy-1`" in report and "`noisy-2`" in report  # each flooder's goodput
    assert "Enterprise attainment" in report and "Shared-pool peak KV occupancy" in report
    assert "behind the wall clock" in report
    assert "## Seeds pooled" in report and "| 2 | c | 1 |" in report


@pytest.mark.slow
def test_several_flooders_with_a_second_quiet_arm_pool_the_baseline(
    bench_redis_url: str, tmp_path: Path
) -> None:
    """bench/nn_multi.py with quiet2: it runs before the arms compared with it, whatever the
    order given, and arm c is judged against both quiet runs pooled."""
    from bench.nn_multi import POOLED_NOTE, run_multi

    path = run_multi(NNConfig.smoke(), [1], [7], tmp_path, "test", arms=["c", "quiet2"])
    report = path.read_text()
    assert POOLED_NOTE in report
    rows = [line for line in report.splitlines() if line.startswith("| 1 | 7 |")]
    assert [row.split(" | ")[2:4] for row in rows] == [
        ["quiet2", "quiet"],
        ["c", "quiet + quiet2 pooled"],
    ]
    assert len(rows[1].split(" | ")) == len(rows[0].split(" | ")) == 12
    assert "| 1 | c | 1 | quiet + quiet2 pooled |" in report
    assert "Baseline of the ratios and of the marks: quiet + quiet2 pooled" in report
    assert "Worst ratio against quiet + quiet2 pooled: TTFT " in report


def test_fleet_sim_isolation_quick(tmp_path: Path) -> None:
    argv = ["--quick", "--isolation", "--workers", "1", "--out", str(tmp_path)]
    argv += ["--size-range", "4,16,4", "--heavy-rps", "0.5,1"]
    assert fleet_sim.main(argv) == 0
    report = (tmp_path / "fleet_sim_isolation.md").read_text()
    for run_name in ("old (P2C + in-flight), 4 heavy tenants", "new (isolation), 4 heavy tenants"):
        assert f"| {run_name} |" in report
    # the sizing bisection: both policies probed at the top of the range first
    assert "| old (P2C + in-flight) | 16 |" in report and "| new (isolation) | 16 |" in report
    assert "- **old (P2C + in-flight): " in report and "- **new (isolation): " in report
    assert "## Reserved class" in report
    assert "| old (P2C + in-flight) (sizing probe) | 16 |" in report
    # each heavy tenant's row, with its own offered rate
    assert "| heavy-1 | 0.5 |" in report and "| heavy-2 | 1 |" in report


def test_fleet_sim_isolation_reserved_arms(tmp_path: Path) -> None:
    """The reserved report's arms: the run drained, the new policy also on replicas with the
    platform's chunk cap and with a reserved pool, in a report of its own name."""
    argv = ["--quick", "--isolation", "--workers", "1", "--out", str(tmp_path), "--drain", "10"]
    argv += ["--chunk-cap", "5242", "--reserved-pools", "2", "--report", "reserved.md"]
    argv += ["--reserved-rule-off", "--reserved-long-rule-on", "--skip-arm", "old ("]
    assert fleet_sim.main(argv) == 0
    report = (tmp_path / "reserved.md").read_text()
    assert not (tmp_path / "fleet_sim_isolation.md").exists()
    assert "| new, chunk cap 5,242, 4 heavy tenants | 6 | 5,242 |" in report
    assert "| new, reserved pool 2, chunk cap 5,242, 4 heavy tenants | 6 (2) | 5,242 |" in report
    assert "goes on 10 model-s past its end" in report
    assert "| new, reserved on idle designated replicas, 4 heavy tenants | 6 |" in report
    rule = "new, reserved pool 2, chunk cap 5,242, reserved long contexts off the pool"
    assert f"| {rule}, 4 heavy tenants | 6 (2) | 5,242 |" in report
    assert "| old (P2C + in-flight), 4 heavy tenants |" not in report  # --skip-arm


def test_fleet_sim_isolation_every_replica_capped(tmp_path: Path) -> None:
    """--replica-cap: both policies, the sizing probes included, on replicas with the
    platform's chunk cap (--chunk-cap caps only an extra arm of the new policy)."""
    argv = ["--quick", "--isolation", "--workers", "1", "--out", str(tmp_path), "--drain", "10"]
    argv += ["--size-range", "15,16", "--replica-cap", "5242", "--report", "capped.md"]
    assert fleet_sim.main(argv) == 0
    report = (tmp_path / "capped.md").read_text()
    assert "--long-prefill-token-threshold 5,242" in report
    assert "goes on 10 model-s past its end, arrivals and all" in report  # the sizing's drain
    assert "| old (P2C + in-flight) (sizing probe) | 16 | 5,242 |" in report
    assert "| old (P2C + in-flight), 4 heavy tenants | 6 | 5,242 |" in report
    assert "| new (isolation), 4 heavy tenants | 6 | 5,242 |" in report
    assert "| feasible: 95 % lower bound |" in report and "Clopper-Pearson" in report
    with pytest.raises(SystemExit):  # both flags: an extra capped arm of capped replicas
        fleet_sim.main([*argv, "--chunk-cap", "5242"])


def test_fleet_sim_isolation_seeds_pool_the_reserved_class(tmp_path: Path) -> None:
    """--seeds: every arm once per seed, and the reserved class pooled over the seeds."""
    argv = ["--quick", "--isolation", "--workers", "1", "--out", str(tmp_path), "--drain", "10"]
    argv += ["--seeds", "1,2", "--skip-arm", "old (", "--report", "seeds.md"]
    assert fleet_sim.main(argv) == 0
    report = (tmp_path / "seeds.md").read_text()
    assert "| new (isolation), 4 heavy tenants, seed 1 | 6 |" in report
    assert "| new (isolation), 4 heavy tenants, seed 2 | 6 |" in report
    assert "## Reserved class pooled over seeds" in report
    assert "| new (isolation), 4 heavy tenants | 1, 2 |" in report
    with pytest.raises(SystemExit):  # the sizing runs one seed
        fleet_sim.main([*argv, "--size-range", "4,8"])


def test_fleet_sim_isolation_ledger_before_arm(tmp_path: Path) -> None:
    """--lc-before: the new policy also with the simulated ledger as before it told the
    gateway's waits, and the long-context 503s' retry-after in the runs table."""
    argv = ["--quick", "--isolation", "--workers", "1", "--out", str(tmp_path)]
    argv += ["--lc-before", "--skip-arm", "old (", "--report", "retry.md"]
    assert fleet_sim.main(argv) == 0
    report = (tmp_path / "retry.md").read_text()
    assert "| new (isolation), 4 heavy tenants |" in report
    assert "| new, long-context 503s as before, 4 heavy tenants |" in report
    assert "their retry-after p50 / p95 / max s" in report
    assert "| budget 503s (whole run) | gave up (whole run) |" in report


def test_fleet_sim_quick(tmp_path: Path) -> None:
    assert fleet_sim.main(["--quick", "--workers", "1", "--out", str(tmp_path)]) == 0
    report = (tmp_path / "fleet_sim.md").read_text()
    for section in ("Fleet arithmetic", "occupancy cliff", "Routing herd", "One replica dies"):
        assert section in report
    for png in ("fleet_sim_cliff.png", "fleet_sim_herd.png", "fleet_sim_storm.png"):
        assert (tmp_path / png).stat().st_size > 10_000


def test_fleet_sim_kill_loses_streams_and_clients_retry() -> None:
    cfg = fleet_sim.FleetConfig(
        replicas=3, rate_rps=15.0, duration_s=12.0, warmup_s=2.0, gateways=1, kill_at_s=6.0
    )
    res = fleet_sim.simulate(cfg)
    lost = sum(res.series.errors)
    assert lost > 0
    # Lost streams come back as retries (those in the last, unsampled second aside).
    assert sum(res.series.retries) >= 0.8 * lost
    # Every resolved request either completed or its client gave up after max_attempts.
    assert all(r.status == "ok" or r.attempt + 1 >= cfg.max_attempts for r in res.measured())


def test_herd_quick(tmp_path: Path) -> None:
    """``python -m bench.herd`` on the shared simulation core (bench/sim.py), tiny: every arm
    replays the same arrivals and gets its row, and the plot is written."""
    argv = ["--replicas", "2", "--rates", "6", "--duration", "8", "--warmup", "2"]
    assert herd.main([*argv, "--out", str(tmp_path)]) == 0
    report = (tmp_path / "herd.md").read_text()
    for arm in herd.ARMS:
        assert f"| 6 req/s (2 decisions per scrape) | {arm.label} |" in report
    assert (tmp_path / "herd.png").stat().st_size > 10_000


@pytest.mark.slow
def test_noisy_neighbour_smoke_with_client_retries(bench_redis_url: str, tmp_path: Path) -> None:
    """The SDK's retries through the real gateway (the default client): every request made
    1-3 attempts; one finally refused made all three unless its retry-after was past the
    SDK's 120 s; the report counts them per tenant."""
    from bench.loadgen import SDK_MAX_RETRIES, SDK_MAX_RETRY_AFTER_S
    from bench.stats import RETRY_HEADER

    cfg = NNConfig.smoke()
    assert cfg.client_retries == SDK_MAX_RETRIES
    results = run(cfg, ["quiet", "c"], tmp_path, "test", write_report)
    for arm, res in results.items():
        assert all(1 <= o.attempts <= 1 + SDK_MAX_RETRIES for o in res.outcomes), arm
        for o in res.outcomes:
            if o.refused:
                too_long = (o.retry_after_s or 0) * cfg.speed > SDK_MAX_RETRY_AFTER_S
                assert o.attempts == 1 + SDK_MAX_RETRIES or too_long, o
        assert any(o.completed and o.attempts == 1 for o in res.outcomes), arm
    report = (tmp_path / "noisy_neighbour.md").read_text()
    assert RETRY_HEADER in report and "Clients retry a 429/503 up to 2 times" in report


def test_noisy_neighbour_client_retries_must_not_be_negative() -> None:
    from bench.noisy_neighbour import main

    with pytest.raises(SystemExit):
        main(["--smoke", "--client-retries", "-1"])
