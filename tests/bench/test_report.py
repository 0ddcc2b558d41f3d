"""Report helpers: censored TTFTs, the prefill-shadow attribution, target checks."""

from __future__ import annotations

from bench.loadgen import RawResult, to_outcome
from bench.nn_report import prefill_shadow, targets
from bench.noisy_neighbour import ArmResult, NNConfig, tenants
from bench.stats import GroupStats, Outcome
from bench.workload import RequestSpec


def _spec(rid: str = "std-1-00001") -> RequestSpec:
    return RequestSpec(rid, "std-1", 1.0, 800, 300, 1)


def test_cut_off_before_first_token_counts_its_wait_as_ttft_lower_bound() -> None:
    raw = RawResult(spec=_spec(), status=0, t_sent=1.0, error="cut off", cut_at=4.0)
    o = to_outcome(raw, "standard", speed=3.0)
    assert o.ttft_s == 9.0 and not o.completed and not o.met_slo()
    g = GroupStats.of("t", [o], duration_s=10.0)
    assert g.ttft.n == 1 and g.failed == 1 and g.attainment == 0.0


def test_streamed_request_timings_in_model_time() -> None:
    raw = RawResult(spec=_spec(), status=200, t_sent=1.0, t_first=1.1, t_last=2.1, chunks=11)
    o = to_outcome(raw, "standard", speed=2.0)
    assert abs(o.ttft_s - 0.2) < 1e-9 and abs(o.tpot_s - 0.2) < 1e-9  # type: ignore[operator]
    assert o.completion_tokens == 11 and o.completed


def _o(tid: str, sent: float, ttft: float | None, status: int = 200) -> Outcome:
    return Outcome(f"{tid}-{sent}", tid, "standard", status, sent, ttft, 0.03, 10)


def test_prefill_shadow_compares_requests_after_an_admitted_128k_prompt() -> None:
    specs = tenants(NNConfig())
    outs = [_o("noisy", 10.0, 5.0), _o("noisy", 30.0, None, status=429)]
    outs += [_o("std-1", 11.0, 2.0), _o("std-1", 12.0, 0.3)]  # in the shadow: 1 of 2 slow
    outs += [_o("std-2", 20.0 + i, 0.2) for i in range(4)]  # outside: none slow
    res = ArmResult("c", outs, {}, 0.0, 1.0, 100.0)
    text = prefill_shadow(res, specs, 6.0)
    assert "1 noisy 128k requests were admitted" in text
    assert "50.0 % had TTFT ≥ 1 s (2 requests)" in text and "0.0 % of the rest (4)" in text


def test_targets_report_each_tenant_against_quiet() -> None:
    specs = tenants(NNConfig())
    quiet = ArmResult("quiet", [_o("std-1", float(i), 0.5) for i in range(20)], {}, 0, 1, 10)
    worse = ArmResult("c", [_o("std-1", float(i), 0.9) for i in range(20)], {}, 0, 1, 10)
    lines, verdicts = targets({"quiet": quiet, "c": worse}, specs)
    assert any("std-1" in line and "1.80×" in line for line in lines)
    assert verdicts["every non-noisy tenant holds both SLOs within 10 % of quiet p95"] is False


def _served(tenant: str, at: float) -> Outcome:
    o = _o(tenant, at, 0.5)
    o.prompt_tokens = 128_000
    return o


def test_several_flooders_verdicts_need_a_quiet_baseline_and_count_prompt_tokens() -> None:
    """bench/nn_multi.py: a tenant whose quiet baseline is missing cannot pass the ratio
    checks (it used to count as 0x); the flooders' goodput is their served prompt tokens."""
    from bench.nn_multi import evaluate

    cfg = NNConfig(noisy_tenants=2)
    specs = tenants(cfg)
    outs = [_o("std-1", float(i), 0.5) for i in range(20)]
    outs += [_served("noisy-1", 1.0), _served("noisy-1", 2.0), _served("noisy-2", 3.0)]
    res = ArmResult("c", outs, {}, 0, 1, 10)
    empty = ArmResult("quiet", [], {}, 0, 1, 10)
    lines, verdicts = evaluate(res, empty, cfg, specs)
    assert verdicts["TTFT p95 <= 1.10x quiet"] is False
    assert verdicts["TPOT p95 <= 1.05x quiet"] is False
    assert verdicts["flooders' served prompt tokens within 2x"] is True  # 256k vs 128k
    assert any("`noisy-1` 2 / 256,000" in line for line in lines)
    quiet = ArmResult("quiet", [_o("std-1", float(i), 0.5) for i in range(20)], {}, 0, 1, 10)
    _, same = evaluate(res, quiet, cfg, specs)
    assert same["TTFT p95 <= 1.10x quiet"] is True
    # the quiet workload again (arm quiet2) has no flood to be fair about: not applicable
    _, again = evaluate(quiet, quiet, cfg, specs)
    assert again["flooders' served prompt tokens within 2x"] is None


