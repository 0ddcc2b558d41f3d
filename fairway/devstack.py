"""`make up`: set up and run the whole platform in the foreground on embedded defaults.

SQLite for the control plane, an embedded Redis unless REDIS_URL is set, the embedded
Kafka-protocol broker unless KAFKA_BOOTSTRAP is set, two emulated replicas per demo model,
the gateway and the control plane. honcho runs the processes; Ctrl-C stops all of them and
then the embedded servers.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from honcho.manager import Manager

from fairway.embedded import EmbeddedServices

ROOT = Path(__file__).resolve().parent.parent
VAR = ROOT / "var"
KEYS_FILE = VAR / "demo-keys.json"
CONSOLE_PORT = 8000
GATEWAY_PORT = 8080


@dataclass(frozen=True)
class DemoReplica:
    name: str
    profile: str
    model: str
    port: int

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


DEMO_REPLICAS = (
    DemoReplica("replica-70b-a", "llama-70b-tp4-h100", "llama-70b-2026-05", 9101),
    DemoReplica("replica-70b-b", "llama-70b-tp4-h100", "llama-70b-2026-05", 9102),
    DemoReplica("replica-8b-a", "llama-8b-tp1-h100", "llama-8b-2026-05", 9111),
    DemoReplica("replica-8b-b", "llama-8b-tp1-h100", "llama-8b-2026-05", 9112),
)


def replica_args() -> list[str]:
    by_model: dict[str, list[str]] = {}
    for replica in DEMO_REPLICAS:
        by_model.setdefault(replica.model, []).append(replica.base_url)
    args: list[str] = []
    for model, urls in by_model.items():
        args += ["--replicas", f"{model}={','.join(urls)}"]
    return args


def manage(env: dict[str, str], *args: str) -> None:
    subprocess.run([sys.executable, "manage.py", *args], cwd=ROOT, env=env, check=True)


def banner(env: dict[str, str]) -> str:
    keys = json.loads(KEYS_FILE.read_text()) if KEYS_FILE.exists() else {}
    lines = [
        "",
        "Fairway is starting.",
        f"  Console:       http://127.0.0.1:{CONSOLE_PORT}",
        f"  API base URL:  http://127.0.0.1:{GATEWAY_PORT}/v1",
    ]
    for tenant, info in keys.items():
        if "key" in info:
            lines.append(f"  Demo key ({tenant}, {info.get('plan', '?')} plan): {info['key']}")
    lines += [
        f"  Redis: {env['REDIS_URL']}   Kafka: {env['KAFKA_BOOTSTRAP']}",
        "  Try: curl -N http://127.0.0.1:8080/v1/chat/completions \\",
        '         -H "Authorization: Bearer $KEY" -H "Content-Type: application/json" \\',
        '         -d \'{"model":"llama-8b","stream":true,'
        '"messages":[{"role":"user","content":"hi"}]}\'',
        "  Ctrl-C stops everything.",
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    VAR.mkdir(exist_ok=True)
    services = EmbeddedServices()
    try:
        env = dict(os.environ)
        env.setdefault("DJANGO_SETTINGS_MODULE", "fairway.settings.local")
        env["REDIS_URL"] = os.environ.get("REDIS_URL") or services.start_redis()
        env["KAFKA_BOOTSTRAP"] = os.environ.get("KAFKA_BOOTSTRAP") or services.start_kafka()
        env.setdefault("DATABASE_URL", services.database_url(allow_sqlite=True))
        env.setdefault("GATEWAY_SPOOL_DIR", str(VAR / "spool"))
        env["PYTHONUNBUFFERED"] = "1"

        manage(env, "migrate", "--noinput")
        manage(env, "seed_demo", *replica_args(), "--keys-out", str(KEYS_FILE))
        manage(env, "push_config")

        manager = Manager()
        py = sys.executable
        for replica in DEMO_REPLICAS:
            manager.add_process(
                replica.name,
                f"{py} -m emulator --profile {replica.profile} --model {replica.model} "
                f"--port {replica.port} --speed 1",
                env=env,
                cwd=str(ROOT),
            )
        manager.add_process(
            "gateway",
            f"{py} -m gateway --host 127.0.0.1 --port {GATEWAY_PORT} --workers 2",
            env=env,
            cwd=str(ROOT),
        )
        manager.add_process(
            "console",
            f"{py} manage.py runserver 127.0.0.1:{CONSOLE_PORT} --noreload",
            env=env,
            cwd=str(ROOT),
        )
        manager.add_process(
            "celery",
            f"{py} -m celery -A fairway.celery worker --beat -l info -c 1",
            env=env,
            cwd=str(ROOT),
        )
        print(banner(env), flush=True)
        manager.loop()
        return int(manager.returncode or 0)
    finally:
        services.stop()


if __name__ == "__main__":
    sys.exit(main())
