"""Training runs: the validated run config and its submission (no torch here).

``RunConfig`` is the one schema of a training run, used by ``tandem train submit``, the
gateway's ``POST /v1/training-runs`` and the trainer itself. ``submit_run`` validates a
config, records the run in KV ``runs`` (state ``pending``) and publishes
``train.<run>.status`` pending, which a trainer coordinator of the run's cluster claims.

Submission is idempotent per run id: resubmitting the same config returns the existing
record; a different config under an existing id raises ``RunExists``.

Two readings of a config, as docs/bus-api.md's versioning rule says: a submission (every
door calls ``submit_run``, which calls ``parse_run_config``) refuses a field it does not
know, naming it; a config a Tandem service wrote (KV ``runs``, a launch spec) is read by
``parse_stored_run_config``, which leaves out the fields a newer version added and names
them. Writers store ``RunConfig.stored()``, only the fields not at their default, so a
version that lacks a field added later reads every config that does not use it.

One module past 450 lines: the schema, its bounds and the one submission path that
enforces them belong together (every door calls ``submit_run``); the size estimate is
``model_size``'s.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    ValidationError,
    field_validator,
    model_validator,
)

from tandem.common import model_size, subjects
from tandem.common.errors import InvalidRunConfig, RunExists, RunNotFound, TooManyRuns
from tandem.common.events import RunRecord, RunState, TrainStatus, encode, now, struct_replace

SEED_MAX = 2**32 - 1  # the loop's derived seeds (seed * 100_003 + rank) stay < 2**64
MAX_NODES = 1024  # a run's nodes: as many as its most ranks (each node runs one at least)
# Past these a model or data set does not fit a node (a UNet of 4096 channels, a class
# table of 10**9 rows, a DiT of width 4096 x 4096): refused here rather than by a rank.
MAX_CHANNELS = 1280  # a UNet block's channels: Stable Diffusion's widest
MAX_CLASSES = 100_000
MAX_TIMESTEPS = 100_000
MAX_SYNTHETIC = 1_000_000
SYNTHETIC_BYTES = 2**32  # a synthetic data set's tensor (float32), on every rank
DIGITS = 1797  # images in scikit-learn's bundled digits, of 10 classes
DIGITS_CLASSES = 10
# A config's whole numbers: true, "5" and 5.0 are refused naming the field, not read as
# 1 and 5 (the published schema says integer).
Int = Annotated[int, Strict()]
# The 2D blocks a UNet2DModel builds with no cross-attention (it has no text encoder).
DownBlock = Literal["DownBlock2D", "AttnDownBlock2D", "ResnetDownsampleBlock2D"]
UpBlock = Literal["UpBlock2D", "AttnUpBlock2D", "ResnetUpsampleBlock2D"]


class FieldError(ValueError):
    """A check across fields that blames one of them: ``parse_run_config`` names ``field``
    (a dotted path) as the problem's, not the whole config."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class _Spec(BaseModel):
    # Unknown keys are errors: a typo in a run config must not be silently ignored.
    # NOTE: no float may be inf or NaN (1e999 and "Infinity" parse as inf): the record
    # stores JSON, where they become null, and the trainer would refuse the run it took.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class ModelSpec(_Spec):
    """The network. ``unet`` builds a diffusers UNet2DModel, ``dit`` a DiTTransformer2DModel."""

    kind: Literal["unet", "dit"] = "unet"
    sample_size: Int = Field(16, ge=4, le=1024, description="Image side in pixels.")
    in_channels: Int = Field(1, ge=1, le=16)
    num_classes: Int = Field(10, ge=0, le=MAX_CLASSES,
                             description="Class-conditional with this many classes.")
    # UNet
    block_out_channels: tuple[Annotated[Int, Field(ge=1, le=MAX_CHANNELS)], ...] = Field(
        (32, 64, 64), min_length=1, max_length=8)
    layers_per_block: Int = Field(1, ge=1, le=8)
    down_block_types: tuple[DownBlock, ...] = ("DownBlock2D", "AttnDownBlock2D", "DownBlock2D")
    up_block_types: tuple[UpBlock, ...] = ("UpBlock2D", "AttnUpBlock2D", "UpBlock2D")
    norm_num_groups: Int = Field(8, ge=1, le=MAX_CHANNELS)
    # DiT
    num_layers: Int = Field(4, ge=1, le=64)
    num_attention_heads: Int = Field(4, ge=1, le=16)
    attention_head_dim: Int = Field(16, ge=4, le=128)
    patch_size: Int = Field(2, ge=1)
    num_train_timesteps: Int = Field(1000, ge=10, le=MAX_TIMESTEPS)

    @model_validator(mode="after")
    def _shape(self) -> ModelSpec:
        if self.kind == "unet":
            n = len(self.block_out_channels)
            if len(self.down_block_types) != n or len(self.up_block_types) != n:
                raise ValueError("block_out_channels, down_block_types and up_block_types "
                                 "must have the same length")
            if any(c % self.norm_num_groups for c in self.block_out_channels):
                raise ValueError("every block_out_channels entry must be divisible by "
                                 "norm_num_groups")
        elif self.sample_size % self.patch_size:
            raise ValueError("sample_size must be divisible by patch_size")
        if self.kind == "dit" and self.num_classes < 1:
            raise ValueError("a DiT is class-conditional: num_classes must be at least 1")
        return self