def test_several_flooders_report_where_the_routing_put_the_work() -> None:
    """bench/nn_multi.py: per shared replica its finished requests and running + waiting
    batch, and the largest batch per sampling round, which shows a herd the means hide."""
    from bench.cluster import ReplicaTrace
    from bench.nn_multi import evaluate

    cfg = NNConfig(noisy_tenants=1, shared_replicas=2)
    # the herd moves: each replica has the big batch half the time, the same mean
    traces = {
        "r0": ReplicaTrace(batch=[40.0, 0.0] * 10, finished=300),
        "r1": ReplicaTrace(batch=[0.0, 40.0] * 10, finished=310),
        "r2": ReplicaTrace(batch=[99.0] * 20),  # the reserved pool: not counted
    }
    res = ArmResult("cache", [_o("std-1", float(i), 0.5) for i in range(20)], traces, 0, 1, 10)
    lines, _ = evaluate(res, res, cfg, tenants(cfg))
    spread = next(line for line in lines if line.startswith("Shared replicas"))
    assert "r0 300 req, batch 20.0 / 40; r1 310 req, batch 20.0 / 40." in spread
    assert "per sample: median 40, p95 40." in spread


def test_pooled_ratios_put_every_seeds_requests_together_without_the_flooders() -> None:
    from bench.nn_multi import pooled_lines

    def run(arm: str, ttft: float, tenant: str = "std-1") -> ArmResult:
        return ArmResult(arm, [_o(tenant, float(i), ttft) for i in range(30)], {}, 0, 1, 10)

    noisy = run("c", 9.0, "noisy")
    first = ArmResult("c", [*run("c", 0.9).outcomes, *noisy.outcomes], {}, 0, 1, 10)
    runs = [(first, run("quiet", 0.5)), (run("c", 0.9), run("quiet", 0.5))]
    lines, worst_ttft, worst_tpot = pooled_lines(runs, {"noisy"})
    assert len(lines) == 1 and lines[0].startswith("| std-1 | 1.80x (1.80–1.80), n=60 |")
    assert worst_ttft == 1.8 and worst_tpot == 1.0


def test_refused_requests_are_counted_per_tenant_beside_the_percentiles_they_miss() -> None:
    """bench/nn_multi.py: a non-noisy tenant's 429s and 503s (no TTFT, so not in its p95s),
    and of its long prompts how many the long-context budget refused, in the arm and in the
    quiet baseline of the same seed; the pooled table sums them over seeds."""
    from bench.nn_multi import LONG_PROMPT_TOKENS, evaluate, pooled_lines, refused_counts

    # the load generator keeps the body's first 300 characters: the code may be cut off
    long_503 = '{"error":{"message":"The fleet\'s long-context capacity for v is in use'
    served = [_o("std-1", float(i), 0.5) for i in range(20)]
    refused = _o("std-1", 30.0, None, status=503)
    refused.prompt_tokens, refused.error = LONG_PROMPT_TOKENS, long_503
    served_long = _o("std-1", 31.0, 0.9)
    served_long.prompt_tokens = LONG_PROMPT_TOKENS + 1
    other_503 = _o("std-1", 32.0, None, status=503)
    other_503.prompt_tokens, other_503.error = 20_000, "replica unavailable"
    quota = _o("std-1", 33.0, None, status=429)
    flood = _o("noisy", 34.0, None, status=503)
    arm_outs = [*served, refused, served_long, other_503, quota, flood]
    counts = refused_counts(arm_outs, "std-1")
    assert (counts.r429, counts.r503, counts.long_refused, counts.long_sent) == (1, 2, 1, 3)
    assert counts.cell() == "1 / 2 (1 of 3 long)"

    cfg = NNConfig(noisy_tenants=1)
    res = ArmResult("c", arm_outs, {}, 0, 1, 10)
    quiet = ArmResult("quiet", [*served, served_long], {}, 0, 1, 10)
    lines, verdicts = evaluate(res, quiet, cfg, tenants(cfg))
    row = next(line for line in lines if line.startswith("| std-1 |"))
    assert row.endswith(
        "| 1 / 2 (1 of 3 long) | 0 / 0 (0 of 1 long) "
        "| 21 / 0 / 3 (0 retries) | 21 / 0 / 0 (0 retries) |"
    )
    assert any("not in the p95s" in line for line in lines)
    # information only: the checks are those of the served requests
    only_served = ArmResult("c", [*served, served_long, flood], {}, 0, 1, 10)
    _, unchanged = evaluate(only_served, quiet, cfg, tenants(cfg))
    assert verdicts == unchanged

    pooled, _, _ = pooled_lines([(res, quiet), (res, quiet)], {"noisy"})
    assert pooled[0].endswith(
        "| 2 / 4 (2 of 6 long) | 0 / 0 (0 of 2 long) "
        "| 42 / 0 / 6 (0 retries) | 42 / 0 / 0 (0 retries) |"
    )


def test_the_long_context_hold_flag_sets_arm_cs_gateways_only() -> None:
    from bench.noisy_neighbour import gateway_env, hold_note

    hold = {"GATEWAY_ADMISSION_LONG_CONTEXT_HOLD_S": "7.5"}
    assert gateway_env("c", 8, 7.5) == hold
    assert gateway_env("c", 8) == {} and gateway_env("c", 8, 0.0) == {}
    for arm in ("quiet", "b", "c0", "fcfs", "quiet2"):
        assert "GATEWAY_ADMISSION_LONG_CONTEXT_HOLD_S" not in gateway_env(arm, 8, 7.5)
    assert hold_note(NNConfig()) == ""
    assert "up to 7.5 wall seconds" in hold_note(NNConfig(long_context_hold_s=7.5))
