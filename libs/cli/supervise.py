"""Supervised child processes for the local stack: each in its own process group,
its output lines pumped to one shared sink (prefixed with its name) and to its log."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from tandem.cli.devstack import Process


@dataclass(frozen=True)
class ProcessSpec:
    """One resolved child process: its name, command line and environment."""

    name: str
    argv: tuple[str, ...]
    env: dict[str, str]
    service: str = ""
    cluster: str = ""
    health_url: str | None = None
    url: str | None = None


class Output:
    """Where every child's lines go, prefixed with its name; one lock, whole lines."""

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream
        self._lock = threading.Lock()

    def line(self, name: str, text: str) -> None:
        with self._lock:
            try:
                self.stream.write(f"[{name}] {text}\n")
                self.stream.flush()
            except (ValueError, OSError):  # sink closed (e.g. a pipe whose reader left)
                pass


class Child(Process):
    """A supervised child: started in its own process group, its output pumped by a thread."""

    def __init__(self, spec: ProcessSpec, out: Output, log_dir: Path) -> None:
        super().__init__(name=spec.name, log_path=log_dir / f"{spec.name}.log")
        self.spec = spec
        self.out = out
        self.starts = 0
        self._reported_exit = False

    def start(self) -> None:
        if self.running:
            return
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        # NOTE: a new session means Ctrl-C in the terminal reaches only the supervisor,
        # which then stops services before the servers they drain into.
        self.proc = subprocess.Popen(
            list(self.spec.argv), env=self.spec.env, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        self.starts += 1
        self._reported_exit = False
        threading.Thread(target=self._pump, args=(self.proc,), daemon=True,
                         name=f"pump-{self.name}").start()

    def _pump(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        with open(self.log_path, "ab") as log:
            for raw in iter(proc.stdout.readline, b""):
                log.write(raw)
                log.flush()
                self.out.line(self.name, raw.decode("utf-8", "replace").rstrip("\r\n"))
        proc.stdout.close()

    def signal(self, sig: signal.Signals, group: bool = False) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if group:
                os.killpg(self.proc.pid, sig)
            elif self.proc.poll() is None:
                os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        """SIGKILL the whole process group, as a crash of the node would."""
        self.signal(signal.SIGKILL, group=True)
        if self.proc is not None:
            self.proc.wait()

    def exit_news(self) -> int | None:
        """The exit code the first time an unexpected exit is seen, else None."""
        if self.proc is None or self._reported_exit:
            return None
        code = self.proc.poll()
        if code is None:
            return None
        self._reported_exit = True
        return code


def stop_children(children: list[Child], grace: float) -> list[str]:
    """SIGTERM every child, wait up to ``grace`` seconds, SIGKILL the stragglers' groups.

    Returns the names that had to be killed. Every process group is SIGKILLed at the end
    either way, so a service's own leftover children never outlive it.
    """
    for c in children:
        c.signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    killed: list[str] = []
    for c in children:
        if c.proc is None:
            continue
        try:
            c.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            killed.append(c.name)
        c.kill()
    return killed
