"""bench.gateway_overhead: the A/B against another checkout (``--against``)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from bench import cluster, gateway_overhead
from bench.gateway_overhead import RESULTS, Arm, Sample, Spread, parse


def arm(values_per_slice: list[list[float]]) -> Arm:
    a = Arm("a", 1.0, True)
    for values in values_per_slice:
        a.samples += [Sample(status=200, ttft=v, total=v) for v in values]
        a.cuts.append(len(a.samples))
    return a


def test_slices_and_their_spread() -> None:
    this = arm([[0.010, 0.012, 0.014], [0.020, 0.022, 0.024], [0.030]])
    other = arm([[0.011, 0.011, 0.011], [0.020, 0.020, 0.020], []])
    assert this.slice_quantiles("ttft", 0.5) == pytest.approx([0.012, 0.022, 0.030])
    assert math.isnan(other.slice_quantiles("ttft", 0.5)[2])
    spread = Spread.of(this, other, "ttft", 0.5)
    assert spread.diffs == pytest.approx([0.001, 0.002])  # the slice with no sample is left out
    low, high = spread.interval()
    assert 0.001 - 1e-12 <= low <= high <= 0.002 + 1e-12
    assert spread.cells() == "+1.50 (+1.00 … +2.00) | [+1.00, +2.00] | 2 of 2"
    assert Spread([]).cells() == "n/a | n/a | n/a"


def test_an_ab_run_does_not_overwrite_the_main_report() -> None:
    assert parse([]).out == RESULTS / "gateway_overhead.md"
    assert parse([]).slices == 8
    assert parse(["--tools"]).out == RESULTS / "gateway_overhead_tools.md"
    ab = parse(["--against", str(cluster.ROOT)])
    assert ab.out == RESULTS / "gateway_overhead_ab.md"
    assert ab.slices == 12  # each arm in each place of the order twice
    assert ab.against == cluster.ROOT and ab.label  # its HEAD commit by default
    with pytest.raises(SystemExit):
        parse(["--against", str(cluster.ROOT / "bench")])  # not a checkout


@pytest.mark.slow
def test_against_a_checkout_smoke(tmp_path: Path) -> None:
    """The tree against itself: three arms in turn, both gateways' figures and the spread."""
    out = tmp_path / "ab.md"
    argv = ["--against", str(cluster.ROOT), "--label", "the tree itself", "--workers", "1",
            "--slices", "2", "--slice-s", "0.5", "--rate", "40", "--out", str(out)]  # fmt: skip
    assert gateway_overhead.main(argv) == 0
    report = out.read_text()
    assert "**other**: `the tree itself`" in report
    assert "--label 'the tree itself'" in report  # the command as one can paste it
    summary = next(line for line in report.splitlines() if line.startswith("| `--workers 1` |"))
    assert "n/a" not in summary and summary.endswith(" of 2 |")
    for row in ("| SSE | time to first token p50 |", "| SSE | end of stream p99 |",
                "| JSON | whole JSON response p50 |"):  # fmt: skip
        assert row in report
    counts = [line for line in report.splitlines() if line.startswith(("| SSE | ", "| JSON | "))]
    assert [line.split(" | ")[2] for line in counts[-2:]] == ["0 / 0 / 0", "0 / 0 / 0"]  # errors
    assert "TTFT p50 per slice" in report


def test_gateway_env_and_prompt_words_are_parsed() -> None:
    args = parse(
        ["--gateway-env", "GATEWAY_ADMISSION_STRATEGY=cache_aware", "--gateway-env", "A=b=c"]
        + ["--prompt-words", "5"]
    )
    assert args.gateway_env == {"GATEWAY_ADMISSION_STRATEGY": "cache_aware", "A": "b=c"}
    assert args.prompt_words == 5
    assert parse([]).gateway_env == {} and parse([]).prompt_words == 0
    with pytest.raises(SystemExit):
        parse(["--gateway-env", "novalue"])
