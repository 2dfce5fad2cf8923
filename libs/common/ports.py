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


def draw(host: str, candidates: range, *, rng: random.Random | None = None,
         skip: Container[int] = (), fallback: bool = True) -> int:
    """A port nothing is bound to on ``host`` now, at random among ``candidates`` (a band's
    ``band_range``, or a range the deployment names) and not in ``skip``. A range of at
    most ``DRAWS`` ports is tried whole, a larger one ``DRAWS`` times at random. None
    free: the kernel's pick (``bind(0)``, which may be in ``skip``) with ``fallback``,
    else ``OSError`` naming the range (a firewall admits only it)."""
    rng = rng or random.Random()
    tries = (rng.sample(candidates, len(candidates)) if len(candidates) <= DRAWS
             else (rng.choice(candidates) for _ in range(DRAWS)))
    for port in tries:
        if port in skip:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    if not fallback:
        raise OSError(f"no free port on {host} in {candidates.start}-{candidates.stop - 1}")
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def parse_range(text: str) -> range:
    """``"first-last"`` (inclusive, unprivileged ports) as a range; ``ValueError`` saying
    what is wrong."""
    first, sep, last = text.partition("-")
    try:
        lo, hi = int(first), int(last)
    except ValueError:
        raise ValueError(f"{text!r} is not first-last, e.g. 29400-29499") from None
    if not sep or not 1024 <= lo <= hi <= 65535:
        raise ValueError(f"{text!r}: want first-last with 1024 <= first <= last <= 65535")
    return range(lo, hi + 1)
