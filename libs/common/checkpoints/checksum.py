"""A checkpoint file's checksum, as its manifest records it, and the checks against it.

A manifest written now records each file's **CRC32** (``FileEntry.crc32``: S3's CRC32,
zlib's, of the whole file, 8 hex digits). Manifests written before 2026-12-05 record
SHA-256 (``FileEntry.sha256``); every reader still verifies those, with the same calls.

Why CRC32 and not SHA-256: the checksum guards against accidental corruption (a file that
rotted on a node's disk, a part damaged on the wire, a truncated download), which is what
S3 keeps checksums for itself. Nothing here asks for a digest an adversary cannot forge:
whoever can write the bucket or the node's disk can write the manifest beside the files.
With SHA-256 every byte was hashed twice on its way to S3 (SHA-256 against the manifest,
CRC32 for S3's part checksums), the one cost the checkpointer's mirror had that boto3
does not (issue 23: 0.89 of boto3's throughput on 2 cores with it, 0.97 without). With
CRC32 the part checksums S3 needs are the file's own: the whole file's CRC32 is combined
from its parts' (``combine``), with no second pass over the bytes; and the trainer's
``scan`` of a new checkpoint reads its files at zlib's CRC32 speed, about twice SHA-256's.
"""

from __future__ import annotations

import base64
import hashlib
import re
import zlib
from collections.abc import Iterator
from concurrent.futures import Executor, Future
from pathlib import Path
from typing import Any

from tandem.common.events import FileEntry

CHUNK = 8 << 20
_HEX = {"crc32": re.compile(r"[0-9a-f]{8}"), "sha256": re.compile(r"[0-9a-f]{64}")}


def algorithm(entry: FileEntry) -> str:
    """The checksum ``entry`` is verified with: ``crc32``, or ``sha256`` (older manifests)."""
    return "crc32" if entry.crc32 else "sha256"


def expected(entry: FileEntry) -> str:
    """The hex checksum the manifest records for ``entry``."""
    return entry.crc32 or entry.sha256


def identity(entry: FileEntry) -> tuple[int, str, str]:
    """What says two entries of the same name describe the same bytes."""
    return entry.size, entry.crc32, entry.sha256


def validate(entry: FileEntry) -> None:
    """ValueError (naming the file) unless ``entry`` records a well-formed checksum."""
    if not (entry.crc32 or entry.sha256):
        raise ValueError(f"{entry.name}: no checksum (crc32 or sha256)")
    for algo in ("crc32", "sha256"):
        value = getattr(entry, algo)
        if value and not _HEX[algo].fullmatch(value):
            digits = 8 if algo == "crc32" else 64
            raise ValueError(f"{entry.name}: {algo} must be {digits} lowercase hex digits, "
                             f"got {value!r}")


def crc32_hex(value: int) -> str:
    return f"{value & 0xFFFFFFFF:08x}"


def _blocks(path: Path, chunk: int) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while block := f.read(chunk):
            yield block


def _problem(algo: str, size: int, digest: str, entry: FileEntry) -> str:
    """What differs between bytes read (``size``, ``digest``) and ``entry`` ("" if none)."""
    if size != entry.size:
        return f"size {size} bytes, manifest says {entry.size}"
    if digest != expected(entry):
        return f"{algo} {digest}, manifest says {expected(entry)}"
    return ""


def file_crc32(path: Path, chunk: int = CHUNK) -> str:
    """The hex CRC32 of the file at ``path`` (what a new manifest records)."""
    crc = 0
    for block in _blocks(path, chunk):
        crc = zlib.crc32(block, crc)
    return crc32_hex(crc)


class Check:
    """A running check of one file's bytes, fed in order, against its manifest entry."""

    def __init__(self, entry: FileEntry) -> None:
        self.entry = entry
        self.algo = algorithm(entry)
        self._crc = 0
        self._sha = hashlib.sha256() if self.algo == "sha256" else None
        self.size = 0

    def update(self, data: bytes | bytearray | memoryview) -> None:
        self.size += len(data)
        if self._sha is not None:
            self._sha.update(data)
        else:
            self._crc = zlib.crc32(data, self._crc)

    def digest(self) -> str:
        return self._sha.hexdigest() if self._sha is not None else crc32_hex(self._crc)

    def ok(self) -> bool:
        return self.size == self.entry.size and self.digest() == expected(self.entry)

    def problem(self) -> str:
        """What differs, for an error message ("" when nothing does)."""
        return _problem(self.algo, self.size, self.digest(), self.entry)


