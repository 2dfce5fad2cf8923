"""Real servers on free loopback ports, one set per test (or per module where noted).

Nothing mocks NATS or S3: these fixtures start ``nats-server`` (single node or a
3-node JetStream cluster) and moto's S3 server, wait for their own readiness
endpoints, and stop them after. ``uid`` gives each test names no other test sees.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import structlog

from tandem.cli.devstack import NatsServer, S3Server
from tandem.cli.topology import NatsCluster
from tandem.common.bus import Bus
from tandem.common.settings import Settings, load

os.environ.setdefault("TANDEM_LOG_FORMAT", "json")
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _logging_as_a_fresh_process_has_it() -> None:
    """Each test starts with structlog's defaults. A command or bench run in-process
    (``main(["bench", "train", ...])``) configures this worker's logging for itself,
    ``error`` and up; a test after it in the same worker that captures a warning
    (``structlog.testing.capture_logs``) then captured nothing: its logger filtered the
    warning out before any processor (seen: ``test_rank_channel`` after the sharded
    bench's test, once ``make test`` ran the files in another order)."""
    structlog.reset_defaults()


@pytest.fixture
def uid() -> str:
    """A short unique token for stream, cluster, task and bucket names."""
    return uuid.uuid4().hex[:10]


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[NatsServer]:
    srv = NatsServer(name="test", log_path=tmp_path / "nats.log", store_dir=tmp_path / "js")
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture
def nats_cluster(tmp_path: Path) -> Iterator[NatsCluster]:
    cluster = NatsCluster(root=tmp_path / "cluster").start()
    yield cluster
    cluster.stop()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """One moto server per session; tests isolate by bucket name (``uid``)."""
    root = tmp_path_factory.mktemp("s3")
    srv = S3Server(name="s3", log_path=root / "s3.log").start()
    yield srv
    srv.stop()


@pytest.fixture
def settings(nats_server: NatsServer, uid: str) -> Settings:
    return load(Settings, nats_url=nats_server.url, cluster=f"c{uid}", node="n0")


@pytest.fixture
async def bus(settings: Settings) -> AsyncIterator[Bus]:
    b = await Bus.connect(settings, "test")
    yield b
    await b.drain()


def service_env(**values: str) -> dict[str, str]:
    """Environment for a child process: this interpreter's, plus TANDEM_* values."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    env.update({f"TANDEM_{k.upper()}": v for k, v in values.items()})
    env["TANDEM_LOG_FORMAT"] = "json"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def thread_cpus(pid: int) -> set[int]:
    """The CPUs every thread of process ``pid`` may run on (one set, or the test fails)."""
    seen = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            seen.add(frozenset(os.sched_getaffinity(int(tid))))
        except ProcessLookupError:
            pass  # a thread that ended while read
    assert len(seen) == 1, f"threads of {pid} on different CPUs: {seen}"
    return set(next(iter(seen)))


def torch_loaded(pid: int) -> bool:
    """Whether process ``pid`` has torch's library mapped (it imported torch)."""
    with open(f"/proc/{pid}/maps") as maps:
        return any("libtorch_cpu" in line for line in maps)


PYTHON = sys.executable


def ports_taken_at_once(code: str, processes: int = 2) -> list[set[int]]:
    """Run ``code`` (it prints the ports it was given) in ``processes`` Python processes
    at once; each one's ports (the test fails if one exits non-zero)."""
    procs = [subprocess.Popen([PYTHON, "-c", code], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(processes)]
    got = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-2000:]
        got.append({int(x) for x in out.split()})
    return got


# A JetStream store that fills in a moment: tests of what a full one does.
FILL = "FILL"  # the stream that fills it (another program's); purge it to make room


def small_store(root: Path) -> Path:
    """A nats-server config (``NatsServer.config_path``) whose JetStream holds 1 MB."""
    conf = root / "nats.conf"
    conf.write_text(f'jetstream {{ store_dir: "{root / "js"}", max_file_store: 1MB }}\n')
    return conf


async def fill_store(bus: Bus) -> None:
    """Write to a stream of its own (``FILL``) until JetStream has no room; from then on
    it refuses every write, whatever its size, until ``FILL`` is purged."""
    await bus.js.add_stream(name=FILL, subjects=["fill.>"])
    while b'"error"' not in (await bus.nc.request("fill.x", b"x" * 4096, timeout=5)).data:
        pass
