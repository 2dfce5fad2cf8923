"""A run whose config validates but cannot be built or trained: the rank says so
(``channel.Invalid``) and the coordinator ends the run ``failed`` at once, with an
incident ``invalid_config`` naming the error, instead of restarting it until
``max_restarts`` is spent; and the image-folder loader, which refuses what would escape
the data root, hang a rank or train on wrong labels, naming it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.common.events import RunState
from tandem.common.runs import submit_run
from tests.test_train_runs import tiny, until
from tests.test_trainer_lifecycle import Env, env  # noqa: F401 (fixture)

pytestmark = [pytest.mark.timeout(300)]


async def test_a_config_a_rank_cannot_build_fails_the_run_at_once_with_its_reason(
        env: Env, tmp_path: Path) -> None:  # noqa: F811 (fixture)
    """The data set is not there: the rank's error ends the run failed, not restarted,
    with the rank's reason in the incident (it was only in the agent's log)."""
    env.coordinator()
    missing = tmp_path / "no-such-data-set"
    await submit_run(env.bus, tiny("invalid", cluster=env.cluster, ranks=1, data={
        "kind": "image_folder", "path": str(missing)}))
    rec = await until(env.bus, "invalid", lambda r: r.state.terminal, timeout=240)
    assert rec.state == RunState.failed
    assert rec.restarts == 0
    last = rec.incidents[-1]
    assert last["kind"] == "invalid_config"
    assert str(missing) in last["reason"] and "not a directory" in last["reason"]
    assert [i["kind"] for i in rec.incidents] == ["invalid_config"]


def _png(path: Path, value: int = 128, size: int = 8) -> None:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("L", (size, size), color=value).save(path)


def _data_set(root: Path, classes: int = 2, images: int = 4) -> Path:
    for c in range(classes):
        for i in range(images):
            _png(root / f"c{c}" / f"{i}.png", 20 * c + i)
    return root


async def test_a_class_folder_linked_out_of_the_data_root_fails_the_run_naming_it(
        env: Env, tmp_path: Path) -> None:  # noqa: F811 (fixture)
    """The coordinator confines ``data.path`` (top level) and hands its ``DATA_ROOT`` to
    the ranks, whose loader refuses a class folder that a symlink takes out of it."""
    root, outside = tmp_path / "data", tmp_path / "outside"
    _data_set(root / "ds")
    _data_set(outside, classes=1)
    (root / "ds" / "c9").symlink_to(outside / "c0")
    env.coordinator(data_root=str(root))
    await submit_run(env.bus, tiny("escape", cluster=env.cluster, ranks=1, batch_size=4,
                                   data={"kind": "image_folder", "path": "ds"}))
    rec = await until(env.bus, "escape", lambda r: r.state.terminal, timeout=240)
    assert rec.state == RunState.failed and rec.restarts == 0
    assert rec.incidents[-1]["kind"] == "invalid_config"
    assert "c9" in rec.incidents[-1]["reason"]
    assert "outside the data root" in rec.incidents[-1]["reason"]


def test_the_loader_refuses_what_resolves_outside_the_data_root(tmp_path: Path) -> None:
    from tandem.trainer.data import load_image_folder

    root, outside = tmp_path / "data", tmp_path / "outside"
    _data_set(outside, classes=1)
    linked_class = _data_set(root / "classlink")
    (linked_class / "c9").symlink_to(outside / "c0")
    linked_file = _data_set(root / "filelink")
    (linked_file / "c0" / "zz.png").symlink_to(outside / "c0" / "0.png")
    for ds, name in ((linked_class, "c9"), (linked_file, "zz.png")):
        with pytest.raises(ValueError, match="outside the data root") as exc:
            load_image_folder(str(ds), 8, 1, 10, str(root))
        assert name in str(exc.value)
    # inside the root, a symlink is followed; with no root (DATA_ROOT empty) any path
    (root / "filelink" / "c1" / "zz.png").symlink_to(root / "filelink" / "c1" / "0.png")
    x, y = load_image_folder(str(root / "filelink"), 8, 1, 10, "")
    assert len(x) == 10 and sorted(set(y.tolist())) == [0, 1]


@pytest.mark.parametrize(("bad", "says"), [
    ("fifo", "is not a regular file"),
    ("folder", "is not a regular file"),
    ("truncated", "is not a readable image"),
    ("garbage", "is not a readable image"),
])
def test_the_loader_refuses_a_file_that_is_not_a_readable_image_naming_it(
        tmp_path: Path, bad: str, says: str) -> None:
    """A FIFO named ``zz.png`` would block the rank for ever in ``open``; the others
    failed with PIL's error, which did not say which file."""
    import os

    from tandem.trainer.data import load_image_folder

    ds = _data_set(tmp_path / "ds")
    zz = ds / "c0" / "zz.png"
    if bad == "fifo":
        os.mkfifo(zz)
    elif bad == "folder":
        zz.mkdir()
    elif bad == "truncated":
        whole = (ds / "c0" / "0.png").read_bytes()
        zz.write_bytes(whole[:len(whole) // 2])
    else:
        zz.write_text("not an image")
    with pytest.raises(ValueError, match=says) as exc:
        load_image_folder(str(ds), 8, 1, 10, str(tmp_path))
    assert str(zz) in str(exc.value)


def test_more_class_folders_than_classes_are_refused_naming_both_counts(
        tmp_path: Path) -> None:
    from tandem.trainer.data import load_image_folder

    ds = _data_set(tmp_path / "ds", classes=12, images=1)
    with pytest.raises(ValueError, match=r"12 class folders, more than model.num_classes \(10\)"):
        load_image_folder(str(ds), 8, 1, 10)
    assert len(load_image_folder(str(ds), 8, 1, 0)[0]) == 12  # unconditional: labels unused


def test_labels_past_the_class_table_are_refused_before_training(tmp_path: Path) -> None:
    """A DiT's table has a row past ``num_classes``, its null class: labels up to 9 with
    ``num_classes`` 9 trained the digit 9 as the null class, silently."""
    from tandem.common.runs import parse_run_config
    from tandem.trainer.loop import TrainLoop

    cfg = parse_run_config({"ranks": 1, "batch_size": 8, "device": "cpu", "model": {
        "kind": "dit", "sample_size": 8, "num_layers": 1, "num_attention_heads": 2,
        "attention_head_dim": 8, "patch_size": 2}})
    # validation refuses it for the digits (num_classes < 10): past it, as a rank sees it
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"num_classes": 9})})
    with pytest.raises(ValueError, match=r"labels up to 9, past model.num_classes \(9\)"):
        TrainLoop(cfg)
