"""The ``retrain`` command: one sub-command per stage; it parses arguments, calls the layer below, prints its lines.

Two kinds of import wait until a command runs (the only imports inside functions here): the registry's (MLflow,
seconds to import, which ``retrain --help`` or ``retrain train`` do not need) and Prefect's (the flow, deployments,
automations), which must come after ``flows.api.defaults()`` has set retrain's Prefect defaults, since Prefect
reads its settings when it is imported.  The stages' own heavy libraries (torch, ultralytics, great-expectations)
are imported by ``runner`` when a stage runs; ``retrain train`` re-executes itself for huge pages before that.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated

import typer

from flows.api import connect, defaults
from retrain import runner
from retrain.config import Params, load_params
from retrain.console import run as run_console
from retrain.console import setup_logging
from retrain.data.sample import generate
from retrain.errors import RetrainError
from retrain.paths import Paths
from retrain.training.hugepages import reexec
from retrain.workspace import DEFAULT_REMOTE, init_workspace, require_workspace
from retrain.workspace import check_remote as run_check
from retrain.workspace import upgrade as run_upgrade

app = typer.Typer(
    name="retrain",
    help="Keep an object detector current: ingest labelled batches, merge, validate, audit, train, evaluate, promote.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)

ProjectOpt = Annotated[Path, typer.Option("--project", "-C", help="Workspace root (default: current folder).")]


@app.callback()
def _setup(verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Debug logging.")] = False) -> None:
    setup_logging(verbose)


def _out(lines: str | Iterable[str]) -> None:
    for line in [lines] if isinstance(lines, str) else lines:
        typer.echo(line)


def _workspace(project: Path) -> tuple[Paths, Params]:
    """The workspace at ``project`` and its validated params (a clear error when it is not one)."""
    paths = Paths.at(project)
    require_workspace(paths)
    return paths, load_params(paths.params)


@app.command()
def init(directory: Annotated[Path, typer.Argument(help="New workspace folder.")],
         remote: Annotated[str, typer.Option(help="Default DVC remote (path or URL).")] = "") -> None:
    """Make a new workspace: pipeline files, data/incoming, git + DVC, a local DVC remote."""
    _out(f"workspace ready: {init_workspace(directory, remote or DEFAULT_REMOTE).root}")


@app.command("sample-data")
def sample_data(
    out: Annotated[Path, typer.Argument(help="Folder to write batch-1..batch-N into.")],
    batches: Annotated[int, typer.Option(min=1, max=20)] = 3,
    images_per_batch: Annotated[int, typer.Option(min=1, max=100_000)] = 40,
    seed: Annotated[int, typer.Option()] = 0,
) -> None:
    """Generate procedural sample batches (COCO JSON + JPEG); later batches shift and add a class."""
    _out([f"{b.path}: {b.images} images, {b.boxes} boxes, classes {', '.join(b.classes)}"
          for b in generate(out, batches, images_per_batch, seed)])


@app.command()
def ingest(
    path: Annotated[Path, typer.Argument(help="Batch folder: COCO JSON, YOLO txt or Pascal VOC.")],
    name: Annotated[str | None, typer.Option(help="Name in data/batches (default: folder name).")] = None,
    fmt: Annotated[str, typer.Option("--format", help="auto, coco, yolo or voc.")] = "auto",
    bad_boxes: Annotated[str | None, typer.Option(
        "--bad-boxes", help="refuse or drop boxes of zero/negative size or with non-finite numbers, for this batch "
        "(default: ingest.bad_boxes). drop lists each one and admits the batch; other rules still refuse.")] = None,
    project: ProjectOpt = Path("."),
) -> None:
    """Check a batch and add it to data/batches as an immutable, DVC-tracked batch."""
    paths, params = _workspace(project)
    _out(runner.run_ingest(paths, params, path, name, fmt, bad_boxes))


@app.command()
def merge(project: ProjectOpt = Path("."),
          migrate_splits: bool = typer.Option(False, "--migrate-splits", help="Accept a changed split rule (merge "
                                              "params, or a master from before the test split) once: the images it "
                                              "moves are counted and recorded in data/master and reports/merge.json.")
          ) -> None:
    """Merge every ingested batch into data/master (a DVC stage)."""
    _out(runner.run_merge(*_workspace(project), migrate_splits=migrate_splits))


@app.command()
def validate(project: ProjectOpt = Path(".")) -> None:
    """Validate data/master (great-expectations + image checks); exit 1 on any failed check (a DVC stage)."""
    _out(runner.run_validate(*_workspace(project)))


@app.command()
def audit(project: ProjectOpt = Path(".")) -> None:
    """The champion looks for label errors in the batches it has not trained on (cleanlab; a DVC stage)."""
    _out(runner.run_audit(*_workspace(project)))


@app.command()
def train(project: ProjectOpt = Path(".")) -> None:
    """Train a candidate on the whole master, warm-started from the champion; resumes after a crash (a DVC stage)."""
    paths, params = _workspace(project)
    reexec(params.runtime.hugepages)  # before torch is imported: glibc reads its tunables when a process starts
    _out(runner.run_train(paths, params))


@app.command()
def evaluate(project: ProjectOpt = Path(".")) -> None:
    """Evaluate the champion and the candidate on the master's val images (a DVC stage)."""
    _out(runner.run_evaluate(*_workspace(project)))


