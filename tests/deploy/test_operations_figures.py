"""docs/operations.md quotes measured figures: each one must be what bench/results/ holds
(the issue's acceptance: the operations guide's numbers match the results). A rerun that
changes a figure fails here until the guide is updated with it."""

from __future__ import annotations

import pytest

from tests.support import ROOT

GUIDE = ROOT / "docs" / "operations.md"
RESULTS = ROOT / "bench" / "results"

# (as the guide writes it, the results file, as that file writes it)
FIGURES = [
    ("2,278 out tok/s per replica", "fleet_sim.md", "| 2,278 |"),
    ("TTFT p95 379 ms", "fleet_sim.md", "| 379 |"),
    ("TPOT p95 49 ms", "fleet_sim.md", "47 / 49"),
    ("p95 165 ms, TTFT p95 5.1 s", "fleet_sim.md", "| 5059 |"),
    ("refuse 35.6 % with 503", "fleet_sim.md", "| 35.6 % |"),
    ("**1.49 req/s**", "fleet_sim.md", "**1.49 req/s**"),
    ("**224\n  replicas (896 GPUs)**", "fleet_sim.md", "**224 replicas** (896 GPUs)"),
    ("4.81 req/s and 70 replicas", "README.md", "| 4.81 req/s |"),
    ("4.81 req/s and 70 replicas", "README.md", "| 70 |"),
    ("TPOT\n  p95 is 47 ms at 2 req/s and 62 ms at 3", "fleet_sim.md", "| 2 | 12.3 % | 38 | 47 |"),
    ("62 ms at 3", "fleet_sim.md", "| 3 | 24.7 % | 51 | 62 |"),
    ("at 5 req/s occupancy reaches 73 %", "fleet_sim.md", "| 5 | 73.0 % |"),
    ("at 6 req/s it is 25 s", "fleet_sim.md", "| 25216 |"),
    ("adds 376 503/s there", "fleet_sim.md", "88 → 376"),
    ("fullest replica at 94.3 %", "fleet_sim.md", "| p2c+inflight | 87.0 % | 94.3 % |"),
    ("reaches 98.7 % with 474", "fleet_sim.md", "| emptiest (stale) | 81.0 % | 98.7 % |"),
    ("TTFT p99\n  7.7 s vs 33.6 s", "fleet_sim.md", "| 7674 |"),
    ("TTFT p99\n  7.7 s vs 33.6 s", "fleet_sim.md", "| 33593 |"),
    ("one worker sustains 600 streaming req/s", "gateway_overhead.md", "**Sustained: 600"),
    ("1.89 ms of gateway CPU per streamed request", "gateway_overhead.md", "| 1.89 ms |"),
    ("adds 1.65 ms p50 / 2.28 ms p99 to TTFT", "gateway_overhead.md", "| 1.65 ms | 2.28 ms |"),
    ("median 25,612 events/s", "ingest.md", "Median **25,612 events/s**"),
    ("**0.31 req/s** per replica", "noisy_neighbour_multi.md", "keeps it up to 0.31 req/s"),
    ("against 2.31 req/s for the p95 SLOs", "noisy_neighbour_multi.md", "up to 2.31 req/s"),
    ("2,993–4,107 admit+settle pairs/s", "redis_cluster.md", "| 2,993 |"),
    ("2,993–4,107 admit+settle pairs/s", "redis_cluster.md", "| 4,107 |"),
    ("1,311–2,573/s against a 3-master cluster", "redis_cluster.md", "| 1,311 |"),
    ("1,311–2,573/s against a 3-master cluster", "redis_cluster.md", "| 2,573 |"),
    ("now 116–122 µs on a cluster", "redis_cluster.md", "| 116 |"),
    ("now 116–122 µs on a cluster", "redis_cluster.md", "| 122 |"),
    ("70–75 µs on a\n  single Redis", "redis_cluster.md", "| 70 |"),
    ("70–75 µs on a\n  single Redis", "redis_cluster.md", "| 75 |"),
    ("pool gives 99.68 % of the feasible", "fleet_sim_reserved_options.md", "| 99.68 % (7782) |"),
    ("replicas 99.73 % (no measurable", "fleet_sim_reserved_options.md", "| 99.73 % (7783) |"),
    ("as the pool 99.83 %", "fleet_sim_reserved_options.md", "| 99.83 % (7789) |"),
    ("falls to ~21 %", "fleet_sim_reserved_options.md", "| 21.1 %, 22.6 %, 20.8 %, 20.9 % |"),
]


@pytest.mark.parametrize(("in_guide", "results", "in_results"), FIGURES)
def test_the_guide_quotes_the_recorded_figure(in_guide: str, results: str, in_results: str) -> None:
    assert in_guide in GUIDE.read_text(), f"docs/operations.md no longer says {in_guide!r}"
    assert in_results in (RESULTS / results).read_text(), (
        f"bench/results/{results} no longer holds {in_results!r} (quoted by the guide as "
        f"{in_guide!r}): rerun or update docs/operations.md"
    )
