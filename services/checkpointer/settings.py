"""The checkpointer's settings: ``TANDEM_*`` variables beside the common ones.

Validated at start (a wrong one stops the service, naming it); each field is a row of
the settings table in ``README.md``. ``mirror_config`` is what the mirror takes of them,
``linger_window`` how long a stopping checkpointer goes on taking checkpoints.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from tandem.common.settings import Settings

from .upload import MirrorConfig

MiB = 1 << 20
# What the drain keeps past the linger: a checkpoint taken at its very end is mirrored then.
MIRROR_ROOM_S = 5.0


class CheckpointerSettings(Settings):
    """``TANDEM_*`` settings of the checkpointer (beside the common ones)."""

    multipart_threshold: int = Field(
        16 * MiB, ge=5 * MiB,
        description="Files larger than this (bytes) are uploaded in parts.")
    part_size: int = Field(
        16 * MiB, ge=5 * MiB, le=5 * 1024 * MiB,
        description="Size of each multipart part (bytes); S3 needs >= 5 MiB.")
    upload_concurrency: int = Field(
        8, ge=1, le=64, description="Parts and small files uploaded at once.")
    verify: Literal["readback", "checksum"] = Field(
        "readback",
        description="How a single-request upload is verified: 'readback' downloads and "
        "checks it (needed for stores that do not check checksums, such as moto); "
        "'checksum' trusts the store's check of the checksum sent (AWS S3, MinIO).")
    attempts: int = Field(
        5, ge=1, le=100,
        description="Mirror attempts per delivery; then an error that can heal hands the "
        "event back (redelivered later), another publishes ckpt.<run>.failed.")
    retry_backoff: float = Field(
        1.0, gt=0, le=60, description="Seconds before the 2nd attempt; doubles, max 30.")
    keep_last: int = Field(3, ge=1, description="Newest committed checkpoints kept in S3.")
    keep_every: int = Field(
        0, ge=0, description="Also keep every step that is a multiple of this (0: none).")
    local_keep: int = Field(
        2, ge=0,
        description="Newest local checkpoints of a run kept on disk; older ones are "
        "deleted once committed in S3 (never before).")
    concurrency: int = Field(2, ge=1, le=16, description="Checkpoints mirrored at once.")
    checkpoint_root: str = Field(
        ".tandem/checkpoints", min_length=1,
        description="Folder every checkpoint event's path (and every file in it, symlinks "
        "resolved) must be inside; others go to the DLQ, never read or deleted. The "
        "trainer's TANDEM_CHECKPOINT_ROOT, whose default it shares.")
    max_deliver: int = Field(
        20, ge=2, le=1000,
        description="Deliveries of a checkpoint event before it is dead-lettered (dlq.MIRROR) "
        "and ckpt.<run>.failed says so; each delivery makes up to 'attempts'.")
    ack_wait: float = Field(
        60.0, gt=0, le=3600,
        description="AckWait of the durable consumer: how long a crashed checkpointer "
        "holds a checkpoint before it is redelivered (in-progress acks keep a live one).")
    stale_upload_age: float = Field(
        3600.0, gt=0,
        description="Multipart uploads under runs/ older than this (s) are aborted at start; "
        "retention deletes a never-committed checkpoint only once nothing was written to "
        "it for this long.")
    scope: Literal["fleet", "node"] = Field(
        "fleet",
        description="node: mirror only the checkpoints written on this node (TANDEM_CLUSTER, "
        "TANDEM_NODE), one checkpointer per node with the node's own disk; fleet: every "
        "node's, for one checkpointer that sees every node's folder (one box, a shared "
        "volume). One or the other per deployment: the server refuses both at once.")
    stop_linger_s: float | None = Field(
        None, ge=0, le=590,
        description="After SIGTERM, how long it goes on taking checkpoints while one may "
        "still come: a run not ended places ranks on its node (scope=fleet: on any node; "
        "a node going away stops them too, and they save their step first: the trainer's "
        "TANDEM_STOP_CHECKPOINT_S) or one waits in its queue; with neither it stops at "
        "once. Unset: DRAIN_TIMEOUT less 5 s, the trainer's rule for its ranks' window "
        "(15 s with the default drain); 0: stop taking at SIGTERM. Set, at least 5 s under "
        "DRAIN_TIMEOUT: what it took is mirrored within the drain.")

    @model_validator(mode="after")
    def _linger_within_drain(self) -> CheckpointerSettings:
        if self.stop_linger_s is not None and \
                self.stop_linger_s + MIRROR_ROOM_S > self.drain_timeout:
            raise ValueError(
                f"TANDEM_STOP_LINGER_S ({self.stop_linger_s:g}) must be at least "
                f"{MIRROR_ROOM_S:g}s under TANDEM_DRAIN_TIMEOUT ({self.drain_timeout:g}): "
                "the checkpoints taken meanwhile are mirrored within the drain")
        return self

    def linger_window(self) -> float:
        """``stop_linger_s``, or unset the drain timeout less ``MIRROR_ROOM_S``."""
        if self.stop_linger_s is not None:
            return self.stop_linger_s
        return max(0.0, self.drain_timeout - MIRROR_ROOM_S)

    def mirror_config(self) -> MirrorConfig:
        return MirrorConfig(bucket=self.s3_bucket, multipart_threshold=self.multipart_threshold,
                            part_size=self.part_size, concurrency=self.upload_concurrency,
                            verify=self.verify)