class DataSpec(_Spec):
    """The data set. ``digits`` is scikit-learn's bundled 8x8 digits (no download)."""

    kind: Literal["digits", "image_folder", "synthetic"] = "digits"
    path: str | None = Field(None, description="image_folder: root with one folder per class.")
    synthetic_size: Int = Field(1024, ge=1, le=MAX_SYNTHETIC,
                                description="synthetic: number of images.")

    @model_validator(mode="after")
    def _path(self) -> DataSpec:
        if self.kind == "image_folder" and not self.path:
            raise ValueError("data.path is required for an image_folder data set")
        return self

    def confined(self, root: str) -> DataSpec:
        """This spec with its image folder resolved under ``root`` (a trainer's
        ``TANDEM_DATA_ROOT``): a relative path is taken from there, and a path that
        leaves it, by ``..`` or a symlink, is refused. An empty ``root`` confines nothing.
        """
        if not root or self.kind != "image_folder" or self.path is None:
            return self
        base = Path(root).resolve()
        path = (base / self.path).resolve()
        if not path.is_relative_to(base):
            raise ValueError(f"data.path {self.path!r} is outside this trainer's data root "
                             f"{str(base)!r} (TANDEM_DATA_ROOT)")
        return self.model_copy(update={"path": str(path)})


class WatchdogSpec(_Spec):
    hang_multiple: float = Field(
        10.0, gt=1, description="A hang is no step within this multiple of the median step.")
    hang_floor_s: float = Field(5.0, gt=0, description="Never call a hang sooner than this.")
    startup_timeout_s: float = Field(180.0, gt=0, description="Launch to first step.")
    max_restarts: Int = Field(5, ge=0, description="Past this the run is failed.")
    backoff_s: float = Field(1.0, ge=0, description="First restart delay; doubles each time.")
    backoff_max_s: float = Field(60.0, ge=0)
    teardown_grace_s: float = Field(
        20.0, gt=0, description="After the last step is done and every rank said goodbye, "
        "how long ranks may take to exit before they are stopped (the run has succeeded).")


class LossHealthSpec(_Spec):
    enabled: bool = True
    window: Int = Field(50, ge=5, description="Steps of loss history for the robust z-score.")
    min_history: Int = Field(20, ge=3, description="Steps before spikes are judged.")
    z_threshold: float = Field(
        12.0, gt=0, description="Robust z-score (median/MAD) above which a loss is a spike.")
    skip_batches: Int = Field(
        1, ge=1, description="Data window skipped after a rollback, ending at the bad batch.")


class StragglerSpec(_Spec):
    ratio: float = Field(1.5, gt=1, description="Flag a rank slower than this times the median.")
    window: Int = Field(20, ge=3, description="Steps over which slowness must persist.")


