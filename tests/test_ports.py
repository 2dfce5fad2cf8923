"""Ports handed out before they are bound: drawn below the kernel's range, in two bands
that never meet, each port free when drawn (``tandem.common.ports``)."""

from __future__ import annotations

import contextlib
import random
import socket
from pathlib import Path

import pytest

from tandem.cli.devstack import free_port
from tandem.common import ports


def test_both_bands_lie_below_the_kernels_range_and_apart() -> None:
    low = ports.ephemeral_low()
    rendezvous, listen = ports.band_range(ports.RENDEZVOUS), ports.band_range(ports.LISTEN)
    assert len(listen) > 10_000 and len(rendezvous) > 1_000  # on this host
    for band in (rendezvous, listen):
        assert 1024 <= band.start and band.stop <= low
    assert rendezvous.stop <= listen.start


def test_a_draw_passes_over_a_bound_port_and_those_it_is_told_to_skip() -> None:
    band = ports.band_range(ports.LISTEN)
    with socket.socket() as held:
        for seed in range(100):  # a seed whose first draw this test can hold
            taken = random.Random(seed).choice(band)
            with contextlib.suppress(OSError):
                held.bind(("127.0.0.1", taken))
                break
        held.listen()
        got = ports.draw("127.0.0.1", ports.LISTEN, rng=random.Random(seed))
        assert got != taken and got in band
    assert ports.draw("127.0.0.1", ports.LISTEN, rng=random.Random(seed)) == taken  # free now
    again = ports.draw("127.0.0.1", ports.LISTEN, rng=random.Random(seed), skip={taken})
    assert again != taken and again in band


def test_where_the_kernels_range_leaves_no_band_the_kernel_picks(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wide = tmp_path / "ip_local_port_range"
    wide.write_text("1024\t65535\n")  # a host that gives every port to connections
    monkeypatch.setattr(ports, "EPHEMERAL", wide)
    assert not ports.band_range(ports.LISTEN) and not ports.band_range(ports.RENDEZVOUS)
    port = ports.draw("127.0.0.1", ports.LISTEN)
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # it was free


def test_a_dev_stacks_ports_never_come_from_the_kernels_range_or_the_trainers_band() -> None:
    got = {free_port() for _ in range(300)}
    assert len(got) == 300 and got <= set(ports.band_range(ports.LISTEN))
