"""`make up`: set up and run the whole platform in the foreground on embedded defaults.

PostgreSQL for the control plane (DATABASE_URL; else the machine's at 127.0.0.1:5432, in a
database ``fairway_dev`` created if absent; else an embedded server with its data under
var/pg), an embedded Redis unless REDIS_URL is set, the embedded Kafka-protocol broker unless
KAFKA_BOOTSTRAP is set, two emulated replicas per demo model, the gateway, the control plane
and a Celery worker with beat that also runs the usage consumer (Kafka usage.v1 → usage).
``fairway.procs`` runs the processes and restarts any that exits (with backoff) while the
rest keep serving; Ctrl-C stops all of them and then the embedded servers.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from contracts.replica_flags import platform_replica_args
from fairway.embedded import (
    LOCAL_POSTGRES_URL,
    EmbeddedServices,
    create_database,
    ensure_topic,
    postgres_answers,
    with_database,
)
from fairway.procs import Supervisor

ROOT = Path(__file__).resolve().parent.parent
VAR = ROOT / "var"
KEYS_FILE = VAR / "demo-keys.json"
CONSOLE_PORT = 8000
GATEWAY_PORT = 8080
INGEST_METRICS_PORT = 9464
DEV_DATABASE = "fairway_dev"
USAGE_TOPIC = "usage.v1"
USAGE_PARTITIONS = 4


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


def tool_args(version: str) -> list[str]:
    """The tool-calling flags the catalog gives the demo version's replicas."""
    from tenants.demo import MODELS

    parser = next((m.tool_call_parser for m in MODELS if m.version == version), "")
    return ["--enable-auto-tool-choice", "--tool-call-parser", parser] if parser else []


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
        f"  PostgreSQL: {env['DATABASE_URL']}",
        f"  Usage consumer metrics: http://127.0.0.1:{env['FAIRWAY_INGEST_METRICS_PORT']}/metrics",
        "  Try: curl -N http://127.0.0.1:8080/v1/chat/completions \\",
        '         -H "Authorization: Bearer $KEY" -H "Content-Type: application/json" \\',
        '         -d \'{"model":"llama-8b","stream":true,'
        '"messages":[{"role":"user","content":"hi"}]}\'',
        "  Ctrl-C stops everything.",
        "",
    ]
    return "\n".join(lines)


def database_url(services: EmbeddedServices) -> str:
    """DATABASE_URL; else fairway_dev on the machine's PostgreSQL; else an embedded server
    whose data lives under var/pg (kept between runs, like the machine's would be)."""
    if os.environ.get("DATABASE_URL"):
        return os.environ["DATABASE_URL"]
    if not postgres_answers(LOCAL_POSTGRES_URL):
        base = services.start_postgres(VAR / "pg")
        create_database(base, DEV_DATABASE)
        return with_database(base, DEV_DATABASE)
    return services.database_url(name=DEV_DATABASE)


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    VAR.mkdir(exist_ok=True)
    services = EmbeddedServices()
    try:
        env = dict(os.environ)
        env.setdefault("DJANGO_SETTINGS_MODULE", "fairway.settings.local")
        env["REDIS_URL"] = os.environ.get("REDIS_URL") or services.start_redis()
        env["KAFKA_BOOTSTRAP"] = os.environ.get("KAFKA_BOOTSTRAP") or services.start_kafka()
        env["DATABASE_URL"] = database_url(services)
        env.setdefault("GATEWAY_SPOOL_DIR", str(VAR / "spool"))
        env.setdefault("FAIRWAY_INGEST_METRICS_PORT", str(INGEST_METRICS_PORT))
        ensure_topic(env["KAFKA_BOOTSTRAP"], USAGE_TOPIC, USAGE_PARTITIONS)
        env["PYTHONUNBUFFERED"] = "1"

        manage(env, "migrate", "--noinput")
        manage(
            env, "seed_demo", *replica_args(), "--keys-out", str(KEYS_FILE), "--usage-days", "40"
        )
        manage(env, "push_config")

        manager = Supervisor()
        py = sys.executable
        for replica in DEMO_REPLICAS:
            manager.add_process(
                replica.name,
                f"{py} -m emulator --profile {replica.profile} --model {replica.model} "
                f"--port {replica.port} --speed 1 {' '.join(platform_replica_args())} "
                f"{' '.join(tool_args(replica.model))}",
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
            f"{py} -m celery -A fairway.celery worker --beat --usage-consumer -l info -c 1",
            env=env,
            cwd=str(ROOT),
        )
        print(banner(env), flush=True)
        return manager.loop()
    finally:
        services.stop()


if __name__ == "__main__":
    sys.exit(main())
