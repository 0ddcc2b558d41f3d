"""Instructions per request of single pieces of the gateway's request path, under callgrind.

CPU time on a shared 2-core machine is too noisy to see a few microseconds; valgrind's
instruction count is not. Each piece runs once and then ``--n`` times in a fresh
interpreter under ``valgrind --tool=callgrind``; the difference over ``n - 1`` is the
piece's instructions per request (interpreter and import costs cancel out):

- ``router``: one replica, choose → dispatch → first token → finish (``Router``);
- ``read_body``: a complete small body read with the body deadline (``read_body``);
- ``head``: a keep-alive request through uvicorn's httptools protocol with the head
  deadline (``header_protocol``), less the same through the plain protocol.

Run from the repository root (valgrind installed)::

    PYTHONPATH=$PWD .venv/bin/python -m bench.gateway_hotpath
    PYTHONPATH=$PWD .venv/bin/python -m bench.gateway_hotpath --root /tmp/old  # another checkout

A piece the other checkout does not have prints n/a.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

PIECES = ("router", "read_body", "head")


def _subpackages() -> bool:
    """Whether the measured checkout (the working directory) has the gateway's subpackages.
    Decided from its files, not by trying an import: an editable install of another
    checkout in the venv would answer for modules this one does not have."""
    return Path("gateway/serving").is_dir()


def _router() -> Callable[[], None]:
    if _subpackages():
        from contracts import schema
        from gateway.admission.replicas import ReplicaState
        from gateway.admission.router import Router
    else:
        from gateway.replicas import ReplicaState  # type: ignore[no-redef]
        from gateway.router import Router  # type: ignore[no-redef]

        from gateway import schema  # type: ignore[attr-defined, no-redef]

    record = schema.ReplicaRecord("r0", "http://127.0.0.1:1", "shared")
    version = schema.ModelVersionRecord(
        version="v", family="f", context_length=131_072, kv_bytes_per_token=131_072,
        tpot_target_ms=50, kv_capacity_tokens=440_000, replicas=(record,),
    )  # fmt: skip
    state = ReplicaState(record, "v", healthy=True, kv_usage=0.1, scraped_at=time.monotonic())

    class Registry:
        def states(self, version: str) -> list[Any]:
            return [state]

        def state(self, replica_id: str) -> Any:
            return state

    router = Router(Registry())
    counter = iter(range(1 << 62))

    def one() -> None:
        request_id = str(next(counter))
        replica = router.choose(version, "standard", 1000 * 131_072)
        assert replica is not None
        router.on_dispatch(replica, request_id, 1000 * 131_072)
        router.on_first_token(replica, request_id)
        router.on_finish(replica, request_id)

    return one


async def _read_body(n: int) -> None:
    if _subpackages():
        from gateway.serving.http import read_body
    else:
        from gateway.http import read_body  # type: ignore[no-redef]
    message = {"type": "http.request", "body": b"{}", "more_body": False}

    async def receive() -> dict[str, Any]:
        return message

    for _ in range(n):
        await read_body(receive, 1 << 20, b"2", timeout_s=30.0)


REQUEST = (
    b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
    b"authorization: Bearer k\r\ncontent-length: 2\r\n\r\n{}"
)


async def _head(n: int, plain: bool) -> None:
    from uvicorn.config import Config
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    from uvicorn.server import ServerState

    if _subpackages():
        from gateway.serving.connections import header_protocol
    else:
        from gateway.connections import header_protocol  # type: ignore[no-redef]

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})

    class Transport(asyncio.Transport):
        def write(self, data: Any) -> None:
            pass

        def get_extra_info(self, name: str, default: Any = None) -> Any:
            return {"sockname": ("127.0.0.1", 1), "peername": ("127.0.0.1", 2)}.get(name, default)

        def is_closing(self) -> bool:
            return False

        def pause_reading(self) -> None:
            pass

        def resume_reading(self) -> None:
            pass

        def close(self) -> None:
            pass

    config = Config(app, lifespan="off", log_level="warning")
    config.load()
    cls = HttpToolsProtocol if plain else header_protocol(10.0)
    protocol = cls(config, ServerState(), {}, asyncio.get_running_loop())
    protocol.connection_made(Transport())
    for _ in range(n):
        protocol.data_received(REQUEST)
        await asyncio.sleep(0)  # the request's task runs
        await asyncio.sleep(0)
    protocol.connection_lost(None)


def run_piece(piece: str, n: int) -> None:
    import uvloop

    if piece == "router":
        one = _router()
        for _ in range(n):
            one()
    elif piece == "read_body":
        uvloop.run(_read_body(n))
    else:
        uvloop.run(_head(n, plain=piece == "head-plain"))


def instructions(root: Path, piece: str, n: int) -> int | None:
    out = subprocess.run(
        ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable,
         str(Path(__file__).resolve()), "--run", piece, str(n)],  # (the other root has no copy)
        cwd=root, env={**os.environ, "PYTHONPATH": str(root)}, capture_output=True, text=True,
    )  # fmt: skip
    found = re.search(r"Collected : (\d+)", out.stderr)
    return int(found.group(1)) if out.returncode == 0 and found else None


def per_request(root: Path, piece: str, n: int) -> float | None:
    once, many = instructions(root, piece, 1), instructions(root, piece, n)
    return None if once is None or many is None else (many - once) / (n - 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gateway_hotpath")
    parser.add_argument("--root", default=".", help="the checkout whose gateway to measure")
    parser.add_argument("--n", type=int, default=2001, help="repetitions (less one: once)")
    parser.add_argument("--pieces", default=",".join(PIECES))
    parser.add_argument("--run", nargs=2, help=argparse.SUPPRESS)  # internal: run a piece
    args = parser.parse_args(argv)
    if args.run:
        run_piece(args.run[0], int(args.run[1]))
        return 0
    root = Path(args.root).resolve()
    print(f"instructions per request (callgrind), {root}")
    for piece in args.pieces.split(","):
        value = per_request(root, piece, args.n)
        if piece == "head" and value is not None:
            plain = per_request(root, "head-plain", args.n)
            value = None if plain is None else value - plain
            piece = "head (over plain httptools)"
        print(f"  {piece}: {'n/a' if value is None else f'{value:,.0f}'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
