"""The ``retrain`` command: one sub-command per stage; it parses arguments and calls the stage."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from retrain.errors import RetrainError, TransientError, ValidationFailed, disk_full, transient_reason

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


class _RunFormatter(logging.Formatter):
    """Prefect's run loggers say which task or flow run a line is from; so does the terminal."""

    def format(self, record: logging.LogRecord) -> str:
        run = getattr(record, "task_run_name", None) or getattr(record, "flow_run_name", None)
        if run and record.name.startswith("prefect."):
            line = f"{record.levelname} {run}: {record.getMessage()}"
            return line + "\n" + self.formatException(record.exc_info) if record.exc_info else line
        return super().format(record)


@app.callback()
def _setup(verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Debug logging.")] = False) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_RunFormatter("%(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, handlers=[handler])
    for noisy in ("great_expectations", "matplotlib", "PIL", "httpx", "httpcore"):  # INFO lines not for our users
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


def _nothing_yet(paths: Paths, stage: str) -> bool:
    """No batch yet: record ``stage``'s outputs as "no data" so that ``dvc repro`` ends cleanly (``nodata.py``)."""
    from retrain import nodata

    if not nodata.no_batch_yet(paths):
        return False
    nodata.record(paths, stage)
    log.debug("%s: %s; its outputs record that", stage, nodata.REASON)
    return True


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
    from retrain.nodata import NOTHING_YET, no_batch_yet

    paths, params = _workspace(project)
    t = run_merge(paths, params.merge).report["totals"]
    if no_batch_yet(paths):
        _out(NOTHING_YET)
        return
    _out(f"master: {t['images']} images, {t['boxes']} boxes, {t['classes']} classes from {t['batches']} batches "
         f"({t['duplicates']} duplicate images, {t['conflicts']} label conflicts)")


@app.command()
def validate(project: ProjectOpt = Path(".")) -> None:
    """Validate data/master (great-expectations + image checks); exit 1 on any failed check (a DVC stage)."""
    paths, params = _workspace(project)
    if _nothing_yet(paths, "validate"):
        return
    from retrain.validation.validate import validate_master

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
    from retrain.training.hugepages import reexec

    paths, params = _workspace(project)
    if _nothing_yet(paths, "train"):
        return
    reexec(params.train.hugepages)  # before torch is imported: glibc reads its tunables when a process starts
    from retrain.training.train import train as run_train

    result = run_train(paths, params)
    if result is None:  # another rank of a multi-process run
        return
    r = result.report
    _out(f"candidate {result.candidate}: mAP50-95 {r['ema']['mAP50-95']:.4f} (EMA; raw {r['raw']['mAP50-95']:.4f}), "
         f"mAP50 {r['ema']['mAP50']:.4f}, best epoch {r['best_epoch']} of {r['epochs']}; report {paths.train_report}")


@app.command()
def evaluate(project: ProjectOpt = Path(".")) -> None:
    """Evaluate the champion and the candidate on the master's val images (a DVC stage)."""
    paths, params = _workspace(project)
    if _nothing_yet(paths, "evaluate"):
        return
    from retrain.evaluation.evaluate import evaluate_models

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
    paths, params = _workspace(project)
    if _nothing_yet(paths, "promote"):
        return
    from retrain.registry.promote import promote as run_promote

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


@app.command("check-remote")
def check_remote(project: ProjectOpt = Path(".")) -> None:
    """Restore the committed version from the DVC remote into an empty cache, as a new machine would (verified)."""
    from retrain.workspace import check_remote as run_check

    paths, _ = _workspace(project)
    _out(run_check(paths))


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


@app.command("registry-copy")
def registry_copy(
    source: Annotated[str, typer.Option("--from", help="Tracking URI to copy the champion from "
                                                       "(e.g. sqlite:///mlflow.db).")],
    target: Annotated[str | None, typer.Option("--to", help="Tracking URI to copy into (default: this workspace's: "
                                                            "MLFLOW_TRACKING_URI, else its mlflow.db).")] = None,
    project: ProjectOpt = Path("."),
) -> None:
    """Copy the champion (model file, lineage tags) into another registry and make it the champion there."""
    from retrain.registry.copy import copy_champion
    from retrain.registry.promote import redact
    from retrain.registry.tracking import tracking_uri

    paths, params = _workspace(project)
    to = target or tracking_uri(paths.root)
    name = params.registry.model_name
    c = copy_champion(source, to, name, params.registry.experiment, paths.root, params.retrain.registry_wait)
    how = "registered" if c.new else "already there"
    _out(f"{name}@champion in {redact(to)}: version {c.version} ({how}; version {c.source_version} of "
         f"{redact(source)})")


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


def summary_lines(s: dict[str, Any]) -> list[str]:
    """What a flow run did, for the terminal."""
    if s["nothing_to_retrain"]:
        from flows.retrain import nothing_line

        return [nothing_line(s)]
    ran = [k for k, v in s["stages"].items() if v]
    lines = [f"batches ingested: {', '.join(s['ingested']) or 'none'}; stages run: {', '.join(ran) or 'none'}",
             f"data version: {s.get('data_version') or '-'}"]
    if s.get("version"):
        lines.append(f"{s['model']} version {s['version']}: "
                     + ("promoted, it is the champion" if s["promoted"] else "registered as challenger, not promoted"))
        lines += [f"  - {r}" for r in s["reasons"]]
    if s.get("commit"):
        lines.append(f"git commit {s['commit']}")
    return lines


@app.command()
def run(
    batches: Annotated[list[Path] | None, typer.Argument(help="Batch folders (default: data/incoming/*).")] = None,
    only_if_new: Annotated[bool, typer.Option(help="Do nothing when no batch is waiting.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the run's summary as JSON.")] = False,
    project: ProjectOpt = Path("."),
) -> None:
    """Run the retrain flow once: ingest waiting batches, then every stale DVC stage; commit and push the result."""
    from flows.api import connect, defaults

    defaults()
    paths, _ = _workspace(project)
    connect()  # before anything changes: a Prefect API that cannot be had is one line and exit 75
    from flows.retrain import outcome
    from flows.retrain import retrain as retrain_flow

    state = retrain_flow(project=str(paths.root), batches=[str(b) for b in batches or []] or None,
                         only_if_new=only_if_new, return_state=True)
    summary = outcome(state)
    if as_json:
        import json

        _out(json.dumps(summary, default=str))
        return
    for line in summary_lines(summary):
        _out(line)


@app.command()
def serve(project: ProjectOpt = Path(".")) -> None:
    """Serve the deployments retrain/weekly (cron from params) and retrain/on-new-batch (polls data/incoming/).

    Needs a Prefect API that schedules runs: `prefect server start`, with PREFECT_API_URL pointing at it.
    """
    from flows.api import connect, defaults

    defaults()
    paths, params = _workspace(project)
    from prefect.settings import PREFECT_API_URL

    if not PREFECT_API_URL.value():
        raise RetrainError("retrain serve needs a Prefect server to schedule its runs: start one with "
                           "'prefect server start' and set PREFECT_API_URL=http://127.0.0.1:4200/api")
    connect()
    from flows.automations import ensure_automations
    from flows.deployments import serve_workspace

    _out(f"automations: {', '.join(ensure_automations())}")
    serve_workspace(paths.root, params)


@app.command()
def automations(notify_url: Annotated[str | None, typer.Option(
        help="Webhook for notifications (default: $RETRAIN_NOTIFY_URL).")] = None) -> None:
    """Create or update retrain's automations on the Prefect server: notify on failed runs and champion moves,
    crash zombie runs."""
    from flows.api import connect, defaults

    defaults()
    from prefect.settings import PREFECT_API_URL

    if not PREFECT_API_URL.value():
        raise RetrainError("automations live on a Prefect server: set PREFECT_API_URL (e.g. "
                           "http://127.0.0.1:4200/api after 'prefect server start')")
    connect()
    from flows.automations import ensure_automations

    for name in ensure_automations(notify_url):
        _out(f"automation ready: {name}")


@app.command()
def demo(
    workspace: Annotated[Path, typer.Option(help="Workspace folder (made if missing).")] = Path("retrain-demo"),
    batches: Annotated[int, typer.Option(min=1, max=20)] = 3,
    images_per_batch: Annotated[int, typer.Option(min=1, max=10_000)] = 40,
    seed: Annotated[int, typer.Option()] = 0,
) -> None:
    """The loop on generated sample data in a fresh workspace: one retrain flow run per arriving batch."""
    from flows.api import defaults
    from retrain.demo import run_demo

    defaults()

    for line in run_demo(workspace, batches, images_per_batch, seed):
        _out(line)


def main() -> None:
    """Console entry point: expected failures print their lines and exit non-zero, without a traceback."""
    os.environ.setdefault("YOLO_OFFLINE", "true")  # ultralytics must never download weights or fonts
    if os.environ.get("RETRAIN_DIE_WITH_PARENT") == "1":  # a stage the flow started (through DVC): see lifeline.py
        from retrain.lifeline import die_with_parent

        die_with_parent()
    try:
        app()
    except RetrainError as e:
        for line in e.lines():
            typer.echo(f"error: {line}", err=True)
        sys.exit(e.exit_code)
    except Exception as e:  # a service down is one line and exit 75, which the flow retries; a bug keeps its traceback
        full = disk_full(e)
        if full is not None:
            typer.echo(f"error: {full}", err=True)
            sys.exit(full.exit_code)
        reason = transient_reason(e)
        if reason is None:
            raise
        typer.echo(f"error: unavailable, try again later: {reason}", err=True)
        sys.exit(TransientError.exit_code)
