"""A model too big to train is refused before it runs: its size is counted from the config
(``tandem.common.model_size``, no torch, so the gateway can count it), exactly as
diffusers builds it; past ``MAX_MODEL_PARAMS`` submission refuses it by every door, and
a coordinator refuses at claim a run whose rank would hold more training state than its
``MAX_RANK_STATE_GB``. Before, each field was bounded but not their product: a UNet of
1.6e9 parameters was recorded, then every attempt of it ran out of memory or crawled
until ``max_restarts`` was spent.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import httpx
import pytest

from tandem.common import model_size
from tandem.common.bus import Bus
from tandem.common.errors import InvalidRunConfig
from tandem.common.events import RunRecord, RunState
from tandem.common.runs import MODEL_PRESETS, parse_run_config, submit_run
from tandem.common.streams import KV_RUNS, core_streams
from tests.test_gateway_training import http  # noqa: F401 (fixture)
from tests.test_train_runs import TINY_DIT, TINY_MODEL, tiny, until
from tests.test_trainer_guards import play_agents
from tests.test_trainer_lifecycle import DEADLINE, Env, env  # noqa: F401 (fixture)

pytestmark = [pytest.mark.timeout(300)]

DOWN = ("DownBlock2D", "AttnDownBlock2D", "ResnetDownsampleBlock2D")
UP = ("UpBlock2D", "AttnUpBlock2D", "ResnetUpsampleBlock2D")
# Within every field's bound (three blocks of Stable Diffusion's widest channels, four
# layers each, attention everywhere), 1,591,512,321 parameters: 31.8 GB of training
# state on every DDP rank.
HUGE = {"sample_size": 64, "block_out_channels": [1280] * 3, "layers_per_block": 4,
        "down_block_types": ["AttnDownBlock2D"] * 3, "up_block_types": ["AttnUpBlock2D"] * 3,
        "norm_num_groups": 32}
HUGE_PARAMS = 1_591_512_321


def _unet(chans: list[int], down: list[str], up: list[str], **over: Any) -> dict[str, Any]:
    return {"block_out_channels": chans, "down_block_types": down, "up_block_types": up,
            "sample_size": 4 * 2 ** (len(chans) - 1), **over}


def _random_models(seed: int, n: int) -> list[dict[str, Any]]:
    """UNets of every block type in any order and channels that are no multiple of the
    attention's 8 (or less than 8), and DiTs of various widths, patches and classes."""
    rng = random.Random(seed)
    out: list[dict[str, Any]] = []
    for _ in range(n):
        blocks, groups = rng.randint(1, 4), rng.choice([1, 2, 3, 4])
        out.append(_unet([groups * rng.randint(1, 12) for _ in range(blocks)],
                         [rng.choice(DOWN) for _ in range(blocks)],
                         [rng.choice(UP) for _ in range(blocks)], norm_num_groups=groups,
                         layers_per_block=rng.randint(1, 3), in_channels=rng.randint(1, 4),
                         num_classes=rng.choice([0, 10, 13])))
        # A DiT's width must be a multiple of 4 to build (its 2D sine position table).
        out.append({"kind": "dit", "num_layers": rng.randint(1, 3),
                    "num_attention_heads": rng.randint(1, 5),
                    "attention_head_dim": 4 * rng.randint(1, 4),
                    "patch_size": rng.choice([1, 2, 4]), "sample_size": 16,
                    "in_channels": rng.randint(1, 4), "num_classes": rng.randint(1, 20)})
    return out


MODELS: list[Any] = [
    {},  # the default: the demo's digits UNet
    TINY_MODEL, TINY_DIT, HUGE, *MODEL_PRESETS,
    _unet([32, 64, 64], list(DOWN), list(UP)),
    _unet([32, 64, 64], list(DOWN[::-1]), list(UP[::-1]), layers_per_block=3),
    _unet([4, 12], ["AttnDownBlock2D"] * 2, ["AttnUpBlock2D"] * 2, norm_num_groups=4),
    _unet([6], ["AttnDownBlock2D"], ["ResnetUpsampleBlock2D"], norm_num_groups=3,
          num_classes=0, in_channels=3),
    {"kind": "dit", "num_layers": 2, "num_attention_heads": 16, "attention_head_dim": 128,
     "num_classes": 1000, "patch_size": 1},
    *_random_models(seed=20261207, n=20),
]


# An attention of fewer than 8 channels has no heads: diffusers builds it empty, and torch
# warns that initialising its empty q, k and v does nothing.
@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors:UserWarning")
@pytest.mark.parametrize("model", MODELS, ids=lambda m: m if isinstance(m, str) else None)
def test_the_count_from_the_config_is_the_built_models_exactly(model: Any) -> None:
    """Against the model a rank builds (``loop.build_model``), on torch's meta device:
    shapes only, so a 1.6e9-parameter UNet costs nothing here."""
    torch = pytest.importorskip("torch")
    from tandem.trainer.loop import build_model

    cfg = parse_run_config({"model": model, "data": {"kind": "synthetic"}})
    with torch.device("meta"):
        built = build_model(cfg)
    assert model_size.parameters(cfg.model) == sum(p.numel() for p in built.parameters())


