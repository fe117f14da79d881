"""``retrain ingest``: check a batch, store it in canonical form and track it with DVC.

A refused batch changes nothing.  An admitted batch is built in ``data/.staging``, renamed into
``data/batches/<name>`` and ``dvc add``-ed; if ``dvc add`` fails, the rename is undone.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

from retrain.config import Params
from retrain.data import canonical
from retrain.data.formats import FORMATS, read_batch
from retrain.errors import BatchRejected, Problem, RetrainError
from retrain.faults import fault_point
from retrain.fsutil import dumps_canonical, fsync_dir
from retrain.paths import Paths
from retrain.validation.batch import validate_batch
from retrain.workspace import dvc, git, require_workspace

log = logging.getLogger(__name__)

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


@dataclass(frozen=True)
class IngestResult:
    """What ``ingest`` did.

    Attributes:
        name: The batch's name in ``data/batches`` (the existing one when the content was already there).
        added: False when the same content was already ingested (nothing changed).
        images: Images in the batch.
        boxes: Boxes in the batch.
        notes: Remarks that did not refuse the batch.
        dropped: Boxes left out under ``ingest.bad_boxes: drop``, one problem each (file, rule, message).
    """

    name: str
    added: bool
    images: int
    boxes: int
    notes: tuple[str, ...]
    dropped: tuple[Problem, ...] = ()


def _copy_verified(src: Path, dst: Path, sha256: str) -> None:
    """Copy ``src`` to ``dst`` and check the copy has the hash that was checked (no swap after the check)."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    h = hashlib.sha256()
    with open(src, "rb") as fi, open(dst, "wb") as fo:
        while chunk := fi.read(1 << 20):
            h.update(chunk)
            fo.write(chunk)
    if h.hexdigest() != sha256:
        raise RetrainError(f"{src}: file changed while the batch was being ingested; ingest it again")


def remove_unadmitted(paths: Paths) -> None:
    """Remove batch folders left without a ``.dvc`` file by a killed ingest (they were never admitted)."""
    if not paths.batches.is_dir():
        return
    for d in paths.batches.iterdir():
        if d.is_dir() and not d.name.startswith(".") and not paths.batch_dvc_file(d.name).exists():
            log.warning("removing %s: left by an interrupted ingest (no %s.dvc)", d, d.name)
            shutil.rmtree(d)


def _write_batch(paths: Paths, name: str, fmt: str, batch: canonical.CanonicalBatch,
                 notes: tuple[str, ...], seq: int, dropped: tuple[Problem, ...]) -> Path:
    paths.staging.mkdir(parents=True, exist_ok=True)
    stage = paths.staging / f"batch-{name}-{uuid.uuid4().hex[:8]}"
    try:
        for rel, src, sha in batch.files:
            _copy_verified(src, stage / canonical.IMAGES / rel, sha)
        (stage / canonical.ANNOTATIONS).write_text(batch.text, encoding="utf-8")
        meta = canonical.BatchMeta(name, seq, fmt, batch.content_sha256, len(batch.coco["images"]),
                                   len(batch.coco["annotations"]), notes,
                                   tuple({"file": p.file, "rule": p.rule, "message": p.message} for p in dropped))
        (stage / canonical.META).write_text(dumps_canonical(meta.to_json()), encoding="utf-8")
        fsync_dir(stage)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return stage


def _admit(paths: Paths, name: str, stage: Path) -> None:
    """Rename the staged batch into place and ``dvc add`` it; undo everything if that fails."""
    target = paths.batch(name)
    gitignore = paths.batches / ".gitignore"
    before = gitignore.read_text(encoding="utf-8") if gitignore.exists() else None
    stage.rename(target)
    try:
        fault_point("ingest.before-dvc-add")
        dvc(["add", target.relative_to(paths.root).as_posix()], paths.root, f"dvc add of batch {name}")
    except BaseException:
        shutil.rmtree(target, ignore_errors=True)
        dvc_file = paths.batch_dvc_file(name)
        dvc_file.unlink(missing_ok=True)
        if before is None:
            gitignore.unlink(missing_ok=True)
        else:
            gitignore.write_text(before, encoding="utf-8")
        rels = [p.relative_to(paths.root).as_posix() for p in (dvc_file, gitignore)]
        with contextlib.suppress(RetrainError):  # nothing was staged
            git(["reset", "-q", "--", *rels], paths.root, "git reset")
        raise


def ingest(paths: Paths, source: Path, params: Params, name: str | None = None, fmt: str = "auto",
           bad_boxes: str | None = None) -> IngestResult:
    """Check a batch and, if it passes, add it to ``data/batches`` as an immutable DVC-tracked batch.

    Args:
        paths: The workspace.
        source: The batch folder (COCO JSON, YOLO txt or Pascal VOC).
        params: All params: ``ingest``; ``validate`` (the batch checks are the batch half of validation);
            ``runtime.check_workers``.
        name: Name in ``data/batches``; default the folder's name.
        fmt: ``auto``, ``coco``, ``yolo`` or ``voc``.
        bad_boxes: ``refuse`` or ``drop`` for this batch; ``None`` = ``ingest.bad_boxes``.

    Returns:
        What was done.

    Raises:
        BatchRejected: The batch failed a check; nothing was changed.
        RetrainError: Bad arguments, a name taken by other content, or a DVC failure (undone).
    """
    require_workspace(paths)
    if fmt != "auto" and fmt not in FORMATS:
        raise RetrainError(f"--format must be auto, {', '.join(FORMATS)}; got {fmt!r}")
    root = source.resolve()
    name = name or root.name
    if not _NAME.match(name):
        raise RetrainError(f"batch name {name!r}: use letters, digits, '.', '_' and '-' (not first), <= 100 chars")
    if not root.is_dir():
        raise BatchRejected(name, [Problem(str(source), "batch-folder", "not a folder")])
    if root.is_relative_to(paths.batches.resolve()):
        raise RetrainError(f"{source}: is already inside data/batches; ingest from outside the workspace's batches")

    parsed = read_batch(root, fmt)
    policy = bad_boxes or params.ingest.bad_boxes
    if policy not in ("refuse", "drop"):
        raise RetrainError(f"--bad-boxes must be refuse or drop; got {policy!r}")
    valid, problems = validate_batch(parsed, params.validation, params.runtime.check_workers, policy)
    if valid is None:
        raise BatchRejected(name, problems, params.ingest.max_problems_shown)
    batch = canonical.build(valid)
    notes = tuple(parsed.notes)
    counts = (len(batch.coco["images"]), len(batch.coco["annotations"]))

    existing = canonical.ingested_batches(paths.batches)
    for _, meta in existing:
        if meta.content_sha256 == batch.content_sha256:
            log.debug("batch %s: same content as ingested batch %s; nothing changed", name, meta.name)
            return IngestResult(meta.name, False, *counts, notes, valid.dropped)
    remove_unadmitted(paths)
    if paths.batch(name).exists() or paths.batch_dvc_file(name).exists():
        raise RetrainError(f"batch {name}: a batch of that name exists with other content; batches are "
                           "immutable, so ingest this one under a new --name")
    seq = max((m.seq for _, m in existing), default=0) + 1
    stage = _write_batch(paths, name, parsed.format, batch, notes, seq, valid.dropped)
    _admit(paths, name, stage)
    log.debug("batch %s admitted: %d images, %d boxes, %d classes (%s)", name, *counts,
             len(parsed.categories), parsed.format)
    return IngestResult(name, True, *counts, notes, valid.dropped)
