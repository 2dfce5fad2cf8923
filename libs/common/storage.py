"""One boto3 S3 client factory, from settings (endpoint, region, credentials, retries).

Remote locations stay strings (``s3://bucket/key``), never ``Path``.
"""

from __future__ import annotations

from typing import Any

from tandem.common.settings import Settings


def s3_client(settings: Settings, *, connect_timeout: float = 5.0,
              read_timeout: float = 60.0, max_pool: int = 32) -> Any:
    import boto3
    from botocore.config import Config

    cfg = Config(
        region_name=settings.s3_region,
        retries={"max_attempts": settings.s3_max_attempts, "mode": "standard"},
        connect_timeout=connect_timeout,
        read_timeout=read_timeout,
        max_pool_connections=max_pool,
        # No SHA-256 of every body for the signature: botocore already leaves it out over
        # https when a checksum header is sent; over http (moto, a MinIO in the cluster)
        # it hashes each body once more, a third SHA-256 pass on a checkpoint's bytes.
        # The headers are still signed, the checksum header with them, and the store
        # checks the body against it (Tandem also verifies what is stored).
        s3={"addressing_style": "path", "payload_signing_enabled": False},
        # SigV4 for presigned URLs too: their lifetime is then stated in the URL
        # (X-Amz-Expires), and every current S3 region and MinIO accept it.
        signature_version="s3v4",
        # Checksums are computed for every upload; we verify them ourselves too,
        # because moto (tests) does not.
        request_checksum_calculation="when_supported",
        response_checksum_validation="when_supported",
    )
    return boto3.client(
        "s3",
        endpoint_url=settings.s3_endpoint,
        aws_access_key_id=settings.s3_access_key.get_secret_value()
        if settings.s3_access_key else None,
        aws_secret_access_key=settings.s3_secret_key.get_secret_value()
        if settings.s3_secret_key else None,
        config=cfg,
    )


def ensure_bucket(client: Any, bucket: str) -> bool:
    """Create ``bucket`` if missing; return True if it was created."""
    from botocore.exceptions import ClientError

    try:
        client.head_bucket(Bucket=bucket)
        return False
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") not in ("404", "NoSuchBucket", "NotFound"):
            raise
    client.create_bucket(Bucket=bucket)
    return True


def s3_uri(bucket: str, key: str) -> str:
    return f"s3://{bucket}/{key}"
