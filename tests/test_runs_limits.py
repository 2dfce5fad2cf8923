"""A run config refuses numbers the trainer cannot use: a float that is not finite
(stored as JSON null, the run then refused by the trainer after the 202), a seed the
loop's derived generator seeds would overflow, more nodes than a run can use, and a
config whose run record would not fit the bus. The error names the field."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from tandem.common.bus import Bus
from tandem.common.errors import InvalidRunConfig
from tandem.common.events import RunRecord
from tandem.common.runs import MAX_NODES, SEED_MAX, parse_run_config, submit_run
from tandem.common.streams import KV_RUNS, core_streams


@pytest.mark.parametrize("field", ["lr", "grad_clip", "weight_decay"])
@pytest.mark.parametrize("value", [float("inf"), "Infinity", float("nan"),
                                   json.loads('{"x": 1e999}')["x"]])
def test_a_float_that_is_not_finite_is_refused_naming_its_field(field: str, value: object
                                                                ) -> None:
    with pytest.raises(InvalidRunConfig) as exc:
        parse_run_config({field: value})
    assert set(exc.value.problems) == {field}
    assert "finite" in exc.value.problems[field]


def test_a_nested_float_that_is_not_finite_is_refused_naming_its_path() -> None:
    with pytest.raises(InvalidRunConfig) as exc:
        parse_run_config({"watchdog": {"backoff_max_s": float("inf")}})
    assert set(exc.value.problems) == {"watchdog.backoff_max_s"}


@pytest.mark.parametrize("seed", [2**48, SEED_MAX + 1, -1])
def test_a_seed_outside_what_the_loop_can_derive_from_is_refused(seed: int) -> None:
    with pytest.raises(InvalidRunConfig) as exc:
        parse_run_config({"seed": seed})
    assert set(exc.value.problems) == {"seed"}
    assert str(SEED_MAX) in exc.value.problems["seed"]


def test_the_largest_seed_fits_torch_generators_of_every_rank() -> None:
    torch = pytest.importorskip("torch")
    cfg = parse_run_config({"seed": SEED_MAX, "ranks": 1024, "batch_size": 1})
    # what TrainLoop and BatchPlan derive from it (loop.py, data.py)
    torch.Generator().manual_seed(cfg.seed * 100_003 + cfg.ranks)
    torch.Generator().manual_seed(cfg.seed * 7919 + 10**6)
    assert cfg.seed == SEED_MAX


def test_more_nodes_than_a_run_can_use_are_refused_naming_the_field() -> None:
    nodes = [f"node-{i:05d}" for i in range(MAX_NODES + 1)]
    with pytest.raises(InvalidRunConfig) as exc:
        parse_run_config({"ranks": 8, "nodes": nodes})
    assert set(exc.value.problems) == {"nodes"}


async def test_a_run_whose_record_would_not_fit_the_bus_is_refused_naming_the_field(
        bus: Bus) -> None:
    """A config that validates but whose KV record would outgrow the bus's max_payload
    (with what the run adds to it): refused as invalid (422 at the door), naming its
    largest field, never a bus error a client would retry (503) forever."""
    await bus.provision(core_streams())
    nodes = [f"node-{i:04d}-".ljust(64, "x") for i in range(MAX_NODES)]
    assert await submit_run(bus, {"run_id": "most-nodes", "ranks": 8, "nodes": nodes})
    with pytest.raises(InvalidRunConfig) as exc:
        await submit_run(bus, {"run_id": "huge", "ranks": 8,
                               "faults": {"nan_at_data_pos": list(range(200_000))}})
    assert set(exc.value.problems) == {"faults"}
    assert "max_payload" in exc.value.problems["faults"]
    assert await (await bus.typed(KV_RUNS, RunRecord)).get("huge") is None


# ---------------------------------------------------- configs that validate but cannot train

_FOLDER = {"kind": "image_folder", "path": "x"}


@pytest.mark.parametrize(("config", "field"), [
    ({"model": {"block_out_channels": [], "down_block_types": [], "up_block_types": []}},
     "model.block_out_channels"),
    ({"model": {"block_out_channels": [0, 0, 0]}}, "model.block_out_channels.0"),
    ({"model": {"block_out_channels": [-8, 16, 16]}}, "model.block_out_channels.0"),
    ({"model": {"block_out_channels": [4096, 4096, 4096]}}, "model.block_out_channels.0"),
    ({"model": {"down_block_types": ["Nope", "AttnDownBlock2D", "DownBlock2D"]}},
     "model.down_block_types.0"),
    ({"model": {"up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"]}},
     "model.up_block_types.1"),
    ({"model": {"num_train_timesteps": 10**10}}, "model.num_train_timesteps"),
    ({"model": {"num_classes": 10**9}}, "model.num_classes"),
    ({"model": {"kind": "dit", "num_attention_heads": 4096}}, "model.num_attention_heads"),
    ({"model": {"kind": "dit", "attention_head_dim": 4096}}, "model.attention_head_dim"),
    ({"model": {"norm_num_groups": 10**6}}, "model.norm_num_groups"),
    ({"data": {"kind": "synthetic", "synthetic_size": 10**9}}, "data.synthetic_size"),
    ({"data": {"kind": "synthetic", "synthetic_size": 1_000_000},
      "model": {"sample_size": 256, "in_channels": 3}}, "data.synthetic_size"),
    ({"model": {"in_channels": 2}, "data": _FOLDER}, "model.in_channels"),
    ({"model": {"in_channels": 4}, "data": _FOLDER}, "model.in_channels"),
    ({"batch_size": 2000, "ranks": 1}, "batch_size"),
    ({"batch_size": 1000, "ranks": 2}, "batch_size"),
    ({"data": {"kind": "synthetic", "synthetic_size": 1}}, "batch_size"),
    ({"model": {"num_classes": 5}}, "model.num_classes"),
    ({"model": {"kind": "dit", "num_classes": 1}}, "model.num_classes"),
])
def test_a_config_that_cannot_build_or_train_is_refused_naming_the_field(
        config: dict[str, object], field: str) -> None:
    """Each of these validated before and failed only in the ranks (a model of no or
    negative channels, a block that needs cross-attention, a table or data set no node
    holds, a batch larger than the data set, labels past the class table)."""
    with pytest.raises(InvalidRunConfig) as exc:
        parse_run_config(config)
    assert field in exc.value.problems, exc.value.problems


@pytest.mark.parametrize("config", [
    {"model": {"down_block_types": ["ResnetDownsampleBlock2D", "AttnDownBlock2D", "DownBlock2D"],
               "up_block_types": ["ResnetUpsampleBlock2D", "AttnUpBlock2D", "UpBlock2D"]}},
    {"model": {"num_classes": 0}},  # unconditional on the digits: the labels are unused
    {"model": {"in_channels": 3}, "data": _FOLDER},
    {"batch_size": 1, "ranks": 1024},
    {"data": {"kind": "synthetic", "synthetic_size": 64}, "batch_size": 32},
])
def test_configs_at_the_edges_of_what_trains_are_accepted(config: dict[str, object]) -> None:
    parse_run_config(config)


async def test_submit_refuses_a_batch_larger_than_the_data_set(bus: Bus) -> None:
    """Refused before the run is recorded (422 at the door), not restarted by the trainer
    until its restarts are spent."""
    await bus.provision(core_streams())
    with pytest.raises(InvalidRunConfig) as exc:
        await submit_run(bus, {"run_id": "toobig", "ranks": 1, "batch_size": 2000})
    assert set(exc.value.problems) == {"batch_size"}
    assert "1797" in exc.value.problems["batch_size"]
    assert await (await bus.typed(KV_RUNS, RunRecord)).get("toobig") is None


async def test_a_record_that_does_not_decode_blocks_no_submission_and_no_reader(
        bus: Bus) -> None:
    """One unreadable record in KV runs (written by hand, or through a bug) made every
    submission with a limit fail after its own record was written (a 500 whose run then
    ran anyway, claimed unannounced), and every reader of the whole bucket with it."""
    await bus.provision(core_streams())
    await (await bus.js.key_value(KV_RUNS)).put("junk", b'{"detail": "not a run"}')
    rec = await submit_run(bus, {"run_id": "fine"}, owner="alice", max_unfinished=2)
    assert rec.run_id == "fine"
    runs = await bus.typed(KV_RUNS, RunRecord)
    assert set(await runs.items()) == {"fine"}
    assert set(await runs.entries()) == {"fine"}


async def test_a_run_for_a_cluster_the_caller_does_not_send_to_is_refused_naming_them(
        bus: Bus) -> None:
    await bus.provision(core_streams())
    with pytest.raises(InvalidRunConfig) as exc:
        await submit_run(bus, {"run_id": "north", "cluster": "north"},
                         clusters=["east", "west"])
    assert set(exc.value.problems) == {"cluster"}
    assert "east, west" in exc.value.problems["cluster"]
    assert await (await bus.typed(KV_RUNS, RunRecord)).get("north") is None
    assert (await submit_run(bus, {"run_id": "east-run", "cluster": "east"},
                             clusters=["east", "west"])).run_id == "east-run"


async def test_a_submission_whose_count_fails_leaves_no_run_behind(
        bus: Bus, monkeypatch: pytest.MonkeyPatch) -> None:
    """An error after the run's record was written (the count of the key's runs: the bus
    timing out) is the caller's error to retry: the record must not stay, or a
    coordinator claims it unannounced and the retry makes a second run."""
    from nats.errors import TimeoutError as NatsTimeout

    from tandem.common.bus import TypedKV

    await bus.provision(core_streams())

    async def times_out(self: TypedKV[RunRecord]) -> dict[str, tuple[RunRecord, int]]:
        raise NatsTimeout

    monkeypatch.setattr(TypedKV, "entries", times_out)
    with pytest.raises(NatsTimeout):
        await submit_run(bus, {"run_id": "counted"}, owner="alice", max_unfinished=2)
    assert await (await bus.typed(KV_RUNS, RunRecord)).get("counted") is None


@pytest.mark.parametrize("value", [True, "5", 5.0])
@pytest.mark.parametrize(("field", "config"), [
    ("steps", lambda v: {"steps": v}),
    ("model.sample_size", lambda v: {"model": {"sample_size": v}}),
    ("model.block_out_channels.0", lambda v: {"model": {"block_out_channels": [v, 64, 64]}}),
])
def test_a_whole_number_given_as_another_type_is_refused_naming_its_field(
        field: str, config: Callable[[object], dict[str, object]], value: object) -> None:
    """``"steps": true`` trained 1 step, ``"5"`` and ``5.0`` 5: the schema says integer."""
    with pytest.raises(InvalidRunConfig) as exc:
        parse_run_config(config(value))
    assert set(exc.value.problems) == {field}
