"""Regenerate docs/screenshots/: ``python -m console.screenshots`` (or ``make screenshots``).

Runs the console's end-to-end browser tests with ``FAIRWAY_SCREENSHOTS_DIR`` set, so the
pictures show exactly what the test checked: a live server, a real gateway and an emulated
replica, on the suite's PostgreSQL and Redis (as ``make test`` finds or starts them). Each
main page is saved at desktop (1366 px) and phone (390 px) width.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "screenshots"


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    for old in OUT.glob("*.png"):
        old.unlink()
    env = {**os.environ, "FAIRWAY_SCREENSHOTS_DIR": str(OUT), "PYTHONPATH": str(ROOT)}
    tests = [
        "tests/console/test_browser.py::test_customer_and_operator_journeys_in_a_real_browser",
        "tests/console/test_browser_key_limits.py",  # a key's limits page, with an error shown
    ]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests], cwd=ROOT, env=env
    )
    shots = sorted(p.name for p in OUT.glob("*.png"))
    print(f"{len(shots)} screenshots in {OUT.relative_to(ROOT)}")
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
