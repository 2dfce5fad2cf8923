"""What a newcomer starts from: the example run config the README points at is a valid
run that trains, and the built-in ``digits`` model says that its weights are random and
how to serve a trained run instead."""

from __future__ import annotations

import math
from pathlib import Path

from tandem.cli.train import load_config
from tandem.common.models import default_registry
from tandem.common.runs import parse_run_config

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = "examples/run.toml"


def test_the_readme_submits_the_example_run_config_that_exists() -> None:
    assert f"tandem train submit {EXAMPLE}" in (ROOT / "README.md").read_text()
    assert (ROOT / EXAMPLE).is_file()


def test_the_example_run_config_is_what_train_submit_sends_and_it_validates() -> None:
    # train submit's own reading of the file (load_config), then the validation every
    # door applies to a submission (parse_run_config), with an override as in the comment.
    cfg = parse_run_config(load_config(str(ROOT / EXAMPLE), ["steps=50"], "mydigits"))
    assert (cfg.run_id, cfg.steps, cfg.data.kind, cfg.ranks) == ("mydigits", 50, "digits", 1)
    assert cfg.ema_warmup and cfg.device == "cpu"


def test_the_example_run_config_trains_a_step() -> None:
    from tandem.trainer.loop import TrainLoop

    loop = TrainLoop(parse_run_config(load_config(str(ROOT / EXAMPLE))))
    result = loop.train_step()
    assert result.anomaly is None and math.isfinite(result.loss) and loop.step == 1


def test_the_builtin_digits_model_says_its_weights_are_random_and_how_to_serve_a_run() -> None:
    digits = default_registry().get("digits")
    assert digits is not None
    assert "random weights" in digits.description
    assert "TANDEM_MODELS" in digits.description and "run:<run_id>" in digits.description
    recipe = (ROOT / "docs/local-stack.md").read_text()
    assert "TANDEM_MODELS=" in recipe and f"train submit {EXAMPLE}" in recipe
