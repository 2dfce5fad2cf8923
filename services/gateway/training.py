"""Training-run and fleet routes.

The gateway validates and records a run with the same code as ``tandem train submit``
(``tandem.common.runs``); the trainer picks it up from ``train.<run>.status``. The fleet
view is the same one ``tandem clusters`` prints (``tandem.common.fleet``).

A pending run's view says what it waits for (``waiting_for``): a run pinned to a cluster
where no trainer coordinator has ever started stays pending until one does, and said
nothing (``train(cluster="east")`` on ``tandem dev up``, whose trainer is ``control``'s).
Coordinators announce themselves only by their durable, ``trainer-<cluster>`` on
``TRAIN``, made by the first one of a cluster to start: so "none has started" is known,
"none is running now" is not (a durable outlives its coordinators).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from fastapi import FastAPI, Path, Request, Response
from nats.errors import Error as NatsError
from nats.js.errors import NotFoundError

from tandem.common import fleet, runs, subjects
from tandem.common.errors import InvalidRunConfig, InvalidToken, RunExists, RunNotFound
from tandem.common.events import RunRecord, RunState
from tandem.common.jobs import TOKEN, Caller, JobRefused
from tandem.common.streams import HEARTBEAT_TTL, TRAIN, trainer_consumer
from tandem.gateway.auth import Denied, Limits
from tandem.gateway.schemas import RunSubmitted, RunView, refused

# A token, as every run id: "a.b" is a 422 naming it, not a 404 for a run that cannot exist.
RUN_ID = Path(description="The run id returned by POST /v1/training-runs.", pattern=TOKEN)


# parse_run_config's names for a problem of the config as a whole (not a mapping; a check
# across fields that blames none): the body itself, as FastAPI's loc ["body"].
_WHOLE_CONFIG = ("", "(config)")


def _problems(exc: InvalidRunConfig, config: Any) -> list[dict[str, Any]]:
    """A refused run config as the 422 items of every door (FastAPI's shape, as for a
    generation): ``loc`` the field's path, or the body itself for the config as a whole,
    and ``input`` what was sent there (None when the field was not sent)."""
    body = config.model_dump(mode="json") if isinstance(config, runs.RunConfig) else config
    out = []
    for path, msg in exc.problems.items():
        parts = [] if path in _WHOLE_CONFIG else path.split(".")
        out.append({"type": "value_error", "loc": ["body", *parts], "msg": msg,
                    "input": _at(body, parts)})
    return out


def _at(value: Any, path: list[str]) -> Any:
    """What ``value`` holds at ``path`` (keys and list indices); None if nothing."""
    for part in path:
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            return None
    return value


async def submit_training(bus: Any, config: Any, caller: Caller,
                          limits: Limits | None = None,
                          clusters: Sequence[str] = ()) -> RunRecord:
    """A run from any door, validated and recorded for ``caller`` by the same code as
    ``tandem train submit`` (``runs.submit_run``), within the caller's limit of unfinished
    runs (``limits``, shared by the doors) and, when given, to one of ``clusters``;
    ``JobRefused`` saying why not."""
    try:
        if limits is None:
            return await runs.submit_run(bus, config, owner=caller.key, clusters=clusters)
        async with limits.run_limit(caller) as limit:
            return await runs.submit_run(bus, config, owner=caller.key, max_unfinished=limit,
                                         clusters=clusters)
    except Denied as exc:
        raise JobRefused(exc.status, exc.message, retry_after=exc.retry_after) from None
    except InvalidRunConfig as exc:
        raise JobRefused(422, _problems(exc, config)) from None
    except RunExists as exc:
        raise JobRefused(409, str(exc)) from None
    except InvalidToken as exc:
        raise JobRefused(422, str(exc)) from None


async def training_run(bus: Any, run_id: str, caller: Caller) -> RunRecord:
    """The run's record; ``JobRefused(404)`` when there is none or it is another key's."""
    try:
        rec = await runs.get_run(bus, run_id)
    except (RunNotFound, InvalidToken) as exc:
        raise JobRefused(404, str(exc)) from None
    if not caller.sees(rec.owner):
        raise JobRefused(404, str(RunNotFound(run_id)))
    return rec


async def cancel_training(bus: Any, run_id: str, caller: Caller) -> RunRecord:
    """Cancel the caller's run (``runs.cancel_run``); 404 as ``training_run``, 409 when it
    has already finished."""
    await training_run(bus, run_id, caller)
    try:
        rec = await runs.cancel_run(bus, run_id)
    except RunNotFound as exc:
        raise JobRefused(404, str(exc)) from None
    if rec.state.terminal and rec.state != RunState.cancelled:
        raise JobRefused(409, f"run {run_id} already {rec.state.value}")
    return rec


async def coordinator_started(bus: Any, cluster: str) -> bool | None:
    """Whether a trainer coordinator of ``cluster`` has ever started on this bus (its
    durable ``trainer-<cluster>`` exists); None when the bus would not say."""
    try:
        await bus.js.consumer_info(TRAIN, trainer_consumer(cluster).durable)
    except NotFoundError:
        return False
    except NatsError:  # the view is answered all the same, without the hint
        return None
    return True


async def waiting_for(bus: Any, rec: RunRecord, clusters: Sequence[str] = ()) -> str:
    """Why ``rec`` has not started, for a pending run no coordinator has claimed yet;
    empty otherwise. When its cluster has never had a coordinator, says so and names those
    of ``clusters`` (where this gateway sends runs) that have."""
    if rec.state != RunState.pending or rec.coordinator or rec.cancel:
        return ""
    cluster = rec.config.get("cluster") or ""
    if not cluster:
        return "waiting for a trainer coordinator (of any cluster) to claim it"
    waits = f"waiting for a trainer coordinator of cluster {cluster!r} to claim it"
    if await coordinator_started(bus, cluster) is not False:
        return waits
    started = [c for c in clusters if c != cluster and await coordinator_started(bus, c)]
    elsewhere = (f"clusters with one: {', '.join(started)}" if started
                 else "none has started on any cluster runs go to here")
    return (f"{waits}; none has ever started there, so it stays pending until one does "
            f"({elsewhere}; a run naming no cluster goes to any)")


async def run_answer(bus: Any, rec: RunRecord, clusters: Sequence[str] = ()) -> dict[str, Any]:
    """``run_view`` with ``waiting`` filled in (``waiting_for``)."""
    return run_view(rec, await waiting_for(bus, rec, clusters))


def run_view(rec: RunRecord, waiting: str = "") -> dict[str, Any]:
    """A run as every door shows it (``RunView``), with the subject its events come on."""
    return RunView(
        run_id=rec.run_id, state=rec.state, cancel_requested=bool(rec.cancel),
        cancel_reason=rec.cancel, restarts=rec.restarts, latest_step=rec.latest_step,
        latest_checkpoint_step=rec.latest_checkpoint_step,
        latest_checkpoint_uri=rec.latest_checkpoint_uri, goodput=rec.goodput,
        incidents=rec.incidents, nodes=rec.nodes, config=runs.filled(rec.config),
        created_at=rec.created_at, updated_at=rec.updated_at, owner=rec.owner,
        status_subject=subjects.train(rec.run_id, "status"), waiting=waiting,
    ).model_dump(mode="json")


def add_training_routes(app: FastAPI, bus: Any, caller: Callable[[Request], Caller],
                        limits: Limits | None = None, clusters: Sequence[str] = ()) -> None:
    @app.post("/v1/training-runs", status_code=202, response_model=RunSubmitted,
              responses={409: {}, 422: {}})
    async def submit_training_run(config: runs.RunConfig, request: Request,
                                  response: Response) -> Any:
        """Submit a training run (model, data, steps, batch, lr, EMA, checkpoint interval,
        ranks, nodes or cluster, seed). 202 with the run id; the same config under the
        same ``run_id`` is idempotent, a different one (or another key's) is 409."""
        try:
            rec = await submit_training(bus, config, caller(request), limits, clusters)
        except JobRefused as exc:
            return refused(exc)
        url = str(request.url_for("get_training_run", run_id=rec.run_id).path)
        response.headers["Location"] = url
        return {**await run_answer(bus, rec, clusters), "status_url": url}

    @app.get("/v1/training-runs/{run_id}", response_model=RunView, responses={404: {}})
    async def get_training_run(request: Request, run_id: str = RUN_ID) -> Any:
        """A run's state, restarts, latest step and committed checkpoint, goodput and
        incidents. Another API key's run is 404 (unless the key is admin)."""
        try:
            return await run_answer(bus, await training_run(bus, run_id, caller(request)),
                                    clusters)
        except JobRefused as exc:
            return refused(exc)

    @app.delete("/v1/training-runs/{run_id}", response_model=RunView,
                responses={404: {}, 409: {}})
    async def cancel_training_run(request: Request, run_id: str = RUN_ID) -> Any:
        """Cancel a run: a pending one never starts (``cancelled`` at once); a running
        one answers ``cancel_requested`` in its state of the moment, then its ranks are
        stopped by its coordinator and it ends ``cancelled``."""
        try:
            return run_view(await cancel_training(bus, run_id, caller(request)))
        except JobRefused as exc:
            return refused(exc)


def add_fleet_routes(app: FastAPI, bus: Any, ttl: float = HEARTBEAT_TTL) -> None:
    """``ttl``: the gateway's heartbeat freshness, as its routing and /metrics judge."""
    @app.get("/v1/clusters")
    async def list_clusters() -> Any:
        """Each cluster and node: health, drained flag, last heartbeat, GPUs total and
        free, models loaded, and each GPU's latest key metrics."""
        return (await fleet.read_fleet(bus, ttl)).to_dict()
