"""Pydantic models of ``params.yaml``: one section per stage, unknown keys rejected.

``params.yaml`` is the only place for knobs.  ``load_params`` turns every problem
(missing file, YAML error, unsafe tag, unknown key, bad value) into a ``ConfigError``
whose message names the file and the key.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from retrain.errors import ConfigError


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class IngestParams(_Section):
    """Knobs of ``retrain ingest`` (its checks are the batch half of ``validate``; their knobs live there)."""

    max_problems_shown: int = Field(default=50, ge=1, description="Problem lines printed for a refused batch.")
    bad_boxes: Literal["refuse", "drop"] = Field(
        default="refuse", description="A box of zero or negative size or with a non-finite number: refuse the "
        "batch (the default), or drop those boxes alone, each listed in the batch's record, and admit the batch "
        "(every other rule still refuses it). `retrain ingest --bad-boxes` overrides it for one batch.")


class MergeParams(_Section):
    """Knobs of ``retrain merge``."""

    val_fraction: float = Field(
        default=0.2, gt=0, lt=1, description="Share of images assigned to val (picks the best checkpoint, early "
        "stopping, EMA or raw), by content hash (stable forever)."
    )
    test_fraction: float = Field(
        default=0.2, ge=0, lt=1, description="Share of images assigned to test (the gate's judge: no training choice "
        "ever looks at it), by the same hash; 0 = no test split (the gate then judges on val, and says so)."
    )
    near_duplicate_distance: int = Field(
        default=40, ge=-1, le=128, description="Images whose perceptual hashes (256-bit pHash) differ in at most "
        "this many bits are one group and share a split; -1 = off (exact duplicates are still merged)."
    )
    split_salt: str = Field(
        default="retrain-split-v1", min_length=1, description="Mixed into the content hash that picks an image's split."
    )
    box_conflict_tolerance_px: float = Field(
        default=0.5, ge=0, description="Two labellings of one image are the same when every box agrees to this."
    )

    @model_validator(mode="after")
    def _train_left(self) -> MergeParams:
        if self.val_fraction + self.test_fraction >= 0.9:
            raise ValueError("val_fraction + test_fraction leave less than 10% of the images to train on")
        return self


Level = Literal["fail", "warn"]


class ValidateParams(_Section):
    """Knobs of ``retrain validate`` and of the batch checks inside ``retrain ingest``."""

    box_tolerance_px: float = Field(
        default=1.0, ge=0, description="How far (pixels) a box may stick out of its image before it is refused; "
        "boxes within the tolerance are clipped to the image at ingest."
    )
    max_image_pixels: int = Field(default=50_000_000, ge=1, le=178_956_970,
                                  description="Largest image accepted (PIL's own bomb limit stays on above it).")
    max_boxes_per_image: int = Field(default=300, ge=1)
    min_train_instances: int = Field(default=10, ge=0, description="Boxes each class needs in train.")
    min_val_instances: int = Field(default=2, ge=0, description="Boxes each class needs in val.")
    instances_level: Level = Field(default="warn", description="Too few instances: fail or warn.")
    val_fraction_min: float = Field(default=0.05, ge=0, le=1)
    val_fraction_max: float = Field(default=0.5, ge=0, le=1)
    val_fraction_level: Level = "fail"
    drift_threshold: float = Field(
        default=0.5, ge=0, description="KL divergence of the newest batch's class distribution from the older "
        "batches' above which drift is reported."
    )
    drift_level: Level = "warn"
    examples: int = Field(default=5, ge=1, le=100, description="Offending rows kept per failed check.")

    @model_validator(mode="after")
    def _bounds(self) -> ValidateParams:
        if self.val_fraction_min > self.val_fraction_max:
            raise ValueError("val_fraction_min is above val_fraction_max")
        return self


class AugmentParams(_Section):
    """ultralytics' training augmentations (names and meaning as in its ``default.yaml``)."""

    hsv_h: float = Field(default=0.015, ge=0, le=1)
    hsv_s: float = Field(default=0.7, ge=0, le=1)
    hsv_v: float = Field(default=0.4, ge=0, le=1)
    degrees: float = Field(default=0.0, ge=0, le=180)
    translate: float = Field(default=0.1, ge=0, le=1)
    scale: float = Field(default=0.5, ge=0, le=1)
    fliplr: float = Field(default=0.5, ge=0, le=1)
    flipud: float = Field(default=0.0, ge=0, le=1)
    mosaic: float = Field(default=1.0, ge=0, le=1)
    mixup: float = Field(default=0.0, ge=0, le=1)
    close_mosaic: int = Field(default=10, ge=0, description="Last epochs trained without mosaic.")


