"""Storage safety: ids are validated before they become subjects or S3 keys, nothing from
storage is unpickled, and checkpoint and model paths must stay inside their roots."""

from __future__ import annotations

import ast
import inspect
import os
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.cli.devstack import S3Server
from tandem.common import checkpoints as ck
from tandem.common import subjects
from tandem.common.bus import Bus
from tandem.common.errors import InvalidToken, SettingsError
from tandem.common.events import DeadLetter, RunRecord, decode
from tandem.common.models import RegistrySettings
from tandem.common.settings import Settings, load
from tandem.common.storage import s3_client
from tandem.common.streams import DLQ, KV_RUNS
from tests.checkpoint_support import mirror_subject, write_checkpoint, written
from tests.conftest import ROOT
from tests.test_checkpointer import running, until

UNSAFE = ["", "a.b", "*", ">", "a b", "../x", "a/b", "x" * 65, "é", "a\nb", "a\x00"]
CODE = sorted(p for d in ("libs", "services") for p in (ROOT / d).rglob("*.py"))


# ------------------------------------------------------------------------------ ids and keys


@settings(max_examples=300, deadline=None, database=None)
@given(st.text(max_size=80))
def test_a_token_that_passes_can_never_widen_a_subject_or_escape_a_key(value: str) -> None:
    try:
        subjects.token(value)
    except InvalidToken:
        return
    assert 1 <= len(value) <= subjects.MAX_TOKEN
    assert not set(value) & set(". *>/\\\t\n\r\x00") and value.isascii()


@settings(max_examples=300, deadline=None, database=None)
@given(st.one_of(st.text(max_size=80), st.from_regex(
    r"[a-z0-9]([-a-z0-9]{0,8}[a-z0-9])?(\.[a-z0-9]([-a-z0-9]{0,8}[a-z0-9])?){1,3}",
    fullmatch=True)))
def test_a_node_name_that_passes_is_a_token_whatever_its_dots(value: str) -> None:
    """``subjects.node`` maps a Kubernetes name's dots; what it returns is a token."""
    try:
        got = subjects.node(value)
    except InvalidToken:
        return
    assert subjects.token(got) == got and got == value.replace(".", "_")
    assert "." not in value or "_" not in value  # "a_b.c" and "a.b.c" never meet


VALID = {"lane_": "batch", "kind": "status", "step": 3, "bucket": "b", "lineage": 1}


def _builders() -> list[tuple[str, Any]]:
    """Every builder of a subject or S3 key that takes an id."""
    fns = [(n, f) for n, f in vars(subjects).items()
           if inspect.isfunction(f) and f.__module__ == subjects.__name__
           and n not in ("token", "token_list", "node", "lane", "is_inbox")]  # a test
    fns += [("ck.run_prefix", ck.run_prefix), ("ck.step_prefix", ck.step_prefix),
            ("ck.checkpoint_uri", ck.checkpoint_uri)]
    return [(n, f) for n, f in fns if set(inspect.signature(f).parameters) - set(VALID)]


@pytest.mark.parametrize(("name", "fn"), _builders(), ids=[n for n, _ in _builders()])
def test_every_subject_and_key_builder_refuses_unsafe_ids(name: str, fn: Any) -> None:
    params = list(inspect.signature(fn).parameters)
    for target in [p for p in params if p not in VALID]:
        for bad in UNSAFE:
            args = {p: VALID.get(p, "ok") for p in params}
            if name == "ckpt":
                args["kind"] = "mirrored"
            args[target] = bad
            with pytest.raises(InvalidToken):
                fn(**args)


# ------------------------------------------------------------------------ nothing unpickled


def _calls(tree: ast.AST) -> list[ast.Call]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call)]


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return node.id if isinstance(node, ast.Name) else ""


def _kw(call: ast.Call, name: str) -> Any:
    for kw in call.keywords:
        if kw.arg == name and isinstance(kw.value, ast.Constant):
            return kw.value.value
    return None


def _restricted_unpickler_only(tree: ast.AST) -> list[int]:
    """Lines where ``pickle`` is used other than as the base of a ``pickle.Unpickler``
    subclass that overrides ``find_class`` (an allow-list) or for ``UnpicklingError``."""
    allowed: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and any(
                _dotted(b) == "pickle.Unpickler" for b in node.bases) and any(
                isinstance(f, ast.FunctionDef) and f.name == "find_class" for f in node.body):
            allowed |= {id(b) for b in node.bases}
    return [node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and _dotted(node.value) == "pickle"
            and node.attr != "UnpicklingError" and id(node) not in allowed]


def test_nothing_loaded_from_storage_is_unpickled() -> None:
    """torch.load only with weights_only=True, diffusers only from safetensors, no
    pickle-family module anywhere in the services and libraries, except ``pickle`` for
    an allow-listing unpickler (DCP's metadata is a pickle)."""
    problems = []
    for path in CODE:
        tree = ast.parse(path.read_text(), str(path))
        where = path.relative_to(ROOT)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                names = [a.name for a in node.names] + [getattr(node, "module", "") or ""]
                for n in names:
                    if n == "pickle" and isinstance(node, ast.Import):
                        problems += [f"{where}:{line} uses pickle beyond an allow-listing "
                                     "Unpickler" for line in _restricted_unpickler_only(tree)]
                    elif n.split(".")[0] in {"pickle", "cPickle", "dill", "shelve",
                                             "marshal", "joblib", "cloudpickle"}:
                        problems.append(f"{where}:{node.lineno} imports {n}")
        for call in _calls(tree):
            fn = _dotted(call.func)
            line = f"{where}:{call.lineno} {fn}"
            if fn == "torch.load" and _kw(call, "weights_only") is not True:
                problems.append(f"{line} without weights_only=True")
            if fn.endswith("from_pretrained") and _kw(call, "use_safetensors") is not True:
                problems.append(f"{line} without use_safetensors=True")
            if fn in ("np.load", "numpy.load") and _kw(call, "allow_pickle"):
                problems.append(f"{line} with allow_pickle")
            if fn == "yaml.load":
                problems.append(f"{line}: use yaml.safe_load")
    assert not problems, "\n".join(problems)
    assert any("weights_only" in p.read_text() for p in CODE)  # the scan does see code


