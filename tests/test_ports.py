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
from tests.conftest import ports_taken_at_once


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
        got = ports.draw("127.0.0.1", band, rng=random.Random(seed))
        assert got != taken and got in band
    assert ports.draw("127.0.0.1", band, rng=random.Random(seed)) == taken  # free now
    again = ports.draw("127.0.0.1", band, rng=random.Random(seed), skip={taken})
    assert again != taken and again in band


def test_a_named_range_is_tried_whole_and_a_full_one_is_an_error_naming_it() -> None:
    """``TANDEM_RENDEZVOUS_PORTS``: what a firewall admits; never the kernel's pick."""
    band = ports.band_range(ports.RENDEZVOUS)
    with contextlib.ExitStack() as held:
        five = None
        # Five free ports in a row, from the band's top (test_train_nodes' agents draw
        # from its first 200).
        for start in range(band.stop - 5, band.start, -5):
            socks = []
            try:
                for port in range(start, start + 5):
                    s = held.enter_context(socket.socket())
                    s.bind(("127.0.0.1", port))
                    socks.append(s)
            except OSError:
                continue
            five = range(start, start + 5)
            break
        assert five is not None
        with pytest.raises(OSError, match=f"no free port on 127.0.0.1 in {five.start}-"
                                          f"{five.stop - 1}"):
            ports.draw("127.0.0.1", five, fallback=False)
        socks[2].close()  # one comes free: found, however the draw is ordered
        assert ports.draw("127.0.0.1", five, fallback=False) == five[2]


@pytest.mark.parametrize("text, error", [
    ("29400", "not first-last"), ("a-b", "not first-last"), ("80-90", "1024 <= first"),
    ("30000-29000", "first <= last"), ("60000-70000", "last <= 65535")])
def test_a_port_range_that_is_not_one_is_refused_saying_why(text: str, error: str) -> None:
    assert ports.parse_range("29400-29409") == range(29400, 29410)
    with pytest.raises(ValueError, match=error):
        ports.parse_range(text)


def test_where_the_kernels_range_leaves_no_band_the_kernel_picks(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wide = tmp_path / "ip_local_port_range"
    wide.write_text("1024\t65535\n")  # a host that gives every port to connections
    monkeypatch.setattr(ports, "EPHEMERAL", wide)
    assert not ports.band_range(ports.LISTEN) and not ports.band_range(ports.RENDEZVOUS)
    port = ports.draw("127.0.0.1", ports.band_range(ports.LISTEN))
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # it was free


def test_a_dev_stacks_ports_never_come_from_the_kernels_range_or_the_trainers_band() -> None:
    got = {free_port() for _ in range(300)}
    assert len(got) == 300 and got <= set(ports.band_range(ports.LISTEN))


def test_two_node_agents_on_one_host_are_never_given_one_rendezvous_port(
        tmp_path: Path) -> None:
    # Two agents of a test's simulated nodes drew one port for two runs 40 ms apart (a
    # suite at 72c2c0d): one run's first attempt failed to rendezvous (EADDRINUSE).
    # Nothing binds here, so with probes alone about 33 of 2 x 100 drawn from 300 would
    # repeat; the leases keep them apart. The two share a lease file of their own: the
    # user's holds this test's leases of a run a minute ago, and other tests'.
    band = ports.band_range(ports.RENDEZVOUS)
    allowed = range(band.stop - 300, band.stop)  # apart from test_train_nodes' ports
    take = ("from pathlib import Path; from tandem.common import ports; "
            f"ports.LEASES = Path({str(tmp_path / 'leases')!r}); "
            "from tandem.trainer.launcher import rendezvous_port; "
            f"print(*(rendezvous_port('127.0.0.1', allowed=range({allowed.start}, "
            f"{allowed.stop})) for _ in range(100)))")
    got = ports_taken_at_once(take)
    assert len(got[0]) == len(got[1]) == 100
    assert not got[0] & got[1]
    assert all(port in allowed for port in got[0] | got[1])
