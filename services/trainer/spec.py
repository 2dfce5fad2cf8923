"""What the coordinator hands every rank of one attempt (``launch.json``; no torch)."""

from __future__ import annotations

from typing import Any

import msgspec


class LaunchSpec(msgspec.Struct, kw_only=True):
    run_id: str
    attempt: int
    # A validated RunConfig as ``RunConfig.stored`` writes it (fields at their default
    # left out); a rank reads it with ``parse_stored_run_config``.
    config: dict[str, Any]
    checkpoint_root: str
    attempt_dir: str  # stack dumps and logs of this attempt
    events: str = ""  # host:port of the coordinator's relay; empty sends nothing
    # The node each global rank is placed on. A guess once several nodes meet in the
    # c10d rendezvous (it assigns node ranks): a rank takes its node from TANDEM_NODE.
    rank_nodes: list[str] = []
    resume_path: str = ""  # checkpoint directory to resume from; empty starts fresh
    # With no resume_path: committed steps of the run's history (``forks``) in S3, newest
    # first; every node fetches the newest one that all nodes verify onto its own disk
    # (``fetch.py``), else starts fresh.
    resume_steps: list[int] = []
    skipped: list[list[int]] = []  # data windows to skip
    # The run's record's forks (``checkpoints.Lineage``): each checkpoint is written in
    # the lineage that owns its step, so a rollback never reuses a checkpoint's name.
    forks: list[int] = []
    # The trainer's DATA_ROOT: an image folder's class folders and files must resolve
    # under it (its symlinks followed); empty: any path.
    data_root: str = ""
    threads: int = 0  # torch intra-op threads per rank; 0: the node's cores but one / its ranks
    node: str = ""
    cluster: str = ""
