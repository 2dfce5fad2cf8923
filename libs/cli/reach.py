"""What a CLI command says when the stack it needs is not there.

``unreachable_message(exc)`` turns the errors of an unreachable NATS or gateway into one
clear sentence naming what was tried and how to start the local stack; anything else
gives None (the error is a real bug and keeps its traceback).
"""

from __future__ import annotations

import os

START = ("Is the stack running? Start the local one with `tandem dev up` (or `make demo` "
         "for the whole tour), or point TANDEM_NATS_URL / --url at yours.")


def unreachable_message(exc: BaseException) -> str | None:
    """A user-facing message if ``exc`` means NATS or the gateway is unreachable."""
    from nats.errors import NoServersError

    nats_url = os.environ.get("TANDEM_NATS_URL", "nats://127.0.0.1:4222")
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
        from botocore.exceptions import EndpointConnectionError, NoCredentialsError
    except ImportError:
        pass
    else:
        s3 = os.environ.get("TANDEM_S3_ENDPOINT", "(TANDEM_S3_ENDPOINT unset)")
        if isinstance(exc, EndpointConnectionError):
            return f"cannot reach S3 at {s3}. {START}"
        if isinstance(exc, NoCredentialsError):
            return (f"no S3 credentials: set TANDEM_S3_ACCESS_KEY and TANDEM_S3_SECRET_KEY "
                    f"(S3 endpoint {s3}). {START}")
    if isinstance(exc, ConnectionError | TimeoutError):  # tandem.client's too
        return f"cannot connect ({str(exc) or 'no answer in time'}). {START}"
    return None