#: The train stage's log line that starts a warm-started run; the flow's progress bar reads its epoch count from it
#: (``WARM_PLAN``), so the line and the pattern live here together.
WARM_PLAN_LOG = "warm schedule (train.warm): %d epochs at lr %g, %g warm-up epochs, mosaic off for the last %d"
WARM_PLAN = re.compile(re.escape(WARM_PLAN_LOG.split("%d", 1)[0]) + r"(\d+)")


class WarmParams(_Section):
    """The schedule of a run warm-started from the champion (``train.warm``): it knows the old data already.

    A run from scratch, or from ``base_model``, keeps the top-level schedule.  ``bench/retrain_cost.py`` chose these
    defaults (README, "A weekly retrain").
    """

    epochs: int = Field(default=20, ge=1, description="Epochs of a warm-started run (never more than train.epochs; a "
                        "class new to the champion takes train.epochs, see new_class_runs).")
    lr: float = Field(default=0.001, gt=0, description="Peak learning rate of a warm-started run.")
    warmup_epochs: float = Field(default=0.5, ge=0, description="Its linear warm-up.")
    close_mosaic: int = Field(default=3, ge=0, description="Its last epochs without mosaic.")
    new_class_runs: int = Field(default=3, ge=0, description="Runs, from the one that brings it, in which a class "
                                "new to the champion takes train.epochs on every train image, not train.warm and "
                                "train.replay (1: its first run only; 0: never).")


class ReplayParams(_Section):
    """What each epoch of a warm-started run trains on (``train.replay``): every image of the batches newer than the
    champion's data, plus a sample of the older ones, drawn anew each epoch from (seed, epoch) alone."""

    old_fraction: float = Field(default=0.25, gt=0, le=1, description="Share of the older train images drawn "
                                "each epoch (more when min_per_class needs more).")
    min_per_class: int = Field(default=20, ge=0, description="Boxes each class of the older images keeps every "
                               "epoch (all of them when it has fewer): no old class is starved.")


