"""A checkpoint's files to S3, each stored whole and verified (blocking, boto3).

``Uploader.send(directory, manifest)`` guarantees, when it returns, that every file the
manifest lists is stored whole under the checkpoint's prefix and verified against the
manifest's checksum; when it raises, what it stored is never taken for whole later (a
next ``send`` verifies it again, or sends it again). It writes no manifest: the commit is
``mirror.Mirror``'s, made only after ``send`` returned.

Verification, per file:

- multipart (size > ``multipart_threshold``): each part is sent with its CRC32 (S3's
  default, as boto3 sends); the store's composite of what it holds (the CRC32 of the
  parts' CRC32s, computed from the stored parts) must equal the one of the bytes read,
  so a part corrupted in transit shows up here.
- single put: sent with the manifest's checksum. With ``verify="readback"`` it is read
  back and checked (moto stores whatever checksum the client claims); with
  ``verify="checksum"`` the store's own check is trusted (AWS S3 and MinIO reject a body
  whose checksum does not match).

The bytes that are checked are the bytes that are sent (each part is read once), and the
whole file's checksum of those bytes must equal the manifest's: a local file that changed
or rotted since the manifest was written fails with ``LocalCheckpointError``, not retried.
A manifest's CRC32 (``checkpoints.checksum``) is combined from the parts' CRC32s, the ones
S3 needs anyway: every byte is checksummed once, as boto3 does. A SHA-256 one (manifests
written before CRC32) is fed the blocks in order by one hasher thread beside the reads.

Idempotence: a file already stored whole and verified is not uploaded again (``send``);
``abort_uploads`` aborts leftover multipart uploads (a step's before an attempt, those
under ``runs/`` left by a crash, at start).

``_Multipart`` is one file's multipart upload; it works on the uploader's pools, buffers
and checks, so it lives beside them.
"""

from __future__ import annotations

import base64
import contextlib
import threading
import zlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NamedTuple

from botocore.exceptions import ClientError

from tandem.common import checkpoints as ck
from tandem.common.events import CheckpointManifest, FileEntry

from .errors import LocalCheckpointError, VerifyError, s3_code, s3_missing

Verify = Literal["readback", "checksum"]


@dataclass(frozen=True)
class MirrorConfig:
    bucket: str
    multipart_threshold: int = 16 << 20
    part_size: int = 16 << 20
    concurrency: int = 8
    verify: Verify = "readback"


class Sent(NamedTuple):
    """What ``Uploader.send`` did: the files it uploaded, those it found already stored
    whole and verified, and the bytes it uploaded."""

    uploaded: list[str]
    skipped: list[str]
    bytes_uploaded: int


def b64(digest: bytes) -> str:
    return base64.b64encode(digest).decode()


def crc32(data: bytes) -> bytes:
    """S3's CRC32 of ``data``: 4 bytes, big-endian (zlib releases the GIL for big ones)."""
    return zlib.crc32(data).to_bytes(4, "big")


def _as_in_manifest(entry: FileEntry, problem: str) -> None:
    """``LocalCheckpointError`` when the bytes read of ``entry`` have a ``problem``."""
    if problem:
        raise LocalCheckpointError(entry.name, f"local file differs from the manifest: "
                                   f"{problem}")


class _Budget:
    """Bounds the bytes read into memory and not yet sent (``slots`` parts)."""

    def __init__(self, slots: int) -> None:
        self._sem = threading.BoundedSemaphore(slots)

    def acquire(self) -> None:
        self._sem.acquire()

    def release(self) -> None:
        self._sem.release()


