"""A CLI command given something wrong ends with one clear line and a non-zero exit, no
traceback: a bad file or argument, a stack file of the wrong types, a server that never
answers, a bucket that does not exist. And ``tandem.client`` over NATS connects as the
``TANDEM_NATS_*`` settings say, and fails fast and quietly where NATS is not there."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from tandem.cli.devstack import NatsServer, S3Server, free_port
from tandem.common import streams
from tandem.common.bus import Bus
from tandem.common.settings import Settings, load

from .conftest import ROOT, service_env

CLI = [sys.executable, "-m", "tandem.cli.main"]


@pytest.fixture(scope="module")
def silent() -> Iterator[int]:
    """A port that takes connections and never answers (a hung gateway or NATS): the
    kernel completes each handshake into the backlog; nothing ever reads."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        yield sock.getsockname()[1]


def tandem(argv: list[str], timeout: float = 90, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *argv], cwd=ROOT, env=service_env(**env), capture_output=True,
                          text=True, timeout=timeout)


STACK_TOML = '[ports]\nnats = 0\nnats_monitor = 0\ns3 = 0\n[[clusters]]\nname = "east"\n'
FILES = {
    "run.json": '{"steps": 5}',
    "list.json": "[1, 2]",
    "bad.toml": "steps = \n",
    "ports.toml": '[ports]\nnats = "x"\nnats_monitor = 0\ns3 = 0\n[[clusters]]\nname = "e"\n',
    "nodes.toml": STACK_TOML + 'nodes = "2"\n',
    "placeholder.toml": STACK_TOML + '[[processes]]\nservice = "gateway"\nname = "gateway"\n'
                        'scope = "global"\nenv = { HTTP_PORT = "{gateway_port}" }\n',
    "report/demo.json": "not json",
    "report2/demo.json": "{}",
}

