"""``tandem generate "<prompt or label>" -n 4 -o out/``: ask a gateway for images.

Posts one generation, follows its Server-Sent Events (a line per step), then downloads
the images from their presigned URLs into the output folder as ``<task>-<i>.png``.
Whether the argument is a prompt or a class label comes from the model's registry entry.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate images through a running gateway",
                       description="Generate images through the gateway's HTTP API.")
    p.add_argument("what", help="the prompt, or the class label for class-conditional models")
    p.add_argument("-n", "--num-images", type=int, default=1)
    p.add_argument("-o", "--out", type=Path, default=Path("out"), help="output folder")
    p.add_argument("-m", "--model", default=None, help="model name (default: the first "
                   "model that takes this kind of input)")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="gateway base URL")
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
    import httpx

    with httpx.Client(base_url=args.url, timeout=60) as http:
        try:
            models = http.get("/v1/models").json()["models"]
        except httpx.HTTPError as exc:
            from tandem.cli.reach import START

            print(f"tandem generate: cannot reach the gateway at {args.url}: {exc}. {START}",
                  file=sys.stderr)
            return 2
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
        headers = {"Idempotency-Key": args.idempotency_key} if args.idempotency_key else {}
        r = http.post("/v1/generations", json=body, headers=headers)
        if r.status_code != 202:
            print(f"tandem generate: {r.status_code}: {r.text}", file=sys.stderr)
            return 1
        accepted = r.json()
        print(f"task {accepted['id']} on {accepted['cluster']} (seed {accepted['seed']})")
        final: dict[str, Any] = {}
        with http.stream("GET", accepted["events_url"], timeout=None) as events:
            kind = ""
            for line in events.iter_lines():
                if line.startswith("event: "):
                    kind = line[7:]
                elif line.startswith("data: "):
                    data = json.loads(line[6:])
                    if kind == "progress":
                        print(f"  step {data['step']}/{data['total']}", end="\r", flush=True)
                    elif kind == "state":
                        print(f"  {data['state']} on {data['worker'] or data['cluster']}")
                    elif kind == "final":
                        final = data
        print()
        if final.get("state") != "succeeded":
            print(f"tandem generate: {final.get('state')}: {final.get('reason')}",
                  file=sys.stderr)
            return 1
        args.out.mkdir(parents=True, exist_ok=True)
        for ref in final["images"]:
            path = args.out / f"{accepted['id']}-{ref['index']}.png"
            path.write_bytes(httpx.get(ref["url"], timeout=60).content)
            print(path)
    return 0
