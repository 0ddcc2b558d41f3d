"""Prometheus text for the benchmarks and tests, read with ``prometheus_client``'s parser
(``metric_sums``, ``metric_sum``, ``sample_names``), and the measurement that decides where
a hand-written parser is still worth it.

The measurement: the gateway's replica scrape parser
(``gateway.admission.replicas.parse_metrics``, a line filter) against
``prometheus_client.parser.text_string_to_metric_families`` on a realistic vLLM ``/metrics``
page: the emulator's own exposition (vLLM's names, labels and histograms) after a few hundred
requests, so every histogram has populated buckets.

The gateway parses one page per replica every 250 ms in every worker, so the cost per page
decides whether the hand-written filter earns its keep.

``python -m bench.prom_parse`` prints the page's size and both parsers' cost per page
(best of ``--repeat`` rounds of ``--number`` parses), after checking that they agree.
"""

from __future__ import annotations

import argparse
import timeit
from collections.abc import Callable, Iterable, Iterator

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from gateway.admission.replicas import (
    ITL_BUCKET,
    KV_USAGE,
    RUNNING,
    WAITING,
    Scrape,
    parse_metrics,
)


def samples(text: str) -> Iterator[Sample]:
    for family in text_string_to_metric_families(text):
        yield from family.samples


def metric_sums(text: str) -> dict[str, float]:
    """Each sample name's sum over its label sets (``x_total``, ``x_bucket`` as exposed)."""
    sums: dict[str, float] = {}
    for sample in samples(text):
        sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    return sums


def metric_sum(text: str, name: str, **labels: str) -> float | None:
    """The sum of the samples of ``name`` whose labels include ``labels``; None if none."""
    values = [
        s.value for s in samples(text) if s.name == name and labels.items() <= s.labels.items()
    ]
    return sum(values) if values else None


def _by_bound(buckets: Iterable[Sample]) -> dict[float, float]:
    """Histogram bucket samples' cumulative counts by upper bound ``le``, label sets summed."""
    out: dict[float, float] = {}
    for sample in buckets:
        le = float(sample.labels["le"])
        out[le] = out.get(le, 0.0) + sample.value
    return out


def bucket_sums(text: str, name: str) -> dict[float, float]:
    return _by_bound(s for s in samples(text) if s.name == name)


def sample_names(text: str) -> set[str]:
    return {s.name for s in samples(text)}


def vllm_page(requests: int = 400, seed: int = 3) -> str:
    """The emulator's ``/metrics`` after ``requests`` requests, most still running."""
    from emulator.driver import EngineDriver
    from emulator.engine import Engine
    from emulator.metrics import MetricsRenderer
    from emulator.profiles import get_profile

    engine = Engine(get_profile("llama-8b-tp1-h100"), seed=seed)
    for i in range(requests):
        engine.add_request(f"r{i}", list(range(i, i + 200 + i % 700)), 50 + i % 300)
        if i % 3 == 0:
            engine.step()
    for _ in range(20):  # a few finish: every series has values
        engine.step()
    return MetricsRenderer(engine, "llama-8b", EngineDriver(engine, 1.0)).render().decode()


def parse_with_prometheus_client(text: str) -> Scrape:
    """``parse_metrics``' result, from the full parser (the candidate replacement)."""
    by_name: dict[str, list[Sample]] = {}
    for sample in samples(text):
        by_name.setdefault(sample.name, []).append(sample)

    def values(name: str) -> list[float]:
        return [s.value for s in by_name.get(name, ())]

    buckets = _by_bound(by_name.get(ITL_BUCKET, ()))
    return Scrape.of(values(KV_USAGE), sum(values(RUNNING)), sum(values(WAITING)), buckets)


def per_page_us(parse: Callable[[str], Scrape], text: str, number: int, repeat: int) -> float:
    timer = timeit.Timer(lambda: parse(text))
    return min(timer.repeat(repeat=repeat, number=number)) / number * 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.prom_parse", description=__doc__)
    ap.add_argument("--number", type=int, default=200, help="parses per round")
    ap.add_argument("--repeat", type=int, default=5, help="rounds (the best one counts)")
    args = ap.parse_args(argv)
    page = vllm_page()
    filtered, full = parse_metrics(page), parse_with_prometheus_client(page)
    if filtered != full:
        raise SystemExit(f"the parsers disagree:\n{filtered}\n{full}")
    lines = page.count("\n")
    print(f"page: {lines} lines, {len(page):,} bytes; running {full.running}, "
          f"waiting {full.waiting}, kv {full.kv_usage:.3f}")  # fmt: skip
    line_filter = per_page_us(parse_metrics, page, args.number, args.repeat)
    client = per_page_us(parse_with_prometheus_client, page, args.number, args.repeat)
    print(f"gateway.admission.replicas.parse_metrics (line filter): {line_filter:8.1f} us per page")
    print(f"prometheus_client text_string_to_metric_families: {client:8.1f} us per page "
          f"({client / line_filter:.1f}x)")  # fmt: skip
    # What that is for a gateway: every worker scrapes every replica 4 times a second.
    for replicas in (8, 44):
        share = replicas * 4 * (client - line_filter) / 1e6
        print(
            f"  {replicas} replicas at 4 Hz: the full parser costs {share * 100:.1f} % "
            "more of one core per worker"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
