"""The local stack's process list as data (``stack.toml``): ports, the bucket, the
clusters and the process kinds, validated whole (every problem named at once)."""

from __future__ import annotations

import string
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from tandem.common import subjects
from tandem.common.errors import SettingsError

DEFAULT_CONFIG = Path(__file__).with_name("stack.toml")
# What a process's env and url may name besides <port>_port (``Stack.specs`` fills them).
PLACEHOLDERS = ("clusters", "nats_url", "s3_endpoint", "bucket", "root", "cluster", "node",
                "index")
_TYPES = {"env": "table of settings"}


def _is(value: object, kind: type) -> bool:
    """``value`` is a ``kind`` as TOML gives it (true is not the number 1)."""
    return isinstance(value, kind) and not isinstance(value, bool)


@dataclass(frozen=True)
class ClusterConfig:
    name: str
    nodes: int = 1


@dataclass(frozen=True)
class ProcessKind:
    """One kind of process: a service, how many (global or per node) and its settings."""

    service: str
    name: str
    scope: Literal["global", "node"] = "node"
    env: dict[str, str] = field(default_factory=dict)
    cluster: str = "control"  # TANDEM_CLUSTER of a global process
    url: str | None = None  # where a user reaches it (printed when the stack is up)


@dataclass(frozen=True)
class StackConfig:
    """The process list as data: ports, bucket, clusters and process kinds."""

    ports: dict[str, int]
    bucket: str
    clusters: tuple[ClusterConfig, ...]
    processes: tuple[ProcessKind, ...]

    @classmethod
    def load(cls, path: Path | None = None) -> StackConfig:
        """Read a stack file (default: the bundled ``stack.toml``); raise ``SettingsError``."""
        path = path or DEFAULT_CONFIG
        where = f"stack config {path}"
        try:
            raw = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise SettingsError(where, {"file": str(exc)}) from None
        problems: dict[str, str] = {}
        try:
            clusters = tuple(ClusterConfig(**c) for c in raw.get("clusters", []))
            kinds = tuple(ProcessKind(**p) for p in raw.get("processes", []))
        except TypeError as exc:  # an unknown or missing key in an entry
            raise SettingsError(where, {"clusters/processes": str(exc)}) from None
        config = cls(ports=dict(raw.get("ports", {})),  # types checked in problems()
                     bucket=str(raw.get("s3", {}).get("bucket", "tandem")),
                     clusters=clusters, processes=kinds)
        problems.update(config.problems())
        if problems:
            raise SettingsError(where, problems)
        return config

    def problems(self) -> dict[str, str]:
        """Everything wrong with this config, by key; empty when valid."""
        from tandem.cli.run import SERVICES

        out: dict[str, str] = {}
        for name in ("nats", "nats_monitor", "s3"):
            if name not in self.ports:
                out[f"ports.{name}"] = "missing"
        for name, port in self.ports.items():
            if not _is(port, int) or not 0 <= port <= 65535:
                out[f"ports.{name}"] = f"{port!r} is not a port (0 picks a free one)"
        if not self.clusters:
            out["clusters"] = "at least one cluster is needed"
        seen: set[str] = set()
        for c in self.clusters:
            if not _is(c.name, str):
                out[f"clusters.{c.name}"] = f"name {c.name!r} is not a string"
                continue
            try:
                subjects.token(c.name, "cluster")
            except ValueError as exc:
                out[f"clusters.{c.name}"] = str(exc)
            if c.name in seen:
                out[f"clusters.{c.name}"] = "listed twice"
            seen.add(c.name)
            if not _is(c.nodes, int) or c.nodes < 1:
                out[f"clusters.{c.name}.nodes"] = f"{c.nodes!r}: a whole number, at least 1"
        # What a process's env and url may name: the ports' and the values Stack.specs
        # fills in (a placeholder it could not fill would stop the stack half-started).
        known = {f"{k}_port" for k in self.ports} | set(PLACEHOLDERS)
        for k in self.processes:
            wrong = {key: v for key, v in (("service", k.service), ("name", k.name),
                                           ("scope", k.scope), ("cluster", k.cluster))
                     if not _is(v, str)}
            if k.url is not None and not _is(k.url, str):
                wrong["url"] = k.url
            if not isinstance(k.env, dict):
                wrong["env"] = k.env
            for key, v in wrong.items():
                out[f"processes.{k.name}.{key}"] = f"{v!r} is not a {_TYPES.get(key, 'string')}"
            if wrong:
                continue
            texts = {f"env.{e}": str(v) for e, v in k.env.items()}
            if k.url is not None:
                texts["url"] = k.url
            for key, text in texts.items():
                try:
                    names = {f for _, f, _, _ in string.Formatter().parse(text) if f}
                except ValueError as exc:
                    out[f"processes.{k.name}.{key}"] = f"{text!r}: {exc}"
                    continue
                if unknown := sorted(names - known):
                    out[f"processes.{k.name}.{key}"] = (
                        f"{text!r}: unknown placeholder {', '.join(map(repr, unknown))}; known: "
                        f"{', '.join(sorted(known))} (<name>_port needs ports.<name>)")
            if k.service not in SERVICES:
                out[f"processes.{k.name}.service"] = (
                    f"{k.service!r} is not one of {', '.join(sorted(SERVICES))}")
            if k.scope not in ("global", "node"):
                out[f"processes.{k.name}.scope"] = f"{k.scope!r}: use 'global' or 'node'"
            for key in ("name", "cluster"):
                try:
                    subjects.token(getattr(k, key), key)
                except ValueError as exc:
                    out[f"processes.{k.name}.{key}"] = str(exc)
        return out

    def with_clusters(self, names: list[str]) -> StackConfig:
        nodes = {c.name: c.nodes for c in self.clusters}
        return replace(self, clusters=tuple(ClusterConfig(n, nodes.get(n, 1)) for n in names))

    def with_ports(self, **ports: int | None) -> StackConfig:
        merged = dict(self.ports)
        merged.update({k: v for k, v in ports.items() if v is not None})
        return replace(self, ports=merged)

    def free_ports(self) -> StackConfig:
        """Every port 0 (picked free at start): for the demo and tests beside a dev stack."""
        return replace(self, ports=dict.fromkeys(self.ports, 0))