class FaultSpec(_Spec):
    """Fault hooks for tests and drills; all off by default."""

    nan_at_data_pos: list[Int] = Field(
        [], description="Inject a NaN loss whenever the batch at these data positions is used.")
    crash_at_step: Int | None = Field(None, description="Rank crash_rank exits 1 at this step.")
    crash_rank: Int = 0
    slow_rank: Int | None = Field(
        None, description="This rank sleeps slow_s in every step, and its step's compute "
                          "takes slow_factor times as long (a throttled GPU).")
    slow_s: float = Field(0.0, ge=0)
    slow_factor: float = Field(1.0, ge=1)
    hang_on_exit_rank: Int | None = Field(
        None, description="This rank never exits after its goodbye (a teardown that hangs).")
    stall_checkpoint_at_step: Int | None = Field(
        None, description="Sharded runs, first attempt only: the node of rank "
        "stall_checkpoint_rank never commits its part of this step's checkpoint (its first "
        "rank waits before the local commit until it is killed), while the other nodes "
        "commit theirs: a node lost in the middle of a checkpoint, for kill drills.")
    stall_checkpoint_rank: Int = 0
    fail_checkpoint_write_at_step: Int | None = Field(
        None, description="Every attempt: the write of this step's checkpoint on the node of "
        "rank 0 fails as on a full disk (OSError ENOSPC once its files are written, before "
        "the commit): the run must go on, report it, and leave no partial folder behind.")


class FSDPSpec(_Spec):
    """FSDP2 (``fully_shard``) options; used only when ``parallelism`` is ``fsdp``."""

    reshard_after_forward: bool = Field(
        True, description="Free each block's gathered parameters after its forward (less "
        "memory, one more all-gather in backward); False keeps them until backward.")
    mixed_precision: Literal["none", "bf16"] = Field(
        "none", description="bf16: parameters are gathered and computed in bf16, gradients "
        "reduced in fp32 (FSDP's MixedPrecisionPolicy). Needs a CUDA device with bf16.")


# Named model configs, for runs and benchmarks that want a size rather than a shape
# (``"model": "dit-b"``). Tests use the small inline ones.
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    # DiT-B/2 on 32x32x4 latents with 1000 classes: 12 blocks of width 768, 147.4M
    # parameters, so weights plus AdamW moments are 1.77 GB of fp32 state (2.36 GB with
    # the EMA): worth sharding.
    "dit-b": {"kind": "dit", "sample_size": 32, "in_channels": 4, "num_classes": 1000,
              "num_layers": 12, "num_attention_heads": 12, "attention_head_dim": 64,
              "patch_size": 2},
}


