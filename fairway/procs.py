"""A small process supervisor for `make up`: every process is restarted when it exits,
with exponential backoff, while the others keep running.

honcho's Manager (used before) stops everything the moment any one process exits, so one
crashed replica took the gateway, the console and the worker down with it. Here a process
that exits is started again after ``backoff`` (doubling up to ``max_backoff_s``; reset once
it has stayed up ``stable_s``), its output prefixed with its name as honcho did. SIGINT or
SIGTERM stops all of them (SIGTERM, then SIGKILL after ``stop_timeout_s``).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import IO


@dataclass
class _Proc:
    name: str
    command: list[str]
    env: Mapping[str, str] | None
    cwd: str | None
    popen: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    restart_at: float = 0.0  # monotonic; 0: running or never started
    backoff: float = 0.0
    starts: int = 0
    pumps: list[threading.Thread] = field(default_factory=list)


class Supervisor:
    def __init__(
        self,
        *,
        backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
        stable_s: float = 60.0,
        stop_timeout_s: float = 10.0,
        out: IO[str] | None = None,
    ) -> None:
        self._procs: list[_Proc] = []
        self._backoff = backoff_s
        self._max_backoff = max_backoff_s
        self._stable = stable_s
        self._stop_timeout = stop_timeout_s
        self._out = out or sys.stdout
        self._lock = threading.Lock()
        self._stopping = threading.Event()

    def add_process(
        self,
        name: str,
        command: str | list[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
    ) -> None:
        argv = shlex.split(command) if isinstance(command, str) else list(command)
        self._procs.append(_Proc(name, argv, env, cwd))

    def pid(self, name: str) -> int | None:
        for proc in self._procs:
            if proc.name == name and proc.popen is not None and proc.popen.poll() is None:
                return proc.popen.pid
        return None

    def starts(self, name: str) -> int:
        return next(p.starts for p in self._procs if p.name == name)

    def stop(self) -> None:
        self._stopping.set()

    def loop(self, poll_s: float = 0.1) -> int:
        """Run until stop() or a signal; returns 0."""
        previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                previous[sig] = signal.signal(sig, lambda *_: self._stopping.set())
        try:
            for proc in self._procs:
                self._start(proc)
            while not self._stopping.wait(poll_s):
                now = time.monotonic()
                for proc in self._procs:
                    self._check(proc, now)
        finally:
            self._stop_all()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return 0

    # -- internals -------------------------------------------------------------------------
    def _check(self, proc: _Proc, now: float) -> None:
        if proc.popen is not None:
            code = proc.popen.poll()
            if code is None:
                return
            up = now - proc.started_at
            proc.backoff = (
                self._backoff
                if up >= self._stable or not proc.backoff
                else min(proc.backoff * 2, self._max_backoff)
            )
            proc.restart_at = now + proc.backoff
            proc.popen = None
            self._say(proc.name, f"exited with {code}; restarting in {proc.backoff:g} s")
        elif proc.restart_at and now >= proc.restart_at:
            self._start(proc)

    def _start(self, proc: _Proc) -> None:
        proc.popen = subprocess.Popen(  # noqa: S603 - our own commands
            proc.command,
            env=dict(proc.env) if proc.env is not None else None,
            cwd=proc.cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a Ctrl-C reaches us, not each child twice
        )
        proc.started_at = time.monotonic()
        proc.restart_at = 0.0
        proc.starts += 1
        pump = threading.Thread(target=self._pump, args=(proc.name, proc.popen), daemon=True)
        pump.start()
        proc.pumps = [t for t in proc.pumps if t.is_alive()] + [pump]
        self._say(proc.name, f"started (pid {proc.popen.pid})")

    def _pump(self, name: str, popen: subprocess.Popen[bytes]) -> None:
        assert popen.stdout is not None
        for raw in popen.stdout:
            self._say(name, raw.decode("utf-8", "replace").rstrip("\n"))

    def _say(self, name: str, line: str) -> None:
        with self._lock:
            self._out.write(f"{time.strftime('%H:%M:%S')} {name:<14} | {line}\n")
            self._out.flush()

    def _stop_all(self) -> None:
        running = [p.popen for p in self._procs if p.popen is not None]
        for popen in running:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(popen.pid, signal.SIGTERM)
        deadline = time.monotonic() + self._stop_timeout
        for popen in running:
            try:
                popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(popen.pid, signal.SIGKILL)
                popen.wait()