# (argv, what stderr must name); {tmp}: the files above, {silent}: a port never answering.
CASES = {
    "train submit, missing file": (["train", "submit", "{tmp}/nope.json"], "nope.json"),
    "train submit, bad TOML": (["train", "submit", "{tmp}/bad.toml"], "bad.toml"),
    "train submit, --set into a number": (
        ["train", "submit", "{tmp}/run.json", "--set", "steps.x=1"], "steps.x=1"),
    "train submit, a JSON list": (["train", "submit", "{tmp}/list.json"], "list"),
    "train submit, silent gateway": (
        ["train", "submit", "{tmp}/run.json", "--url", "http://127.0.0.1:{silent}",
         "--timeout", "2"], "no answer from the gateway at http://127.0.0.1:{silent}"),
    "train submit, timeout not a number": (
        ["train", "submit", "{tmp}/run.json", "--timeout", "soon"], "--timeout"),
    "train submit, timeout zero": (
        ["train", "submit", "{tmp}/run.json", "--timeout", "0"], "a number above 0"),
    "train status, silent NATS": (["train", "status", "r1"], "no answer"),
    "stack file, port not a number": (["dev", "up", "--config", "{tmp}/ports.toml"],
                                      "ports.nats"),
    "stack file, nodes not a number": (["dev", "up", "--config", "{tmp}/nodes.toml"],
                                       "clusters.east.nodes"),
    "stack file, placeholder without its port": (
        ["dev", "up", "--config", "{tmp}/placeholder.toml", "--root", "{tmp}/root"],
        "gateway_port"),
    "nats-config, no cluster": (["security", "nats-config", "--clusters", ""], "--clusters"),
    "nats-config, login not NEW=OLD": (["security", "nats-config", "--add-login", "b"],
                                       "--add-login 'b': give NEW=OLD"),
    "nats-config, login of no user": (
        ["security", "nats-config", "--accounts", "--add-login", "b=trainer-eats"],
        "no user 'trainer-eats' to copy"),
    "nats-config, drop of no user": (["security", "nats-config", "--drop", "trainer-eats"],
                                     "no user 'trainer-eats' to drop"),
    "certs, folder cannot be made": (["security", "certs", "/proc/nope"], "/proc/nope"),
    "api-key, bad name": (["security", "api-key", "--name", "bad name!"], "name"),
    "bench, no repeat": (["bench", "bus", "--repeat", "0"], "--repeat"),
    "bench, negative repeat": (["bench", "bus", "--repeat", "-1"], "--repeat"),
    **{f"bench {b}, {opt} {v}": (["bench", b, opt, v], f"argument {opt}: '{v}': give ")
       for b, opt, v in [
           ("bus", "--messages", "0"), ("bus", "--messages", "-5"), ("bus", "--batch", "0"),
           ("bus", "--window", "0"), ("serve", "--tasks", "0"), ("serve", "--images", "-1"),
           ("serve", "--batch", "0"), ("serve", "--threads", "-1"), ("agent", "--ticks", "0"),
           ("agent", "--seconds", "0"), ("checkpoint", "--part-mb", "0"),
           ("checkpoint", "--commits", "-2"), ("failover", "--tasks", "0"),
           ("failover", "--grace", "-1"), ("scale", "--gpus", "0"),
           ("scale", "--sizes", "10,0"), ("scale", "--interval", "0"),
           ("train", "--steps", "0"), ("train", "--batch-size", "x"),
           ("train", "--part-mb", "0"), ("all", "--repeat", "0")]},
    "bench, heartbeat TTL past the bucket's": (["bench", "failover", "--ttl", "30"],
                                               "longer than KV nodes' (6 s)"),
    "report, not JSON": (["report", "{tmp}/report"], "demo.json"),
    "report, not a demo record": (["report", "{tmp}/report2"], "demo.json"),
    "checkpoints, no such bucket": (
        ["checkpoints", "list", "r1", "--bucket", "nosuchbucket"], "nosuchbucket"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_wrong_input_ends_with_one_clear_line_and_no_traceback(
        case: str, tmp_path: Path, silent: int, s3_server: S3Server) -> None:
    for name, text in FILES.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    argv, wanted = CASES[case]
    fill = {"{tmp}": str(tmp_path), "{silent}": str(silent)}
    for k, v in fill.items():
        argv = [a.replace(k, v) for a in argv]
        wanted = wanted.replace(k, v)
    res = tandem(argv, NATS_URL=f"nats://127.0.0.1:{silent}", S3_ENDPOINT=s3_server.url,
                 S3_ACCESS_KEY="tandem", S3_SECRET_KEY="tandem")
    assert res.returncode != 0, res.stdout + res.stderr
    assert "Traceback" not in res.stderr + res.stdout, res.stderr[-3000:]
    assert wanted in res.stderr, res.stderr[-3000:]
    assert not any(line.startswith("[stack]") for line in res.stdout.splitlines()), \
        "the stack began to start: " + res.stdout[-2000:]


@pytest.mark.parametrize("argv, said", [
    (["--add-login", "trainer-east-2"], "--add-login 'trainer-east-2': give NEW=OLD"),
    (["--add-login", "=trainer-east"], "--add-login '=trainer-east': give NEW=OLD"),
    (["--add-login", "b=a=c"], "--add-login 'b=a=c': give NEW=OLD"),
    (["--add-login", "b=trainer-eats"], "no user 'trainer-eats' to copy"),
    (["--accounts", "--add-login", "b=leaf-north"], "no user 'leaf-north' to copy"),
    (["--add-login", "gateway=admin"], "login 'gateway' is already a user"),
    (["--add-login", "b c=gateway"], "invalid user 'b c'"),
    (["--add-login", "sys-2=sys"], "'sys': a user of the accounts layout only"),
    (["--accounts", "--drop", "sys-2"], "no user 'sys-2' to drop"),
])
def test_nats_config_refuses_a_bad_login_in_one_line_with_exit_2(
        argv: list[str], said: str) -> None:
    """docs/security.md's rotation by ``--add-login NEW=OLD`` and ``--drop USER``: a
    malformed pair, an OLD or dropped user that is none, a NEW that is taken or no valid
    name, each gets one line naming it and exit status 2, and no config is printed."""
    res = tandem(["security", "nats-config", *argv], timeout=60)
    assert res.returncode == 2 and res.stdout == "", res.stdout[-2000:] + res.stderr[-2000:]
    assert len(res.stderr.splitlines()) == 1, res.stderr[-3000:]
    assert res.stderr.startswith("tandem security nats-config: ") and said in res.stderr, \
        res.stderr


# ------------------------------------------------------------- tandem.client over NATS


@pytest.mark.parametrize("argv", [["generate", "3", "--url", "nats://127.0.0.1:{port}"],
                                  ["train", "submit", "{tmp}/run.json"]])
def test_without_nats_the_client_fails_with_one_line_and_no_traceback(
        argv: list[str], tmp_path: Path) -> None:
    port = free_port()  # nothing listens on it
    (tmp_path / "run.json").write_text('{"steps": 5}')
    argv = [a.replace("{port}", str(port)).replace("{tmp}", str(tmp_path)) for a in argv]
    res = tandem(argv, NATS_URL=f"nats://127.0.0.1:{port}")
    assert res.returncode != 0
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr[-3000:]
    assert f"127.0.0.1:{port}" in lines[0] and "tandem dev up" in lines[0]


@pytest.mark.parametrize("argv", [["generate", "3", "--url", "{url}"],
                                  ["train", "submit", "{tmp}/run.json"]])
def test_with_nats_but_no_gateway_the_client_says_so_in_one_line(
        argv: list[str], tmp_path: Path, nats_server: NatsServer) -> None:
    (tmp_path / "run.json").write_text('{"steps": 5}')
    argv = [a.replace("{url}", nats_server.url).replace("{tmp}", str(tmp_path)) for a in argv]
    res = tandem(argv, NATS_URL=nats_server.url)
    assert res.returncode != 0
    assert "Traceback" not in res.stderr and "Task was destroyed" not in res.stderr, \
        res.stderr[-3000:]
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr[-3000:]
    assert "no gateway serves the job service (tandem.jobs." in lines[0], lines[0]


@pytest.fixture
def auth_nats(tmp_path: Path) -> Iterator[NatsServer]:
    """A NATS server that takes only user ``cli`` with password ``pw``."""
    conf = tmp_path / "auth.conf"
    conf.write_text(f'jetstream {{ store_dir: "{tmp_path / "js"}" }}\n'
                    'authorization { users = [ { user: "cli", password: "pw" } ] }\n')
    srv = NatsServer(name="auth", log_path=tmp_path / "nats.log", config_path=conf).start()
    yield srv
    srv.stop()


@pytest.fixture
async def job_answers(auth_nats: NatsServer) -> AsyncIterator[list[str]]:
    """Answers on the job service's subjects (what was asked is listed): a run accepted,
    no models. It stands in for the gateway: what is tested is the client's login."""
    asked: list[str] = []

    async def on(msg: object) -> None:
        subject = msg.subject  # type: ignore[attr-defined]
        asked.append(subject)
        body = ({"run_id": "r-auth", "state": "pending"} if subject.endswith(".train")
                else {"models": []})
        await msg.respond(json.dumps(body).encode())  # type: ignore[attr-defined]

    bus = await Bus.connect(load(Settings, nats_url=auth_nats.url, nats_user="cli",
                                 nats_password="pw"), "test")
    await bus.nc.subscribe("tandem.jobs.>", cb=on)
    await bus.synced()
    yield asked
    await bus.drain()


@pytest.mark.parametrize("argv, said", [
    (["train", "submit", "{tmp}/run.json"], "submitted r-auth"),
    (["generate", "3", "--url", "{url}"], "no model takes class_label"),
])
async def test_the_cli_on_nats_logs_in_as_the_tandem_nats_settings_say(
        argv: list[str], said: str, tmp_path: Path, auth_nats: NatsServer,
        job_answers: list[str]) -> None:
    (tmp_path / "run.json").write_text('{"steps": 5}')
    argv = [a.replace("{tmp}", str(tmp_path)).replace("{url}", auth_nats.url) for a in argv]
    res = await asyncio.to_thread(tandem, argv, NATS_URL=auth_nats.url, NATS_USER="cli",
                                  NATS_PASSWORD="pw", NATS_INBOX_PREFIX="_INBOX_cli")
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    assert said in res.stdout + res.stderr, res.stdout + res.stderr[-3000:]
    assert job_answers, "the job service was never asked"


@pytest.mark.parametrize("argv", [["clusters"], ["train", "status", "r1"]])
def test_a_refused_nats_login_is_named_not_taken_for_a_missing_stack(
        argv: list[str], tmp_path: Path, auth_nats: NatsServer) -> None:
    """NATS that is there but refuses the login: one line naming the refusal and the
    settings to set, never "cannot reach" or "is the stack running?"."""
    (tmp_path / "run.json").write_text('{"steps": 5}')
    argv = [a.replace("{tmp}", str(tmp_path)).replace("{url}", auth_nats.url) for a in argv]
    res = tandem(argv, NATS_URL=auth_nats.url, NATS_USER="cli", NATS_PASSWORD="wrong")
    assert res.returncode != 0
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr[-3000:]
    assert "refused the login" in lines[0] and "TANDEM_NATS_PASSWORD" in lines[0], lines[0]
    assert "cannot reach" not in lines[0] and "stack running" not in lines[0], lines[0]


def test_an_s3_without_credentials_names_them_and_not_a_missing_stack(
        s3_server: S3Server) -> None:
    res = tandem(["checkpoints", "list", "r1"], S3_ENDPOINT=s3_server.url,
                 S3_ACCESS_KEY="", S3_SECRET_KEY="", AWS_SHARED_CREDENTIALS_FILE="/nonexistent",
                 AWS_CONFIG_FILE="/nonexistent")
    assert res.returncode != 0
    assert "TANDEM_S3_ACCESS_KEY" in res.stderr and "stack running" not in res.stderr, \
        res.stderr[-3000:]


def test_generate_names_the_url_it_reads_not_tandem_nats_url() -> None:
    port = free_port()  # nothing listens on it
    res = tandem(["generate", "3", "--url", f"http://127.0.0.1:{port}"],
                 NATS_URL=f"nats://127.0.0.1:{port}")
    assert res.returncode != 0
    assert "--url (default http://127.0.0.1:8000)" in res.stderr, res.stderr[-3000:]
    assert "TANDEM_NATS_URL" not in res.stderr, res.stderr[-3000:]


async def test_train_status_ends_without_connection_warnings(
        nats_server: NatsServer, bus: Bus) -> None:
    """A normal end closes the connection: that is no ``nats.disconnected`` warning."""
    await bus.provision([s for s in streams.core_streams(1)
                         if not isinstance(s, streams.ConsumerSpec)])
    res = await asyncio.to_thread(tandem, ["train", "status", "nosuchrun"],
                                  NATS_URL=nats_server.url)
    assert res.returncode != 0
    assert "nosuchrun" in res.stderr, res.stderr[-3000:]
    assert "nats.disconnected" not in res.stdout + res.stderr, res.stdout + res.stderr


async def test_a_submission_whose_answer_is_lost_is_sent_again_under_one_key(
        nats_server: NatsServer) -> None:
    """A gateway killed mid-request leaves the client with no answer: ``generate`` sends
    it again under the same Idempotency-Key (made for the call when none is given), so
    the gateway queues it once however often it is sent."""
    from tandem.client import connect

    keys: list[str | None] = []

    async def on(msg: object) -> None:  # stands in for the gateway: the first one dies
        keys.append((msg.headers or {}).get("Idempotency-Key"))  # type: ignore[attr-defined]
        if len(keys) > 1:
            await msg.respond(json.dumps({"id": "t1", "state": "queued"}).encode())  # type: ignore[attr-defined]

    bus = await Bus.connect(load(Settings, nats_url=nats_server.url), "test")
    await bus.nc.subscribe("tandem.jobs.generate", cb=on)
    await bus.synced()
    client = await connect(nats_server.url, timeout=0.5)
    try:
        assert (await client.generate(model="noop"))["id"] == "t1"
        assert len(keys) == 2 and keys[0] and keys[0] == keys[1]
        keys.clear()
        assert (await client.generate(idempotency_key="mine", model="noop"))["id"] == "t1"
        assert keys == ["mine", "mine"]
    finally:
        await client.close()
        await bus.drain()
