"""The trainer's EMA (what is served) warms up: after k steps it is the EMA of the weights
with decay ``min(ema_decay, (1 + step) / (10 + step))``, step being the global step, so a
resume goes on with the same decays; a checkpoint from before the warm-up existed resumes
with the constant decay it started with."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tandem.common.runs import RunConfig, parse_run_config
from tandem.trainer.async_ckpt import AsyncCheckpointer, load_objects
from tandem.trainer.loop import TrainLoop, ema_decay_at
from tests.test_train_units import TINY_MODEL


def config(**over: object) -> RunConfig:
    return parse_run_config({"model": TINY_MODEL, "ranks": 1, "batch_size": 4, "steps": 8,
                             "device": "cpu", "lr": 1e-2, "warmup_steps": 0,
                             "data": {"kind": "synthetic", "synthetic_size": 64}, **over})


def params(loop: TrainLoop) -> dict[str, torch.Tensor]:
    return {k: p.detach().clone() for k, p in loop.model.named_parameters()}


def replayed_ema(loop: TrainLoop, steps: int, decay_of: object) -> dict[str, torch.Tensor]:
    """Train ``steps`` steps, folding the weights after each into an EMA by hand with the
    decay ``decay_of(step)`` (step: updates applied before this one)."""
    ema = {k: v.clone() for k, v in loop.ema.items()}
    for _ in range(steps):
        step = loop.step
        assert loop.train_step().anomaly is None
        d = decay_of(step)  # type: ignore[operator]
        for k, p in params(loop).items():
            ema[k] = d * ema[k] + (1 - d) * p
    return ema


def assert_ema_is(loop: TrainLoop, expected: dict[str, torch.Tensor]) -> None:
    assert set(loop.ema) == set(expected)
    for k, v in expected.items():
        torch.testing.assert_close(loop.ema[k], v, rtol=1e-5, atol=1e-7, msg=k)


def test_ema_decay_warms_up_to_the_configured_decay() -> None:
    assert [ema_decay_at(0.999, s, True) for s in (0, 1, 80)] == [0.1, 2 / 11, 0.9]
    assert ema_decay_at(0.999, 8990, True) == pytest.approx(0.999)
    assert ema_decay_at(0.999, 50_000, True) == 0.999
    assert ema_decay_at(0.999, 0, False) == 0.999


def test_after_k_steps_the_ema_is_the_warm_up_formulas_average_not_the_initial_weights(
        ) -> None:
    loop = TrainLoop(config())
    initial = params(loop)
    expected = replayed_ema(loop, 6, lambda s: min(0.999, (1 + s) / (10 + s)))
    assert_ema_is(loop, expected)
    # What the user sees: the served weights moved from the random initial ones towards
    # the trained ones (with a constant 0.999 they would still be 99.4% the initial ones).
    now = params(loop)
    moved = sum(float((loop.ema[k] - initial[k]).norm()) for k in now)
    trained = sum(float((now[k] - initial[k]).norm()) for k in now)
    assert moved > 0.5 * trained


def test_ema_warmup_false_keeps_the_constant_decay() -> None:
    loop = TrainLoop(config(ema_warmup=False, ema_decay=0.9))
    assert_ema_is(loop, replayed_ema(loop, 4, lambda s: 0.9))


def test_a_resume_goes_on_with_the_global_steps_decay_bitwise(tmp_path: Path) -> None:
    cfg = config()
    writer = AsyncCheckpointer(tmp_path, "r")
    whole = TrainLoop(cfg)
    for _ in range(3):
        whole.train_step()
    whole.checkpoint(writer)
    writer.close()
    for _ in range(3):
        whole.train_step()
    resumed = TrainLoop(cfg)
    resumed.load(writer.written[0].path)
    assert resumed.step == 3 and resumed.ema_warmup
    for _ in range(3):
        resumed.train_step()
    for k, v in whole.ema.items():
        assert torch.equal(resumed.ema[k], v), k


def test_a_checkpoint_from_before_the_warm_up_resumes_with_the_constant_decay(
        tmp_path: Path) -> None:
    cfg = config()
    writer = AsyncCheckpointer(tmp_path, "r")
    old = TrainLoop(cfg)
    old.ema_warmup = False  # as a trainer before the warm-up trained it
    old.train_step()
    old.checkpoint(writer)
    writer.close()
    path = writer.written[0].path
    state = load_objects(path, "trainer")
    del state["ema_warmup"]  # what an older trainer wrote
    torch.save(state, path / "trainer.pt")
    resumed = TrainLoop(cfg)
    resumed.load(path)
    assert not resumed.ema_warmup
    assert_ema_is(resumed, replayed_ema(resumed, 2, lambda s: cfg.ema_decay))
