"""Container health, by role (FAIRWAY_ROLE, recorded by entrypoint.sh). Exit 0 healthy, 1 not.

controlplane, gateway, emulator: GET the liveness endpoint over loopback. worker,
consumer: ``celery inspect ping`` of this node. beat: the schedule file was written within
the last five minutes (beat rewrites it on every tick). A one-off (``run``, ``migrate``,
``manage``): healthy. An unknown role: unhealthy (the role file is missing).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request

ROLE_FILE = "/tmp/fairway-role"  # noqa: S108 - written by entrypoint.sh in the container


def _role() -> str:
    """The container's role: its environment, or what entrypoint.sh recorded (an exec'd
    health check does not inherit the entrypoint's exports)."""
    role = os.environ.get("FAIRWAY_ROLE", "")
    if not role:
        try:
            with open(ROLE_FILE) as f:
                role = f.read().strip()
        except OSError:
            role = ""
    return role


ROLE = _role()
HTTP = {
    "controlplane": f"http://127.0.0.1:{os.environ.get('PORT', '8000')}/healthz",
    "gateway": f"http://127.0.0.1:{os.environ.get('PORT', '8080')}/healthz",
    "emulator": f"http://127.0.0.1:{os.environ.get('PORT', '8000')}/health",
}


def main() -> int:
    if ROLE in HTTP:
        try:
            with urllib.request.urlopen(HTTP[ROLE], timeout=4) as resp:  # noqa: S310
                return 0 if resp.status == 200 else 1
        except OSError:
            return 1
    if ROLE in ("worker", "consumer"):
        node = f"celery@{socket.gethostname()}"
        done = subprocess.run(
            ["celery", "-A", "fairway.celery", "inspect", "ping", "-d", node, "--timeout", "3"],
            capture_output=True,
            timeout=10,
            check=False,
        )
        return 0 if done.returncode == 0 else 1
    if ROLE == "beat":
        path = os.environ.get("CELERY_BEAT_SCHEDULE_FILENAME", "/app/var/celerybeat-schedule")
        try:
            return 0 if time.time() - os.stat(path).st_mtime < 300 else 1
        except OSError:
            return 1
    return 0 if ROLE in ("run", "migrate", "manage") else 1


if __name__ == "__main__":
    sys.exit(main())
