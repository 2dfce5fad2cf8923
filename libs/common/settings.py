"""Settings shared by every service, read from ``TANDEM_*`` environment variables.

Each service subclasses ``Settings`` with its own fields. ``load`` validates everything
at start and raises one ``SettingsError`` that names every bad variable.
"""

from __future__ import annotations

from typing import Literal, TypeVar

from pydantic import Field, SecretStr, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from tandem.common import subjects
from tandem.common.errors import SettingsError
from tandem.common.subjects import token

ENV_PREFIX = "TANDEM_"

S = TypeVar("S", bound="Settings")


class Settings(BaseSettings):
    """What every Tandem process needs: where the bus and S3 are, and who it is."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, extra="ignore", validate_default=True, frozen=True
    )

    nats_url: str = Field(
        "nats://127.0.0.1:4222",
        description="Comma-separated NATS server URLs; the client fails over between them.",
    )
    nats_user: str | None = Field(None, description="NATS user name, if the server needs one.")
    nats_password: SecretStr | None = Field(None, description="NATS password for nats_user.")
    nats_creds: str | None = Field(None, description="Path to a NATS .creds file (nkey/JWT).")
    nats_tls_ca: str | None = Field(None, description="CA bundle to verify the NATS server.")
    nats_tls_cert: str | None = Field(
        None, description="Client certificate (PEM) for mutual TLS; needs nats_tls_ca.")
    nats_tls_key: str | None = Field(None, description="Private key (PEM) of nats_tls_cert.")
    nats_js_domain: str | None = Field(
        None, description="JetStream domain of the control plane, for a process connected "
        "through a GPU cluster's leaf-node server (e.g. 'hub'); unset: the server's own.")
    nats_js_api_prefix: str | None = Field(
        None, description="JetStream API prefix, for a process whose NATS account imports "
        "the control plane's JetStream (the leaf topology with accounts: "
        "JS.control-plane.API); unset: $JS.API, or the domain's.")
    nats_inbox_prefix: str | None = Field(
        None, description="Prefix of this process's reply inboxes (default _INBOX). In "
        "the leaf topology with accounts, _INBOX_<cluster>: the control plane delivers a "
        "cluster's push consumers (KV watches) by that prefix.")
    stream_replicas: int = Field(
        1, ge=1, le=5, description="Replicas of each stream: 1 locally, 3 in production."
    )
    cluster: str = Field("local", description="The GPU cluster this process belongs to.")
    node: str = Field("node-0", description="The node (host) this process runs on; a "
                      "Kubernetes node name's dots become '_' (ip-10-0-0-1.ec2.internal: "
                      "ip-10-0-0-1_ec2_internal).")
    s3_endpoint: str | None = Field(
        None, description="S3 endpoint URL (MinIO, moto); None means AWS's own."
    )
    s3_bucket: str = Field("tandem", description="Bucket for checkpoints and images.")
    s3_region: str = Field("us-east-1", description="S3 region.")
    s3_access_key: SecretStr | None = Field(None, description="S3 access key id.")
    s3_secret_key: SecretStr | None = Field(None, description="S3 secret access key.")
    s3_max_attempts: int = Field(5, ge=1, le=20, description="boto3 retry attempts per call.")
    metrics_host: str = Field("127.0.0.1", description="Address of /healthz and /metrics.")
    metrics_port: int = Field(
        0, ge=0, le=65535, description="Port of /healthz and /metrics; 0 picks a free one."
    )
    log_format: Literal["auto", "json", "console"] = Field(
        "auto", description="auto: console on a TTY, JSON otherwise."
    )
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    gc_threshold: int = Field(
        20_000, ge=0, le=10_000_000, description="Allocations between collections of the "
        "youngest generation (Python's default is 700); 0 keeps Python's defaults.")
    event_loop: Literal["auto", "uvloop", "asyncio"] = Field(
        "auto", description="asyncio event loop: uvloop when installed (auto), or the "
        "standard one.")
    otlp_endpoint: str | None = Field(
        None, description="OTLP/HTTP endpoint for traces; unset exports nothing."
    )
    drain_timeout: float = Field(
        20.0, gt=0, le=600, description="Seconds in-flight work may take after SIGTERM."
    )

    @field_validator("cluster")
    @classmethod
    def _token(cls, value: str, info) -> str:  # type: ignore[no-untyped-def]
        return token(value, info.field_name)

    @field_validator("node")
    @classmethod
    def _node(cls, value: str) -> str:
        return subjects.node(value)

    @field_validator("nats_inbox_prefix")
    @classmethod
    def _inbox(cls, value: str | None) -> str | None:
        return None if value is None else token(value, "nats_inbox_prefix")

    @field_validator("nats_js_api_prefix")
    @classmethod
    def _prefix(cls, value: str | None) -> str | None:
        if value is not None:
            for part in value.split("."):
                token(part, "nats_js_api_prefix")
        return value

    @field_validator("nats_url")
    @classmethod
    def _urls(cls, value: str) -> str:
        for url in value.split(","):
            url = url.strip()
            if not url.startswith(("nats://", "tls://", "ws://", "wss://")):
                raise ValueError(f"{url!r} is not a nats://, tls:// or ws:// URL")
        return value

    @property
    def nats_servers(self) -> list[str]:
        return [u.strip() for u in self.nats_url.split(",") if u.strip()]


def load(cls: type[S], service: str | None = None, **overrides: object) -> S:
    """Build ``cls`` from the environment (and ``overrides``), or raise ``SettingsError``.

    The error names each variable as the operator would set it (``TANDEM_NATS_URL``).
    """
    try:
        return cls(**overrides)  # type: ignore[arg-type]
    except ValidationError as exc:
        problems: dict[str, str] = {}
        for err in exc.errors():
            if not err["loc"]:  # a check across settings: its input is all of them
                problems["settings"] = err["msg"]  # (secrets too): its message names them
                continue
            name = ENV_PREFIX + ".".join(str(p) for p in err["loc"]).upper()
            problems[name] = f"{err['msg']} (got {err.get('input')!r})"
        raise SettingsError(service or cls.__name__, problems) from None