class Uploader:
    """Uploads checkpoints' files with one boto3 client and one pool of upload threads."""

    def __init__(self, s3: Any, config: MirrorConfig,
                 on_progress: Callable[[str, int], None] | None = None) -> None:
        self.s3 = s3
        self.cfg = config
        self.on_progress = on_progress
        self._pool = ThreadPoolExecutor(max(1, config.concurrency),
                                        thread_name_prefix="ckpt-upload")
        # Completes each multipart file as soon as its own parts are in, while the next
        # files' parts upload: a pool of its own, so a completion waiting for its parts
        # never holds a thread those parts need.
        self._completer = ThreadPoolExecutor(max(1, config.concurrency),
                                             thread_name_prefix="ckpt-complete")
        # Feeds a SHA-256 manifest's whole-file check its blocks in order (one thread:
        # FIFO), beside the thread that reads them, so reading and hashing overlap.
        self._hasher = ThreadPoolExecutor(1, thread_name_prefix="ckpt-hash")
        # Part buffers (bytearrays of part_size), kept between parts and checkpoints: a
        # part is read into memory already mapped, not into fresh pages to fault in (on a
        # VM, 2-13 us a page). At most the budget's worth (2 x concurrency) is kept.
        self._buffers: list[bytearray] = []
        self._buffers_lock = threading.Lock()

    def _buffer(self) -> bytearray:
        with self._buffers_lock:
            return self._buffers.pop() if self._buffers else bytearray(self.cfg.part_size)

    def _return(self, buf: bytearray) -> None:
        with self._buffers_lock:
            if len(self._buffers) < 2 * self.cfg.concurrency:
                self._buffers.append(buf)

    def close(self) -> None:
        self._buffers.clear()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._completer.shutdown(wait=True, cancel_futures=True)
        self._hasher.shutdown(wait=True, cancel_futures=True)

    # ------------------------------------------------------------------------------ send

    def send(self, directory: Path, manifest: CheckpointManifest) -> Sent:
        """Upload the files of ``manifest`` not already stored whole and verified."""
        run, step, lineage = manifest.run_id, manifest.step, manifest.lineage
        stored = self.stored_sizes(ck.step_prefix(run, step, lineage))
        todo: list[FileEntry] = []
        skipped: list[str] = []
        for entry in manifest.files:
            if stored.get(ck.object_key(run, step, entry.name, lineage)) == entry.size and \
                    self._stored_whole(directory, run, step, entry, lineage):
                skipped.append(entry.name)
            else:
                todo.append(entry)
        uploaded = self._upload(directory, run, step, todo, lineage)
        return Sent([e.name for e in todo], skipped, uploaded)

    # --------------------------------------------------------------------- what is stored

    def _head(self, key: str) -> dict[str, Any] | None:
        try:
            return self.s3.head_object(Bucket=self.cfg.bucket, Key=key, ChecksumMode="ENABLED")
        except ClientError as exc:
            if s3_missing(exc) or s3_code(exc) == "NoSuchBucket":
                return None
            raise

    def stored_sizes(self, prefix: str) -> dict[str, int]:
        """Key -> size of the objects under ``prefix``: one listing, not a HEAD per file."""
        out: dict[str, int] = {}
        try:
            for page in self.s3.get_paginator("list_objects_v2").paginate(
                    Bucket=self.cfg.bucket, Prefix=prefix):
                out.update({o["Key"]: o["Size"] for o in page.get("Contents", [])})
        except ClientError as exc:
            if s3_code(exc) != "NoSuchBucket":
                raise
        return out

    def _stored_whole(self, directory: Path, run: str, step: int, entry: FileEntry,
                      lineage: int = 0) -> bool:
        """Whether ``entry`` is already stored whole and verified (a redelivery)."""
        key = ck.object_key(run, step, entry.name, lineage)
        head = self._head(key)
        if head is None or head.get("ContentLength") != entry.size:
            return False
        if entry.size > self.cfg.multipart_threshold:
            path = self._local(directory, entry)
            digests = self._hash_parts(path, entry)
            stored = self._stored_checksum(head)
            if stored:
                return stored == self._composite(digests)
            return self._read_back(key, entry)
        return self._verified_single(key, entry, head)

    def _verified_single(self, key: str, entry: FileEntry, head: dict[str, Any]) -> bool:
        if self.cfg.verify == "checksum" and \
                (same := ck.checksum.stored_matches(entry, head)) is not None:
            return same
        return self._read_back(key, entry)

    def _read_back(self, key: str, entry: FileEntry) -> bool:
        """Download ``key`` and compare its size and checksum with ``entry``."""
        check = ck.checksum.Check(entry)
        body = self.s3.get_object(Bucket=self.cfg.bucket, Key=key)["Body"]
        for chunk in body.iter_chunks(ck.CHUNK):
            check.update(chunk)
        return check.ok()

    @staticmethod
    def _stored_checksum(head: dict[str, Any]) -> str:
        """The store's CRC32 composite ("" if none: no checksums, or a SHA-256 one)."""
        return str(head.get("ChecksumCRC32") or "").split("-")[0]

    @staticmethod
    def _composite(digests: list[bytes]) -> str:
        return b64(crc32(b"".join(digests)))

    def _local(self, directory: Path, entry: FileEntry) -> Path:
        path = directory / entry.name
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise LocalCheckpointError(entry.name, f"local file {path} is missing") from None
        if size != entry.size:
            raise LocalCheckpointError(
                entry.name, f"local file is {size} bytes, manifest says {entry.size}")
        return path

    def _hash_parts(self, path: Path, entry: FileEntry) -> list[bytes]:
        """The CRC32s of the local file's parts, once its whole is checked."""
        whole = ck.checksum.PartsCheck(entry, None)
        digests = []
        with open(path, "rb") as f:
            while block := f.read(self.cfg.part_size):
                whole.feed(block)
                digests.append(crc32(block))
                whole.part(digests[-1], len(block))
        _as_in_manifest(entry, whole.problem())
        return digests

    # ---------------------------------------------------------------------------- uploads

    def abort_uploads(self, prefix: str, older_than: float | None = None,
                      keys: set[str] | None = None) -> int:
        """Abort multipart uploads under ``prefix`` (initiated before ``older_than``, an
        epoch time, when given; only of ``keys``, when given). Returns how many were
        aborted."""
        n = 0
        kwargs: dict[str, Any] = {"Bucket": self.cfg.bucket, "Prefix": prefix}
        while True:
            try:
                page = self.s3.list_multipart_uploads(**kwargs)
            except ClientError as exc:
                if s3_code(exc) == "NoSuchBucket":
                    return n
                raise
            for up in page.get("Uploads", []):
                if keys is not None and up["Key"] not in keys:
                    continue  # another node's upload of the same step, maybe in flight
                initiated = up.get("Initiated")
                if older_than is not None and initiated is not None \
                        and initiated.timestamp() > older_than:
                    continue
                try:
                    self.s3.abort_multipart_upload(Bucket=self.cfg.bucket, Key=up["Key"],
                                                   UploadId=up["UploadId"])
                    n += 1
                except ClientError as exc:
                    if s3_code(exc) != "NoSuchUpload":
                        raise
            if not page.get("IsTruncated"):
                return n
            kwargs["KeyMarker"] = page.get("NextKeyMarker", "")
            kwargs["UploadIdMarker"] = page.get("NextUploadIdMarker", "")

    def _upload(self, directory: Path, run: str, step: int, todo: list[FileEntry],
                lineage: int = 0) -> int:
        """Upload ``todo``, parts and small files in parallel; verify each. Returns bytes."""
        if not todo:
            return 0
        paths = {e.name: self._local(directory, e) for e in todo}
        budget = _Budget(self.cfg.concurrency * 2)
        small: list[Future[None]] = []
        large: list[_Multipart] = []
        try:
            # Largest first keeps the pool busy while the small files fill the gaps.
            for entry in sorted(todo, key=lambda e: -e.size):
                key = ck.object_key(run, step, entry.name, lineage)
                if entry.size > self.cfg.multipart_threshold:
                    mp = _Multipart(self, key, entry, paths[entry.name])
                    large.append(mp)
                    mp.start(budget)
                    mp.done = self._completer.submit(mp.finish)
                else:
                    budget.acquire()
                    small.append(self._pool.submit(self._put_single, key, entry,
                                                   paths[entry.name], budget))
            for mp in large:
                mp.done.result()  # type: ignore[union-attr]
            for fut in small:
                fut.result()
        except BaseException:
            for mp in large:
                mp.abort()
            for fut in small:
                fut.cancel()
            raise
        return sum(e.size for e in todo)

    def _put_single(self, key: str, entry: FileEntry, path: Path, budget: _Budget) -> None:
        try:
            data = path.read_bytes()
        finally:
            budget.release()
        check = ck.checksum.Check(entry)
        check.update(data)
        _as_in_manifest(entry, check.problem())
        self.s3.put_object(Bucket=self.cfg.bucket, Key=key, Body=data,
                           **ck.checksum.s3_checksum(entry))
        self._progress(entry.name, len(data))
        if self.cfg.verify == "readback":
            ok = self._read_back(key, entry)
        else:
            head = self._head(key)
            ok = head is not None and head.get("ContentLength") == entry.size \
                and self._verified_single(key, entry, head)
        if not ok:
            self.discard(key)
            raise VerifyError(entry.name, "stored object differs from the local file "
                              f"({ck.checksum.algorithm(entry)} mismatch after upload)")

    def discard(self, key: str) -> None:
        try:
            self.s3.delete_object(Bucket=self.cfg.bucket, Key=key)
        except ClientError:
            pass

    def _progress(self, name: str, n: int) -> None:
        if self.on_progress is not None:
            self.on_progress(name, n)


