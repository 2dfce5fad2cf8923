"""What a CLI command says when the stack it needs is not there.

``unreachable_message(exc)`` turns the errors of an unreachable NATS or gateway into one
clear sentence naming what was tried and how to start the local stack; anything else
gives None (the error is a real bug and keeps its traceback). ``refusal_message(exc)``
tells a server that is there but refuses (a NATS login or permission, an API key, S3
credentials) apart: it names the refusal and what to set, never "is the stack running?".
"""

from __future__ import annotations

import os


def start_hint(point: str = "TANDEM_NATS_URL / --url") -> str:
    """How to start the local stack, or point ``point`` (what the command reads) at one."""
    return ("Is the stack running? Start the local one with `tandem dev up` (or `make demo` "
            f"for the whole tour), or point {point} at yours.")


START = start_hint()


NATS_LOGIN = ("set TANDEM_NATS_USER and TANDEM_NATS_PASSWORD (`tandem dev up --auth` printed "
              "them) or TANDEM_NATS_CREDS")
API_KEY = "pass --api-key or set TANDEM_API_KEY"


def _nats_url() -> str:
    return os.environ.get("TANDEM_NATS_URL", "nats://127.0.0.1:4222")


def refusal_message(exc: BaseException) -> str | None:
    """A user-facing message if ``exc`` is a refusal by a server that is there."""
    from nats.errors import AuthorizationError

    status = getattr(exc, "status", None)
    if type(exc).__name__ == "JobError" and status in (401, 403):  # tandem.client's
        what = "an API key with that scope" if status == 403 else "an API key"
        return f"refused ({exc}): {API_KEY} ({what})"
    text = str(exc)
    if isinstance(exc, AuthorizationError) or "authorization violation" in text.lower():
        return f"NATS at {_nats_url()} refused the login ({text.strip()}): {NATS_LOGIN}"
    try:
        from botocore.exceptions import NoCredentialsError
    except ImportError:
        return None
    if isinstance(exc, NoCredentialsError):
        s3 = os.environ.get("TANDEM_S3_ENDPOINT", "(TANDEM_S3_ENDPOINT unset)")
        return (f"no S3 credentials: set TANDEM_S3_ENDPOINT, TANDEM_S3_ACCESS_KEY and "
                f"TANDEM_S3_SECRET_KEY (S3 endpoint {s3}; `tandem dev up` prints the local "
                "stack's)")
    return None


def permission_message(user: str, subject: str, instead: str = "") -> str:
    """NATS refused ``user`` a subject (least privilege: the ``client`` user reads no KV)."""
    return (f"NATS user {user or '(anonymous)'!r} may not use {subject} (refused by the "
            f"server: a right of Tandem's services and admin, not this login)"
            + (f"; {instead}" if instead else ""))


def unreachable_message(exc: BaseException) -> str | None:
    """A user-facing message if ``exc`` means NATS or the gateway is unreachable, or
    refused (``refusal_message``)."""
    from nats.errors import NoServersError

    refused = refusal_message(exc)
    if refused is not None:
        return refused
    nats_url = _nats_url()
    if isinstance(exc, NoServersError):
        return f"cannot reach NATS at {nats_url}. {START}"
    try:
        import httpx
    except ImportError:
        httpx = None  # type: ignore[assignment]
    if httpx is not None and isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
        where = getattr(getattr(exc, "request", None), "url", "the gateway")
        return f"cannot reach the gateway at {where}. {START}"
    if httpx is not None and isinstance(exc, httpx.TimeoutException):
        where = getattr(getattr(exc, "request", None), "url", "the gateway")
        return f"no answer from the gateway at {where} in time ({type(exc).__name__}). {START}"
    try:
        from botocore.exceptions import EndpointConnectionError
    except ImportError:
        pass
    else:
        if isinstance(exc, EndpointConnectionError):
            s3 = os.environ.get("TANDEM_S3_ENDPOINT", "(TANDEM_S3_ENDPOINT unset)")
            return f"cannot reach S3 at {s3}. {START}"
    if isinstance(exc, ConnectionError | TimeoutError):  # tandem.client's too
        return f"cannot connect ({str(exc) or 'no answer in time'}). {START}"
    return None
