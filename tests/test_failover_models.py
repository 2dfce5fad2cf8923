"""Failover adopts a dead cluster's queue only if this worker serves every model that
cluster's workers were serving: otherwise each of its tasks would be handed back here
until its deliveries ran out, when it could have waited for its own cluster and run.
In-process against a real NATS server; heartbeats are written to KV ``nodes`` as agents
write them, and a whole cluster drained serves nothing, as a dead one does."""

from __future__ import annotations

import time

from tandem.common import fleet
from tandem.common.bus import Bus
from tandem.common.streams import core_streams, gen_stream
from tandem.inference_worker.failover import Failover
from tests.test_failover_routing import beat, until

GRACE = 2.0


def failover(bus: Bus, home: str, others: list[str], serves: list[str] | None) -> Failover:
    return Failover(bus, [home], [], lambda spec: None, grace=GRACE, ttl=30.0,  # type: ignore[arg-type, return-value]
                    candidates=others, serves=serves)


def later() -> float:
    """Judged as of well past the grace period, so no clock races the assertion."""
    return time.monotonic() + GRACE + 5


async def test_a_dead_cluster_is_adopted_only_by_a_worker_serving_all_its_models(
        bus: Bus, uid: str) -> None:
    home, east, blank = f"w{uid}", f"e{uid}", f"u{uid}"
    await bus.provision([*core_streams(), *(gen_stream(c) for c in (home, east, blank))])
    await beat(bus, home, "n0", models=("noop",))
    await beat(bus, east, "n0", models=("digits",))
    await beat(bus, east, "n1", models=("digits", "tiny-text"))
    await beat(bus, blank, "n0", models=())  # its nodes announce no models: nothing known
    noop = failover(bus, home, [east, blank], ["noop"])
    most = failover(bus, home, [east, blank], ["noop", "digits"])
    every = failover(bus, home, [east, blank], ["noop", "digits", "tiny-text"])
    anyway = failover(bus, home, [east, blank], None)  # what it serves is not said
    seen = (noop, most, every, anyway)
    for f in seen:
        await f.board.start()
    late = None
    try:
        await until(lambda: all(f.board.summary(c).healthy
                                for f in seen for c in (home, east, blank)))
        for f in seen:  # each check while east is healthy notes what it serves
            assert f.wanted() == []
        for c, n in ((east, "n0"), (east, "n1"), (blank, "n0")):
            await fleet.drain(bus, c, n, reason="cluster down")
        await until(lambda: all(not f.board.summary(c).healthy
                                for f in seen for c in (east, blank)))
        assert noop.wanted(later()) == [blank]  # east's digits would only bounce here
        assert noop.known_models(east) == frozenset({"digits", "tiny-text"})
        assert most.wanted(later()) == [blank]  # tiny-text too
        assert every.wanted(later()) == [east, blank]
        assert anyway.wanted(later()) == [east, blank]
        # A worker that starts after east died knows its models from the heartbeats
        # the board still holds for its nodes.
        late = failover(bus, home, [east, blank], ["noop"])
        await late.board.start()
        await until(lambda: late.board.summary(east).nodes_drained == 2)
        assert late.wanted(later()) == [blank]
        # Back, then down again with only digits announced: now most may adopt it.
        for n in ("n0", "n1"):
            await fleet.undrain(bus, east, n)
            await beat(bus, east, n, models=("digits",))
        await until(lambda: most.board.summary(east).healthy
                    and most.board.summary(east).models == frozenset({"digits"}))
        assert most.wanted() == []
        for n in ("n0", "n1"):
            await fleet.drain(bus, east, n, reason="cluster down again")
        await until(lambda: not most.board.summary(east).healthy)
        assert most.wanted(later()) == [east, blank]
    finally:
        for f in (*seen, late):
            if f is not None:
                await f.board.stop()