class TrainParams(_Section):
    """Knobs of ``retrain train``."""

    model: str = Field(default="yolo11n.yaml", min_length=1,
                       description="ultralytics architecture yaml (built offline, never downloaded).")
    use_champion: bool = Field(default=True, description="Warm-start from the registry's champion when there is one.")
    base_model: str = Field(default="", description="Warm start when there is no champion: a local ultralytics .pt "
                            "or retrain model file (relative to the workspace); empty = from scratch.")
    imgsz: int = Field(default=320, ge=32, multiple_of=32)
    epochs: int = Field(default=30, ge=1)
    batch: int = Field(default=16, ge=1)
    accumulate: int = Field(default=1, ge=1, description="Batches per optimizer step.")
    optimizer: Literal["AdamW", "SGD"] = "AdamW"
    lr: float = Field(default=0.002, gt=0)
    lrf: float = Field(default=0.01, gt=0, le=1, description="Final learning rate as a fraction of lr.")
    schedule: Literal["cosine", "linear"] = "cosine"
    momentum: float = Field(default=0.9, ge=0, lt=1, description="SGD momentum, or AdamW's beta1.")
    weight_decay: float = Field(default=0.0005, ge=0)
    warmup_epochs: float = Field(default=1.0, ge=0, description="Linear learning-rate warm-up.")
    warmup_bias_lr: float = Field(default=0.1, ge=0, description="Biases' LR at the start of the warm-up, falling "
                                  "to lr (ultralytics' default; from scratch only: a warm start's biases rise from "
                                  "0 as the other LRs do).")
    grad_clip: float = Field(default=10.0, ge=0, description="Gradient norm clip; 0 = off.")
    ema_decay: float = Field(default=0.9999, gt=0, lt=1)
    ema_tau: float = Field(default=2000, gt=0, description="EMA warm-up: decay * (1 - exp(-updates / tau)).")
    eval_interval: int = Field(default=1, ge=1, description="Epochs between val mAP measurements.")
    patience: int = Field(default=20, ge=1, description="Evaluations without improvement before stopping early.")
    nms_conf: float = Field(default=0.001, ge=0, le=1)
    nms_iou: float = Field(default=0.7, gt=0, le=1)
    max_det: int = Field(default=300, ge=1)
    seed: int = 0
    accelerator: str = "auto"
    devices: int | str = "auto"
    strategy: str = "auto"
    num_nodes: int = Field(default=1, ge=1)
    precision: str = Field(default="auto", description="auto = bf16-mixed on a CUDA GPU with bf16 and on a CPU that "
                           "computes bf16 natively (AMX or AVX512-BF16), else 32-true.")
    channels_last: Literal["auto", "on", "off"] = Field(
        default="auto", description="auto = on CUDA; on a CPU the faster format for this model, timed once.")
    augment: AugmentParams = AugmentParams()
    warm: WarmParams | Literal[False] = Field(
        default=WarmParams(), description="The schedule of a run warm-started from the champion; off (false) = the "
        "schedule above for every run.")
    replay: ReplayParams | Literal[False] = Field(
        default=ReplayParams(), description="Replay sampling in a run warm-started from the champion; off (false) = "
        "every epoch covers the whole train split.")


class EvaluateParams(_Section):
    """Knobs of ``retrain evaluate``: champion and candidate on the master's val images."""

    conf: float = Field(default=0.001, ge=0, le=1, description="NMS confidence threshold (evaluation setting).")
    iou: float = Field(default=0.7, gt=0, le=1, description="NMS IoU threshold.")
    max_det: int = Field(default=300, ge=1, description="Detections kept per image.")
    batch: int = Field(default=16, ge=1, description="Images per forward pass.")
    bootstrap: int = Field(default=200, ge=10, le=100_000,
                           description="Paired bootstrap resamples of the val images for the delta's interval.")
    confidence: float = Field(default=0.95, gt=0, lt=1, description="Confidence level of that interval.")
    seed: int = Field(default=0, description="Seeds the bootstrap draws.")


class AuditParams(_Section):
    """Knobs of ``retrain audit``: the champion looks for label errors in the batches it has not trained on."""

    level: Level = Field(default="warn", description="fail: a batch whose flagged share of images is above "
                         "max_flagged_fraction stops the run before training; warn: report it and train.")
    max_flagged_fraction: float = Field(default=0.2, ge=0, le=1,
                                        description="The share of a batch's images that may be flagged.")
    confident: float = Field(
        default=0.5, gt=0, lt=1, description="A champion's box at least this confident counts as a confident "
        "prediction: one with no label is a missing box, one over a label of another class a wrong class (cleanlab "
        "uses 0.95, a level a small detector seldom reaches; bench/audit_quality.py chose 0.5).")
    show: int = Field(default=50, ge=0, description="Worst images drawn in reports/audit/index.html.")


