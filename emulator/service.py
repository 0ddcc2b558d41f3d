"""One emulated replica: engine + driver + ASGI app + a uvicorn (httptools) listener.

Used by the CLI (``python -m emulator``) and the in-process test fixture. The listener is a
socket we bind ourselves (port 0 picks a free one), handed to uvicorn's ``Server.startup``;
we drive uvicorn's tick loop and shutdown directly so no signal handlers are installed.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable
from dataclasses import replace

import uvicorn

from emulator.engine import Engine, EngineConfig
from emulator.faults import Faults
from emulator.kv_events import KVEventsConfig, make_publisher
from emulator.profiles import Profile
from emulator.server import EmulatorApp


class EmulatorService:
    def __init__(
        self,
        profile: Profile,
        model: str,
        *,
        speed: float = 1.0,
        config: EngineConfig | None = None,
        seed: int = 0,
        faults: Faults | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        on_crash: Callable[[], None] | None = None,
        log_level: str = "warning",
        enable_prompt_tokens_details: bool = False,
        kv_events: KVEventsConfig | None = None,
        enable_auto_tool_choice: bool = False,
        tool_call_parser: str | None = None,
        int_block_hashes: bool = True,
    ) -> None:
        # vLLM's schemes publish the digest's low 64 bits as an int by default
        # (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1), the 32-byte digest with it set to 0; the
        # emulator's own hash is an int either way
        hash_bytes = (
            not int_block_hashes
            and (config or EngineConfig()).prefix_caching_hash_algo != "emulator"
        )
        self.kv_events = make_publisher(kv_events, hash_bytes)
        if self.kv_events is not None:  # record events only when something takes them
            config = replace(config or EngineConfig(), enable_kv_cache_events=True)
        self.engine = Engine(profile, config, seed)
        self.app = EmulatorApp(
            self.engine,
            model,
            speed=speed,
            faults=faults,
            on_crash=on_crash or self._crash,
            enable_prompt_tokens_details=enable_prompt_tokens_details,
            on_kv_events=self.kv_events.publish if self.kv_events is not None else None,
            enable_auto_tool_choice=enable_auto_tool_choice,
            tool_call_parser=tool_call_parser,
        )
        self.host = host
        self.requested_port = port
        self.log_level = log_level
        self._sock: socket.socket | None = None
        self._server: uvicorn.Server | None = None
        self._ticker: asyncio.Task[None] | None = None
        self._crash_task: asyncio.Task[None] | None = None
        self.port = 0

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def faults(self) -> Faults:
        return self.app.faults

    async def start(self) -> None:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.requested_port))
        sock.setblocking(False)
        self._sock = sock
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            self.app,
            http="httptools",
            lifespan="off",
            log_level=self.log_level,
            access_log=False,
            timeout_graceful_shutdown=2,
            backlog=4096,
        )
        config.load()
        server = uvicorn.Server(config)
        server.lifespan = config.lifespan_class(config)  # what Server._serve would set up
        await server.startup(sockets=[sock])
        self._server = server
        self.app.start()
        self._ticker = asyncio.get_running_loop().create_task(server.main_loop())

    async def stop(self, abort_connections: bool = False) -> None:
        """Stop serving. In-flight requests are aborted first (vLLM's --shutdown-timeout 0)."""
        server, self._server = self._server, None
        if server is None:
            return
        await self.app.close()
        if self.kv_events is not None:
            self.kv_events.shutdown()
        server.should_exit = True
        if self._ticker is not None:
            await self._ticker
        if abort_connections:
            for connection in list(server.server_state.connections):
                connection.transport.abort()
        await server.shutdown(sockets=[self._sock] if self._sock else None)

    def _crash(self) -> None:
        """In-process stand-in for a process crash: drop every connection, stop listening."""
        if self._server is not None:
            for server in self._server.servers:
                server.close()
            for connection in list(self._server.server_state.connections):
                connection.transport.abort()
        self._crash_task = asyncio.get_running_loop().create_task(self.stop(abort_connections=True))

    async def wait_crashed(self) -> None:
        if self._crash_task is not None:
            with contextlib.suppress(Exception):
                await self._crash_task
