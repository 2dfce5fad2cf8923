"""What the coordinator hands every rank of one attempt (``launch.json``; no torch)."""

from __future__ import annotations

from typing import Any

import msgspec


class LaunchSpec(msgspec.Struct, kw_only=True):
    run_id: str
    attempt: int
    config: dict[str, Any]  # a validated RunConfig, as JSON
    checkpoint_root: str
    attempt_dir: str  # stack dumps and logs of this attempt
    events: str = ""  # host:port of the coordinator's relay; empty sends nothing
    rank_nodes: list[str] = []  # node of each global rank
    resume_path: str = ""  # checkpoint directory to resume from; empty starts fresh
    skipped: list[list[int]] = []  # data windows to skip
    # The run's record's forks (``checkpoints.Lineage``): each checkpoint is written in
    # the lineage that owns its step, so a rollback never reuses a checkpoint's name.
    forks: list[int] = []
    threads: int = 0  # torch intra-op threads per rank; 0: the node's cores / its ranks
    node: str = ""
    cluster: str = ""