class RunConfig(_Spec):
    """A training run: what to train, on what, for how long, where, and how to recover."""

    run_id: str | None = Field(None, description="Token; generated when absent.")
    model: ModelSpec = ModelSpec()
    data: DataSpec = DataSpec()
    steps: Int = Field(1000, ge=1)
    batch_size: Int = Field(32, ge=1, description="Per rank.")
    lr: float = Field(2e-4, gt=0)
    lr_schedule: Literal["constant", "cosine", "linear"] = "cosine"
    warmup_steps: Int = Field(20, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float = Field(1.0, gt=0)
    ema_decay: float = Field(
        0.999, ge=0, lt=1, description="Decay of the EMA of the weights, which is what is "
        "served; with ema_warmup, reached after (10 decay - 1) / (1 - decay) steps "
        "(8,990 for 0.999, 890 for 0.99).")
    ema_warmup: bool = Field(
        True, description="Warm the EMA up: decay min(ema_decay, (1 + step) / (10 + step)) "
        "at each step, so a short run serves trained weights. False: ema_decay from the "
        "first step, and after N steps ema_decay**N of the served weights are the random "
        "initial ones (74% after 300 steps at 0.999).")
    mixed_precision: Literal["no", "bf16", "fp16"] = "no"
    checkpoint_every: Int = Field(100, ge=1, description="Steps between checkpoints.")
    step_event_every: Int = Field(1, ge=1, description="Publish every k-th step.")
    ranks: Int = Field(2, ge=1, le=1024, description="Total ranks (world size).")
    nodes: list[str] = Field([], max_length=MAX_NODES,
                             description="Nodes to run on; empty: the coordinator's node.")
    cluster: str | None = Field(None, description="Cluster whose coordinator runs it.")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="cuda uses NCCL, cpu uses gloo; auto picks cuda when present.")
    parallelism: Literal["ddp", "fsdp"] = Field(
        "ddp", description="ddp replicates the model on every rank; fsdp shards parameters, "
        "gradients and optimizer state (FSDP2) and checkpoints per rank (DCP).")
    fsdp: FSDPSpec = FSDPSpec()
    seed: Int = 0
    watchdog: WatchdogSpec = WatchdogSpec()
    loss_health: LossHealthSpec = LossHealthSpec()
    straggler: StragglerSpec = StragglerSpec()
    faults: FaultSpec = FaultSpec()

    @field_validator("run_id", "cluster")
    @classmethod
    def _token(cls, value: str | None, info: Any) -> str | None:
        return None if value is None else subjects.token(value, info.field_name.replace("_", " "))

    @field_validator("seed")
    @classmethod
    def _seed(cls, value: int) -> int:
        # NOTE: a validator, not Field(ge, le), so the published schema (docs/bus-api.md,
        # generated) is unchanged; the bound is what the loop's derived seeds need.
        if not 0 <= value <= SEED_MAX:
            raise ValueError(f"seed must be between 0 and {SEED_MAX} (2**32 - 1), got {value}")
        return value

    @field_validator("nodes")
    @classmethod
    def _nodes(cls, value: list[str]) -> list[str]:
        nodes = [subjects.node(n) for n in value]
        if len(set(nodes)) != len(nodes):
            raise ValueError("nodes must not repeat")
        return nodes

    @field_validator("model", mode="before")
    @classmethod
    def _preset(cls, value: Any) -> Any:
        if isinstance(value, str):
            if value not in MODEL_PRESETS:
                raise ValueError(f"model preset {value!r} is not one of "
                                 f"{', '.join(MODEL_PRESETS)}")
            return MODEL_PRESETS[value]
        return value

    def stored(self) -> dict[str, Any]:
        """This config as it is stored and relayed (KV ``runs``, a launch spec): only the
        fields not at their default, at every depth; ``parse_stored_run_config`` (or
        ``parse_run_config``) of it is this config again.

        NOTE: a field a newer version adds is then written only by the runs that use it,
        so an older reader (which refuses or leaves out what it does not know) sees every
        other run exactly. It also means a default must never change: a stored run would
        change with it.
        """
        return self.model_dump(mode="json", exclude_defaults=True)

    @model_validator(mode="after")
    def _fit(self) -> RunConfig:
        if self.parallelism == "fsdp":
            if self.mixed_precision != "no":
                raise ValueError("with parallelism fsdp, mixed precision is fsdp."
                                 "mixed_precision (bf16), not mixed_precision")
            if self.fsdp.mixed_precision == "bf16" and self.device == "cpu":
                raise ValueError("fsdp.mixed_precision bf16 needs a CUDA device with bf16; "
                                 "this run asks for device cpu")
        if self.model.kind == "unet" and self.model.sample_size % 2 ** (
                len(self.model.block_out_channels) - 1):
            raise ValueError("model.sample_size must be divisible by 2^(number of blocks - 1)")
        self._data_fits()
        return self

    def _data_fits(self) -> None:
        """What the data set must have for the model and one global batch (every rank's
        batch of one step): refused here, naming the field, rather than by each rank."""
        m, data, batch = self.model, self.data, self.batch_size * self.ranks
        per_step = f"batch_size x ranks ({self.batch_size} x {self.ranks} = {batch})"
        if data.kind == "image_folder" and m.in_channels not in (1, 3):
            raise FieldError("model.in_channels", "must be 1 (grey) or 3 (RGB) for an "
                             f"image_folder data set, got {m.in_channels}")
        if data.kind == "digits":
            if batch > DIGITS:
                raise FieldError("batch_size", f"{per_step} is more than the digits' "
                                 f"{DIGITS} images")
            if 0 < m.num_classes < DIGITS_CLASSES:
                raise FieldError("model.num_classes", f"must be at least {DIGITS_CLASSES} "
                                 f"(or 0, unconditional) for the digits, got {m.num_classes}")
        if data.kind == "synthetic":
            if batch > data.synthetic_size:
                raise FieldError("batch_size", f"{per_step} is more than "
                                 f"data.synthetic_size ({data.synthetic_size})")
            size = data.synthetic_size * m.sample_size ** 2 * m.in_channels * 4
            if size > SYNTHETIC_BYTES:
                raise FieldError("data.synthetic_size", f"{data.synthetic_size} images of "
                                 f"{m.sample_size}x{m.sample_size}x{m.in_channels} are "
                                 f"{size} bytes, over {SYNTHETIC_BYTES} on every rank")


def parse_run_config(data: dict[str, Any] | RunConfig) -> RunConfig:
    """Validate ``data`` as a request (a submission, whatever its door): raise
    ``InvalidRunConfig`` naming every bad field, a field this version does not know too
    (``Extra inputs are not permitted``). A config read back from a record or a launch
    spec is ``parse_stored_run_config``'s."""
    if isinstance(data, RunConfig):
        return data
    if not isinstance(data, dict):
        raise InvalidRunConfig({"": f"a run config is a mapping, got {type(data).__name__}"})
    try:
        return RunConfig.model_validate(data)
    except ValidationError as exc:
        raise InvalidRunConfig(_problems(exc)) from None


