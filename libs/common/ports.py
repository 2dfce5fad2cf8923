"""Ports a process is told to listen on before it binds: drawn below the kernel's range.

A port found free by ``bind(0)`` comes from the kernel's ephemeral range, where the local
end of every outgoing connection on the host comes from too: between the check and the
listener's bind, a connection can take it. That failed a suite's rendezvous (torchrun's
``EADDRINUSE`` while other work on the host opened connections). Below the range, only
a program that binds a port of its choosing can take one.

Two bands, so the trainer's draws and the dev stacks' never meet: ``RENDEZVOUS`` (the
trainer's torchrun store, ``tandem.trainer.launcher``) and ``LISTEN`` (the children of
dev stacks, benches and tests, ``tandem.cli.devstack.free_port``, which also leases what
it hands out, so two of its own callers never get one port).
"""

from __future__ import annotations

import random
import socket
from collections.abc import Container
from pathlib import Path

EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")
LINUX_DEFAULT_LOW = 32768
# Offsets below the ephemeral range's low end: a band is [low - start, low - end).
RENDEZVOUS = (20000, 16000)
LISTEN = (16000, 0)
DRAWS = 64  # random draws in the band before the kernel's own pick


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default where unknown)."""
    try:
        return int(EPHEMERAL.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return LINUX_DEFAULT_LOW


def band_range(band: tuple[int, int]) -> range:
    """The ports of ``band`` on this host (never a privileged one; empty where the
    ephemeral range starts too low to leave it any)."""
    low = ephemeral_low()
    return range(max(1024, low - band[0]), max(1024, low - band[1]))


def draw(host: str, band: tuple[int, int], *, rng: random.Random | None = None,
         skip: Container[int] = ()) -> int:
    """A port nothing is bound to on ``host`` now, at random in ``band`` and not in
    ``skip``; the kernel's pick (``bind(0)``, which may be in ``skip``) when ``DRAWS``
    draws find none (an empty or full band)."""
    rng = rng or random.Random()
    ports = band_range(band)
    for _ in range(DRAWS if ports else 0):
        port = rng.choice(ports)
        if port in skip:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
