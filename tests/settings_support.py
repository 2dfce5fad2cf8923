"""What a deployment may set: the TANDEM_* variables each service's settings define.

The local stack's process list, compose.yaml and deploy/k8s all configure services by
environment variables, and a misspelt one is silently ignored by pydantic-settings
(``extra="ignore"``); their tests ask this module which names a service does not know.
"""

from __future__ import annotations

from collections.abc import Iterable

from tandem.cli.run import service_class
from tandem.common.settings import ENV_PREFIX


def fields(service: str) -> set[str]:
    """The settings ``service`` reads, as field names (``nats_url``)."""
    return set(service_class(service).settings_class.model_fields)


def unknown_settings(service: str, names: Iterable[str]) -> set[str]:
    """The ``TANDEM_*`` names among ``names`` that are not settings of ``service``;
    names without the prefix are not Tandem's and are left alone."""
    known = fields(service)
    return {n for n in names
            if n.startswith(ENV_PREFIX) and n.removeprefix(ENV_PREFIX).lower() not in known}
