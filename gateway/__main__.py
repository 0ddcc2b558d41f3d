"""``python -m gateway --host 127.0.0.1 --port 8080 --workers 2``.

Configuration comes from the environment (see gateway/config.py): REDIS_URL,
KAFKA_BOOTSTRAP, FAIRWAY_KEY_PEPPER, FAIRWAY_CACHE_SALT_KEY, FAIRWAY_ENV,
GATEWAY_SPOOL_DIR, GATEWAY_DRAIN_DEADLINE_S, GATEWAY_UPSTREAM_*_TIMEOUT_S, …
"""

from __future__ import annotations

import argparse
import logging
import sys

from gateway.config import ConfigError, GatewayConfig
from gateway.supervisor import Supervisor, worker_main


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
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s",
    )
    try:
        config = GatewayConfig.from_env()  # fail fast, before any worker starts
    except ConfigError as exc:
        print(f"gateway: {exc}", file=sys.stderr)
        return 2
    if args.workers < 1:
        parser.error("--workers must be at least 1")
    if args.workers == 1:
        from gateway.supervisor import bind_socket

        worker_main(bind_socket(args.host, args.port), args.log_level, args.access_log)
        return 0
    return Supervisor(
        host=args.host,
        port=args.port,
        workers=args.workers,
        drain_deadline_s=config.drain_deadline_s,
        log_level=args.log_level,
        access_log=args.access_log,
    ).run()


if __name__ == "__main__":
    sys.exit(main())
