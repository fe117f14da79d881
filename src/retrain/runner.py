"""The thin layer that runs a stage for the command line: it resolves what the stage takes, calls it, and words
the result for the terminal.

The stages take their inputs: ``train`` and ``evaluate`` receive the champion's model file (resolved here, once
per version, through ``registry``) and never read the registry themselves; ``train`` receives where its MLflow run
goes.  A workspace with no batch yet gets each stage's "no data" record instead (``nodata.py``).  Each function
returns the lines to print; failures are ``RetrainError`` (one line each, from ``console.run``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from retrain import codeversions, nodata
from retrain.config import Params
from retrain.detector.registered import RegisteredModel
from retrain.errors import AuditFailed, ValidationFailed
from retrain.paths import Paths

if TYPE_CHECKING:
    from retrain.training.train import RunLog

# Each function imports its stage when it runs: a stage command is a process of its own (under `dvc repro`), and the
# stages' libraries (torch and ultralytics, MLflow, great-expectations) take seconds each to import.

log = logging.getLogger(__name__)


def champion(paths: Paths, params: Params) -> RegisteredModel | None:
    """``models:/<registry.model_name>@champion`` as a local model file (downloaded once per version), or ``None``."""
    from retrain.registry import tracking

    return tracking.champion(tracking.tracking_uri(paths.root), params.registry.model_name,
                             paths.cache / "champion", params.runtime.registry_wait)


def run_log(paths: Paths, params: Params) -> RunLog:
    """Where the training's MLflow run goes: this workspace's tracking URI and, for a local store, its artifacts."""
    from retrain.registry import tracking
    from retrain.training.train import RunLog

    uri = tracking.tracking_uri(paths.root)
    where = tracking.artifact_root(paths.root, uri)
    tracking.ensure_experiment(uri, params.registry.experiment, where, params.runtime.registry_wait)
    return RunLog(uri, where, params.registry.experiment)


def _nothing_yet(paths: Paths, stage: str) -> bool:
    """No batch yet: record ``stage``'s outputs as "no data" so that ``dvc repro`` ends cleanly (``nodata.py``)."""
    if not nodata.no_batch_yet(paths):
        return False
    nodata.record(paths, stage)
    log.debug("%s: %s; its outputs record that", stage, nodata.REASON)
    return True


def run_ingest(paths: Paths, params: Params, source: Path, name: str | None, fmt: str,
               bad_boxes: str | None = None) -> list[str]:
    """``retrain ingest`` (``bad_boxes`` overrides ``ingest.bad_boxes`` for this batch)."""
    from retrain.ingest import ingest

    result = ingest(paths, source, params, name, fmt, bad_boxes)
    codeversions.record(paths)  # what `dvc repro` after it compares against
    lines = [f"note: batch {result.name}: {note}" for note in result.notes]
    lines += [f"dropped: {p.format(result.name)}" for p in result.dropped]
    if result.dropped:
        lines.append(f"note: batch {result.name}: {len(result.dropped)} broken box(es) dropped, each listed above "
                     f"and in data/batches/{result.name}/batch.json")
    if result.added:
        return [*lines, f"batch {result.name} added: {result.images} images, {result.boxes} boxes"]
    return [*lines, f"batch {result.name} already ingested with the same content; nothing changed"]


def run_merge(paths: Paths, params: Params, migrate_splits: bool = False) -> list[str]:
    """``retrain merge`` (a DVC stage; ``--migrate-splits`` once, by hand, after a change of the split rule)."""
    from retrain.merge import merge

    report = merge(paths, params.merge, migrate_splits).report
    if nodata.no_batch_yet(paths):
        return [nodata.NOTHING_YET]
    t, sp, g = report["totals"], report["splits"], report["groups"]
    lines = [f"master: {t['images']} images, {t['boxes']} boxes, {t['classes']} classes from {t['batches']} batches "
             f"({t['duplicates']} duplicate images, {t['conflicts']} label conflicts); train/val/test "
             f"{sp['train']['images']}/{sp['val']['images']}/{sp['test']['images']} images; {g['count']} near-copy "
             f"groups of {g['images']} images"]
    moved = report["split"]["changed_since_previous"]
    if moved:
        lines.append(f"split: {sum(moved.values())} images changed split since the previous master ("
                     + ", ".join(f"{n} {k}" for k, n in moved.items()) + f"); recorded in {paths.merge_report}")
    return lines


def run_validate(paths: Paths, params: Params) -> Iterator[str]:
    """``retrain validate`` (a DVC stage): warnings first, then the summary; a failed check raises
    ``ValidationFailed`` with one line per failing row."""
    if _nothing_yet(paths, "validate"):
        return
    from retrain.validation.validate import validate_master

    report = validate_master(paths, params.validation, params.runtime.check_workers)
    for check in report.warned:
        for p in check.problems():
            yield f"warning: {p.file}: [{p.rule}] {p.message}"
    failed = [f"{p.file}: [{p.rule}] {p.message}" for c in report.failed for p in c.problems()]
    summary = (f"validation: {len(report.checks)} checks, {len(report.warned)} warnings, {len(report.failed)} "
               f"failures; report {paths.validation_report}, Data Docs {paths.validation_docs / 'index.html'}")
    if failed:
        raise ValidationFailed([*failed, summary])
    yield summary


