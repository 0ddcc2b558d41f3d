"""Helpers to run emulated replicas from tests and benchmarks.

In-process, inside the current event loop (fast; gives direct access to the engine)::

    from emulator.testing import running_emulator

    async with running_emulator(profile="llama-8b-tp1-h100", speed=50) as emu:
        async with httpx.AsyncClient(base_url=emu.base_url) as client: ...
        emu.engine.pool.num_used        # KV blocks in use right now
        emu.faults.refuse_503 = True    # flip a fault knob

The crash fault in-process drops every connection and stops listening instead of killing the
test process; ``await emu.wait_crashed()`` waits for that to finish.

As a subprocess (for multi-process tests and benches; the server has its own core/GIL)::

    from emulator.testing import spawn_emulator

    with spawn_emulator(profile="llama-70b-tp4-h100", model="llama-70b-2026-05", speed=10) as emu:
        httpx.get(emu.base_url + "/health")

``spawn_emulator`` starts ``python -m emulator --port 0 ...``, waits for its
``EMULATOR_READY <url>`` line (``ready_timeout`` seconds), and on exit sends SIGTERM, then
SIGKILL after ``stop_timeout``. ``emu.process`` is the ``subprocess.Popen``;
``emu.returncode`` is set once stopped (70 after a crash fault). ``cpu_affinity`` pins it.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass
from typing import IO, Any

from emulator.engine import Engine, EngineConfig, SchedulingPolicy
from emulator.faults import Faults
from emulator.kv_events import KVEventsConfig
from emulator.profiles import Profile, get_profile
from emulator.server import EmulatorApp
from emulator.service import EmulatorService


@dataclass
class EmulatorHandle:
    service: EmulatorService

    @property
    def base_url(self) -> str:
        return self.service.base_url

    @property
    def port(self) -> int:
        return self.service.port

    @property
    def engine(self) -> Engine:
        return self.service.engine

    @property
    def app(self) -> EmulatorApp:
        return self.service.app

    @property
    def faults(self) -> Faults:
        return self.service.faults

    @property
    def model(self) -> str:
        return self.service.app.model

    async def wait_crashed(self) -> None:
        await self.service.wait_crashed()


@contextlib.asynccontextmanager
async def running_emulator(
    profile: str | Profile = "llama-8b-tp1-h100",
    model: str | None = None,
    speed: float = 10.0,
    *,
    seed: int = 0,
    scheduling_policy: SchedulingPolicy = "fcfs",
    max_num_seqs: int | None = None,
    max_num_batched_tokens: int | None = None,
    kv_capacity_tokens: int | None = None,
    max_model_len: int | None = None,
    enable_prefix_caching: bool = True,
    reserve_full_prompt: bool = True,
    enable_prompt_tokens_details: bool = False,
    kv_events: KVEventsConfig | None = None,
    enable_auto_tool_choice: bool = False,
    tool_call_parser: str | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    faults: Faults | None = None,
    **fault_knobs: Any,
) -> AsyncIterator[EmulatorHandle]:
    """Serve an emulated replica on loopback inside the running event loop. Defaults are
    vLLM's (fcfs, no cached_tokens in usage, no KV events); a platform replica wants
    ``contracts.replica_flags``' settings.

    ``fault_knobs`` are ``Faults`` fields (``fail_after_tokens=3``, ``refuse_503=True``...).
    """
    resolved = get_profile(profile) if isinstance(profile, str) else profile
    knobs = faults or Faults()
    if fault_knobs:
        knobs.update(fault_knobs)
    service = EmulatorService(
        resolved,
        model or resolved.name,
        speed=speed,
        config=EngineConfig(
            scheduling_policy=scheduling_policy,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            kv_capacity_tokens=kv_capacity_tokens,
            max_model_len=max_model_len,
            enable_prefix_caching=enable_prefix_caching,
            reserve_full_prompt=reserve_full_prompt,
        ),
        seed=seed,
        faults=knobs,
        enable_prompt_tokens_details=enable_prompt_tokens_details,
        kv_events=kv_events,
        enable_auto_tool_choice=enable_auto_tool_choice,
        tool_call_parser=tool_call_parser,
        host=host,
        port=port,
    )
    await service.start()
    try:
        yield EmulatorHandle(service)
    finally:
        await service.wait_crashed()
        await service.stop(abort_connections=True)


class SpawnedEmulator:
    """A ``python -m emulator`` child process. Prefer the ``spawn_emulator`` context manager."""

    def __init__(
        self,
        profile: str = "llama-8b-tp1-h100",
        model: str | None = None,
        speed: float = 10.0,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        extra_args: Iterable[str] = (),
        cpu_affinity: Iterable[int] | None = None,
        env: dict[str, str] | None = None,
        stderr: int | IO[Any] | None = None,
        ready_timeout: float = 30.0,
        stop_timeout: float = 5.0,
        **options: Any,
    ) -> None:
        args = [
            sys.executable, "-m", "emulator",
            "--profile", profile,
            "--host", host,
            "--port", str(port),
            "--speed", str(speed),
        ]  # fmt: skip
        if model:
            args += ["--model", model]
        for name, value in options.items():
            flag = "--" + name.replace("_", "-")
            if value is True:
                args.append(flag)
            elif value is not None and value is not False:
                args += [flag, str(value)]
        args += list(extra_args)
        self.args = args
        self.cpu_affinity = set(cpu_affinity) if cpu_affinity is not None else None
        self.env = env
        self.stderr = stderr
        self.ready_timeout = ready_timeout
        self.stop_timeout = stop_timeout
        self.process: subprocess.Popen[bytes] | None = None
        self.base_url = ""

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    @property
    def returncode(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def start(self) -> SpawnedEmulator:
        affinity = self.cpu_affinity

        def pin() -> None:
            if affinity is not None:
                os.sched_setaffinity(0, affinity)

        env = dict(os.environ if self.env is None else self.env)
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
        self.process = subprocess.Popen(
            self.args,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            env=env,
            preexec_fn=pin if affinity is not None else None,  # noqa: PLW1509
        )
        try:
            self.base_url = self._await_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _await_ready(self) -> str:
        assert self.process is not None and self.process.stdout is not None
        deadline = time.monotonic() + self.ready_timeout
        selector = selectors.DefaultSelector()
        selector.register(self.process.stdout, selectors.EVENT_READ)
        buffered = b""
        try:
            while time.monotonic() < deadline:
                if not selector.select(timeout=max(0.0, deadline - time.monotonic())):
                    continue
                chunk = os.read(self.process.stdout.fileno(), 4096)
                if not chunk:
                    code = self.process.wait(timeout=5)
                    raise RuntimeError(f"emulator exited with code {code} before it was ready")
                buffered += chunk
                for line in buffered.splitlines():
                    if line.startswith(b"EMULATOR_READY "):
                        return line.split(b" ", 1)[1].strip().decode()
        finally:
            selector.close()
        raise TimeoutError(f"emulator not ready within {self.ready_timeout} s: {self.args}")

    def stop(self) -> int | None:
        process = self.process
        if process is None:
            return None
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=self.stop_timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=self.stop_timeout)
        if process.stdout is not None:
            process.stdout.close()
        return process.returncode


@contextlib.contextmanager
def spawn_emulator(
    profile: str = "llama-8b-tp1-h100", model: str | None = None, speed: float = 10.0, **kwargs: Any
) -> Iterator[SpawnedEmulator]:
    """Run ``python -m emulator`` as a child process for the ``with`` block.

    Keyword options map to CLI flags (``max_num_seqs=64`` -> ``--max-num-seqs 64``;
    ``refuse_503=True`` -> ``--refuse-503``); see ``SpawnedEmulator`` for the rest.
    """
    emu = SpawnedEmulator(profile, model, speed, **kwargs).start()
    try:
        yield emu
    finally:
        emu.stop()
