"""``python -m bench.prefix_route_cost``, tiny: it runs against this tree and another checkout
(this one again, standing in for it) and reports every prompt case for both."""

from __future__ import annotations

from pathlib import Path

from bench import cluster, prefix_route_cost


def test_route_cost_quick(tmp_path: Path) -> None:
    out = tmp_path / "cost.md"
    argv = ["--words", "60", "--requests", "60", "--out", str(out)]
    assert prefix_route_cost.main([*argv, "--against", str(cluster.ROOT), "--label", "same"]) == 0
    text = out.read_text()
    assert "before / after the send, same |" in text
    for case in prefix_route_cost.CASES:
        assert f"| {case.format(n=60)} |" in text
