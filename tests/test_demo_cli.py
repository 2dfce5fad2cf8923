"""CLI ergonomics: every command says what it does; no stack means a clear message."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from tandem.cli.devstack import free_port
from tandem.cli.main import build_parser

from .conftest import ROOT, service_env

CLI = [sys.executable, "-m", "tandem.cli.main"]


def commands() -> list[tuple[list[str], argparse.ArgumentParser, str | None]]:
    out = []

    def walk(parser: argparse.ArgumentParser, path: list[str]) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                helps = {a.dest: a.help for a in action._choices_actions}
                for name, sub in action.choices.items():
                    out.append(([*path, name], sub, helps.get(name)))
                    walk(sub, [*path, name])

    walk(build_parser(), [])
    return out


def test_every_command_and_subcommand_says_what_it_does_in_its_help() -> None:
    found = commands()
    assert {"demo", "report", "generate", "dev", "train", "clusters"} <= {
        p[0] for p, _, _ in found}
    for path, parser, one_line in found:
        assert one_line and len(one_line) > 10, f"tandem {' '.join(path)}: no one-line help"
        assert parser.description and len(parser.description) > 10, \
            f"tandem {' '.join(path)} --help does not say what it does"
    top = subprocess.run([*CLI, "--help"], cwd=ROOT, env=service_env(), capture_output=True,
                         text=True, timeout=60)
    assert top.returncode == 0
    for path, _, one_line in found:
        if len(path) == 1:
            assert path[0] in top.stdout and one_line.split()[0] in top.stdout


@pytest.mark.parametrize("argv", [
    ["clusters"],
    ["train", "status", "some-run"],
    ["checkpoints", "list", "some-run"],
    ["generate", "3", "--url", "{gateway}"],
])
def test_a_command_that_needs_the_stack_says_it_is_not_running_and_how_to_start_it(
        argv: list[str]) -> None:
    nats, gateway, s3 = free_port(), free_port(), free_port()  # nothing listens on them
    argv = [a.replace("{gateway}", f"http://127.0.0.1:{gateway}") for a in argv]
    env = service_env(NATS_URL=f"nats://127.0.0.1:{nats}", S3_ENDPOINT=f"http://127.0.0.1:{s3}",
                      S3_ACCESS_KEY="k", S3_SECRET_KEY="k")
    res = subprocess.run([*CLI, *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=60)
    assert res.returncode != 0
    assert "Traceback" not in res.stderr, res.stderr[-2000:]
    assert "tandem dev up" in res.stderr, res.stderr[-2000:]
    where = {"generate": gateway, "checkpoints": s3}.get(argv[0], nats)
    assert f"127.0.0.1:{where}" in res.stderr, res.stderr[-2000:]


def test_a_reader_that_stops_early_ends_the_command_quietly_with_sigpipes_code() -> None:
    """`tandem schema | head -1`: the reader closes the pipe after one line; the command
    ends with 141 (128 + SIGPIPE), as a shell tool would, and prints no traceback. (The
    schemas are ~80 KB, more than a pipe holds, so the write does meet the closed pipe.)"""
    proc = subprocess.Popen([*CLI, "schema"], cwd=ROOT, env=service_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.readline().strip() == b"{"
    proc.stdout.close()  # what head does after its line
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141, err[-2000:]
    assert "Traceback" not in err and "BrokenPipeError" not in err, err[-2000:]


def test_a_failed_runs_incident_is_one_line_without_the_ranks_stacks() -> None:
    """The demo and `tandem train status` say why a run failed in one line; the ranks'
    stacks a hang captured stay in the record (demo.json, the report)."""
    from tandem.cli.train import format_incident

    stack = 'Thread 0x7f (most recent call first):\n  File "loop.py", line 183 in train_step\n'
    hang = {"kind": "hang", "attempt": 6, "step": 443, "resume_from": 400,
            "detector": "no step within 13.31s", "stacks": {"0": {"stack": stack * 40}},
            "logs": ["/tmp/x/agent-0.log"]}
    line = format_incident(hang)
    assert line == "#6 hang resume_from=400 detector=no step within 13.31s"
    assert "\n" not in line and "train_step" not in line