def parse_stored_run_config(data: dict[str, Any]) -> tuple[RunConfig, list[str]]:
    """A config that a Tandem service wrote (the ``config`` of a KV ``runs`` record, of a
    launch spec), and the dotted names of the fields in it that this version does not
    know, left out: a newer version's, written while versions are mixed in a rolling
    upgrade (docs/bus-api.md: stored records may grow). The caller logs them. Every
    other field is validated as ``parse_run_config`` does (``InvalidRunConfig``)."""
    if not isinstance(data, dict):
        raise InvalidRunConfig({"": f"a run config is a mapping, got {type(data).__name__}"})
    try:
        return RunConfig.model_validate(data), []
    except ValidationError as exc:
        unknown = sorted(_where(e) for e in exc.errors() if e["type"] == "extra_forbidden")
        if not unknown:
            raise InvalidRunConfig(_problems(exc)) from None
    try:
        return RunConfig.model_validate(data, extra="ignore"), unknown
    except ValidationError as exc:
        raise InvalidRunConfig(_problems(exc)) from None


def filled(stored: dict[str, Any]) -> dict[str, Any]:
    """A stored config as it is shown (a run's view, the steps of its progress bar):
    every field this version knows, defaults filled in; as stored when this version
    cannot read it (the view still shows what the run was submitted with)."""
    try:
        return parse_stored_run_config(stored)[0].model_dump(mode="json")
    except InvalidRunConfig:
        return stored


def _problems(exc: ValidationError) -> dict[str, str]:
    return {_where(e): e["msg"] for e in exc.errors()}


def _where(error: Any) -> str:
    """The field a validation error names: its location, or a ``FieldError``'s field."""
    cause = error.get("ctx", {}).get("error")
    if isinstance(cause, FieldError):
        return cause.field
    return ".".join(str(p) for p in error["loc"]) or "(config)"


def fits(record: RunRecord, max_payload: int) -> None:
    """Refuse (``InvalidRunConfig``, naming the config's largest field) a run whose record
    would take more than half the bus's ``max_payload``: every write of a record past it
    fails, and the run's life adds to it (incidents, stragglers: each list bounded, see
    the trainer's supervisor), so it gets the other half. A config that passes
    validation can still be this large (its lists, the nodes stored twice)."""
    size, limit = len(encode(record)), max_payload // 2
    if size <= limit:
        return
    field, part = max(((k, len(encode(v))) for k, v in record.config.items()),
                      key=lambda kv: kv[1])
    raise InvalidRunConfig({field: f"the run's record would be {size} bytes, over the "
                            f"{limit} a run's record may start with (half the bus's "
                            f"max_payload); this field is {part} bytes of it"})


def new_run_id() -> str:
    return f"run-{uuid.uuid4().hex[:12]}"


async def get_run(bus: Any, run_id: str) -> RunRecord:
    """The run's record from KV ``runs``; ``RunNotFound`` when there is none."""
    from tandem.common.streams import KV_RUNS

    got = await (await bus.typed(KV_RUNS, RunRecord)).get(subjects.token(run_id, "run id"))
    if got is None:
        raise RunNotFound(run_id)
    return got[0]


