"""The service runner: /healthz and /metrics while running, a clear exit on a stream
conflict or a bad setting, and nothing deleted on the way."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import urllib.request
from pathlib import Path

import pytest

from tandem.cli.devstack import free_port, logged_metrics_port
from tandem.common import streams
from tandem.common.bus import Bus
from tandem.common.settings import Settings
from tests.conftest import PYTHON, ROOT, service_env

TIMEOUT = 30


async def _start_echo(env: dict[str, str], log: Path) -> tuple[asyncio.subprocess.Process, int]:
    """The echo service, its metrics on a port it picks itself (read back from its log)."""
    with log.open("ab") as out:
        proc = await asyncio.create_subprocess_exec(
            PYTHON, "-m", "tests.support.echo_service", cwd=ROOT,
            env={**env, "TANDEM_METRICS_PORT": "0"}, stdout=out, stderr=subprocess.STDOUT)
    return proc, await asyncio.to_thread(logged_metrics_port, proc, log, 0, TIMEOUT)


async def _sigterm(proc: asyncio.subprocess.Process) -> int:
    """SIGTERM the service; its exit code (within the deadline)."""
    proc.send_signal(signal.SIGTERM)
    return await asyncio.wait_for(proc.wait(), TIMEOUT)


async def _reap(proc: asyncio.subprocess.Process) -> None:
    """SIGKILL the service if a failed assertion left it running."""
    if proc.returncode is None:
        proc.kill()
        await proc.wait()


async def _wait_healthy(url: str, proc: asyncio.subprocess.Process) -> dict:
    async def poll() -> dict:
        while True:
            assert proc.returncode is None, "service exited early"
            try:
                body = await asyncio.to_thread(
                    lambda: urllib.request.urlopen(url, timeout=1).read())
                return json.loads(body)
            except OSError:
                await asyncio.sleep(0.05)  # polling the service's own readiness endpoint

    return await asyncio.wait_for(poll(), TIMEOUT)


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
async def test_service_serves_healthz_and_metrics_then_exits_zero_on_sigterm(
        settings: Settings, uid: str, loop: str, tmp_path: Path) -> None:
    env = service_env(nats_url=settings.nats_url, echo_name=uid, event_loop=loop)
    proc, port = await _start_echo(env, tmp_path / "echo.log")
    try:
        health = await _wait_healthy(f"http://127.0.0.1:{port}/healthz", proc)
        assert health["status"] == "ok" and health["service"] == "echo"
        assert health["nats"] == "connected" and health["loop"] == loop
        assert health["gc_threshold"] == 20_000  # the default, applied before the run
        text = await asyncio.to_thread(
            lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode())
        assert 'tandem_service_up{tandem_service="echo"} 1.0' in text
        assert await _sigterm(proc) == 0
    finally:
        await _reap(proc)


@pytest.mark.parametrize("hang", ["executor", "default"])
async def test_sigterm_exits_even_with_a_thread_that_never_ends(
        settings: Settings, uid: str, hang: str, tmp_path: Path) -> None:
    """A thread stuck for good (a pipeline call in a hung driver) cannot be stopped, and
    Python joins it at exit: the runner ends the process anyway once it is done, naming
    the thread, instead of leaving a stopped service alive until someone SIGKILLs it."""
    env = service_env(nats_url=settings.nats_url, echo_name=uid, echo_hang=hang,
                      drain_timeout="1")
    log = tmp_path / "echo.log"
    proc, port = await _start_echo(env, log)
    try:
        await _wait_healthy(f"http://127.0.0.1:{port}/healthz", proc)
        assert await _sigterm(proc) == 0
        forced = [json.loads(line) for line in log.read_text().splitlines()
                  if '"runner.exit_forced"' in line]
        assert len(forced) == 1 and forced[0]["threads"], forced
    finally:
        await _reap(proc)


async def test_stream_conflict_at_start_exits_2_naming_stream_and_field(
        bus: Bus, settings: Settings, uid: str) -> None:
    await bus.provision([streams.StreamSpec(f"ECHO_{uid}", (f"echo.{uid}", "other.x"))])
    await bus.publish("other.x", b"{}")
    out = await asyncio.to_thread(
        subprocess.run, [PYTHON, "-m", "tests.support.echo_service"], cwd=ROOT,
        env=service_env(nats_url=settings.nats_url, echo_name=uid),
        capture_output=True, text=True, timeout=TIMEOUT)
    assert out.returncode == 2
    assert f"stream ECHO_{uid} exists with a conflicting config: subjects" in out.stdout
    info = await bus.js.stream_info(f"ECHO_{uid}")
    assert info.state.messages == 1  # never deleted or reshaped


def test_bad_setting_exits_2_with_the_variable_named() -> None:
    out = subprocess.run([PYTHON, "-m", "tests.support.echo_service"], cwd=ROOT,
                         env=service_env(cluster="no.dots", drain_timeout="-1"),
                         capture_output=True, text=True, timeout=TIMEOUT)
    assert out.returncode == 2
    assert "TANDEM_CLUSTER" in out.stderr and "TANDEM_DRAIN_TIMEOUT" in out.stderr


def test_an_unknown_event_loop_is_a_bad_setting() -> None:
    out = subprocess.run([PYTHON, "-m", "tests.support.echo_service"], cwd=ROOT,
                         env=service_env(event_loop="tokio"), capture_output=True, text=True,
                         timeout=TIMEOUT)
    assert out.returncode == 2 and "TANDEM_EVENT_LOOP" in out.stderr


async def test_sigterm_while_nats_is_unreachable_exits_promptly_with_zero() -> None:
    env = service_env(nats_url=f"nats://127.0.0.1:{free_port()}", echo_name="nobody")
    proc = await asyncio.create_subprocess_exec(
        PYTHON, "-m", "tests.support.echo_service", cwd=ROOT, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    try:
        async def wait_for_retry() -> None:
            assert proc.stdout is not None
            # The client's connect error, logged as it retries (the wording is the event
            # loop's: asyncio says "Connect call failed", uvloop "Connection refused").
            while b'"nats.error"' not in await proc.stdout.readline():
                pass

        await asyncio.wait_for(wait_for_retry(), TIMEOUT)
        assert await _sigterm(proc) == 0
    finally:
        await _reap(proc)


async def test_sigterm_after_nats_died_still_exits(settings: Settings, uid: str,
                                                   nats_server, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    env = service_env(nats_url=settings.nats_url, echo_name=uid)
    proc, port = await _start_echo(env, tmp_path / "echo.log")
    try:
        await _wait_healthy(f"http://127.0.0.1:{port}/healthz", proc)
        nats_server.kill()
        assert await _sigterm(proc) == 0
    finally:
        await _reap(proc)