@app.command()
def promote(project: ProjectOpt = Path(".")) -> None:
    """Register the candidate in MLflow (alias challenger); champion moves to it only if the gate passes (DVC stage)."""
    _out(runner.run_promote(*_workspace(project)))


@app.command()
def upgrade(project: ProjectOpt = Path(".")) -> None:
    """Bring a workspace made by an earlier retrain to this version's params.yaml and dvc.yaml (review, commit)."""
    paths = Paths.at(project)
    require_workspace(paths)  # its params may not load yet: that is what this fixes
    _out(run_upgrade(paths))


@app.command("code-versions")
def code_versions(project: ProjectOpt = Path(".")) -> None:
    """Record the installed code each stage runs (code-versions.yaml), so that dvc repro reruns what an upgrade
    changed (retrain run and retrain ingest do this themselves)."""
    paths, _ = _workspace(project)
    _out(runner.run_code_versions(paths))


@app.command("check-remote")
def check_remote(project: ProjectOpt = Path(".")) -> None:
    """Restore the committed version from the DVC remote into an empty cache, as a new machine would (verified)."""
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


@app.command()
def export(
    out: Annotated[Path, typer.Argument(help="A new folder for the export (model, classes, metadata, README).")],
    version: Annotated[str | None, typer.Option("--version", help="Registered version to export.")] = None,
    alias: Annotated[str | None, typer.Option("--alias", help="Alias to export (default: champion).")] = None,
    fmt: Annotated[str, typer.Option("--format", help="onnx (onnxruntime) or openvino (OpenVINO IR; "
                                                     "needs the openvino package).")] = "onnx",
    project: ProjectOpt = Path("."),
) -> None:
    """Write a registered version (default: the champion) as a deployable folder, checked against PyTorch."""
    from retrain.promotion.export import export_version

    paths, params = _workspace(project)
    e = export_version(paths, params, out.resolve(), version, alias, fmt)
    checked = (f"mAP50-95 {e.parity.map_onnx:.4f} vs PyTorch {e.parity.map_torch:.4f} on {e.parity.images} val "
               f"images, boxes within {e.parity.box_diff:.2g} px, scores within {e.parity.score_diff:.2g}"
               if e.parity else "not checked: no val images in this workspace")
    _out(f"{e.model} version {e.version} exported to {e.out} ({', '.join(e.files)}); {checked}")


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
    from retrain.registry.tracking import tracking_uri
    from retrain.registry.versions import redact

    paths, params = _workspace(project)
    to = target or tracking_uri(paths.root)
    name = params.registry.model_name
    c = copy_champion(source, to, name, params.registry.experiment, paths.root, params.runtime.registry_wait)
    how = "registered" if c.new else "already there"
    _out(f"{name}@champion in {redact(to)}: version {c.version} ({how}; version {c.source_version} of "
         f"{redact(source)})")


