"""A gateway process with no proxy in front against hostile connections, over raw
sockets: an endless header gets 431, a connection that sends no head is closed after
``HTTP_HEAD_TIMEOUT``, one past ``HTTP_MAX_CONNECTIONS`` gets 503 at once; keep-alive
and an event stream outlive the head timeout. No worker runs: tasks stay queued."""

from __future__ import annotations

import asyncio
import contextlib
import resource
import signal
import subprocess
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest

from tandem.cli.devstack import S3Server
from tests.conftest import PYTHON
from tests.serving_stack import Child, ServingStack, gateway, http_port

CLUSTER = "conns"
MAX_HEADER = 8192
MAX_CONNECTIONS = 4
DEADLINE = 30.0


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, s3_server: S3Server
          ) -> Iterator[ServingStack]:
    st = ServingStack(tmp_path_factory.mktemp("conns"), s3_server, "conns")
    try:
        st.nats.start()
        yield st
    finally:
        st.stop()


def start_gateway(st: ServingStack, name: str) -> Child:
    gw = gateway(st.root, name, **st.env(cluster=CLUSTER), clusters=CLUSTER,
                 routing="static", sse_ping="0.2", http_head_timeout="1",
                 http_max_header_bytes=str(MAX_HEADER),
                 http_max_connections=str(MAX_CONNECTIONS))
    st.children.append(gw.start())
    return gw


@pytest.fixture(scope="module")
def port(stack: ServingStack) -> int:
    return http_port(start_gateway(stack, "gateway"))


@contextlib.asynccontextmanager
async def connection(port: int) -> AsyncIterator[tuple[asyncio.StreamReader,
                                                         asyncio.StreamWriter]]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        yield reader, writer
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One response of a content-length body: status, headers, body."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), DEADLINE)
    status, *lines = head.decode().strip().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines)
    body = await reader.readexactly(int(headers.get("content-length", 0)))
    return int(status.split()[1]), headers, body


async def get(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
              path: str = "/healthz") -> int:
    writer.write(f"GET {path} HTTP/1.1\r\nHost: gw\r\n\r\n".encode())
    return (await response(reader))[0]


async def closed(reader: asyncio.StreamReader) -> bytes:
    """All the gateway sends until it closes the connection (the test fails if it does
    not within the deadline)."""
    return await asyncio.wait_for(reader.read(), DEADLINE)


async def head_timeout_passed(port: int) -> None:
    """Returns once a connection opened now has been closed for sending no head: the
    gateway's head timeout has passed since this call."""
    async with connection(port) as (reader, _):
        assert await closed(reader) == b""


async def test_an_endless_header_gets_431_naming_the_limit_and_the_connection_closed(
        port: int) -> None:
    async with connection(port) as (reader, writer):
        async def endless_header() -> None:
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: gw\r\nX-Big: ")
            with contextlib.suppress(ConnectionError):
                for _ in range(256):  # 1 MiB: a gateway that buffers it all answers never
                    writer.write(b"a" * 4096)
                    await writer.drain()

        sending = asyncio.create_task(endless_header())
        try:
            status, headers, body = await response(reader)
            assert status == 431 and headers["connection"] == "close"
            assert f"over {MAX_HEADER} bytes (TANDEM_HTTP_MAX_HEADER_BYTES)" in body.decode()
            assert await closed(reader) == b""
        finally:
            sending.cancel()
    async with connection(port) as (reader, writer):  # a head within the limit is served
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: gw\r\nX-Big: "
                     + b"a" * (MAX_HEADER - 200) + b"\r\n\r\n")
        assert (await response(reader))[0] == 200


async def test_a_connection_that_sends_no_head_is_closed_and_a_partial_one_gets_408(
        port: int) -> None:
    async with connection(port) as (reader, _):
        assert await closed(reader) == b""
    async with connection(port) as (reader, writer):
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: g")
        status, _, body = await response(reader)
        assert status == 408 and "TANDEM_HTTP_HEAD_TIMEOUT" in body.decode()
        assert await closed(reader) == b""


async def test_keep_alive_between_requests_outlives_the_head_timeout(port: int) -> None:
    async with connection(port) as (reader, writer):
        assert await get(reader, writer) == 200
        await head_timeout_passed(port)
        assert await get(reader, writer) == 200  # the same connection, idle meanwhile


async def test_an_event_stream_outlives_the_head_timeout(port: int) -> None:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}",
                                 timeout=DEADLINE) as http:
        r = await http.post("/v1/generations", json={"model": "noop"})
        assert r.status_code == 202, r.text
        task = r.json()["id"]
        async with http.stream("GET", f"/v1/generations/{task}/events") as events:
            lines = events.aiter_lines()
            assert await anext(lines) == "event: state"
            await head_timeout_passed(port)
            assert (await http.delete(f"/v1/generations/{task}")).status_code == 200
            async for line in lines:
                if line == "event: final":
                    break
            else:
                raise AssertionError("the stream ended without its final event")


async def test_a_connection_past_the_limit_gets_503_while_open_ones_go_on(
        port: int) -> None:
    async with contextlib.AsyncExitStack() as held:
        for _ in range(MAX_CONNECTIONS + 1):
            reader, writer = await held.enter_async_context(connection(port))
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: gw\r\n\r\n")
            status, headers, body = await response(reader)
            if status != 200:
                break
            held_open = (reader, writer)
        assert status == 503, "every connection was served"
        assert headers["retry-after"] == "1" and headers["connection"] == "close"
        assert f"its {MAX_CONNECTIONS} connections open (TANDEM_HTTP_MAX_CONNECTIONS)" in (
            body.decode())
        assert await closed(reader) == b""
        assert await get(*held_open) == 200  # a connection already open is still served
    # Their slots are free again once the gateway has seen them close.
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEADLINE
    while True:
        async with connection(port) as (reader, writer):
            if await get(reader, writer) == 200:
                break
        assert loop.time() < deadline, "the closed connections' slots were never freed"


async def test_sigterm_stops_the_gateway_with_connections_open_in_each_state(
        stack: ServingStack) -> None:
    """Idle, mid-head, kept alive after a response, refused and lingering: the drain
    closes each, so the gateway exits 0 (a guard: the old code stopped too)."""
    gw = start_gateway(stack, "gateway-stop")
    port = http_port(gw)
    async with contextlib.AsyncExitStack() as held:
        _, partial = await held.enter_async_context(connection(port))
        partial.write(b"GET /healthz HTTP/1.1\r\nHost: g")
        await held.enter_async_context(connection(port))  # sends nothing
        statuses = []
        for _ in range(MAX_CONNECTIONS - 1):  # served, then kept alive; the last refused
            reader, writer = await held.enter_async_context(connection(port))
            statuses.append(await get(reader, writer))
        assert 200 in statuses
        assert gw.proc is not None
        gw.proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(asyncio.to_thread(gw.proc.wait), DEADLINE) == 0


def test_the_gateway_raises_its_open_file_limit_to_hold_its_connections() -> None:
    """Started from a shell's 1024 (here 256), 1000 connections would hit EMFILE first."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < 1100:
        pytest.skip(f"the hard limit on open files here is {hard}")
    code = ("import resource\n"
            "from tandem.gateway.service import open_files_for\n"
            f"resource.setrlimit(resource.RLIMIT_NOFILE, (256, {hard}))\n"
            "print(open_files_for(1000), resource.getrlimit(resource.RLIMIT_NOFILE)[0])\n")
    out = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "1100"]
