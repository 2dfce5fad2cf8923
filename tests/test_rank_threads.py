"""How many torch threads a rank is given when its run does not say.

torch's intra-op threads wait for each other at the end of every op, so a rank that
takes every core of its node stalls whenever anything else there runs (its own
checkpoint writer and relay, torchrun, the agents): the node's cores but one are shared
by its ranks, and a run that names a count gets it.
"""

from __future__ import annotations

import os

import pytest

from tandem.trainer.rank import threads


@pytest.mark.parametrize("cores,ranks,expected", [
    (2, 1, 1), (16, 1, 15), (16, 2, 7), (16, 8, 1), (96, 8, 11), (1, 1, 1), (2, 4, 1)])
def test_a_rank_shares_the_nodes_cores_but_one_with_the_nodes_other_ranks(
        monkeypatch: pytest.MonkeyPatch, cores: int, ranks: int, expected: int) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(ranks))
    assert threads(0) == expected
    assert threads(3) == 3  # what the run asks for
