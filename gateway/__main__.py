"""``python -m gateway --host 127.0.0.1 --port 8080 --workers 2``.

Configuration comes from the environment (see gateway/config.py): REDIS_URL,
KAFKA_BOOTSTRAP, FAIRWAY_KEY_PEPPER, FAIRWAY_CACHE_SALT_KEY, FAIRWAY_ENV,
GATEWAY_SPOOL_DIR, GATEWAY_DRAIN_DEADLINE_S, GATEWAY_UPSTREAM_*_TIMEOUT_S, …
"""

from __future__ import annotations

import argparse
import sys

from fairway import logs as fairway_logs
from gateway.config import ConfigError, GatewayConfig
from gateway.serving.supervisor import Supervisor, worker_main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gateway", description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )
    parser.add_argument("--access-log", action="store_true")
    args = parser.parse_args(argv)
    fairway_logs.configure(args.log_level)  # LOG_FORMAT=json: JSON lines with the request id
    try:
        config = GatewayConfig.from_env()  # fail fast, before any worker starts
    except ConfigError as exc:
        print(f"gateway: {exc}", file=sys.stderr)
        return 2
    if args.workers < 1:
        parser.error("--workers must be at least 1")
    if config.metrics_port is not None and (
        config.metrics_port == args.port or config.metrics_port > 65535
    ):
        parser.error("GATEWAY_METRICS_PORT must be a port other than --port")
    if args.workers == 1:
        from gateway.serving.supervisor import bind_socket

        metrics_sock = bind_socket(args.host, config.metrics_port) if config.metrics_port else None
        worker_main(
            bind_socket(args.host, args.port), args.log_level, args.access_log, metrics_sock
        )
        return 0
    return Supervisor(
        host=args.host,
        port=args.port,
        workers=args.workers,
        drain_deadline_s=config.drain_deadline_s,
        log_level=args.log_level,
        access_log=args.access_log,
        metrics_port=config.metrics_port,
    ).run()


if __name__ == "__main__":
    sys.exit(main())
