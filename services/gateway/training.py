"""Training-run and fleet routes.

The gateway validates and records a run with the same code as ``tandem train submit``
(``tandem.common.runs``); the trainer picks it up from ``train.<run>.status``. The fleet
view is the same one ``tandem clusters`` prints (``tandem.common.fleet``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Path, Request, Response
from fastapi.responses import JSONResponse

from tandem.common import fleet, runs
from tandem.common.errors import InvalidRunConfig, InvalidToken, RunExists, RunNotFound
from tandem.common.jobs import Caller

RUN_ID = Path(description="The run id returned by POST /v1/training-runs.", max_length=64)


def _view(rec: Any) -> dict[str, Any]:
    return {
        "run_id": rec.run_id, "state": rec.state.value, "restarts": rec.restarts,
        "latest_step": rec.latest_step, "latest_checkpoint_step": rec.latest_checkpoint_step,
        "latest_checkpoint_uri": rec.latest_checkpoint_uri, "goodput": rec.goodput,
        "incidents": rec.incidents, "nodes": rec.nodes, "config": rec.config,
        "created_at": rec.created_at, "updated_at": rec.updated_at, "owner": rec.owner,
    }


def add_training_routes(app: FastAPI, bus: Any, caller: Callable[[Request], Caller]) -> None:
    @app.post("/v1/training-runs", status_code=202, responses={409: {}, 422: {}})
    async def submit_training_run(config: runs.RunConfig, request: Request,
                                  response: Response) -> Any:
        """Submit a training run (model, data, steps, batch, lr, EMA, checkpoint interval,
        ranks, nodes or cluster, seed). 202 with the run id; the same config under the
        same ``run_id`` is idempotent, a different one is 409."""
        try:
            rec = await runs.submit_run(bus, config, owner=caller(request).key)
        except InvalidRunConfig as exc:
            return JSONResponse(status_code=422, content={"detail": [
                {"type": "value_error", "loc": ["body", *k.split(".")], "msg": v}
                for k, v in exc.problems.items()]})
        except (RunExists, InvalidToken) as exc:
            return JSONResponse(status_code=409 if isinstance(exc, RunExists) else 422,
                                content={"detail": str(exc)})
        url = str(request.url_for("get_training_run", run_id=rec.run_id).path)
        response.headers["Location"] = url
        return {**_view(rec), "status_url": url}

    @app.get("/v1/training-runs/{run_id}", responses={404: {}})
    async def get_training_run(request: Request, run_id: str = RUN_ID) -> Any:
        """A run's state, restarts, latest step and committed checkpoint, goodput and
        incidents. Another API key's run is 404 (unless the key is admin)."""
        try:
            rec = await runs.get_run(bus, run_id)
            if not caller(request).sees(rec.owner):
                raise RunNotFound(run_id)
            return _view(rec)
        except (RunNotFound, InvalidToken) as exc:
            return JSONResponse(status_code=404, content={"detail": str(exc)})


def add_fleet_routes(app: FastAPI, bus: Any) -> None:
    @app.get("/v1/clusters")
    async def list_clusters() -> Any:
        """Each cluster and node: health, drained flag, last heartbeat, GPUs total and
        free, models loaded, and each GPU's latest key metrics."""
        return (await fleet.read_fleet(bus)).to_dict()
