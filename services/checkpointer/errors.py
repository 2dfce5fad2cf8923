"""What fails in a mirror attempt, and whether another attempt can succeed.

The mirror's own errors name the file (``name``; ``manifest.json`` for a commit) and the
``reason``::

    MirrorError                an attempt failed; ``retryable``: another one can succeed
    ├── VerifyError            what S3 stored differs from what was sent: retried
    ├── LocalCheckpointError   the local checkpoint is missing or differs from its
    │                          manifest: not retried
    └── CommitConflict         the step is committed with other files: never overwritten,
                               not retried

``heals(exc)`` is the one verdict on any error an attempt raised, the mirror's or S3's
(a ``ClientError``: its status and code; anything else, S3 unreachable: heals). The
service retries and hands back what heals and gives up at once on what does not.
``s3_code`` and ``s3_missing`` read the code of a ``ClientError``.
"""

from __future__ import annotations

from botocore.exceptions import ClientError


class MirrorError(Exception):
    """An attempt failed. ``retryable`` says whether another attempt can succeed."""

    retryable = True

    def __init__(self, name: str, reason: str) -> None:
        self.name = name
        self.reason = reason
        super().__init__(f"{name}: {reason}")


class VerifyError(MirrorError):
    """What S3 stored differs from what was sent (corrupted in transit): retry."""


class LocalCheckpointError(MirrorError):
    """The local checkpoint is missing or does not match its manifest: retrying won't help."""

    retryable = False


class CommitConflict(MirrorError):
    """The step is already committed with different files; it is never overwritten."""

    retryable = False


def s3_code(exc: ClientError) -> str:
    """S3's error code of ``exc`` ("" when it has none)."""
    return str(exc.response.get("Error", {}).get("Code", ""))


def s3_missing(exc: ClientError) -> bool:
    """Whether ``exc`` says the object asked for does not exist."""
    return s3_code(exc) in ("404", "NoSuchKey", "NotFound")


# S3's codes of a request refused for now (rate, a slow client), not for what it asks.
_THROTTLED = {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout",
              "RequestLimitExceeded", "TooManyRequests"}


def heals(exc: Exception) -> bool:
    """Whether an attempt's error can go away by itself: S3 unreachable, a 5xx, throttling,
    a transfer that did not verify; not a local checkpoint that does not match its
    manifest, a conflicting commit, or a request S3 refuses (403 AccessDenied, ...)."""
    if isinstance(exc, MirrorError):
        return exc.retryable
    if isinstance(exc, ClientError):
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        return status >= 500 or status == 429 or s3_code(exc) in _THROTTLED
    return True
