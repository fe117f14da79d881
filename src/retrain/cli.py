"""The ``retrain`` command: one sub-command per stage; it parses arguments and calls the stage."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from retrain.errors import RetrainError, ValidationFailed

if TYPE_CHECKING:
    from retrain.config import Params
    from retrain.paths import Paths

app = typer.Typer(
    name="retrain",
    help="Keep an object detector current: ingest labelled batches, merge, validate, train, evaluate, promote.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
log = logging.getLogger("retrain")

ProjectOpt = Annotated[Path, typer.Option("--project", "-C", help="Workspace root (default: current folder).")]


@app.callback()
def _setup(verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Debug logging.")] = False) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    for noisy in ("great_expectations", "matplotlib", "PIL"):  # their INFO lines are not for our users
        logging.getLogger(noisy).setLevel(logging.DEBUG if verbose else logging.WARNING)


def _out(line: str) -> None:
    typer.echo(line)


def _workspace(project: Path) -> tuple[Paths, Params]:
    """The workspace at ``project`` and its validated params (a clear error when it is not one)."""
    from retrain.config import load_params
    from retrain.paths import Paths
    from retrain.workspace import require_workspace

    paths = Paths.at(project)
    require_workspace(paths)
    return paths, load_params(paths.params)


@app.command()
def init(directory: Annotated[Path, typer.Argument(help="New workspace folder.")],
         remote: Annotated[str, typer.Option(help="Default DVC remote (path or URL).")] = "") -> None:
    """Make a new workspace: pipeline files, data/incoming, git + DVC, a local DVC remote."""
    from retrain.workspace import DEFAULT_REMOTE, init_workspace

    paths = init_workspace(directory, remote or DEFAULT_REMOTE)
    _out(f"workspace ready: {paths.root}")


@app.command("sample-data")
def sample_data(
    out: Annotated[Path, typer.Argument(help="Folder to write batch-1..batch-N into.")],
    batches: Annotated[int, typer.Option(min=1, max=20)] = 3,
    images_per_batch: Annotated[int, typer.Option(min=1, max=100_000)] = 40,
    seed: Annotated[int, typer.Option()] = 0,
) -> None:
    """Generate procedural sample batches (COCO JSON + JPEG); later batches shift and add a class."""
    from retrain.data.sample import generate

    for b in generate(out, batches, images_per_batch, seed):
        _out(f"{b.path}: {b.images} images, {b.boxes} boxes, classes {', '.join(b.classes)}")


@app.command()
def ingest(
    path: Annotated[Path, typer.Argument(help="Batch folder: COCO JSON, YOLO txt or Pascal VOC.")],
    name: Annotated[str | None, typer.Option(help="Name in data/batches (default: folder name).")] = None,
    fmt: Annotated[str, typer.Option("--format", help="auto, coco, yolo or voc.")] = "auto",
    project: ProjectOpt = Path("."),
) -> None:
    """Check a batch and add it to data/batches as an immutable, DVC-tracked batch."""
    from retrain.data.ingest import ingest as run_ingest

    paths, params = _workspace(project)
    result = run_ingest(paths, path, params.ingest, params.validation, name, fmt)
    for note in result.notes:
        _out(f"note: batch {result.name}: {note}")
    if result.added:
        _out(f"batch {result.name} added: {result.images} images, {result.boxes} boxes")
    else:
        _out(f"batch {result.name} already ingested with the same content; nothing changed")


@app.command()
def merge(project: ProjectOpt = Path(".")) -> None:
    """Merge every ingested batch into data/master (a DVC stage)."""
    from retrain.data.merge import merge as run_merge

    paths, params = _workspace(project)
    t = run_merge(paths, params.merge).report["totals"]
    _out(f"master: {t['images']} images, {t['boxes']} boxes, {t['classes']} classes from {t['batches']} batches "
         f"({t['duplicates']} duplicate images, {t['conflicts']} label conflicts)")


@app.command()
def validate(project: ProjectOpt = Path(".")) -> None:
    """Validate data/master (great-expectations + image checks); exit 1 on any failed check (a DVC stage)."""
    from retrain.validation.validate import validate_master

    paths, params = _workspace(project)
    report = validate_master(paths, params.validation)
    for check in report.warned:
        for p in check.problems():
            _out(f"warning: {p.file}: [{p.rule}] {p.message}")
    lines = [f"{p.file}: [{p.rule}] {p.message}" for c in report.failed for p in c.problems()]
    summary = (f"validation: {len(report.checks)} checks, {len(report.warned)} warnings, {len(report.failed)} "
               f"failures; report {paths.validation_report}, Data Docs {paths.validation_docs / 'index.html'}")
    if lines:
        raise ValidationFailed([*lines, summary])
    _out(summary)


@app.command()
def train(project: ProjectOpt = Path(".")) -> None:
    """Train a candidate on the whole master, warm-started from the champion; resumes after a crash (a DVC stage)."""
    from retrain.training.train import train as run_train

    paths, params = _workspace(project)
    result = run_train(paths, params)
    if result is None:  # another rank of a multi-process run
        return
    r = result.report
    _out(f"candidate {result.candidate}: mAP50-95 {r['ema']['mAP50-95']:.4f} (EMA; raw {r['raw']['mAP50-95']:.4f}), "
         f"mAP50 {r['ema']['mAP50']:.4f}, best epoch {r['best_epoch']} of {r['epochs']}; report {paths.train_report}")


@app.command()
def evaluate(project: ProjectOpt = Path(".")) -> None:
    """Evaluate the champion and the candidate on the master's val images (a DVC stage)."""
    from retrain.evaluation.evaluate import evaluate_models

    paths, params = _workspace(project)
    r = evaluate_models(paths, params).report
    cand = r["candidate"]["metrics"]
    line = f"candidate: mAP50-95 {cand['mAP50-95']:.4f}, mAP50 {cand['mAP50']:.4f} on {r['images']} val images"
    if r["champion"]:
        d = r["delta"]
        line += (f"; champion (version {r['champion']['version']}): {r['champion']['metrics']['mAP50-95']:.4f}; "
                 f"delta {d['mAP50-95']:+.4f}, {d['confidence']:.0%} interval [{d['ci'][0]:+.4f}, {d['ci'][1]:+.4f}]")
    else:
        line += "; no champion yet"
    _out(f"{line}; report {paths.eval_markdown}")