class _Multipart:
    """One file as a multipart upload: read once, hashed, parts sent in parallel."""

    def __init__(self, uploader: Uploader, key: str, entry: FileEntry, path: Path) -> None:
        self.m = uploader
        self.key = key
        self.entry = entry
        self.path = path
        self.upload_id: str | None = None
        self.parts: list[Future[dict[str, Any]]] = []
        self.whole = ck.checksum.PartsCheck(entry, uploader._hasher)
        self.failed: BaseException | None = None
        self.done: Future[None] | None = None  # finish(), run by the uploader's completer

    def start(self, budget: _Budget) -> None:
        cfg = self.m.cfg
        resp = self.m.s3.create_multipart_upload(Bucket=cfg.bucket, Key=self.key,
                                                 ChecksumAlgorithm="CRC32",
                                                 ChecksumType="COMPOSITE")
        self.upload_id = resp["UploadId"]
        with open(self.path, "rb") as f:
            number = 0
            while True:
                budget.acquire()
                if self.failed is not None:  # S3 is failing: stop reading, report it
                    budget.release()
                    raise self.failed
                buf = self.m._buffer()
                n = f.readinto(buf)
                if not n:
                    self.m._return(buf)
                    budget.release()
                    break
                number += 1
                block: bytes | bytearray = buf
                if n < len(buf):  # a file's short last part: its own bytes (botocore
                    block = bytes(memoryview(buf)[:n])  # takes bytes, not a view)
                    self.m._return(buf)
                # A SHA-256 check takes the blocks in order (one thread); a buffer goes
                # back to the uploader once both its check and its part are done.
                fed = self.whole.feed(block)
                self.parts.append(self.m._pool.submit(self._part, number, block, budget, fed))

    def _part(self, number: int, block: bytes | bytearray, budget: _Budget,
              hashed: Future[None]) -> dict[str, Any]:
        try:
            digest = crc32(block)
            crc = b64(digest)
            resp = self.m.s3.upload_part(Bucket=self.m.cfg.bucket, Key=self.key,
                                         UploadId=self.upload_id, PartNumber=number, Body=block,
                                         ChecksumCRC32=crc)
            self.m._progress(self.entry.name, len(block))
            return {"PartNumber": number, "ETag": resp["ETag"], "ChecksumCRC32": crc,
                    "_digest": digest, "_size": len(block)}
        except BaseException as exc:
            self.failed = exc
            raise
        finally:
            wait([hashed])  # its bytes are read by the hasher until then
            if isinstance(block, bytearray):  # a buffer of the uploader's (not a short part)
                self.m._return(block)
            budget.release()

    def finish(self) -> None:
        parts = [f.result() for f in self.parts]
        digests = [p.pop("_digest") for p in parts]
        for p, digest in zip(parts, digests, strict=True):
            self.whole.part(digest, p.pop("_size"))
        _as_in_manifest(self.entry, self.whole.problem())
        self.m.s3.complete_multipart_upload(
            Bucket=self.m.cfg.bucket, Key=self.key, UploadId=self.upload_id,
            MultipartUpload={"Parts": parts})
        self.upload_id = None
        head = self.m._head(self.key)
        expected = Uploader._composite(digests)
        stored = Uploader._stored_checksum(head or {})
        if head is not None and not stored:  # a store that keeps no checksums
            stored = expected if self.m._read_back(self.key, self.entry) else "mismatch"
        if head is None or head.get("ContentLength") != self.entry.size or stored != expected:
            self.m.discard(self.key)
            raise VerifyError(self.entry.name,
                              f"stored composite CRC32 {stored or 'none'} differs from the "
                              f"one sent {expected}")

    def abort(self) -> None:
        for f in self.parts:
            f.cancel()
        # Wait for parts in flight, so the abort is not followed by a late part, and for
        # finish() (it ends once its parts have), so it does not complete what is aborted.
        wait(self.parts)
        if self.done is not None:
            wait([self.done])
        if self.upload_id is None:
            return
        # Best effort: the next attempt and the start-up sweep abort what is left.
        with contextlib.suppress(Exception):
            self.m.s3.abort_multipart_upload(Bucket=self.m.cfg.bucket, Key=self.key,
                                             UploadId=self.upload_id)
        self.upload_id = None