@app.command()
def status(
    plot: Annotated[bool, typer.Option("--plot", help="Also draw mAP50-95 per version, overall and per class, with "
                                       "the champion's moves, as a PNG (--out).")] = False,
    out: Annotated[Path, typer.Option(help="Where --plot writes the PNG (relative to the workspace).")] = Path(
        "reports/history.png"),
    project: ProjectOpt = Path("."),
) -> None:
    """The registry's versions: aliases, data versions, metrics, decisions; --plot draws their quality history."""
    from retrain.registry.history import status as run_status
    from retrain.registry.history import status_lines
    from retrain.registry.tracking import tracking_uri

    paths, params = _workspace(project)
    name = params.registry.model_name
    rows = run_status(tracking_uri(paths.root), name)
    _out(status_lines(rows, name))
    if plot:
        from retrain.errors import WorkspaceError
        from retrain.registry.history_plot import save

        try:
            png = save(rows, name, paths.root / out)
        except OSError as e:
            raise WorkspaceError(f"status --plot: cannot write {paths.root / out}: {e.strerror or e}") from e
        _out(f"quality history of {len(rows)} version(s): {png}")


@app.command()
def run(
    batches: Annotated[list[Path] | None, typer.Argument(help="Batch folders (default: data/incoming/*).")] = None,
    only_if_new: Annotated[bool, typer.Option(help="Do nothing when no batch is waiting.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the run's summary as JSON.")] = False,
    project: ProjectOpt = Path("."),
) -> None:
    """Run the retrain flow once: ingest waiting batches, then every stale DVC stage; commit and push the result."""
    defaults()
    paths, _ = _workspace(project)
    connect()  # before anything changes: a Prefect API that cannot be had is one line and exit 75
    from flows.retrain import outcome
    from flows.retrain import retrain as retrain_flow
    from flows.summary import RunSummary

    summary = outcome(retrain_flow(project=str(paths.root), batches=[str(b) for b in batches or []] or None,
                                   only_if_new=only_if_new, return_state=True))
    _out(json.dumps(summary, default=str) if as_json else RunSummary.of(summary).lines())


@app.command()
def serve(project: ProjectOpt = Path(".")) -> None:
    """Serve the deployments retrain/weekly (cron from params) and retrain/on-new-batch (polls data/incoming/).

    Needs a Prefect API that schedules runs: `prefect server start`, with PREFECT_API_URL pointing at it.
    """
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
    defaults()
    from prefect.settings import PREFECT_API_URL

    if not PREFECT_API_URL.value():
        raise RetrainError("automations live on a Prefect server: set PREFECT_API_URL (e.g. "
                           "http://127.0.0.1:4200/api after 'prefect server start')")
    connect()
    from flows.automations import ensure_automations

    _out([f"automation ready: {name}" for name in ensure_automations(notify_url)])


@app.command()
def demo(
    workspace: Annotated[Path, typer.Option(help="Workspace folder (made if missing).")] = Path("retrain-demo"),
    batches: Annotated[int, typer.Option(min=1, max=20)] = 3,
    images_per_batch: Annotated[int, typer.Option(min=1, max=10_000)] = 40,
    seed: Annotated[int, typer.Option()] = 0,
) -> None:
    """The loop on generated sample data in a fresh workspace: one retrain flow run per arriving batch."""
    defaults()  # before Prefect is imported: it reads its settings then
    from flows.demo import run_demo

    _out(run_demo(workspace, batches, images_per_batch, seed))


def main() -> None:
    """Console entry point: expected failures print their lines and exit non-zero, without a traceback."""
    run_console(app)