def check_file(path: Path, entry: FileEntry, chunk: int = CHUNK) -> Check:
    """``Check`` of the whole file at ``path`` against ``entry``."""
    check = Check(entry)
    for block in _blocks(path, chunk):
        check.update(block)
    return check


_FED: Future[None] = Future()
_FED.set_result(None)


class PartsCheck:
    """One file's check against its manifest entry, from its parts in order (the
    checkpointer's multipart uploads).

    A CRC32 entry is checked by combining the parts' own CRC32s (``part``), the ones S3
    needs anyway: no pass over the bytes beyond that one. A SHA-256 entry (an older
    manifest) is fed every block (``feed``) by ``hasher``, one thread so in order, or
    inline when it is None."""

    def __init__(self, entry: FileEntry, hasher: Executor | None) -> None:
        self.entry = entry
        self.hasher = hasher
        self.fed = _FED  # the last block fed to a SHA-256 check
        self._check = None if entry.crc32 else Check(entry)
        self._crc = self._size = 0

    def feed(self, block: bytes | bytearray) -> Future[None]:
        """Done once ``block`` is read by the check (its buffer may then be reused)."""
        if self._check is None:
            return _FED
        if self.hasher is None:
            self._check.update(block)
            return _FED
        self.fed = self.hasher.submit(self._check.update, block)
        return self.fed

    def part(self, crc: bytes, size: int) -> None:
        """The next part's CRC32 (4 bytes, big-endian, as S3 takes it) and size."""
        self._crc = combine(self._crc, int.from_bytes(crc, "big"), size)
        self._size += size

    def problem(self) -> str:
        """What differs between the bytes read and the manifest ("" when nothing)."""
        if self._check is not None:
            self.fed.result()
            return self._check.problem()
        return _problem("crc32", self._size, crc32_hex(self._crc), self.entry)


def s3_checksum(entry: FileEntry) -> dict[str, str]:
    """The manifest's checksum of ``entry`` as S3's request parameter (a single put:
    the store that checks checksums refuses a body that does not match it)."""
    raw = bytes.fromhex(expected(entry))
    key = "ChecksumCRC32" if algorithm(entry) == "crc32" else "ChecksumSHA256"
    return {key: base64.b64encode(raw).decode()}


def stored_matches(entry: FileEntry, head: dict[str, Any]) -> bool | None:
    """Whether the checksum S3 keeps for a single put (a ``head_object`` with checksum
    mode on) is the manifest's; None when it keeps none of that algorithm."""
    (key, value), = s3_checksum(entry).items()
    stored = head.get(key)
    return None if not stored else stored == value


# CRC32 combination (zlib's crc32_combine, which Python's zlib does not expose): the CRC32
# of A + B from crc(A), crc(B) and len(B), in the reflected polynomial representation.
_POLY = 0xEDB88320


def _multmodp(a: int, b: int) -> int:
    """a(x) * b(x) modulo the CRC32 polynomial."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if not a & (m - 1):
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


def _x2n_table() -> list[int]:
    table, p = [], 1 << 30  # x^1
    for _ in range(32):
        table.append(p)
        p = _multmodp(p, p)
    return table


_X2N = _x2n_table()  # x^(2^k) modulo the polynomial


def _x8nmodp(n: int) -> int:
    """x^(8 * n) modulo the polynomial: ``n`` bytes of shift."""
    p, k = 1 << 31, 3  # x^0; 8 = 2^3
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return p


def combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """The CRC32 of A followed by B, from crc32(A), crc32(B) and B's length in bytes."""
    return _multmodp(_x8nmodp(len_b), crc_a) ^ crc_b


__all__ = ["Check", "PartsCheck", "algorithm", "check_file", "combine", "crc32_hex", "expected",
           "file_crc32", "identity", "s3_checksum", "stored_matches", "validate"]
