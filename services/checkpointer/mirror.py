"""One attempt at mirroring a local checkpoint to S3 and committing it (blocking, boto3).

``Mirror.mirror(directory, manifest)`` guarantees, when it returns, that every file is
stored whole and verified against the manifest's checksum (``upload.Uploader.send``, which
returns only then) and that ``manifest.json`` is stored (the commit). When it raises,
nothing is committed: the manifest is put last, with ``If-None-Match: *``, and only after
``send`` returned; a file gone by then (retention swept it meanwhile) takes the commit
back.

Idempotence: a committed checkpoint is recognised (same files) and nothing is written;
leftover multipart uploads of the step are aborted before an attempt; a file already
stored whole and verified is not sent again.

``Mirror.mirror_part(directory, part, attempt)`` does the same for one node's part of a
sharded checkpoint, then records the part (``parts/a<attempt>/<node>.json`` under the
checkpoint's own prefix, which names its step and lineage; verified like a file) and
lists the parts recorded for that attempt: when together they make the checkpoint whole
(``checkpoints.merge_parts``) and every file they list is stored with its size, it
commits their merge, ``If-None-Match: *`` as above. Each node's checkpointer records its
part before it lists, so whichever records last sees every part and commits; two that
finish together both find it whole, and the conditional put lets exactly one write it.
A part never aborts another node's uploads: only the multipart uploads of its own files.

The files' transfer and its checks are ``upload``'s; this module is the commit: the
manifests, the part records, and the order that keeps the invariant (nothing is committed
before every byte it lists is stored and verified). The errors (``errors``) and
``MirrorConfig`` are re-exported here, where the service, the benches and the tests take
them from.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from botocore.exceptions import ClientError

from tandem.common import checkpoints as ck
from tandem.common.events import CheckpointManifest

from .errors import (
    CommitConflict,
    LocalCheckpointError,
    MirrorError,
    VerifyError,
    s3_code,
    s3_missing,
)
from .upload import MirrorConfig, Uploader, Verify, b64

__all__ = ["CommitConflict", "LocalCheckpointError", "Mirror", "MirrorConfig", "MirrorError",
           "MirrorResult", "Verify", "VerifyError"]


@dataclass
class MirrorResult:
    committed: bool  # True: this attempt stored the manifest; False: it was already there
    # (or, for a node's part, that the checkpoint still ``lacks`` other nodes' parts)
    lacks: list[str] = field(default_factory=list)
    # The checkpoint's commit manifest (for a part: the merge of every node's), once it
    # is committed, by this call or before it; None while it lacks parts.
    manifest: CheckpointManifest | None = None
    uploaded: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # already stored whole and verified
    bytes_uploaded: int = 0
    aborted_uploads: int = 0
    seconds: float = 0.0


class Mirror(Uploader):
    """Mirrors and commits checkpoints with one boto3 client and one pool of upload
    threads (``Uploader``'s)."""

    # ------------------------------------------------------------------------- the attempt

    def mirror(self, directory: Path, manifest: CheckpointManifest) -> MirrorResult:
        """Mirror a whole checkpoint and commit it (see the module docstring)."""
        ck.check_commit(manifest)  # a node's part of a sharded checkpoint: ``mirror_part``
        started = time.perf_counter()
        run, step, lineage = manifest.run_id, manifest.step, manifest.lineage
        if done := self._already_committed(manifest, ck.same_files, started):
            return done
        result = MirrorResult(committed=True, manifest=manifest)
        result.aborted_uploads = self.abort_uploads(ck.step_prefix(run, step, lineage))
        result.uploaded, result.skipped, result.bytes_uploaded = self.send(directory, manifest)
        result.committed = self._commit_stored(manifest)
        result.seconds = time.perf_counter() - started
        return result

    def mirror_part(self, directory: Path, part: CheckpointManifest,
                    attempt: int) -> MirrorResult:
        """Mirror one node's part of a sharded checkpoint written by ``attempt``, record
        it, and commit the checkpoint if every node's part is now recorded (module
        docstring). ``committed`` is True only if this call stored the manifest; ``lacks``
        names what the checkpoint still needs when it is not whole yet. Parts, their
        records and the commit are all under the checkpoint's own prefix (its step *and*
        lineage), so a rollback's step N never merges with an abandoned lineage's."""
        if not part.part:
            raise ValueError("mirror_part takes a node's part (its manifest names the node)")
        started = time.perf_counter()
        run, step, lineage = part.run_id, part.step, part.lineage
        if done := self._already_committed(part, ck.covers, started):
            return done
        result = MirrorResult(committed=False)
        mine = {ck.object_key(run, step, f.name, lineage) for f in part.files}
        result.aborted_uploads = self.abort_uploads(ck.step_prefix(run, step, lineage),
                                                    keys=mine)
        result.uploaded, result.skipped, result.bytes_uploaded = self.send(directory, part)
        self._put_verified(ck.part_key(run, step, attempt, part.part, lineage),
                           ck.encode_manifest(part))
        parts = self._recorded_parts(run, step, attempt, lineage)
        try:
            result.lacks = ck.lacking(parts)
            whole = None if result.lacks else ck.merge_parts(parts)
        except ValueError as exc:
            raise CommitConflict(ck.MANIFEST, f"the parts of attempt {attempt} disagree: "
                                 f"{exc}") from None
        if whole is not None:
            self._check_stored(whole)
            result.committed = self._commit_stored(whole)
            result.manifest = whole
        result.seconds = time.perf_counter() - started
        return result

    # -------------------------------------------------------------------------- the commit

    def _already_committed(
            self, manifest: CheckpointManifest,
            agrees: Callable[[CheckpointManifest, CheckpointManifest], bool],
            started: float) -> MirrorResult | None:
        """None while the checkpoint is not committed; the result of a redelivery when its
        commit ``agrees`` with ``manifest`` (nothing to send); ``CommitConflict`` else."""
        existing = self._stored_manifest(manifest.run_id, manifest.step, manifest.lineage)
        if existing is None:
            return None
        if not agrees(existing, manifest):
            raise CommitConflict(ck.MANIFEST, "step already committed with other files")
        return MirrorResult(committed=False, manifest=existing,
                            seconds=time.perf_counter() - started)

    def _recorded_parts(self, run: str, step: int, attempt: int,
                        lineage: int) -> list[CheckpointManifest]:
        """Every node's part of ``step`` of ``lineage`` recorded for ``attempt`` (this
        one's included); a record of another step or lineage is unreadable here."""
        out = []
        for key in sorted(self.stored_sizes(ck.parts_prefix(run, step, attempt, lineage))):
            data = self.s3.get_object(Bucket=self.cfg.bucket, Key=key)["Body"].read()
            try:
                out.append(ck.parse_manifest(data, run, step, lineage))
            except ValueError as exc:
                raise VerifyError(key.rsplit("/", 1)[-1], f"unreadable part record: {exc}") \
                    from None
        return out

    def _check_stored(self, whole: CheckpointManifest) -> None:
        """Every file ``whole`` lists is stored with its size (each file, or each node's
        part, was verified as it was sent; this catches a file gone since)."""
        run, step, lineage = whole.run_id, whole.step, whole.lineage
        stored = self.stored_sizes(ck.step_prefix(run, step, lineage))
        for entry in whole.files:
            size = stored.get(ck.object_key(run, step, entry.name, lineage))
            if size != entry.size:
                raise VerifyError(entry.name, f"the manifest lists it with {entry.size} "
                                  f"bytes, S3 holds {'none' if size is None else size}")

    def _commit_stored(self, manifest: CheckpointManifest) -> bool:
        """``_commit``, then ``_check_stored``: retention may have swept the step's files
        while they were sent (it took the upload for an abandoned one). A file gone takes
        the commit back (nobody may load it) and fails the attempt, to be retried: the
        next one sends the files again."""
        committed = self._commit(manifest)
        try:
            self._check_stored(manifest)
        except VerifyError:
            self.discard(ck.manifest_key(manifest.run_id, manifest.step, manifest.lineage))
            raise
        return committed

    def _put_verified(self, key: str, body: bytes) -> None:
        """Put a small object (a part record) and verify what was stored."""
        self.s3.put_object(Bucket=self.cfg.bucket, Key=key, Body=body,
                           ChecksumSHA256=b64(hashlib.sha256(body).digest()),
                           ContentType="application/json")
        if self.cfg.verify != "checksum":
            self._stored_is(key, body)

    def _stored_is(self, key: str, body: bytes) -> None:
        """Read ``key`` back: it must be ``body``, else it is deleted (nobody may rely on
        a corrupted copy) and the attempt fails to be retried."""
        stored = self.s3.get_object(Bucket=self.cfg.bucket, Key=key)["Body"].read()
        if stored != body:
            self.s3.delete_object(Bucket=self.cfg.bucket, Key=key)
            raise VerifyError(key.rsplit("/", 1)[-1], "stored object differs from the one sent")

    def _stored_manifest(self, run: str, step: int, lineage: int) -> CheckpointManifest | None:
        try:
            data = self.s3.get_object(Bucket=self.cfg.bucket,
                                      Key=ck.manifest_key(run, step, lineage))["Body"].read()
        except ClientError as exc:
            if s3_missing(exc) or s3_code(exc) == "NoSuchBucket":
                return None
            raise
        return ck.decode_manifest(data, run, step, lineage)

    def _commit(self, manifest: CheckpointManifest) -> bool:
        """Put the manifest if absent. True if this call committed it."""
        ck.check_commit(manifest)  # a node's part of a sharded checkpoint never commits
        run, step, lineage = manifest.run_id, manifest.step, manifest.lineage
        body = ck.encode_manifest(manifest)
        key = ck.manifest_key(run, step, lineage)
        try:
            self.s3.put_object(Bucket=self.cfg.bucket, Key=key, Body=body, IfNoneMatch="*",
                               ChecksumSHA256=b64(hashlib.sha256(body).digest()),
                               ContentType="application/json")
        except ClientError as exc:
            if s3_code(exc) not in ("PreconditionFailed", "ConditionalRequestConflict"):
                raise
            # Someone (a previous delivery of this event) committed first.
            existing = self._stored_manifest(run, step, lineage)
            if existing is None or not ck.same_files(existing, manifest):
                raise CommitConflict(
                    ck.MANIFEST, "step already committed with other files") from None
            return False
        if self.cfg.verify == "checksum":  # the store checked the SHA-256 sent with it
            return True
        # Our own commit arriving corrupted is taken back (it is not a valid commit anyone
        # may rely on) and the next attempt writes it again.
        self._stored_is(key, body)
        return True

