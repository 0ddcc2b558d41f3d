"""`make up`'s processes: one that dies is restarted with backoff while the others keep
running (honcho's Manager, used before, stopped everything when any one exited)."""

from __future__ import annotations

import io
import sys
import threading
import time
from pathlib import Path

from fairway.procs import Supervisor
from tests.support import wait_until


def test_a_dead_process_is_restarted_and_the_rest_keep_running(tmp_path: Path) -> None:
    starts = tmp_path / "starts"
    crasher = (
        f"import pathlib, sys; p = pathlib.Path({str(starts)!r}); "
        "p.write_text((p.read_text() if p.exists() else '') + 'x'); sys.exit(3)"
    )
    out = io.StringIO()
    supervisor = Supervisor(backoff_s=0.05, max_backoff_s=0.2, stop_timeout_s=5, out=out)
    supervisor.add_process("replica", [sys.executable, "-c", crasher])
    supervisor.add_process("gateway", [sys.executable, "-c", "import time; time.sleep(120)"])
    runner = threading.Thread(target=supervisor.loop, daemon=True)
    runner.start()
    try:
        first = wait_until(lambda: supervisor.pid("gateway"), timeout=10)
        wait_until(lambda: starts.exists() and len(starts.read_text()) >= 3, timeout=20)
        # The survivor is the same process throughout; the dead one came back each time.
        assert supervisor.pid("gateway") == first
        assert supervisor.starts("gateway") == 1
        assert supervisor.starts("replica") >= 3
        assert "replica" in out.getvalue() and "restarting in" in out.getvalue()
    finally:
        supervisor.stop()
        runner.join(15)
    assert not runner.is_alive()
    assert supervisor.pid("gateway") is None  # stopped with the supervisor


def test_backoff_grows_while_a_process_keeps_dying(tmp_path: Path) -> None:
    supervisor = Supervisor(backoff_s=0.05, max_backoff_s=0.4, out=io.StringIO())
    supervisor.add_process("dies", [sys.executable, "-c", "raise SystemExit(1)"])
    runner = threading.Thread(target=supervisor.loop, daemon=True)
    runner.start()
    try:
        wait_until(lambda: supervisor.starts("dies") >= 5, timeout=20)
        started = time.monotonic()
        count = supervisor.starts("dies")
        wait_until(lambda: supervisor.starts("dies") >= count + 2, timeout=20)
        # At the cap, two more starts take at least two capped delays.
        assert time.monotonic() - started >= 0.6
    finally:
        supervisor.stop()
        runner.join(15)
