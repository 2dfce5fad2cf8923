"""The local stack: its process list as data, the supervisor, and `tandem dev up` itself."""

from __future__ import annotations

import contextlib
import io
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tandem.cli.devstack import free_port
from tandem.cli.stack import Stack, built_services
from tandem.cli.stack_config import StackConfig
from tandem.cli.supervise import Child, Output, ProcessSpec, stop_children
from tandem.common.errors import SettingsError
from tandem.common.settings import ENV_PREFIX
from tests.conftest import ports_taken_at_once

from .conftest import ROOT, service_env
from .settings_support import unknown_settings

CLI = [sys.executable, "-m", "tandem.cli.main"]
FREE_PORTS = ["--nats-port", "0", "--nats-monitor-port", "0", "--s3-port", "0",
              "--gateway-port", "0"]


# ------------------------------------------------------------------------------ helpers


def alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid``, from /proc (new sessions included)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            parents.setdefault(ppid, []).append(int(entry.name))
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def wait_until(cond, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)  # polling process state; there is no event to wait on


class Lines:
    """A child's stdout, line by line, with waits that have a deadline."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.q: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, args=(proc,), daemon=True).start()

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self.q.put(line.rstrip("\n"))
        self.q.put(None)

    def wait_for(self, text: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            assert left > 0, f"no line with {text!r} in {timeout}s:\n" + "\n".join(self.seen[-40:])
            try:
                line = self.q.get(timeout=left)
            except queue.Empty:
                continue
            assert line is not None, "process ended early:\n" + "\n".join(self.seen[-40:])
            self.seen.append(line)
            if text in line:
                return line


def stub(name: str, script: str) -> ProcessSpec:
    return ProcessSpec(name=name, argv=(sys.executable, "-c", script),
                       env=service_env(), service="stub", cluster=name.split("/")[0])


# ------------------------------------------------------------------------- the process list


def test_clusters_are_added_by_config_not_code(tmp_path: Path) -> None:
    config = StackConfig.load().with_clusters(["east", "west", "north"])
    names = {s.name: s for s in Stack(config, tmp_path).specs()}
    for cluster in ("east", "west", "north"):
        for kind in ("agent", "worker"):
            spec = names[f"{cluster}/{kind}-0"]
            assert spec.env["TANDEM_CLUSTER"] == cluster
            assert spec.env["TANDEM_NODE"] == "node-0"
    assert {"gateway", "trainer", "checkpointer"} <= set(names)
    assert names["gateway"].env["TANDEM_CLUSTERS"] == "east,west,north"


def test_no_two_processes_of_a_stack_are_given_one_port(tmp_path: Path) -> None:
    # Each probe is drawn at random from the 16,000 ports of ports.LISTEN: a thousand
    # probes repeat about thirty times; a port handed out is never handed out again.
    ports = [free_port() for _ in range(1000)]
    assert len(set(ports)) == len(ports)
    config = StackConfig.load().with_clusters([f"c{i}" for i in range(8)]).free_ports()
    stack = Stack(config, tmp_path)
    claimed = stack._claim_ports()
    metrics = [s.env["TANDEM_METRICS_PORT"] for s in stack.specs()]
    assert len(metrics) >= 19
    assert len(set(metrics) | {str(p) for p in claimed.values()}) == len(metrics) + len(claimed)


def test_two_processes_are_never_given_one_port() -> None:
    # Two test workers starting stacks at once: each probe may pick a port the other
    # probed a moment ago and whose child has not bound it yet. Nothing binds here, so
    # with probes alone about ten of 2 x 400 would repeat; the leases that every process
    # shares keep them apart.
    take = "from tandem.cli.devstack import free_port; print(*(free_port() for _ in range(400)))"
    got = ports_taken_at_once(take)
    assert len(got[0]) == len(got[1]) == 400
    assert not got[0] & got[1]
    assert not (got[0] | got[1]) & {free_port() for _ in range(100)}


def test_a_stack_file_sets_nodes_ports_and_settings(tmp_path: Path) -> None:
    path = tmp_path / "stack.toml"
    path.write_text(
        '[ports]\nnats = 0\nnats_monitor = 0\ns3 = 0\n'
        '[[clusters]]\nname = "solo"\nnodes = 2\n'
        '[[processes]]\nservice = "cluster-agent"\nname = "agent"\n'
        'env = { SIM_GPUS = "4", NOTE = "{cluster}-{index}-of-{clusters}" }\n')
    specs = Stack(StackConfig.load(path), tmp_path).specs()
    assert [s.name for s in specs] == ["solo/agent-0", "solo/agent-1"]
    assert [s.env["TANDEM_NOTE"] for s in specs] == ["solo-0-of-solo", "solo-1-of-solo"]
    assert specs[1].env["TANDEM_NODE"] == "node-1"
    assert specs[0].argv[1:] == ("-m", "tandem.cluster_agent")
    assert specs[0].health_url != specs[1].health_url


def test_bad_stack_config_names_what_is_wrong(tmp_path: Path) -> None:
    path = tmp_path / "stack.toml"
    path.write_text(
        '[ports]\nnats = 70000\nnats_monitor = 0\ns3 = 0\n'
        '[[clusters]]\nname = "ea.st"\n[[clusters]]\nname = "west"\nnodes = 0\n'
        '[[processes]]\nservice = "painter"\nname = "p"\nscope = "rack"\n')
    with pytest.raises(SettingsError) as err:
        StackConfig.load(path)
    assert set(err.value.problems) == {"ports.nats", "clusters.ea.st", "clusters.west.nodes",
                                       "processes.p.service", "processes.p.scope"}
    path.write_text('[ports]\nnats = 0\nnats_monitor = 0\ns3 = 0\n[[clusters]]\nname = "e"\n'
                    '[[processes]]\nservice = "gateway"\nname = "gw"\nscope = "global"\n'
                    'env = { X = "{nope}" }\n')
    with pytest.raises(SettingsError, match="unknown placeholder 'nope'") as err:
        Stack(StackConfig.load(path), tmp_path).specs()
    assert list(err.value.problems) == ["processes.gw.env.X"]


def test_stack_file_sets_only_settings_the_services_define(tmp_path: Path) -> None:
    """A misspelt TANDEM_* variable would be silently ignored: catch it here."""
    config = StackConfig.load()
    built, _ = built_services([k.service for k in config.processes])
    for kind in config.processes:
        if kind.service in built:
            unknown = unknown_settings(kind.service, (ENV_PREFIX + k.upper() for k in kind.env))
            assert not unknown, f"{kind.name} sets {sorted(unknown)}, unknown to {kind.service}"


# ------------------------------------------------------------------------------ supervisor


def test_output_lines_are_prefixed_and_a_stubborn_child_is_killed_with_its_group(
        tmp_path: Path) -> None:
    # Ignores SIGTERM and has a child of its own (as the trainer has ranks).
    script = ("import signal, subprocess, sys, time\n"
              "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
              "kid = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
              "print('ready', kid.pid, flush=True)\n"
              "time.sleep(600)\n")
    sink = io.StringIO()
    child = Child(stub("east/stubborn-0", script), Output(sink), tmp_path)
    child.start()
    assert child.pid is not None
    wait_until(lambda: "[east/stubborn-0] ready" in sink.getvalue(), 30, "the ready line")
    grandchild = int(sink.getvalue().split()[-1])
    assert alive(grandchild)
    killed = stop_children([child], grace=0.5)
    assert killed == ["east/stubborn-0"]
    assert not alive(child.pid)
    wait_until(lambda: not alive(grandchild), 10, "the grandchild to die")
    assert (tmp_path / "east" / "stubborn-0.log").read_text().startswith("ready ")


# ---------------------------------------------------------------------------- tandem dev up


@pytest.mark.parametrize("flag", ["--nats-port", "--s3-port", "--gateway-port"])
def test_dev_up_port_in_use_fails_fast_with_a_clear_message(tmp_path: Path, flag: str) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        args = dict(zip(FREE_PORTS[::2], FREE_PORTS[1::2], strict=True))
        args[flag] = str(port)
        argv = [*CLI, "dev", "up", "--root", str(tmp_path), *sum(args.items(), ())]
        res = subprocess.run(argv, cwd=ROOT, env=service_env(), capture_output=True,
                             text=True, timeout=60)
    assert res.returncode == 2, res.stdout + res.stderr
    assert f"127.0.0.1:{port} is already in use" in res.stderr
    assert flag in res.stderr
    assert "[stack] ready" not in res.stdout


@pytest.mark.slow
def test_dev_up_runs_the_stack_and_sigterm_leaves_no_process_behind(tmp_path: Path) -> None:
    proc = subprocess.Popen([*CLI, "dev", "up", "--root", str(tmp_path), *FREE_PORTS],
                            cwd=ROOT, env=service_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    children: set[int] = set()
    try:
        out = Lines(proc)
        out.wait_for("[stack] ready", 240)
        children = descendants(proc.pid)
        recorded = json.loads((tmp_path / "stack.json").read_text())["processes"]
        # nats-server, the S3 server and every built service: each a child, each recorded.
        assert {"nats", "s3"} <= set(recorded)
        assert set(recorded.values()) <= children
        proc.send_signal(signal.SIGTERM)
        out.wait_for("[stack] stopped", 60)
        assert proc.wait(30) == 0
        wait_until(lambda: not any(alive(p) for p in children), 10, "no child left")
        assert not (tmp_path / "stack.json").exists()
        services = set(recorded) - {"nats", "s3"}
        for name in services:  # every service's own lines came through, prefixed
            assert any(line.startswith(f"[{name}] ") for line in out.seen), name
        assert not [line for line in out.seen if "exited with code" in line]
    finally:
        for pid in children | descendants(proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def test_killing_a_cluster_leaves_the_other_and_restart_brings_its_heartbeat_back(
        tmp_path: Path) -> None:
    sink = io.StringIO()
    # Started from inside a running event loop, as an async benchmark would.
    with Stack(StackConfig.load().free_ports(), tmp_path, sink, grace=5) as stack:
        health = stack.start(services=["cluster-agent"], health_timeout=120)
        assert health == {"east/agent-0": "healthy", "west/agent-0": "healthy"}, sink.getvalue()
        before = await heartbeat_revision(stack, "east.node-0", after=0)
        old = stack.pids()["east/agent-0"]

        assert stack.kill("east") == ["east/agent-0"]
        assert not alive(old)
        assert stack.children["west/agent-0"].running
        assert stack.exits() == [("east/agent-0", -signal.SIGKILL)]

        new = stack.restart("east")
        assert new["east/agent-0"] != old
        assert stack.wait_healthy("east", 120) == {"east/agent-0": "healthy"}
        assert await heartbeat_revision(stack, "east.node-0", after=before) > before
        pids = set(stack.pids().values())
    assert not any(alive(p) for p in pids)
    assert "[east/agent-0] " in sink.getvalue() and "[west/agent-0] " in sink.getvalue()


async def heartbeat_revision(stack: Stack, key: str, after: int, timeout: float = 60) -> int:
    """Wait for a heartbeat in KV nodes newer than revision ``after``; return its revision."""
    import asyncio

    import nats
    from nats.js.errors import KeyNotFoundError

    nc = await nats.connect(stack.nats_url)
    try:
        kv = await nc.jetstream().key_value("nodes")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(KeyNotFoundError):
                entry = await kv.get(key)
                if entry.revision and entry.revision > after:
                    return entry.revision
            await asyncio.sleep(0.1)  # the agent beats on its own interval
        raise AssertionError(f"no heartbeat {key} newer than {after} in {timeout}s")
    finally:
        await nc.close()


def test_after_a_supervisor_crash_dev_up_refuses_and_dev_down_stops_the_leftovers(
        tmp_path: Path) -> None:
    argv = [*CLI, "dev", "up", "--root", str(tmp_path), *FREE_PORTS, "--only", "cluster-agent"]
    proc = subprocess.Popen(argv, cwd=ROOT, env=service_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    leftovers: set[int] = set()
    try:
        Lines(proc).wait_for("[stack] ready", 240)
        leftovers = descendants(proc.pid)
        assert len(leftovers) >= 4  # nats, s3, east/agent-0, west/agent-0
        proc.kill()  # the supervisor dies without a chance to stop anything
        proc.wait(10)
        assert all(alive(p) for p in leftovers)

        again = subprocess.run(argv, cwd=ROOT, env=service_env(), capture_output=True,
                               text=True, timeout=60)
        assert again.returncode == 2
        assert "still running" in again.stderr and "tandem dev down" in again.stderr

        down = subprocess.run([*CLI, "dev", "down", "--root", str(tmp_path)], cwd=ROOT,
                              env=service_env(), capture_output=True, text=True, timeout=90)
        assert down.returncode == 0, down.stdout + down.stderr
        assert not any(alive(p) for p in leftovers)
        assert not (tmp_path / "stack.json").exists()
    finally:
        for pid in leftovers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---------------------------------------------------------------------------- tandem dev down


@pytest.mark.parametrize("stuck", [False, True])
def test_dev_down_kills_only_a_supervisor_that_does_not_stop(tmp_path: Path, stuck: bool) -> None:
    """One that stops on SIGTERM is left alone (no SIGKILL after it is gone); one that
    ignores SIGTERM is SIGKILLed after the timeout."""
    script = ("import signal, time  # a tandem supervisor stand-in\n"
              + ("signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" if stuck else "")
              + "print('ready', flush=True)\ntime.sleep(600)\n")
    sup = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert sup.stdout is not None and sup.stdout.readline().strip() == "ready"
        reaper = threading.Thread(target=sup.wait, daemon=True)  # reaped at once, as a shell
        reaper.start()
        (tmp_path / "stack.json").write_text(json.dumps({"supervisor": sup.pid,
                                                         "processes": {}}))
        down = subprocess.run([*CLI, "dev", "down", "--root", str(tmp_path), "--timeout", "1"],
                              cwd=ROOT, env=service_env(), capture_output=True, text=True,
                              timeout=60)
        assert down.returncode == 0, down.stdout + down.stderr
        assert "Traceback" not in down.stderr, down.stderr
        assert ("killing it" in down.stdout) == stuck, down.stdout
        reaper.join(30)
        assert sup.returncode == (-signal.SIGKILL if stuck else -signal.SIGTERM)
    finally:
        if sup.poll() is None:
            sup.kill()
            sup.wait()


@pytest.mark.parametrize("how", ["SIGKILL", "SIGHUP"])
def test_a_supervisor_ended_while_starting_leaves_nothing_dev_down_cannot_stop(
        tmp_path: Path, how: str) -> None:
    """SIGKILL once NATS is up: each server started is in stack.json already, and `dev
    down` stops it. SIGHUP (its terminal closed) stops everything as SIGTERM does."""
    argv = [*CLI, "dev", "up", "--root", str(tmp_path), *FREE_PORTS, "--only", "cluster-agent"]
    proc = subprocess.Popen(argv, cwd=ROOT, env=service_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    started: set[int] = set()
    try:
        out = Lines(proc)
        out.wait_for("Server is ready", 120)  # nats-server's own line: it runs
        proc.send_signal(signal.SIGSTOP)  # frozen: what it started so far is all there is
        started = descendants(proc.pid)
        assert started
        proc.send_signal(getattr(signal, how))
        proc.send_signal(signal.SIGCONT)
        code = proc.wait(90)
        if how == "SIGHUP":
            assert code == 130, "\n".join(out.seen[-20:])
            wait_until(lambda: not any(alive(p) for p in started), 30, "no child left")
            assert not (tmp_path / "stack.json").exists()
            return
        recorded = set(json.loads((tmp_path / "stack.json").read_text())["processes"].values())
        assert started <= recorded, (started, recorded)
        down = subprocess.run([*CLI, "dev", "down", "--root", str(tmp_path)], cwd=ROOT,
                              env=service_env(), capture_output=True, text=True, timeout=90)
        assert down.returncode == 0, down.stdout + down.stderr
        wait_until(lambda: not any(alive(p) for p in started), 30, "no server left")
    finally:
        for pid in started:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
            proc.wait()


def test_dev_up_only_with_an_unknown_service_names_it_and_starts_nothing(
        tmp_path: Path) -> None:
    res = subprocess.run([*CLI, "dev", "up", "--root", str(tmp_path), *FREE_PORTS,
                          "--only", "gateway,gatway"], cwd=ROOT, env=service_env(),
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "gatway" in res.stderr, res.stderr
    assert "inference-worker" in res.stderr  # the valid ones are listed
    assert "[stack] ready" not in res.stdout and "[nats]" not in res.stdout