# ---------------------------------------------------------------------- paths inside roots


def test_a_model_folder_outside_the_model_root_stops_the_service_at_start(
        tmp_path: Path) -> None:
    root, outside = tmp_path / "models", tmp_path / "elsewhere"
    (root / "ok").mkdir(parents=True)
    outside.mkdir()
    (root / "sneaky").symlink_to(outside)

    def registry(path: Path) -> str:
        return f'[{{"name": "m", "source": "dir:{path}"}}]'

    ok = load(RegistrySettings, models=registry(root / "ok"), model_root=str(root))
    assert ok.registry.get("m") is not None
    for bad in (outside, root / "sneaky", root / ".." / "elsewhere", Path("/etc")):
        with pytest.raises(SettingsError) as err:
            load(RegistrySettings, "inference-worker", models=registry(bad),
                 model_root=str(root))
        assert "TANDEM_MODEL_ROOT" in str(err.value) and "outside the model root" in str(
            err.value)


def test_roots_are_closed_by_default_to_the_stacks_own_folders(tmp_path: Path) -> None:
    from tandem.checkpointer.service import CheckpointerSettings
    from tandem.trainer.service import TrainerSettings

    ckpt = load(CheckpointerSettings, "checkpointer")
    assert ckpt.checkpoint_root == load(TrainerSettings, "trainer").checkpoint_root
    assert Path(ckpt.checkpoint_root) == Path(".tandem/checkpoints")
    models = load(RegistrySettings, "inference-worker")
    assert Path(models.model_root) == Path(".tandem/models")
    # A model folder anywhere else is refused with no TANDEM_MODEL_ROOT set at all.
    (tmp_path / "m").mkdir()
    with pytest.raises(SettingsError) as err:
        load(RegistrySettings, "inference-worker",
             models=f'[{{"name": "m", "source": "dir:{tmp_path / "m"}"}}]')
    assert "outside the model root" in str(err.value)


async def test_a_checkpoint_outside_the_checkpoint_root_goes_to_dlq_untouched(
        bus: Bus, settings: Settings, uid: str, tmp_path: Path, s3_server: S3Server) -> None:
    """A forged event naming files elsewhere (or a symlink out of the root) is never read,
    uploaded or deleted; the checkpointer goes on with the next, valid one."""
    root, outside = tmp_path / "checkpoints", tmp_path / "elsewhere"
    bad_run, good_run = f"bad-{uid}", f"good-{uid}"
    out_dir, out_manifest = write_checkpoint(outside / bad_run, bad_run, 1)
    (root / bad_run).mkdir(parents=True)
    (root / bad_run / "step-2").symlink_to(out_dir, target_is_directory=True)
    link_manifest = ck.scan(out_dir, bad_run, 1)
    link_manifest = msgspec.structs.replace(link_manifest, step=2)
    # A real folder inside the root, but one file in it is a link to a file outside.
    mixed_dir, mixed_manifest = write_checkpoint(root / bad_run, bad_run, 4)
    (mixed_dir / "model.safetensors").unlink()
    (mixed_dir / "model.safetensors").symlink_to(out_dir / "model.safetensors")
    mixed_manifest = ck.scan(mixed_dir, bad_run, 4)
    good_dir, good_manifest = write_checkpoint(root / good_run, good_run, 3)
    bucket = f"b{uid}"
    config = dict(nats_url=settings.nats_url, s3_endpoint=s3_server.url, s3_bucket=bucket,
                  s3_access_key="tandem", s3_secret_key="tandem", retry_backoff=0.1,
                  ack_wait=3.0, checkpoint_root=str(root), local_keep=5)
    async with running(bus, **config):
        for ev in (written(out_dir, out_manifest),
                   written(root / bad_run / "step-2", link_manifest),
                   written(mixed_dir, mixed_manifest), written(good_dir, good_manifest)):
            await bus.publish(mirror_subject(ev), ev)
        runs = await bus.typed(KV_RUNS, RunRecord)

        async def committed() -> bool:
            got = await runs.get(good_run)
            return got is not None and got[0].latest_checkpoint_step == 3

        await until(committed, what="the valid checkpoint committed")
        sub = await bus.js.pull_subscribe(subjects.dlq("MIRROR"), stream=DLQ)
        letters = [decode(m.data, DeadLetter) for m in await sub.fetch(3, timeout=10)]
    assert len(letters) == 3
    assert all("outside the checkpoint root" in d.reason for d in letters), letters
    assert any("file 'model.safetensors'" in d.reason for d in letters), letters
    assert (mixed_dir / "model.safetensors").is_symlink()  # nothing there was deleted
    assert sorted(os.listdir(out_dir)) == sorted(f.name for f in out_manifest.files)
    s3 = s3_client(load(Settings, s3_endpoint=s3_server.url, s3_access_key="tandem",
                        s3_secret_key="tandem"))
    listed = s3.list_objects_v2(Bucket=bucket, Prefix=ck.run_prefix(bad_run))
    assert listed.get("KeyCount", 0) == 0
