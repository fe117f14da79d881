"""The demo loop on generated sample data: what the README's main command runs.

Batches arrive one at a time in ``data/incoming/``, and each arrival is one run of the retrain flow (the same
flow the deployments run): batch 1 trains the first champion; each later batch, some with a new class, trains
a candidate on old + new data that is compared with the champion and promoted or refused.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

from flows.api import connect
from flows.retrain import outcome, retrain
from flows.summary import RunSummary
from retrain.data.sample import generate
from retrain.paths import Paths
from retrain.workspace import commit, dvc, init_workspace, require_workspace, set_params

#: The demo's batches are small (40 images, of which about 24 train once val and test have theirs): at imgsz 320,
#: batch 8 and 30 epochs the first model took 90 optimizer steps and scored 0.000 (no champion, so every later run
#: trained from scratch too).  At imgsz 160 a step costs a quarter, so batch 4 and 60 epochs give four times the steps
#: for about the same time (the shapes are 24-120 px: 160 keeps them).  40 epochs (240 steps for the first model) and
#: a val mAP every second epoch (a third of an epoch's time went to it, profiled) keep the demo within 12 minutes.
DEMO_TRAIN = {"imgsz": 160, "batch": 4, "epochs": 40, "eval_interval": 2}
#: An epoch takes 2-4 s here and a write of last.ckpt 0.17-0.21 s (42 MB: weights, EMA, Adam state; measured): 8-10 s
#: of a 130-150 s training (two A/B pairs could not resolve it from the host's noise).  Once a minute instead: a crash
#: loses at most a minute and an epoch.
DEMO_RUNTIME = {"checkpoint_every_s": 60}


def _demo_params(paths: Paths) -> None:
    """Set ``train`` and ``runtime`` for the demo's small batches (params.yaml's comments kept); commit it."""
    set_params(paths, {**{f"train.{k}": v for k, v in DEMO_TRAIN.items()},
                       **{f"runtime.{k}": v for k, v in DEMO_RUNTIME.items()}})
    commit(paths, f"demo: train {DEMO_TRAIN}, runtime {DEMO_RUNTIME} for 40-image batches")


def _map(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def run_demo(workspace: Path, batches: int, images_per_batch: int, seed: int) -> Iterator[str]:
    """Make (or reuse) a workspace, generate sample batches, and run the flow once per arriving batch.

    Args:
        workspace: The workspace folder; made with ``init`` when it is not one yet.
        batches: Sample batches to generate.
        images_per_batch: Images in each.
        seed: Sample-data seed.

    Yields:
        Lines for the user.

    Raises:
        RetrainError: A flow run failed (its reason), or Prefect's API cannot be had (``PrefectUnavailable``).
    """
    connect()  # Prefect's API first: if it cannot be had, one line and nothing made
    paths = Paths.at(workspace)
    if not (paths.root / ".dvc").is_dir():
        init_workspace(paths.root)
        _demo_params(paths)
        yield f"workspace made: {paths.root} (train {DEMO_TRAIN}, runtime {DEMO_RUNTIME} for the small sample batches)"
    require_workspace(paths)
    shutil.rmtree(paths.cache / "samples", ignore_errors=True)
    rows = []
    for s in generate(paths.cache / "samples", batches, images_per_batch, seed):
        arrived = paths.incoming / s.path.name
        shutil.rmtree(arrived, ignore_errors=True)
        shutil.move(str(s.path), str(arrived))
        yield f"batch {s.path.name} arrived in {paths.incoming} ({s.images} images, classes {', '.join(s.classes)})"
        r = RunSummary.of(outcome(retrain(project=str(paths.root), return_state=True)))
        rows.append((s.path.name, (r.data_dvc_md5 or "-")[:12], f"v{r.version}" if r.version else "-",
                     _map(r.champion_map), _map(r.candidate_map), r.decision()))
    yield ""
    yield f"{'run':<9} {'data version':<13} {'model':<6} {'champion':>8} {'candidate':>9}  decision (mAP50-95 on test)"
    for row in rows:
        yield f"{row[0]:<9} {row[1]:<13} {row[2]:<6} {row[3]:>8} {row[4]:>9}  {row[5]}"
    status = dvc(["status", "-q"], paths.root, "dvc status").strip()
    yield "dvc status: " + (status or "clean (dvc repro has nothing to do)")
    yield ""
    yield f"look at it (cd {paths.root}, with the venv active):"
    yield "  retrain status                      # the registry: versions, champion, data versions, decisions"
    yield "  prefect server start                # the flow runs, task runs, logs and artifacts: http://127.0.0.1:4200"
    yield "  mlflow ui --backend-store-uri sqlite:///mlflow.db   # runs and the model registry: http://127.0.0.1:5000"
    yield "  dvc metrics show; dvc plots show    # metrics of the last run; training curves (dvc_plots/index.html)"
    yield "  git log --oneline                   # one commit per run: data version and decision"
    yield "  retrain run                         # again, with no new batch: 'nothing to retrain'"