class PromoteParams(_Section):
    """The promotion gate of ``retrain promote`` (``champion`` moves only when every rule holds)."""

    min_map: float = Field(default=0.1, ge=0, le=1,
                           description="With no champion yet: the first candidate needs this mAP50-95.")
    min_delta: float = Field(default=0.005, ge=-1, le=1,
                             description="Candidate minus champion mAP50-95 must be at least this.")
    max_class_drop: float = Field(default=0.05, ge=0, le=1,
                                  description="Forgetting guard: no class may lose more AP50-95 than this.")
    min_class_instances: int = Field(default=5, ge=0, description="Classes with fewer val boxes are reported, "
                                     "not gated (their AP is too noisy).")
    max_slice_drop: float = Field(default=0.05, ge=0, le=1,
                                  description="No origin batch's val images may lose more mAP50-95 than this.")
    require_significant: bool = Field(default=False,
                                      description="Also require the bootstrap interval's lower bound above 0.")
    max_size_drop: float | None = Field(default=None, ge=0, le=1, description="No object size (COCO small, medium, "
                                        "large) may lose more AP50-95 than this, overall or per class; null = off.")


class RegistryParams(_Section):
    """The MLflow model registry (its URI comes from ``MLFLOW_TRACKING_URI``, default ``mlflow.db``)."""

    model_name: str = Field(default="retrain-detector", min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    experiment: str = Field(default="retrain", min_length=1)


class RuntimeParams(_Section):
    """How the stages use this machine and wait for services: speed and patience, never a result.

    No ``dvc.yaml`` stage lists this section (they list the keys that change their results), so changing a thread
    count or a wait never makes a stage stale, and a resumed training stays valid.
    """

    threads: int = Field(default=0, ge=0, description="torch CPU threads; 0 = the cores this process may use.")
    workers: int | Literal["auto"] = Field(
        default="auto", description="Training and evaluation dataloader processes; auto = none on a CPU "
        "(ultralytics' choice too: the step is compute-bound and a loader process only takes cores from it), "
        "min(8, cores) with a GPU.")
    check_workers: int = Field(default=0, ge=0, description="Processes checking images (validate, ingest); 0 = one "
                               "per CPU core.")
    cache: Literal["auto", "ram", "disk", "none"] = Field(
        default="auto", description="Decoded-image cache; auto = RAM when it fits three times over, else disk.")
    hugepages: Literal["auto", "off"] = Field(
        default="auto", description="auto = malloc'd memory in transparent huge pages where the kernel's mode is "
        "madvise and the C library is glibc >= 2.35 (retrain train re-executes itself with GLIBC_TUNABLES).")
    compile: Literal["auto", "on", "off"] = Field(
        default="auto", description="torch.compile the training step's forward; auto = when this machine's measured "
        "saving per step times the run's steps exceeds the compile time (measured once per CPU and shape, compiled "
        "artefacts cached in .cache/inductor/); a failed compile trains eagerly with one warning.")
    checkpoint_every_s: float = Field(
        default=0.0, ge=0, description="Seconds of training between writes of models/checkpoints/last.ckpt, the "
        "resume point, at an epoch's end; 0 = every epoch; the final epoch always.  Where epochs take seconds (small "
        "data: the demo) a write costs a noticeable share of each; a crash loses at most this much training and an "
        "epoch.")
    registry_wait: float = Field(default=120.0, ge=0, description="Seconds one registry call is retried, with "
                                 "backoff, while the store is busy (sqlite locked) or unreachable, before the stage "
                                 "fails with exit 75 (which the flow retries `retrain.retries` times).")


class FlowParams(_Section):
    """The Prefect flow around the stages (section ``retrain``): versioning, schedule, retries, one run at a time.

    No DVC stage depends on this section and no stage reads it: changing the schedule never makes a stage stale.
    """

    commit: bool = Field(default=True, description="Commit dvc.lock, params and the batches' .dvc files to git "
                         "after a run that changed something, naming the data version and the decision.")
    push: bool = Field(default=True, description="`dvc push` the data to the default DVC remote after the commit.")
    schedule: str = Field(default="0 3 * * 1", min_length=9, description="Cron of the weekly deployment "
                          "(`retrain serve`; prefect.yaml's `retrain/weekly` carries the same).")
    timezone: str = Field(default="UTC", min_length=1, description="Time zone of the cron.")
    poll_interval: int = Field(default=600, ge=10, description="Seconds between looks at data/incoming/ by the "
                               "`retrain/on-new-batch` deployment.")
    lock_timeout: float = Field(default=6 * 3600, ge=0, description="Seconds a second run waits for the one "
                                "holding the workspace before it gives up (0: give up at once).")
    retries: int = Field(default=3, ge=0, le=10, description="Retries of a stage or push that failed for a "
                         "transient reason (registry or remote unreachable); bad data is never retried.")
    retry_delay: float = Field(default=10.0, ge=0, description="First retry delay in seconds; it doubles each time.")
    mlflow_ui: str = Field(default="http://127.0.0.1:5000", description="Base URL of `mlflow ui` for the links in "
                           "the Prefect UI when MLflow is a local store (a server's URL is used as it is).")


class Params(_Section):
    """All of ``params.yaml``."""

    ingest: IngestParams = IngestParams()
    merge: MergeParams = MergeParams()
    # The section is `validate` in params.yaml (the stage's name); `validate` is taken on pydantic models.
    validation: ValidateParams = Field(default=ValidateParams(), alias="validate")
    audit: AuditParams = AuditParams()
    train: TrainParams = TrainParams()
    evaluate: EvaluateParams = EvaluateParams()
    promote: PromoteParams = PromoteParams()
    registry: RegistryParams = RegistryParams()
    runtime: RuntimeParams = RuntimeParams()
    retrain: FlowParams = FlowParams()


def _format_validation_error(path: Path, err: ValidationError) -> str:
    parts = []
    for e in err.errors():
        key = ".".join(str(x) for x in e["loc"]) or "(top level)"
        parts.append(f"{key}: {e['msg']}")
    return f"{path.name}: " + "; ".join(parts)


def read_yaml(path: Path) -> Any:
    """Read a YAML file safely (no Python tags).

    Args:
        path: The file.

    Returns:
        The parsed document.

    Raises:
        ConfigError: The file is missing or is not safe, valid YAML.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError as e:
        raise ConfigError(f"{path}: file not found") from e
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot be read ({e})") from e
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"{path}: not safe YAML ({first})") from e


#: Keys an older params.yaml had, and where they live now (``retrain upgrade`` moves them).
MOVED = {("train", "workers"): ("runtime", "workers"), ("train", "threads"): ("runtime", "threads"),
         ("train", "cache"): ("runtime", "cache"), ("train", "hugepages"): ("runtime", "hugepages"),
         ("validate", "workers"): ("runtime", "check_workers"),
         ("retrain", "registry_wait"): ("runtime", "registry_wait")}


def parse_params(data: Any, source: Path = Path("params.yaml")) -> Params:
    """Validate an already-parsed params document.

    Args:
        data: The parsed YAML (``None`` for an empty file).
        source: Where it came from, for messages.

    Returns:
        The validated params.

    Raises:
        ConfigError: Unknown key or bad value; the message names the key.
    """
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source.name}: expected a mapping of sections, got {type(data).__name__}")
    old = [f"{a}.{b}" for a, b in MOVED if isinstance(data.get(a), dict) and b in data[a]]
    if old:
        raise ConfigError(f"{source.name}: {', '.join(old)} moved to the runtime section (they change speed, not "
                          "results); run 'retrain upgrade' to move them and update dvc.yaml")
    try:
        return Params.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_validation_error(source, e)) from e


def load_params(path: Path) -> Params:
    """Load and validate ``params.yaml``.

    Args:
        path: Path to ``params.yaml``.

    Returns:
        The validated params.

    Raises:
        ConfigError: The file is missing, unsafe, or has an unknown key or a bad value.
    """
    return parse_params(read_yaml(path), path)
