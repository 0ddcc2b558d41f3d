"""bench/nn_multi.py's baseline: with a second quiet arm (quiet2) in a run, every other arm
is compared with the run's quiet arms pooled (the same seeded workload measured twice); the
first quiet arm alone stays beside it, and without quiet2 nothing changes."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.nn_multi import (
    FIRST_ALONE_TPOT,
    FIRST_ALONE_TTFT,
    POOLED_NOTE,
    TPOT_CHECK,
    TTFT_CHECK,
    Baseline,
    _pooled_section,
    _write,
    evaluate,
    pooled_lines,
    run_table_head,
)
from bench.noisy_neighbour import ArmResult, NNConfig, tenants
from bench.stats import Outcome, percentile, ratio_interval

CFG = NNConfig(noisy_tenants=1)
SPECS = tenants(CFG)


def _arm(arm: str, ttfts: dict[str, list[float]], tpot: float = 0.030) -> ArmResult:
    outs = [
        Outcome(f"{arm}-{tid}-{i}", tid, "standard", 200, float(i), t, tpot, 10)
        for tid, values in ttfts.items()
        for i, t in enumerate(values)
    ]
    return ArmResult(arm, outs, {}, 0.0, 1.0, 10.0)


# Three runs of one seed: the quiet arm, quiet2 and arm c. std-1's p95 moves between the two
# quiet runs as a small sample's does; free has a handful of requests, as in the benchmark.
QUIET = {"std-1": [0.30 + 0.01 * i for i in range(40)], "free": [0.40 + 0.02 * i for i in range(9)]}
QUIET2 = {
    "std-1": [0.33 + 0.012 * i for i in range(40)],
    "free": [0.45 + 0.03 * i for i in range(8)],
}
ARM_C = {
    "std-1": [0.31 + 0.0125 * i for i in range(40)],
    "free": [0.42 + 0.025 * i for i in range(9)],
}


def _runs() -> tuple[ArmResult, ArmResult, ArmResult]:
    return _arm("quiet", QUIET), _arm("quiet2", QUIET2), _arm("c", ARM_C)


def _interval(xs: list[float], ys: list[float]) -> str:
    lo, hi = ratio_interval(xs, ys)
    return f"{lo:.2f}–{hi:.2f}"


def _row(lines: list[str], tid: str) -> str:
    return next(line for line in lines if line.startswith(f"| {tid} |"))


def test_pooled_baseline_is_the_ratio_against_both_quiet_runs_samples_together() -> None:
    quiet, quiet2, c = _runs()
    lines, _ = evaluate(c, Baseline(quiet, (quiet2,)), CFG, SPECS)
    for tid in ("std-1", "free"):
        pooled = QUIET[tid] + QUIET2[tid]
        p95 = percentile(ARM_C[tid], 95)
        ratio = p95 / percentile(pooled, 95)
        first = p95 / percentile(QUIET[tid], 95)
        assert ratio != pytest.approx(first, abs=0.01)  # the two baselines tell apart
        # TTFT: the arm's p95, its ratio to the pooled p95 and that ratio's interval, then
        # the ratio against the first quiet run alone with its own interval
        assert _row(lines, tid).startswith(
            f"| {tid} | {p95 * 1000:.0f} ({ratio:.2f}x; {_interval(ARM_C[tid], pooled)}) | "
            f"{first:.2f}x; {_interval(ARM_C[tid], QUIET[tid])} | 30.0 (1.00x; 1.00–1.00) | "
            "1.00x; 1.00–1.00 |"
        )
    # by hand: std-1's p95s are 0.773 (c), 0.6705 (quiet), 0.7506 (quiet + quiet2)
    assert _row(lines, "std-1").startswith("| std-1 | 773 (1.03x; 0.95–1.12) | 1.15x; 1.07–1.23 |")
    # the sentence naming the baseline, with each quiet run's TTFT / TPOT samples per tenant
    note = next(line for line in lines if line.startswith("Baseline of the ratios"))
    assert "quiet + quiet2 pooled" in note
    assert "free 9+8 / 9+8, std-1 40+40 / 40+40" in note
    # the same cells and checks as against one quiet arm holding both runs' requests
    both = ArmResult("quiet", quiet.outcomes + quiet2.outcomes, {}, 0.0, 1.0, 10.0)
    cat_lines, cat_verdicts = evaluate(c, both, CFG, SPECS)
    _, verdicts = evaluate(c, Baseline(quiet, (quiet2,)), CFG, SPECS)
    assert {k: verdicts[k] for k in cat_verdicts} == cat_verdicts
    for tid in ("std-1", "free"):
        pooled_cells = _row(lines, tid).split(" | ")
        cat_cells = _row(cat_lines, tid).split(" | ")
        assert pooled_cells[1] == cat_cells[1] and pooled_cells[3] == cat_cells[2]


def test_pooled_table_ratio_equals_the_one_against_the_concatenated_quiet_samples() -> None:
    quiet, quiet2, c = _runs()
    # today's path with one quiet arm holding both runs' requests
    concatenated = ArmResult("quiet", quiet.outcomes + quiet2.outcomes, {}, 0.0, 1.0, 10.0)
    (free, std1), worst_ttft, worst_tpot = pooled_lines([(c, Baseline(quiet, (quiet2,)))], set())
    (free_cat, std1_cat), worst_ttft_cat, _ = pooled_lines([(c, concatenated)], set())
    for row, cat in ((free, free_cat), (std1, std1_cat)):
        ratio_cell = row.split(" | ")[1]
        assert ratio_cell.split(" vs ")[0] == cat.split(" | ")[1]
    ratio = percentile(ARM_C["std-1"], 95) / percentile(QUIET["std-1"] + QUIET2["std-1"], 95)
    interval = _interval(ARM_C["std-1"], QUIET["std-1"] + QUIET2["std-1"])
    assert std1.startswith(f"| std-1 | {ratio:.2f}x ({interval}), n=40 vs 80 | ")
    # beside it, against the first quiet run alone
    first = percentile(ARM_C["std-1"], 95) / percentile(QUIET["std-1"], 95)
    assert f"| {first:.2f}x ({_interval(ARM_C['std-1'], QUIET['std-1'])}), n=40 vs 40 |" in std1
    assert (
        worst_ttft
        == worst_ttft_cat
        == pytest.approx(
            max(
                percentile(ARM_C[t], 95) / percentile(QUIET[t] + QUIET2[t], 95)
                for t in ("std-1", "free")
            )
        )
    )
    assert worst_tpot == 1.0
    # two seeds: every seed's quiet runs pooled together
    two = [(c, Baseline(quiet, (quiet2,))), (c, Baseline(quiet, (quiet2,)))]
    lines, _, _ = pooled_lines(two, set())
    assert "n=80 vs 160" in _row(lines, "std-1")


def test_marks_use_the_pooled_baseline_and_the_first_quiet_alone_is_for_information(
    tmp_path: Path,
) -> None:
    """A tenant 15 % above the first quiet run's p95 but within 10 % of the pooled one passes
    the TTFT check; the check against the first quiet alone is reported beside it."""
    quiet = _arm("quiet", {"std-1": [0.50] * 20})
    quiet2 = _arm("quiet2", {"std-1": [0.60] * 20})
    c = _arm("c", {"std-1": [0.575] * 20}, tpot=0.0312)
    lines, verdicts = evaluate(c, Baseline(quiet, (quiet2,)), CFG, SPECS)
    assert verdicts[TTFT_CHECK] is True  # 0.575 / 0.60 = 0.96x
    assert verdicts[FIRST_ALONE_TTFT] is False  # 0.575 / 0.50 = 1.15x
    assert verdicts[TPOT_CHECK] is True and verdicts[FIRST_ALONE_TPOT] is True  # 1.04x
    assert _row(lines, "std-1").startswith(
        "| std-1 | 575 (0.96x; 0.96–0.96) | 1.15x; 1.15–1.15 | 31.2 (1.04x; 1.04–1.04) | "
        "1.04x; 1.04–1.04 |"
    )
    worst = lines[-1]
    assert worst.startswith(
        "Worst ratio against quiet + quiet2 pooled: TTFT 0.96x (std-1, 0.96–0.96), "
        "TPOT 1.04x (std-1, 1.04–1.04); against quiet alone: TTFT 1.15x, TPOT 1.04x."
    )
    assert "✅ TTFT p95 <= 1.10x baseline" in worst
    assert "❌ (first quiet alone: TTFT p95 <= 1.10x)" in worst
    # the same arm against the first quiet run alone, as without quiet2: it fails
    _, alone = evaluate(c, quiet, CFG, SPECS)
    assert alone[TTFT_CHECK] is False and FIRST_ALONE_TTFT not in alone
    # quiet2 itself is judged against the first quiet run alone (the noise floor): 1.20x
    _, floor = evaluate(quiet2, Baseline(quiet), CFG, SPECS)
    assert floor[TTFT_CHECK] is False and FIRST_ALONE_TTFT not in floor

    # the summary: the baseline column, the checks named against it, quiet2's row without
    # the first-quiet-alone columns (its own checks are those)
    summary = [
        ("| 1 | 7 | quiet2 | quiet |", floor),
        ("| 1 | 7 | c | quiet + quiet2 pooled |", verdicts),
    ]
    text = _written(tmp_path / "pooled.md", summary, pooled_run=True)
    assert POOLED_NOTE in text
    assert (
        "| flooders | seed | arm | baseline | TTFT p95 <= 1.10x baseline | "
        "TPOT p95 <= 1.05x baseline | both SLOs held | shared occupancy <= 0.85 | "
        "flooders' served prompt tokens within 2x | enterprise (feasible) >= 99.9 % | "
        "(first quiet alone: TTFT p95 <= 1.10x) | (first quiet alone: TPOT p95 <= 1.05x) |\n"
        + "| --- "
        * 12
        + "|\n| 1 | 7 | quiet2 | quiet | ❌ | ✅ | ✅ | ✅ | — | ❌ | — | — |\n"
        "| 1 | 7 | c | quiet + quiet2 pooled | ✅ | ✅ | ✅ | ✅ | — | ❌ | ❌ | ✅ |\n"
    ) in text


def _written(
    path: Path, summary: list[tuple[str, dict[str, bool | None]]], *, pooled_run: bool
) -> str:
    _write(path, "cmd", CFG, [1], [7], summary, ["body"], 0.0, pooled_run=pooled_run)
    return path.read_text()


def test_without_quiet2_nothing_changes(tmp_path: Path) -> None:
    quiet, _, c = _runs()
    # evaluate: one quiet arm, given as itself or as a Baseline without more runs
    assert evaluate(c, quiet, CFG, SPECS) == evaluate(c, Baseline(quiet), CFG, SPECS)
    lines, verdicts = evaluate(c, quiet, CFG, SPECS)
    ratio = percentile(ARM_C["std-1"], 95) / percentile(QUIET["std-1"], 95)
    assert _row(lines, "std-1").startswith(
        f"| std-1 | 773 ({ratio:.2f}x; {_interval(ARM_C['std-1'], QUIET['std-1'])}) | "
        "30.0 (1.00x; 1.00–1.00) | 100.0% | yes |"
    )
    assert not any(line.startswith("Baseline of the ratios") for line in lines)
    assert lines[-1].startswith("Worst ratio: TTFT 1.15x, TPOT 1.00x. ❌ TTFT p95 <= 1.10x quiet")
    assert list(verdicts) == [
        TTFT_CHECK,
        TPOT_CHECK,
        "both SLOs held",
        "shared occupancy <= 0.85",
        "flooders' served prompt tokens within 2x",
        "enterprise (feasible) >= 99.9 %",
    ]
    assert run_table_head(Baseline(quiet))[0].startswith(
        "| tenant | TTFT p95 ms (× quiet) | TPOT p95 ms (× quiet) | attainment | SLOs held |"
    )
    # the pooled-over-seeds section: the table and headers of a single quiet arm
    assert pooled_lines([(c, quiet)], set()) == pooled_lines([(c, Baseline(quiet))], set())
    md = _pooled_section({(1, "c"): [(c, Baseline(quiet))]}, {"noisy"})
    assert md[2].startswith("Each tenant's requests of every seed so far put together, the arm's")
    assert md[4:7] == [
        "| flooders | arm | seeds | worst TTFT ratio | worst TPOT ratio |",
        "| --- | --- | --- | --- | --- |",
        "| 1 | c | 1 | 1.15x | 1.00x |",
    ]
    assert any(
        line.startswith("| tenant | TTFT p95 ratio (interval), n | TPOT p95 ratio (interval), n |")
        for line in md
    )
    # the summary: no baseline column, no note
    text = _written(tmp_path / "single.md", [("| 1 | 7 | c |", verdicts)], pooled_run=False)
    assert POOLED_NOTE not in text
    assert (
        "| flooders | seed | arm | TTFT p95 <= 1.10x quiet | TPOT p95 <= 1.05x quiet | "
        "both SLOs held | shared occupancy <= 0.85 | flooders' served prompt tokens within 2x "
        "| enterprise (feasible) >= 99.9 % |\n| --- | --- | --- | --- | --- | --- | --- | --- "
        "| --- |\n| 1 | 7 | c | ❌ | ✅ | ✅ | ✅ | — | ❌ |\n"
    ) in text


def test_pooled_section_pools_every_quiet_run_and_names_the_baseline() -> None:
    quiet, quiet2, c = _runs()
    pooled = {
        (1, "c"): [(c, Baseline(quiet, (quiet2,)))],
        (1, "quiet2"): [(quiet2, Baseline(quiet))],
    }
    md = _pooled_section(pooled, {"noisy"})
    std1 = percentile(ARM_C["std-1"], 95)
    worst = std1 / percentile(QUIET["std-1"] + QUIET2["std-1"], 95)
    free = percentile(ARM_C["free"], 95)
    worst = max(worst, free / percentile(QUIET["free"] + QUIET2["free"], 95))
    worst_first = max(std1 / percentile(QUIET["std-1"], 95), free / percentile(QUIET["free"], 95))
    noise = max(percentile(QUIET2[t], 95) / percentile(QUIET[t], 95) for t in ("std-1", "free"))
    assert md[4:8] == [
        "| flooders | arm | seeds | baseline | worst TTFT ratio | worst TPOT ratio | "
        "worst TTFT × first quiet alone | worst TPOT × first quiet alone |",
        "| --- " * 8 + "|",
        f"| 1 | c | 1 | quiet + quiet2 pooled | {worst:.2f}x | 1.00x | {worst_first:.2f}x | "
        "1.00x |",
        f"| 1 | quiet2 | 1 | quiet | {noise:.2f}x | 1.00x | {noise:.2f}x | 1.00x |",
    ]
    assert any(
        line.startswith("| tenant | TTFT p95 ratio × quiet + quiet2 pooled (interval), ")
        for line in md
    )
    # quiet2's own pooled table keeps the single-baseline layout
    assert any(
        line.startswith("| tenant | TTFT p95 ratio (interval), n | TPOT p95 ratio (interval), n |")
        for line in md
    )


def test_the_refusals_table_shows_a_seeds_quiet_run_once_for_every_flooder_count() -> None:
    # two flooder counts share the seed's first quiet run: one quiet row, not two
    quiet, quiet2, c = _runs()
    pooled = {
        (n, arm): [(run, Baseline(quiet, (quiet2,)) if arm == "c" else Baseline(quiet))]
        for n in (1, 2)
        for arm, run in (("c", c), ("quiet2", quiet2))
    }
    md = _pooled_section(pooled, {"noisy"})
    refusal_rows = [line for line in md if line.startswith("| quiet | ")]
    assert len(refusal_rows) == 1
    assert [line for line in md if line.startswith("| 2 × c | ")]