@app.command()
def promote(project: ProjectOpt = Path(".")) -> None:
    """Register the candidate in MLflow (alias challenger); champion moves to it only if the gate passes (DVC stage)."""
    from retrain.registry.promote import promote as run_promote

    paths, params = _workspace(project)
    result = run_promote(paths, params)
    name = params.registry.model_name
    if result.decision.promote:
        _out(f"{name} version {result.version} registered and promoted: it is {name}@champion")
    else:
        _out(f"{name} version {result.version} registered as {name}@challenger, not promoted:")
        for reason in result.decision.reasons:
            _out(f"  - {reason}")
    for note in result.decision.notes:
        _out(f"note: {note}")


@app.command()
def rollback(
    to: Annotated[str | None, typer.Option("--to", help="Version to make champion (default: the previous).")] = None,
    project: ProjectOpt = Path("."),
) -> None:
    """Move the champion alias back to the previous champion (or to --to VERSION)."""
    from retrain.registry.history import rollback as run_rollback
    from retrain.registry.tracking import tracking_uri

    paths, params = _workspace(project)
    r = run_rollback(tracking_uri(paths.root), params.registry.model_name, to)
    _out(f"{params.registry.model_name}@champion: version {r.previous} -> {r.champion}")


@app.command()
def status(project: ProjectOpt = Path(".")) -> None:
    """The registry's versions: aliases, data versions, metrics, decisions."""
    from retrain.registry.history import status as run_status
    from retrain.registry.history import status_lines
    from retrain.registry.tracking import tracking_uri

    paths, params = _workspace(project)
    for line in status_lines(run_status(tracking_uri(paths.root), params.registry.model_name),
                             params.registry.model_name):
        _out(line)


@app.command()
def demo(
    workspace: Annotated[Path, typer.Option(help="Workspace folder (made if missing).")] = Path("retrain-demo"),
    batches: Annotated[int, typer.Option(min=1, max=20)] = 2,
    images_per_batch: Annotated[int, typer.Option(min=1, max=10_000)] = 40,
    seed: Annotated[int, typer.Option()] = 0,
) -> None:
    """Run the loop on generated sample data in a fresh workspace: one ingest + `dvc repro` per batch."""
    from retrain.demo import run_demo

    for line in run_demo(workspace, batches, images_per_batch, seed):
        _out(line)


def main() -> None:
    """Console entry point: expected failures print their lines and exit non-zero, without a traceback."""
    os.environ.setdefault("YOLO_OFFLINE", "true")  # ultralytics must never download weights or fonts
    try:
        app()
    except RetrainError as e:
        for line in e.lines():
            typer.echo(f"error: {line}", err=True)
        sys.exit(e.exit_code)
