"""Ports a process is told to listen on before it binds: drawn below the kernel's range.

A port found free by ``bind(0)`` comes from the kernel's ephemeral range, where the local
end of every outgoing connection on the host comes from too: between the check and the
listener's bind, a connection can take it. That failed a suite's rendezvous (torchrun's
``EADDRINUSE`` while other work on the host opened connections). Below the range, only
a program that binds a port of its choosing can take one.

Two bands, so the trainer's draws and the dev stacks' never meet: ``RENDEZVOUS`` (the
trainer's torchrun store, ``tandem.trainer.launcher``) and ``LISTEN`` (the children of
dev stacks, benches and tests, ``tandem.cli.devstack.free_port``).

A probe's socket is closed before the port's taker binds it, so two draws on one host
can return one port: a dev stack of a dozen processes got one metrics port twice, and
two node agents on one host (a test's simulated nodes) once handed two runs one
rendezvous port, 40 ms apart. ``lease`` draws a port no process of this user leased in
the last seconds it names, and leases it (``LEASES``, a file locked while it is read and
rewritten).
"""

from __future__ import annotations

import contextlib
import os
import random
import socket
import tempfile
import threading
import time
from collections.abc import Container, Iterator
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


# The lease file shared by every process of this user; None: tandem-port-leases-<uid> in
# the temporary directory (found when first used: a process with none still leases, in
# its own memory).
LEASES: Path | None = None
_OWN_LEASES: dict[int, float] = {}
_LEASES_LOCK = threading.Lock()


def lease(host: str, candidates: range, seconds: float, *, rng: random.Random | None = None,
          fallback: bool = True) -> int:
    """``draw``, skipping every port a process of this user leased in the last
    ``seconds`` (the other draws' ports, not bound yet), and lease the one drawn for
    ``seconds``. ``OSError`` when no port is left that is free and not leased."""
    now = time.time()
    with _LEASES_LOCK, _leases(now) as leased:
        for _ in range(1000):
            port = draw(host, candidates, rng=rng, skip=leased, fallback=fallback)
            if port not in leased:  # the kernel's own pick can be a leased one
                leased[port] = _OWN_LEASES[port] = now + seconds
                return port
    raise OSError(f"no port on {host} in {candidates.start}-{candidates.stop - 1} left "
                  f"that is not leased ({len(leased)} leased)")


def _lease_file() -> Path:
    return LEASES or Path(tempfile.gettempdir()) / f"tandem-port-leases-{os.getuid()}"


@contextlib.contextmanager
def _leases(now: float) -> Iterator[dict[int, float]]:
    """The leases still running, for the block to add to; written back after it, all
    under an exclusive lock on the file (``port expiry`` per line)."""
    for port, until in list(_OWN_LEASES.items()):
        if until <= now:
            del _OWN_LEASES[port]
    try:
        f = open(_lease_file(), "a+", encoding="ascii")
    except OSError:  # no temporary directory, or none this user may write
        yield dict(_OWN_LEASES)
        return
    import fcntl

    with f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        leased = dict(_OWN_LEASES)
        for line in f.read().splitlines():
            port_s, _, until_s = line.partition(" ")
            with contextlib.suppress(ValueError):
                if (until := float(until_s)) > now:
                    leased[int(port_s)] = max(until, leased.get(int(port_s), 0.0))
        yield leased
        f.seek(0)
        f.truncate()
        f.write("".join(f"{port} {until:.0f}\n" for port, until in leased.items()))
        f.flush()
