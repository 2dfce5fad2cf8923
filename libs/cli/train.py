"""``tandem train submit|watch|status``: training runs from the command line.

``submit`` validates a run config (JSON or TOML, the schema of ``tandem.common.runs``)
and hands it to a trainer coordinator; ``watch`` follows a run's events live with a
progress bar until it ends; ``status`` summarises its state, restarts, incidents,
stragglers and goodput from KV ``runs``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
import tomllib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, TextIO

from tandem.cli.args import positive_float
from tandem.common import runs
from tandem.common.events import RunRecord, RunState, TrainEvent

TERMINAL = (RunState.succeeded, RunState.failed, RunState.cancelled)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="submit, watch and inspect training runs",
                       description="Training runs: a validated config goes to a trainer "
                       "coordinator, which launches torchrun ranks, checkpoints, and restarts "
                       "the run by itself on failures.")
    tsub = p.add_subparsers(dest="train_command", metavar="<action>", required=True)
    s = tsub.add_parser("submit", help="submit a run config (JSON or TOML file, - for stdin)")
    s.add_argument("config", help="path to the run config; '-' reads JSON from stdin")
    s.add_argument("--run-id", help="run id (overrides the config's)")
    s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override one field, e.g. --set steps=200 --set model.kind=dit")
    s.add_argument("--watch", action="store_true", help="then watch it until it ends")
    s.add_argument("--url", default=None, help="where to submit: nats://... (the job "
                   "service; default TANDEM_NATS_URL) or the gateway's http://...")
    s.add_argument("--api-key", default=os.environ.get("TANDEM_API_KEY"),
                   help="API key where the gateway has keys (default $TANDEM_API_KEY)")
    s.add_argument("--timeout", type=positive_float, default=None, metavar="SECONDS",
                   help="how long to wait for the answer (default 10 over NATS, 30 over "
                   "HTTP)")
    s.set_defaults(func=lambda a: asyncio.run(_submit(a)))
    w = tsub.add_parser("watch", help="follow a run live (progress bar, restarts)")
    w.add_argument("run")
    w.set_defaults(func=lambda a: asyncio.run(_watch_cmd(a)))
    st = tsub.add_parser("status", help="a run's state, incidents, stragglers and goodput")
    st.add_argument("run")
    st.add_argument("--json", action="store_true", help="print the run record as JSON")
    st.set_defaults(func=lambda a: asyncio.run(_status_cmd(a)))


# ------------------------------------------------------------------------------- config


def _parse_value(raw: str) -> Any:
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def load_config(source: str, overrides: list[str] = (), run_id: str | None = None,  # type: ignore[assignment]
                stdin: TextIO | None = None) -> dict[str, Any]:
    """Read a run config file (.toml, else JSON; '-' is stdin) and apply KEY=VALUE overrides."""
    where = "stdin" if source == "-" else source
    try:
        if source == "-":
            data = json.loads((stdin or sys.stdin).read() or "{}")
        else:
            path = Path(source)
            text = path.read_text()
            data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except OSError as exc:
        raise SystemExit(f"tandem train: cannot read {where}: {exc.strerror}") from None
    except (ValueError, UnicodeDecodeError) as exc:  # JSON's, TOML's
        raise SystemExit(f"tandem train: {where} is not a valid run config: {exc}") from None
    if not isinstance(data, dict):
        raise SystemExit(f"tandem train: {where} holds a {type(data).__name__}, not a run "
                         "config (an object of settings)")
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep:
            raise SystemExit(f"tandem train: --set {item!r} is not KEY=VALUE")
        node = data
        *parents, leaf = key.split(".")
        for i, part in enumerate(parents):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise SystemExit(f"tandem train: --set {item!r}: "
                                 f"{'.'.join(parents[:i + 1])} is {node!r}, not a table")
        node[leaf] = _parse_value(raw)
    if run_id:
        data["run_id"] = run_id
    return data


async def _connect(denied: list[Any] | None = None) -> Any:
    """The CLI's bus connection; each permission the server refuses it goes to ``denied``
    (the bus's own log line of it stays out of the output)."""
    from tandem.cli.reach import START, refusal_message
    from tandem.common import log
    from tandem.common.bus import Bus
    from tandem.common.bus.connect import violation
    from tandem.common.settings import Settings, load

    # The bus's own connection logs (nats.disconnected at the end) stay out of the output.
    log.configure("auto", "error", stream=sys.stderr)
    settings = load(Settings, "tandem")

    async def on_error(exc: Exception) -> None:
        refused = violation(exc)
        if refused is not None and denied is not None:
            denied.append(refused)

    try:
        return await Bus.connect(settings, "cli", allow_reconnect=False, connect_timeout=3,
                                 max_reconnect_attempts=1, error_cb=on_error)
    except Exception as exc:
        refused = refusal_message(exc)
        if refused is not None:
            raise SystemExit(f"tandem train: {refused}") from None
        why = str(exc).strip() or ("no answer in 3s" if isinstance(exc, TimeoutError)
                                   else type(exc).__name__)
        raise SystemExit(f"tandem train: cannot reach NATS at {settings.nats_url} "
                         f"({why}). {START}") from None


@contextlib.asynccontextmanager
async def _run_reader(command: str) -> AsyncIterator[Any]:
    """A bus that reads KV ``runs``; a read the server refuses (the ``client`` user has
    no KV right) ends the command saying so, not as an unreachable stack."""
    from tandem.cli.reach import permission_message

    denied: list[Any] = []
    bus = await _connect(denied)
    try:
        yield bus
    except Exception:
        if not denied:
            raise
        raise SystemExit(f"tandem train {command}: " + permission_message(
            _nats_user(), denied[0].subject, "run it with the admin login `tandem dev up --auth` "
            "prints; a program with the client login reads a run through the job service "
            "(tandem.client's run(), GET /v1/training-runs/<id>)")) from None
    finally:
        await bus.drain()


async def _submit(args: argparse.Namespace) -> int:
    """Through ``tandem.client`` (the NATS job service, or HTTP by ``--url``): validated,
    recorded and owned exactly as any other client's run."""
    from tandem.client import JobError, connect
    from tandem.common.settings import Settings, load

    config = load_config(args.config, args.set, args.run_id)
    url = args.url or load(Settings, "tandem").nats_url
    options = {} if args.timeout is None else {"timeout": args.timeout}
    async with await connect(url, api_key=args.api_key, **options) as tandem:
        try:
            rec = await tandem.train(**config)
        except JobError as exc:
            from tandem.cli.reach import refusal_message

            print(f"tandem train: {refusal_message(exc) or exc}", file=sys.stderr)
            return 2
    print(f"submitted {rec['run_id']} ({rec['state']}); follow it through the job service "
          f"(tandem.client's run({rec['run_id']!r})), or with `tandem train watch "
          f"{rec['run_id']}` as a login that reads KV runs (the client login does not)"
          if args.url is None and _nats_user() == CLIENT_USER else
          f"submitted {rec['run_id']} ({rec['state']}); watch with: "
          f"tandem train watch {rec['run_id']}")
    if args.watch:
        async with _run_reader("watch") as bus:
            return await watch(bus, rec["run_id"], sys.stdout)
    return 0


CLIENT_USER = "client"  # docs/security.md: programs outside Tandem; it reads no KV


def _nats_user() -> str:
    from tandem.common.settings import Settings, load

    return load(Settings, "tandem").nats_user or ""


# -------------------------------------------------------------------------------- watch


async def follow(bus: Any, run_id: str) -> AsyncIterator[TrainEvent]:
    """Every event of the run from its first, then live (an ordered JetStream consumer)."""
    from nats.js.api import DeliverPolicy

    from tandem.common import subjects
    from tandem.common.events import decode

    sub = await bus.js.subscribe(f"train.{subjects.token(run_id, 'run id')}.*",
                                 ordered_consumer=True, deliver_policy=DeliverPolicy.ALL)
    try:
        while True:
            msg = await sub.next_msg(timeout=3600)
            yield decode(msg.data, TrainEvent)
    finally:
        await sub.unsubscribe()


def progress_bar(step: int, total: int, width: int = 30) -> str:
    frac = min(max(step / total, 0.0), 1.0) if total else 0.0
    full = int(frac * width)
    return "[" + "#" * full + "." * (width - full) + f"] {step}/{total} {frac:6.1%}"


def _render_step(ev: Any, total: int) -> str:
    slowest = max(ev.rank_step_times) if ev.rank_step_times else 0.0
    return (f"{progress_bar(ev.step, total)} loss {ev.loss:.4f} gnorm {ev.grad_norm:.3f} "
            f"lr {ev.lr:.2e} {ev.samples_per_s:7.1f} samples/s step {ev.step_time * 1000:.0f} ms"
            f" (ranks {', '.join(f'{t * 1000:.0f}' for t in ev.rank_step_times)} ms; "
            f"slowest {slowest * 1000:.0f})")


async def watch(bus: Any, run_id: str, out: TextIO) -> int:
    """Print the run's events until it ends; exit code 0 if it succeeded."""
    from tandem.common.events import CheckpointWritten, TrainStatus, TrainStep
    from tandem.common.runs import get_run

    rec = await get_run(bus, run_id)
    total = int(runs.filled(rec.config).get("steps", 0))
    tty = out.isatty()
    last_line = False
    async for ev in follow(bus, run_id):
        if isinstance(ev, TrainStep):
            line = _render_step(ev, total)
            if tty:
                out.write("\r" + line)
                last_line = True
            else:
                out.write(line + "\n")
        else:
            if last_line:
                out.write("\n")
                last_line = False
            if isinstance(ev, CheckpointWritten):
                size = sum(f.size for f in ev.manifest.files)
                out.write(f"checkpoint step {ev.step}: {len(ev.manifest.files)} files, "
                          f"{size / 1e6:.1f} MB, training blocked {ev.blocked_s * 1000:.1f} ms, "
                          f"written in {ev.write_s:.2f} s\n")
            elif isinstance(ev, TrainStatus):
                out.write(f"{time.strftime('%H:%M:%S', time.localtime(ev.at))} "
                          f"{ev.state.value}: {ev.reason} (restarts {ev.restarts})\n")
                if ev.state in TERMINAL:
                    out.flush()
                    final = await get_run(bus, run_id)
                    out.write(render_status(final) + "\n")
                    return 0 if ev.state == RunState.succeeded else 1
        out.flush()
    return 1


async def _watch_cmd(args: argparse.Namespace) -> int:
    async with _run_reader("watch") as bus:
        return await watch(bus, args.run, sys.stdout)


# ------------------------------------------------------------------------------- status


def format_incident(inc: dict[str, Any]) -> str:
    bits = [f"#{inc.get('attempt', '?')} {inc.get('kind')}"]
    for k in ("rank", "node", "exit_code", "anomaly", "data_pos", "skip_window",
              "stopped_ranks", "resume_from", "lineage", "forked_at", "detector"):
        if inc.get(k) not in (None, "", []):
            bits.append(f"{k}={inc[k]}")
    return " ".join(str(b) for b in bits)


def render_status(rec: RunRecord) -> str:
    config = runs.filled(rec.config)  # defaults are not stored
    total = int(config.get("steps", 0))
    g = rec.goodput
    lines = [
        f"run {rec.run_id}: {rec.state.value}  {progress_bar(rec.latest_step, total)}",
        f"  coordinator {rec.coordinator or '-'}  nodes {', '.join(rec.nodes) or '-'}  "
        f"restarts {rec.restarts}/{config.get('watchdog', {}).get('max_restarts', '?')}",
    ]
    if rec.forks:
        lines.append(f"  lineage {len(rec.forks)}: rolled back {len(rec.forks)} time(s), "
                     f"forked at step(s) {', '.join(map(str, rec.forks))} (--forks "
                     f"{','.join(map(str, rec.forks))})")
    if rec.latest_checkpoint_step is not None:
        lines.append(f"  latest committed checkpoint: step {rec.latest_checkpoint_step} "
                     f"{rec.latest_checkpoint_uri}")
    if g:
        lines.append(f"  goodput {g.get('goodput', 0.0):.1%}: productive "
                     f"{g.get('productive_s', 0.0):.1f}s of {g.get('elapsed_s', 0.0):.1f}s elapsed")
        lines.append("  badput: " + ", ".join(
            f"{k[len('badput_'):-2]} {v:.1f}s" for k, v in g.items() if k.startswith("badput_")))
    for inc in rec.incidents:
        lines.append("  incident " + format_incident(inc))
    for s in rec.stragglers:
        lines.append(f"  straggler rank {s.get('rank')} on {s.get('node')}: "
                     f"{s.get('score')}x the median step time (from step {s.get('step')})")
    for c in rec.corrupt_checkpoints:
        lines.append(f"  corrupt checkpoint step {c.get('step')}: {c.get('reason')}")
    for c in rec.checkpoint_failures:
        lines.append(f"  checkpoint step {c.get('step')} not written on {c.get('node')} "
                     f"(rank {c.get('rank')}, attempt {c.get('attempt')}): {c.get('error')}")
    if rec.skipped:
        lines.append(f"  skipped data windows: {rec.skipped}")
    return "\n".join(lines)


async def _status_cmd(args: argparse.Namespace) -> int:
    import msgspec

    from tandem.common.runs import get_run

    async with _run_reader("status") as bus:
        rec = await get_run(bus, args.run)
    if args.json:
        print(json.dumps(msgspec.to_builtins(rec)))
    else:
        print(render_status(rec))
    return 0

