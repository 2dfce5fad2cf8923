"""``tandem generate "<prompt or label>" -n 4 -o out/``: ask Tandem for images.

Submits one generation with ``tandem.client`` (over HTTP or the NATS job service, by the
URL), follows it (a line per step), then downloads the images from their presigned URLs
into the output folder as ``<task>-<i>.png``.
Whether the argument is a prompt or a class label comes from the model's registry entry.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

DEFAULT_URL = "http://127.0.0.1:8000"  # the local stack's gateway; TANDEM_NATS_URL is not read


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate images through a running gateway",
                       description="Generate images through the gateway's HTTP API "
                       f"(--url, default {DEFAULT_URL}) or the NATS job service "
                       "(--url nats://...).")
    p.add_argument("what", help="the prompt, or the class label for class-conditional models")
    p.add_argument("-n", "--num-images", type=int, default=1)
    p.add_argument("-o", "--out", type=Path, default=Path("out"), help="output folder")
    p.add_argument("-m", "--model", default=None, help="model name (default: the first "
                   "model that takes this kind of input)")
    p.add_argument("--url", default=DEFAULT_URL,
                   help="the gateway's HTTP API (http://...) or NATS (nats://...: the job "
                   "service); the same either way")
    p.add_argument("--api-key", default=os.environ.get("TANDEM_API_KEY"),
                   help="API key where the gateway has keys (default $TANDEM_API_KEY)")
    p.add_argument("--negative", default=None, help="negative prompt (text models)")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--guidance", type=float, default=None)
    p.add_argument("--size", type=int, default=None, help="width and height")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--lane", choices=("interactive", "batch"), default="interactive")
    p.add_argument("--cluster", default=None, help="pin to one cluster")
    p.add_argument("--idempotency-key", default=None)
    p.set_defaults(func=_generate)


def _pick_model(models: list[dict[str, Any]], name: str | None, what: str) -> dict[str, Any]:
    if name is not None:
        for m in models:
            if m["name"] == name:
                return m
        raise SystemExit(f"tandem generate: no model {name!r}; "
                         f"known: {', '.join(m['name'] for m in models)}")
    want = "class_label" if what.isdigit() else "text"
    for m in models:
        if m["conditioning"] == want:
            return m
    raise SystemExit(f"tandem generate: no model takes {want}; pass --model")


def _generate(args: argparse.Namespace) -> int:
    from tandem.client import JobError, SyncClient

    tandem = None
    try:
        tandem = SyncClient(args.url, api_key=args.api_key)
        models = tandem.models()
    except Exception as exc:  # httpx's or nats-py's, no gateway: Tandem is not there
        from tandem.cli.reach import refusal_message, start_hint

        if tandem is not None:
            tandem.close()
        refused = refusal_message(exc)
        print(f"tandem generate: {refused}" if refused is not None else
              f"tandem generate: cannot reach Tandem at {args.url}: "
              f"{str(exc) or type(exc).__name__}. "
              f"{start_hint(f'--url (default {DEFAULT_URL})')}", file=sys.stderr)
        return 2
    with tandem:
        model = _pick_model(models, args.model, args.what)
        body: dict[str, Any] = {"model": model["name"], "num_images": args.num_images,
                                "lane": args.lane}
        if model["conditioning"] == "class_label":
            if not args.what.isdigit():
                print(f"tandem generate: {model['name']} takes a class label "
                      f"{model['class_labels']}, not {args.what!r}", file=sys.stderr)
                return 2
            body["class_label"] = int(args.what)
        elif model["conditioning"] == "text":
            body["prompt"] = args.what
            if args.negative:
                body["negative_prompt"] = args.negative
        for key, value in (("steps", args.steps), ("guidance", args.guidance),
                           ("width", args.size), ("height", args.size), ("seed", args.seed),
                           ("cluster", args.cluster)):
            if value is not None:
                body[key] = value
        try:
            accepted = tandem.generate(idempotency_key=args.idempotency_key, **body)
        except JobError as exc:
            from tandem.cli.reach import refusal_message

            print(f"tandem generate: {refusal_message(exc) or exc}", file=sys.stderr)
            return 1
        print(f"task {accepted['id']} on {accepted['cluster']} (seed {accepted['seed']})")
        final: dict[str, Any] = {}
        for event in tandem.events(accepted["id"]):
            if event["event"] == "progress":
                print(f"  step {event['step']}/{event['total']}", end="\r", flush=True)
            elif event["event"] == "state":
                where = event.get("worker") or event.get("cluster")
                print(f"  {event['state']}" + (f" on {where}" if where else ""))
            elif event["event"] == "final":
                final = event["record"]
        print()
        if final.get("state") != "succeeded":
            print(f"tandem generate: {final.get('state')}: {final.get('reason')}",
                  file=sys.stderr)
            return 1
        args.out.mkdir(parents=True, exist_ok=True)
        for ref, png in zip(final["images"], tandem.images(final), strict=True):
            path = args.out / f"{accepted['id']}-{ref['index']}.png"
            path.write_bytes(png)
            print(path)
    return 0
