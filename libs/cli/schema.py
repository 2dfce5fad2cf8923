"""``tandem schema``: the JSON Schemas of the wire contract, and the doc that includes them.

``tandem schema`` prints one JSON object, name -> schema, for every entry of
``wire_types.WIRE_TYPES``; ``tandem schema <name>`` prints one; ``--list`` lists the names
and where each travels. ``--write-docs`` regenerates the generated blocks of
``docs/bus-api.md`` (``bus_api``); ``--check`` exits 1 when the file is stale.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "schema", help="JSON Schema of every wire event and job body; docs/bus-api.md",
        description="Print the JSON Schema (2020-12) of every wire event and job body, "
        "generated from the msgspec Structs and pydantic models, or regenerate the "
        "generated blocks of docs/bus-api.md.")
    p.add_argument("name", nargs="?", help="print only this type's schema (see --list)")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--list", action="store_true", help="list the names and where each travels")
    what.add_argument("--write-docs", action="store_true",
                      help="rewrite the generated blocks of the bus API doc")
    what.add_argument("--check", action="store_true",
                      help="exit 1 if the bus API doc differs from what --write-docs writes")
    p.add_argument("--doc", type=Path, default=None,
                   help="the bus API doc (default: docs/bus-api.md)")
    p.set_defaults(func=_schema)


def _schema(args: argparse.Namespace) -> int:
    from tandem.cli import bus_api, wire_types

    if args.write_docs or args.check:
        if args.name:
            print("tandem schema: a name does not go with --write-docs or --check",
                  file=sys.stderr)
            return 2
        return _docs(args.doc or Path(bus_api.DOC), write=args.write_docs)
    if args.list:
        width = max(len(n) for n in wire_types.names())
        for w in wire_types.WIRE_TYPES:
            print(f"{w.name:<{width}}  {w.travels}")
        return 0
    if args.name:
        try:
            entry = wire_types.get(args.name)
        except wire_types.UnknownType as exc:
            print(f"tandem schema: {exc}", file=sys.stderr)
            return 2
        print(json.dumps(wire_types.schema(entry), indent=2))
        return 0
    print(json.dumps(wire_types.all_schemas(), indent=2))
    return 0


def _docs(path: Path, write: bool) -> int:
    from tandem.cli import bus_api

    try:
        text = path.read_text()
        fresh = bus_api.rewrite(text)
    except (OSError, bus_api.DocError) as exc:
        print(f"tandem schema: {path}: {exc}", file=sys.stderr)
        return 2
    if write:
        if fresh != text:
            path.write_text(fresh)
        print(f"{path}: {'rewritten' if fresh != text else 'up to date'}")
        return 0
    if fresh != text:
        print(f"{path} is stale: run `{bus_api.REGENERATE}`", file=sys.stderr)
        return 1
    print(f"{path}: up to date")
    return 0
