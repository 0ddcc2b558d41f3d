"""A tiny run of the retry-identity bench: every row, and the SDK's connection reuse for a
short wait (its retry comes on the failed attempt's connection)."""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.retry_identity import main


def test_retry_identity_bench_writes_its_report(tmp_path: Path) -> None:
    args = argparse.Namespace(calls=500, waits=[0.1], out=tmp_path)
    main(args)
    text = (tmp_path / "retry_identity.md").read_text()
    assert "--calls 500 --waits 0.1" in text
    assert "| `take`, tenant-key without a mark |" in text
    assert "| shared `take`" in text
    assert "| 0.1 s | yes |" in text