async def submit_run(bus: Any, config: dict[str, Any] | RunConfig,
                     owner: str = "", max_unfinished: int | None = None,
                     clusters: Sequence[str] = ()) -> RunRecord:
    """Validate ``config`` (its model's size too: ``model_size.check``), record the run
    as pending (created by API key ``owner``) and announce it. A run recorded but never
    announced (a caller that died between the two, or a publish refused past its
    retries) is claimed by a coordinator of its cluster ``unclaimed_after_s`` later all
    the same (``tandem.trainer.service``).

    Returns the stored record. Idempotent: the same config under the same run id by the
    same owner returns the existing record (and re-announces it if it is still pending);
    a different config or another owner under an existing run id raises ``RunExists``.
    ``clusters``: where the caller may send runs (the gateway's); a ``cluster`` outside
    them is refused, naming them (it would wait ``pending`` for a coordinator for good).

    ``max_unfinished``: a new run is refused (``TooManyRuns``) when ``owner`` has that many
    runs not finished before it, counted in KV ``runs`` after its record is written,
    and its record is deleted before anything was announced. Every gateway counts the
    same records, so the limit holds across replicas and restarts. Counted: every run
    past ``pending`` (let through), and the pending ones written before this one (a
    lower revision: a pending record is never rewritten, claiming or cancelling moves it
    on). So of submissions that race for room, the one written first is not refused for
    the later ones, and each later one sees it (it reads after its own write): exactly
    as many are let through as there is room for. A refused one can still be counted by
    a later one in the moment before its record is deleted, if room was made between
    their reads (``Retry-After``).
    """
    from tandem.common.streams import KV_RUNS

    cfg = parse_run_config(config)
    model_size.check(cfg)  # here, not in RunConfig: a run accepted before still parses
    if clusters and cfg.cluster and cfg.cluster not in clusters:
        raise InvalidRunConfig({"cluster": f"{cfg.cluster!r} is not one of the clusters "
                                f"runs go to here: {', '.join(clusters)}"})
    if cfg.run_id is None:
        cfg = cfg.model_copy(update={"run_id": new_run_id()})
    run_id = cfg.run_id
    assert run_id is not None
    as_dict = cfg.stored()
    kv = await bus.typed(KV_RUNS, RunRecord)
    record = RunRecord(run_id=run_id, config=as_dict, state=RunState.pending,
                       nodes=list(cfg.nodes), owner=owner)
    fits(record, bus.nc.max_payload)
    revision = await kv.create(run_id, record)
    if revision is None:
        got = await kv.get(run_id)
        if got is None or not _same(got[0].config, cfg) or got[0].owner != owner:
            raise RunExists(run_id)
        record = got[0]
        if record.state != RunState.pending:
            return record
    elif max_unfinished is not None:
        try:
            others = sorted(k for k, (rec, rev) in (await kv.entries()).items()
                            if k != run_id and rec.owner == owner and not rec.state.terminal
                            and (rec.state != RunState.pending or rev < revision))
        except BaseException:
            # Refused with an error, so not left to run: a coordinator would claim it
            # unannounced later, and the caller's retry would make a second run.
            with contextlib.suppress(Exception):
                await kv.delete(run_id, last=revision)
            raise
        if len(others) >= max_unfinished:
            # Moved meanwhile (cancelled; or claimed by a coordinator that found it
            # unannounced, unclaimed_after_s later: a stall no submission lasts): leave it.
            await kv.delete(run_id, last=revision)
            raise TooManyRuns(owner, others, max_unfinished)
    await bus.publish(subjects.train(run_id, "status"),
                      TrainStatus(run_id=run_id, state=RunState.pending, reason="submitted"),
                      msg_id=f"{run_id}-pending", retry_for=10.0)
    return record


def _same(stored: dict[str, Any], cfg: RunConfig) -> bool:
    """Whether a record's config is ``cfg``, however it was written (every field, as
    versions before ``RunConfig.stored`` did, or only those set). One with fields this
    version does not know is another run's."""
    try:
        got, unknown = parse_stored_run_config(stored)
    except InvalidRunConfig:
        return False
    return not unknown and got == cfg


async def cancel_run(bus: Any, run_id: str, reason: str = "cancelled by client") -> RunRecord:
    """Stop a run: one still pending (no coordinator has claimed it) ends ``cancelled`` at
    once; a claimed one is marked (``RunRecord.cancel``) for its coordinator, which
    stops the ranks and ends it ``cancelled``. Returns the record as it now stands (a
    finished run is returned unchanged: the caller says it was already over).
    ``RunNotFound`` when there is no such run.
    """
    from tandem.common.streams import KV_RUNS

    kv = await bus.typed(KV_RUNS, RunRecord)

    def move(cur: RunRecord | None) -> RunRecord | None:
        if cur is None or cur.state.terminal or cur.cancel:
            return None
        if cur.state == RunState.pending and not cur.coordinator:
            return struct_replace(cur, state=RunState.cancelled, cancel=reason,
                                  updated_at=now())
        return struct_replace(cur, cancel=reason, updated_at=now())

    rec = await kv.update(subjects.token(run_id, "run id"), move)
    if rec is None:
        raise RunNotFound(run_id)
    if rec.state == RunState.cancelled:
        await bus.publish(subjects.train(run_id, "status"), TrainStatus(
            run_id=run_id, state=RunState.cancelled, reason=rec.cancel),
            msg_id=f"{run_id}-cancelled", retry_for=10.0)
    return rec

