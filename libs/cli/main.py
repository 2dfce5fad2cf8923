"""``tandem``: the one command-line entry.

Each command group lives in its own module with a ``register(subparsers)`` function
that adds its parser and sets ``func`` (sync, returning an exit code) on it. Modules are
imported when the CLI starts, but heavy imports (torch, diffusers) happen inside the
command functions, so ``tandem --help`` stays fast and lean installs keep working.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys

from tandem.common.errors import TandemError

# Command modules, in the order `tandem --help` lists them.
COMMAND_MODULES = [
    "tandem.cli.run",
    "tandem.cli.dev",
    "tandem.cli.demo",
    "tandem.cli.report",
    "tandem.cli.fleet",
    "tandem.cli.generate",
    "tandem.cli.train",
    "tandem.cli.checkpoints",
    "tandem.cli.bench",
    "tandem.cli.security",
    "tandem.cli.schema",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandem",
        description="Train and serve diffusion models across GPU clusters on NATS JetStream.",
    )
    sub = parser.add_subparsers(dest="command", metavar="<command>", required=True)
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except Exception as exc:
            # A broken command module must not take every other command down with it.
            short = name.rsplit(".", 1)[-1]
            bad = sub.add_parser(short, help=f"(unavailable: {exc})")
            bad.set_defaults(func=_unavailable(short, exc))
            continue
        module.register(sub)
    _describe(parser)
    return parser


def _describe(parser: argparse.ArgumentParser) -> None:
    """Every (sub)command's ``--help`` says what it does: its one-line help is its
    description where a module gave none."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            for name, sub in action.choices.items():
                if not sub.description and helps.get(name):
                    sub.description = str(helps[name])[:1].upper() + str(helps[name])[1:]
                _describe(sub)


def _unavailable(name: str, exc: Exception):  # type: ignore[no-untyped-def]
    def run(args: argparse.Namespace) -> int:
        print(f"tandem {name}: unavailable in this install: {exc!r}", file=sys.stderr)
        return 2

    return run


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        code = args.func(args)
    except TandemError as exc:
        print(f"tandem: {exc}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        code = 130
    except BrokenPipeError:
        # The reader went away (`tandem schema | head`): what it wanted it has. Point
        # stdout at /dev/null so the interpreter's final flush cannot raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 128 + signal.SIGPIPE
    except Exception as exc:
        from tandem.cli.reach import unreachable_message

        message = unreachable_message(exc)
        if message is None:
            raise
        print(f"tandem: {message}", file=sys.stderr)
        code = 1
    sys.exit(code or 0)


if __name__ == "__main__":
    main()
