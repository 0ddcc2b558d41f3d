"""Headless chromium for the console's browser tests and screenshots.

Playwright drives the system's chromium (Debian's ``chromium`` package; Playwright's own
browser download is not used). axe-core is the vendored copy the console ships.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

AXE = Path(__file__).resolve().parent / "static" / "console" / "vendor" / "axe.min.js"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
]
DESKTOP = {"width": 1366, "height": 900}
PHONE = {"width": 390, "height": 844}
BLOCKING_IMPACTS = ("serious", "critical")


def chromium_path() -> str:
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    raise RuntimeError("chromium is not installed: apt-get install -y chromium (make chromium)")


def launch(playwright: Any) -> Any:
    return playwright.chromium.launch(
        executable_path=chromium_path(), args=CHROMIUM_ARGS, headless=True
    )


def axe_violations(page: Any) -> list[dict[str, Any]]:
    """axe-core's serious and critical violations on the page as it is now."""
    page.add_script_tag(path=str(AXE))
    result = page.evaluate(
        "async () => (await axe.run(document, {resultTypes: ['violations']})).violations"
    )
    return [
        {
            "id": v["id"],
            "impact": v["impact"],
            "help": v["help"],
            "nodes": [n["target"] for n in v["nodes"]][:5],
        }
        for v in result
        if v.get("impact") in BLOCKING_IMPACTS
    ]
