"""A tiny run of the ingestion benchmark (real broker, PostgreSQL, producer processes)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import ROOT


def drop_database(name: str) -> None:
    """Drop the run's database on the machine's PostgreSQL (an embedded one went with it)."""
    import psycopg
    from psycopg import sql

    from fairway.embedded import LOCAL_POSTGRES_URL, postgres_answers

    if not postgres_answers(LOCAL_POSTGRES_URL):
        return
    url = LOCAL_POSTGRES_URL.replace("postgres://", "postgresql://")
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )


@pytest.mark.kafka
def test_ingest_bench_smoke(redis_url: str, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "KAFKA_BOOTSTRAP")}
    env.update({"BENCH_REDIS_URL": redis_url, "PYTHONPATH": str(ROOT)})
    env.pop("DJANGO_SETTINGS_MODULE", None)
    argv = [sys.executable, "-m", "bench.ingest", "--events", "4000", "--burst-s", "0.2"]
    argv += ["--batch-max", "500", "--repeats", "1", "--out", str(tmp_path)]
    # A database of its own: a bench run elsewhere empties request_log between its runs.
    db = f"fairway_bench_smoke_{os.getpid()}"
    try:
        done = subprocess.run(
            [*argv, "--db-name", db], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240
        )
    finally:
        drop_database(db)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = (tmp_path / "ingest.md").read_text()
    for section in ("## Sustained ingest", "## Burst at 5×", "the transaction", "drain"):
        assert section in report
    # The default mode also drains a pre-loaded backlog and checks it (lag 0, every row).
    assert "(backlog pre-loaded)" in report
    assert "(5R − C)" in report
    assert "lag 0)" in report


@pytest.mark.kafka
@pytest.mark.slow
def test_prefix_invoice_bench_smoke(redis_url: str, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "KAFKA_BOOTSTRAP")}
    env.update({"BENCH_REDIS_URL": redis_url, "PYTHONPATH": str(ROOT)})
    env.pop("DJANGO_SETTINGS_MODULE", None)
    out = tmp_path / "prefix_invoice.md"
    out.write_text("# earlier runs\n")
    argv = [sys.executable, "-m", "bench.prefix_invoice", "--sizes", "2", "--turns", "2"]
    argv += ["--conversations-per-replica", "1", "--speed", "20", "--out", str(out), "--append"]
    argv += ["--db-name", f"fairway_prefix_invoice_smoke_{os.getpid()}"]
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = out.read_text()
    assert report.startswith("# earlier runs\n\n---\n\nRun ")
    assert "## 2 replicas" in report and "| requests | 4 | 4 |" in report
    assert "| lines bill the clients' usage | yes | yes |" in report


EARLIER = """# Usage ingestion: Kafka → committed PostgreSQL rows

`python -m bench.ingest` on 2 CPU cores, load average (1 min) 3.5 at the start and 3.6 at the
end of the run, on 2 cores.

## Sustained ingest

| run | events | seconds | events/s | batches |
|---|---|---|---|---|
| 1 | 195000 | 7.61 | 25,612 | 53 |

Median **25,612 events/s** (each run a fresh topic).

## Burst at 5× the sustained rate

A live burst, capped.
"""


def test_keep_earlier_keeps_what_was_not_rerun(tmp_path: Path) -> None:
    """``--keep-earlier``: R is the earlier median; the sections not rerun are kept verbatim,
    each labelled with the run that measured them (once, however often it is kept again)."""
    import argparse

    from bench import ingest

    (tmp_path / "ingest.md").write_text(EARLIER)
    earlier = ingest.read_earlier(tmp_path / "ingest.md")
    assert earlier.rate == 25_612
    r = earlier.rate
    wanted = int(4 * r * 60)
    pre = ingest.Preload(
        sustained_rate=r, consumer_rate=r, burst_s=60, wanted=wanted, events=wanted,
        produce_seconds=300, join_s=3, drain_s=240, batches=1200, lag_after=0, rows=wanted,
        broker_rss_mb=(30, 4000), min_available_mb=12000, memory_cap=10**8,
        stage_seconds={"poll": 50.0, "write": 150.0},
    )  # fmt: skip
    args = argparse.Namespace(batch_max=5000, burst_s=60, max_burst=400_000)
    loads = ((1.0, 1.0, 1.0), (2.0, 2.0, 2.0))
    text = ingest.report([], None, pre, args, "db", "python -m bench.ingest", loads, earlier)
    assert "| 1 | 195000 | 7.61 | 25,612 | 53 |" in text
    assert "A live burst, capped." in text
    label = "*Kept from an earlier run (`python -m bench.ingest`, load average (1 min) 3.5"
    assert text.count(label) == 2
    assert f"**{wanted:,} events**" in text and "recorded by the earlier run" in text
    assert (
        "| the transaction: request_log + usage (+ dead letters) | 150.00 | 24.4 | 75 % |" in text
    )
    assert "\n\n\n" not in text
    # Kept again by a later run: still one label per section, still naming the first run.
    (tmp_path / "ingest.md").write_text(text)
    again = ingest.report(
        [], None, None, args, "db", "x", loads, ingest.read_earlier(tmp_path / "ingest.md")
    )
    assert again.count("*Kept from an earlier run") == 3
    assert again.count(label) == 2