def run_audit(paths: Paths, params: Params) -> list[str]:
    """``retrain audit`` (a DVC stage): a line per audited batch; with ``audit.level: fail``, a batch over the bound
    raises ``AuditFailed`` (one line each), and ``dvc repro`` stops before training."""
    if _nothing_yet(paths, "audit"):
        return []
    from retrain.audit.audit import audit_batches

    r = audit_batches(paths, params, champion(paths, params))
    page = paths.audit_page / "index.html"
    if r.champion is None:
        return [f"audit: {n}" for n in r.notes]
    if not r.batches:
        return [f"audit: champion version {r.champion} trained on every batch of the master: nothing new to audit"]
    lines = [f"note: {n}" for n in r.notes]
    for name, b in r.batches.items():
        lines.append(f"audit: batch {name}: {b.flagged} of {b.images} images flagged ({b.flagged_fraction:.0%}; "
                     + ", ".join(f"{n} {k.replace('_', ' ')}" for k, n in b.issues.items()) + ")")
    over = [f"batch {b}: {r.batches[b].flagged_fraction:.0%} of its images ({r.batches[b].flagged} of "
            f"{r.batches[b].images}) have suspect labels, above audit.max_flagged_fraction "
            f"{r.max_flagged_fraction:.0%}; see {page}" for b in r.failed]
    if r.stops():
        raise AuditFailed([*over, f"audit failed: {len(over)} batch(es) over the bound; nothing was trained. Fix "
                           "the labels (replace the batch), or train on it anyway with audit.level: warn"])
    summary = (f"audit: champion version {r.champion} found suspect labels in {len(r.flagged)} of "
               f"{sum(b.images for b in r.batches.values())} images of {len(r.batches)} new batch(es); "
               f"report {paths.audit_report}, pages {page}")
    return [*lines, *[f"warning: {o}" for o in over], summary]


def run_train(paths: Paths, params: Params) -> list[str]:
    """``retrain train`` (a DVC stage); nothing on the other ranks of a multi-process run."""
    if _nothing_yet(paths, "train"):
        return []
    from retrain.training.train import train

    result = train(paths, params, champion(paths, params) if params.train.use_champion else None,
                   run_log(paths, params))
    if result is None:  # another rank of a multi-process run
        return []
    r = result.report
    return [f"candidate {result.candidate}: mAP50-95 {r.ema.map:.4f} (EMA; raw {r.raw.map:.4f}), mAP50 "
            f"{r.ema.map50:.4f}, best epoch {r.best_epoch} of {r.epochs}; report {paths.train_report}"]


def run_evaluate(paths: Paths, params: Params) -> list[str]:
    """``retrain evaluate`` (a DVC stage)."""
    if _nothing_yet(paths, "evaluate"):
        return []
    from retrain.evaluation.evaluate import evaluate_models

    r = evaluate_models(paths, params, champion(paths, params))
    cand = r.candidate.metrics
    line = f"candidate: mAP50-95 {cand.map:.4f}, mAP50 {cand.map50:.4f} on {r.images} {r.split} images"
    if r.champion is not None and r.delta is not None:
        d = r.delta
        line += (f"; champion (version {r.champion.version}): {r.champion.metrics.map:.4f}; delta {d.map:+.4f}, "
                 f"{d.confidence:.0%} interval [{d.ci[0]:+.4f}, {d.ci[1]:+.4f}]")
    else:
        line += "; no champion yet"
    if r.val is not None:
        line += f" (val, beside: candidate {r.val.candidate.map:.4f})"
    return [*[f"note: {n}" for n in r.notes], f"{line}; report {paths.eval_markdown}"]


def run_promote(paths: Paths, params: Params) -> list[str]:
    """``retrain promote`` (a DVC stage)."""
    if _nothing_yet(paths, "promote"):
        return []
    from retrain.promotion.promote import promote

    result = promote(paths, params)
    name = params.registry.model_name
    if result.decision.promote:
        lines = [f"{name} version {result.version} registered and promoted: it is {name}@champion"]
    else:
        lines = [f"{name} version {result.version} registered as {name}@challenger, not promoted:"]
        lines += [f"  - {reason}" for reason in result.decision.reasons]
    return lines + [f"note: {note}" for note in result.decision.notes]


def run_code_versions(paths: Paths) -> list[str]:
    """``retrain code-versions``: record the installed code's versions; which stages they make stale."""
    changed = codeversions.record(paths)
    if not changed:
        return [f"{codeversions.FILE}: the installed code is what it records; no stage is stale for code"]
    return [f"{codeversions.FILE}: new code for {', '.join(changed)}: 'dvc repro' (or 'retrain run') reruns "
            "those stages"]