def test_a_rank_holds_twenty_bytes_a_parameter_and_with_fsdp_only_its_share() -> None:
    ddp = parse_run_config({"model": "dit-b", "ranks": 4})
    fsdp = parse_run_config({"model": "dit-b", "ranks": 4, "parallelism": "fsdp"})
    params = model_size.parameters(ddp.model)
    assert params == 147_427_600
    assert model_size.rank_state_bytes(ddp) == 20 * params
    assert model_size.rank_state_bytes(fsdp) == 5 * params
    reason = model_size.rank_state_over(ddp, 2.0)
    assert reason is not None
    assert "2.95 GB" in reason and "1.47e8 parameters" in reason and "2 GB" in reason
    assert "TANDEM_MAX_RANK_STATE_GB" in reason
    assert model_size.rank_state_over(fsdp, 2.0) is None  # 0.74 GB a rank


@pytest.mark.parametrize("config", [
    {},  # the demo's (its DemoPlan changes no model field)
    {"model": "dit-b"}, {"model": "dit-b", "parallelism": "fsdp"},
    {"model": TINY_MODEL}, {"model": TINY_DIT},
], ids=["demo", "dit-b", "dit-b-fsdp", "tiny-unet", "tiny-dit"])
def test_the_models_the_project_trains_fit_both_limits(config: dict[str, Any]) -> None:
    cfg = parse_run_config(config)
    model_size.check(cfg)
    assert model_size.rank_state_over(cfg, 8.0) is None  # the trainer's default


def _assert_names_the_figures(message: str) -> None:
    assert "1.59e9 parameters" in message and f"{HUGE_PARAMS:,}" in message
    assert "limit 1e9 (MAX_MODEL_PARAMS)" in message and "31.8 GB" in message


async def test_a_model_too_big_to_train_is_refused_at_submission_naming_both_figures(
        bus: Bus) -> None:
    """It passes every field's bound; it is refused before it is recorded, naming the
    model, its parameters, the limit and the training state it would take."""
    await bus.provision(core_streams())
    with pytest.raises(InvalidRunConfig) as exc:
        await submit_run(bus, {"run_id": "huge", "model": HUGE})
    assert set(exc.value.problems) == {"model"}
    _assert_names_the_figures(exc.value.problems["model"])
    assert await (await bus.typed(KV_RUNS, RunRecord)).get("huge") is None


async def test_the_gateways_door_refuses_it_422_naming_the_model(
        http: httpx.AsyncClient) -> None:  # noqa: F811 (fixture)
    """The HTTP door validates with the same ``submit_run`` as the CLI and the bus door
    (``training.submit_training``)."""
    r = await http.post("/v1/training-runs", json={"run_id": "huge-http", "model": HUGE})
    assert r.status_code == 422, r.text
    [problem] = r.json()["detail"]
    assert problem["loc"] == ["body", "model"]
    _assert_names_the_figures(problem["msg"])
    assert (await http.get("/v1/training-runs/huge-http")).status_code == 404


async def test_a_coordinator_refuses_a_run_whose_rank_would_hold_more_than_its_limit(
        env: Env) -> None:  # noqa: F811 (fixture)
    """The tiny UNet (164,625 parameters) holds 3.29 MB a rank: past a 1 MB limit, its
    run fails at claim with both figures, and nothing is launched."""
    env.coordinator(max_rank_state_gb="0.001")
    await submit_run(env.bus, tiny("over", cluster=env.cluster, ranks=1, nodes=["n0"]))
    rec = await until(env.bus, "over", lambda r: r.state.terminal, timeout=DEADLINE)
    assert rec.state == RunState.failed and rec.restarts == 0 and rec.attempt == 0
    [incident] = rec.incidents
    assert incident["kind"] == "invalid_config"
    assert "0.00329 GB" in incident["reason"] and "1.65e5 parameters" in incident["reason"]
    assert "limit of 0.001 GB a rank (TANDEM_MAX_RANK_STATE_GB)" in incident["reason"]
    assert not (env.root / "work" / "over").exists()


async def test_a_run_adopted_by_a_coordinator_of_a_lower_limit_goes_on(
        env: Env) -> None:  # noqa: F811 (fixture)
    """Its size was judged when it was claimed: the coordinator that adopts it after a
    restart (kill -9), with a limit the run is past, orders its next attempt rather than
    failing a run it had let through. The test plays the node agent: nothing launches."""
    orders = await play_agents(env.bus, env.cluster, ["n0"])
    first = env.coordinator(launcher="nodes", agent_lost_after_s="600")
    await submit_run(env.bus, tiny("adopted", cluster=env.cluster, ranks=1, nodes=["n0"],
                                   watchdog={"startup_timeout_s": 3600}))
    assert (await asyncio.wait_for(orders.get(), DEADLINE)).attempt == 1
    first.kill()
    first.wait()
    env.coordinator(launcher="nodes", agent_lost_after_s="600", max_rank_state_gb="0.001")
    rec = await until(env.bus, "adopted", lambda r: r.attempt == 2 or r.state.terminal,
                      timeout=DEADLINE)
    assert not rec.state.terminal, rec.incidents
    assert [i["kind"] for i in rec.incidents] == ["coordinator_restart"]
