"""`retrain train` for real: Lightning + ultralytics on tiny generated data, DVC stage, MLflow, resume, DDP.

Every run is a real ``retrain train`` process (so SIGKILL is a real kill) on a real git + DVC workspace with
the sample batches merged; MLflow is the workspace's own sqlite store.  Models are yolo11n at imgsz 96 (the slow
tests: at the sizes issue 4 names).
"""

from __future__ import annotations

import csv
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from retrain.detector.files import load_model_file
from retrain.paths import Paths
from retrain.training import hugepages
from retrain.training.callbacks import LAST, PREVIOUS
from tests.helpers import load_json, run_cli, run_dvc, set_params, set_train_params, tree_hash

# channels_last pinned: `auto` times a step in each format per workspace, and at imgsz 96 the two are close, so two
# copies of a workspace could choose differently (other conv kernels, other float rounding) and two runs the tests
# compare would differ by more than a resume could explain.
TINY: dict[str, Any] = {"imgsz": 96, "epochs": 3, "batch": 4, "workers": 0, "cache": "none", "use_champion": False,
                        "seed": 0, "channels_last": "off", "augment": {"close_mosaic": 1}}


@pytest.fixture(scope="module")
def merged(tmp_path_factory: pytest.TempPathFactory, sample_root: Path) -> Path:
    """A workspace with batch-1 and batch-2 ingested and merged (copy it before use)."""
    from retrain.workspace import init_workspace

    base = tmp_path_factory.mktemp("merged")
    paths = init_workspace(base / "ws", remote=str(base / "remote"))
    for b in ("batch-1", "batch-2"):
        run_cli("ingest", sample_root / b, cwd=paths.root, check=True)
    run_cli("merge", cwd=paths.root, check=True)
    run_cli("validate", cwd=paths.root, check=True)  # training reads only a validated master
    set_train_params(paths.root, **TINY)
    return paths.root


def _copy(src: Path, dst: Path) -> Paths:
    shutil.copytree(src, dst, symlinks=True)
    return Paths(dst)


def _train(root: Path, env: dict[str, str] | None = None):
    return run_cli("train", cwd=root, env=env)


def _report(paths: Paths) -> dict[str, Any]:
    return load_json(paths.train_report)


def _weights(paths: Paths) -> dict[str, torch.Tensor]:
    return load_model_file(paths.candidate / "model.pt").state_dict


def test_dvc_repro_trains_a_candidate_with_report_plots_and_one_mlflow_run(merged: Path, tmp_path: Path):
    paths = _copy(merged, tmp_path / "ws")
    run_dvc("repro", "validate", cwd=paths.root)
    data_before = tree_hash(paths.data)
    out = run_dvc("repro", "train", cwd=paths.root)
    assert "Running stage 'train'" in out
    report = _report(paths)
    assert report["epochs"] == 3 and report["warm_start"] == {"kind": "scratch"} and report["resumed_from"] is None
    assert report["ema"]["mAP50-95"] >= 0 and set(report["ema"]["per_class"]) == {
        "circle", "square", "triangle", "star"}
    model = load_model_file(paths.candidate / "model.pt")  # small and safe: weights_only loads it
    assert model.names == ("circle", "square", "triangle", "star") and model.imgsz == 96
    assert model.meta["data_version"] == report["data_version"]
    assert (paths.candidate / "model.pt").stat().st_size < 15e6
    rows = list(csv.DictReader(paths.train_metrics.open()))
    epochs = [r for r in rows if r.get("val/mAP50-95")]
    assert [int(r["epoch"]) for r in epochs] == [0, 1, 2]
    # Ultralytics wrote nothing next to the data (no label caches, no repaired JPEGs): data/ is byte for byte the same.
    assert tree_hash(paths.data) == data_before
    assert not list(paths.data.rglob("*.cache")) and not list(paths.data.rglob("*.npy"))
    # One MLflow run for the training, tagged with the data version; nothing else wrote runs.
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{paths.root / 'mlflow.db'}")
    exps = [e for e in client.search_experiments() if e.name != "Default"]
    assert [e.name for e in exps] == ["retrain"]
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert len(runs) == 1 and runs[0].info.run_id == report["mlflow_run_id"]
    assert runs[0].data.tags["retrain.data_version"] == report["data_version"]
    assert "val/mAP50-95" in runs[0].data.metrics and "final/ema_mAP50-95" in runs[0].data.metrics
    assert "up to date" in run_dvc("status", "train", cwd=paths.root).lower()
    # The per-epoch CSV is a DVC plot.
    assert "val/mAP50-95" in run_dvc("plots", "show", "--json", cwd=paths.root)

    # What makes train stale: a param that changes its result, or new training code; a speed knob does not.
    clean = "Data and pipelines are up to date."
    set_params(paths.root, "runtime", threads=1, workers=0, cache="disk", hugepages="off", registry_wait=5)
    assert run_dvc("status", "train", cwd=paths.root).strip() == clean
    lock = (paths.root / "dvc.lock").read_text()
    set_params(paths.root, "train", lr=0.01)
    status = run_dvc("status", "train", cwd=paths.root)
    assert "train:" in status and "train.lr" in status, status
    set_params(paths.root, "train", lr=TINY.get("lr", 0.002))
    assert run_dvc("status", "train", cwd=paths.root).strip() == clean
    code = paths.root / "code-versions.yaml"
    recorded = code.read_text()
    code.write_text(recorded.replace("train: ", "train: 0"))  # as after an upgrade of the training code
    status = run_dvc("status", "train", cwd=paths.root)
    assert "code-versions.yaml" in status and "train" in status, status
    assert run_dvc("status", "merge", "validate", cwd=paths.root).strip() == clean  # their code did not change
    changed = run_cli("code-versions", cwd=paths.root, check=True)  # records what is installed: the real hash
    assert "new code for train" in changed.stdout and code.read_text() == recorded, changed.stdout
    assert run_dvc("status", "train", cwd=paths.root).strip() == clean
    assert (paths.root / "dvc.lock").read_text() == lock


def test_sigkill_in_epoch_2_resumes_with_optimizer_and_ema_and_matches_an_uninterrupted_run(
        merged: Path, tmp_path: Path):
    straight = _copy(merged, tmp_path / "straight")
    assert _train(straight.root).returncode == 0
    killed = _copy(merged, tmp_path / "killed")
    proc = _train(killed.root, env={"RETRAIN_FAULT": "train.epoch1"})  # 0-based: the second epoch
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    ck = torch.load(killed.checkpoints / LAST, map_location="cpu", weights_only=True)
    assert ck["epoch"] == 0 and ck["optimizer_states"] and ck["lr_schedulers"]
    assert "current_model_state" in ck  # EMAWeightAveraging: state_dict holds the EMA, this the raw weights
    assert not killed.train_report.exists() and not (killed.candidate / "model.pt").exists()
    proc = _train(killed.root)
    assert proc.returncode == 0, proc.stderr
    assert "resuming from" in proc.stderr and "epoch 1 done" in proc.stderr
    if hugepages.why_not("auto") is None:  # retrain train re-executed itself with glibc's huge-page tunable
        assert "glibc.malloc.hugetlb=1: malloc'd memory in transparent huge pages" in proc.stderr, proc.stderr
    a, b = _report(straight), _report(killed)
    assert b["resumed_from"] == LAST and b["mlflow_run_id"] == load_json(
        killed.train_report)["mlflow_run_id"] and b["epochs"] == a["epochs"] == 3
    assert abs(a["ema"]["mAP50-95"] - b["ema"]["mAP50-95"]) <= 0.02
    assert abs(a["ema"]["mAP50"] - b["ema"]["mAP50"]) <= 0.02
    # The CSV of the resumed run has every epoch once (the killed run's epoch 0, then the resumed ones), and every
    # epoch's training loss is the unbroken run's: same batches, same augmentations, same optimizer state.
    def losses(paths: Paths) -> list[tuple[int, float]]:
        rows = [r for r in csv.DictReader(paths.train_metrics.open()) if r.get("train/loss")]
        return [(int(r["epoch"]), float(r["train/loss"])) for r in rows]

    ours, theirs = losses(killed), losses(straight)
    assert [e for e, _ in ours] == [e for e, _ in theirs] == [0, 1, 2]
    assert all(abs(x - y) <= 1e-4 * max(1.0, abs(y)) for (_, x), (_, y) in zip(ours, theirs, strict=True)), (
        ours, theirs)
    wa, wb = _weights(straight), _weights(killed)
    diff = max(float((wa[k].float() - wb[k].float()).abs().max()) for k in wa if wa[k].is_floating_point())
    assert diff < 1e-2, diff  # same seed, same draws after the resume: the same weights up to float noise
    # The resumed run continued the killed run's MLflow run: still one run.
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{killed.root / 'mlflow.db'}")
    assert len(client.search_runs([e.experiment_id for e in client.search_experiments()])) == 1


def test_a_truncated_checkpoint_falls_back_to_the_previous_one_and_all_damaged_is_a_clear_error(
        merged: Path, tmp_path: Path):
    paths = _copy(merged, tmp_path / "ws")
    set_train_params(paths.root, epochs=4)
    assert _train(paths.root, env={"RETRAIN_FAULT": "train.epoch2"}).returncode == -signal.SIGKILL
    last, prev = paths.checkpoints / LAST, paths.checkpoints / PREVIOUS
    assert torch.load(last, weights_only=True)["epoch"] == 1 and torch.load(prev, weights_only=True)["epoch"] == 0
    saved = {p.name: p.read_bytes() for p in (last, prev)}
    last.write_bytes(saved[LAST][: len(saved[LAST]) // 2])
    proc = _train(paths.root)
    assert proc.returncode == 0, proc.stderr
    assert "is damaged" in proc.stderr and "falling back to the previous good checkpoint" in proc.stderr
    assert "epoch 1 done" in proc.stderr and _report(paths)["resumed_from"] == PREVIOUS
    # Every checkpoint damaged: exit 1 with one line, and no silent restart (nothing deleted, nothing trained).
    for name, data in saved.items():
        (paths.checkpoints / name).write_bytes(data[: len(data) // 2])
    before = _report(paths)
    proc = _train(paths.root)
    assert proc.returncode == 1
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "every checkpoint is damaged" in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert last.exists() and prev.exists() and _report(paths) == before


def test_changed_params_start_fresh_and_say_why(merged: Path, tmp_path: Path):
    paths = _copy(merged, tmp_path / "ws")
    assert _train(paths.root, env={"RETRAIN_FAULT": "train.epoch1"}).returncode == -signal.SIGKILL
    set_train_params(paths.root, lr=0.001)
    proc = _train(paths.root)
    assert proc.returncode == 0, proc.stderr
    assert "the training params changed; starting fresh" in proc.stderr
    assert "train: resuming from" not in proc.stderr
    assert _report(paths)["resumed_from"] is None


def _losses(paths: Paths) -> list[tuple[int, float]]:
    rows = [r for r in csv.DictReader(paths.train_metrics.open()) if r.get("train/loss")]
    return [(int(r["epoch"]), float(r["train/loss"])) for r in rows]


def test_a_compile_that_fails_trains_eagerly_after_one_warning_line(merged: Path, tmp_path: Path):
    """``compile: on`` where the C++ compiler is broken (inductor reads ``CXX``): a real compile fails, the run trains
    eagerly and says so once; ``auto`` remembers the failure for this machine."""
    paths = _copy(merged, tmp_path / "ws")
    set_train_params(paths.root, compile="on", epochs=1)
    proc = _train(paths.root, env={"CXX": "/bin/false"})
    assert proc.returncode == 0, proc.stderr
    warnings = [ln for ln in proc.stderr.splitlines() if "compile: failed" in ln]
    assert len(warnings) == 1 and "InvalidCxxCompiler" in warnings[0] and "training eagerly" in warnings[0], (
        proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr
    report = _report(paths)
    assert report["compile"]["compiled"] is False and "InvalidCxxCompiler" in report["compile"]["reason"]
    assert report["epochs"] == 1 and report["ema"]["mAP50-95"] >= 0
    table = load_json(paths.cache / "compile.json")
    assert len(table) == 1 and "InvalidCxxCompiler" in next(iter(table.values()))["failed"], table


@pytest.mark.slow
def test_a_compiled_run_killed_in_epoch_2_resumes_to_the_losses_of_an_uncompiled_run(merged: Path, tmp_path: Path):
    """``compile: on`` at the tests' tiny size.  The killed run compiles (cold: minutes); the resumed one compiles from
    the workspace's inductor cache in seconds and ends where an unbroken compiled run ends (as an eager resume does),
    and within float noise of an eager run.  At a low LR: at the tests' LR this tiny training is chaotic, and float
    noise alone (eager on 1 thread against 2) moves an epoch's mean loss by 20-40% after two epochs."""
    calm = {"compile": "on", "lr": 0.0002, "warmup_bias_lr": 0.0}
    eager = _copy(merged, tmp_path / "eager")
    set_train_params(eager.root, **{**calm, "compile": "off"})
    assert _train(eager.root).returncode == 0
    paths = _copy(merged, tmp_path / "compiled")
    set_train_params(paths.root, **calm)
    proc = _train(paths.root, env={"RETRAIN_FAULT": "train.epoch1"})
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    first = next(ln for ln in proc.stderr.splitlines() if "compile: compiled in" in ln)
    proc = _train(paths.root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming from" in proc.stderr and "epoch 1 done" in proc.stderr
    report = _report(paths)
    assert report["compile"]["compiled"] is True and "from the cache" in report["compile"]["reason"], report["compile"]
    cold = float(first.split("compile: compiled in ", 1)[1].split(" s", 1)[0])
    assert report["compile"]["compile_s"] < cold / 3, (first, report["compile"])
    assert list(paths.cache.glob("inductor/torch-*/fxgraph/*"))  # the compiled graphs live in the workspace's cache
    # An unbroken compiled run, as next week's on this machine: the workspace's cache, so compiled from the cache.
    straight = _copy(merged, tmp_path / "straight")
    set_train_params(straight.root, **calm)
    shutil.copytree(paths.cache / "inductor", straight.cache / "inductor")
    shutil.copy(paths.cache / "compile.json", straight.cache / "compile.json")
    assert _train(straight.root).returncode == 0
    a, b = _report(eager), _report(straight)
    assert a["compile"]["compiled"] is False and b["compile"]["compiled"] is True
    assert report["resumed_from"] == LAST and report["epochs"] == a["epochs"] == b["epochs"] == 3
    ours, unbroken, uncompiled = _losses(paths), _losses(straight), _losses(eager)
    assert [e for e, _ in ours] == [e for e, _ in unbroken] == [e for e, _ in uncompiled] == [0, 1, 2]
    # The resume: the unbroken compiled run's losses and weights (same kernels, same draws, same optimizer state).
    assert all(abs(x - y) <= 1e-4 * max(1.0, abs(y)) for (_, x), (_, y) in zip(ours, unbroken, strict=True)), (
        ours, unbroken)
    wa, wb = _weights(straight), _weights(paths)
    diff = max(float((wa[k].float() - wb[k].float()).abs().max()) for k in wa if wa[k].is_floating_point())
    assert diff < 1e-2, diff
    # Against eager: a compiled graph fuses and reorders float operations, equal per step up to ~1e-7 and apart by
    # ~3e-3 after three epochs (measured in development): equal up to rounding, not bit for bit.
    assert all(abs(x - y) <= 1e-2 * max(1.0, abs(y)) for (_, x), (_, y) in zip(ours, uncompiled, strict=True)), (
        ours, uncompiled)


def test_ddp_with_two_cpu_processes_runs_an_epoch_and_saves_a_checkpoint(merged: Path, tmp_path: Path):
    paths = _copy(merged, tmp_path / "ws")
    set_train_params(paths.root, epochs=1, accelerator="cpu", devices=2, strategy="ddp", threads=1)
    proc = _train(paths.root)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "world_size: 2" in proc.stderr or "GLOBAL_RANK: 1" in proc.stderr, proc.stderr
    assert (paths.checkpoints / "best.ckpt").is_file()
    ck = torch.load(paths.checkpoints / "best.ckpt", weights_only=True)
    assert ck["epoch"] == 0 and ck["global_step"] > 0
    report = _report(paths)
    assert report["epochs"] == 1 and (paths.candidate / "model.pt").is_file()
    # Rank 1 wrote no report, no candidate and no second MLflow run.
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{paths.root / 'mlflow.db'}")
    assert len(client.search_runs([e.experiment_id for e in client.search_experiments()])) == 1


def _register_champion(root: Path, model_file: Path, name: str = "retrain-detector") -> str:
    """Put ``model_file`` in the workspace's MLflow registry as ``name@champion`` (what promote will do)."""
    import mlflow

    uri = f"sqlite:///{root / 'mlflow.db'}"
    client = mlflow.MlflowClient(tracking_uri=uri, registry_uri=uri)
    exp = client.create_experiment("seed-champion", artifact_location=(root / "mlartifacts").as_uri())
    run = client.create_run(exp)
    client.log_artifact(run.info.run_id, str(model_file), artifact_path="model")
    client.set_terminated(run.info.run_id)
    client.create_registered_model(name)
    mv = client.create_model_version(name, f"runs:/{run.info.run_id}/model", run_id=run.info.run_id)
    client.set_registered_model_alias(name, "champion", mv.version)
    return str(mv.version)


@pytest.fixture(scope="module")
def champion_b1(tmp_path_factory: pytest.TempPathFactory, sample_root: Path) -> Path:
    """A 3-class model file trained one epoch on batch-1 alone: as a champion, batch-2 is new to it."""
    from retrain.workspace import init_workspace

    base = tmp_path_factory.mktemp("champion-b1")
    old = init_workspace(base / "old", remote=str(base / "remote-old"))
    run_cli("ingest", sample_root / "batch-1", cwd=old.root, check=True)
    run_cli("merge", cwd=old.root, check=True)
    run_cli("validate", cwd=old.root, check=True)
    set_train_params(old.root, **{**TINY, "epochs": 1})
    assert _train(old.root).returncode == 0
    model = load_model_file(old.candidate / "model.pt")
    assert model.names == ("circle", "square", "triangle") and model.meta["batches"] == ["batch-1"]
    return old.candidate / "model.pt"


def test_warm_start_from_the_registry_champion_onto_a_grown_class_list(merged: Path, tmp_path: Path,
                                                                       champion_b1: Path):
    """A 3-class champion (trained here on batch-1) warm-starts a 4-class run: weights moved, log says so."""
    paths = _copy(merged, tmp_path / "ws")
    version = _register_champion(paths.root, champion_b1)
    set_train_params(paths.root, epochs=1, use_champion=True)
    proc = _train(paths.root)
    assert proc.returncode == 0, proc.stderr
    report = _report(paths)
    assert report["warm_start"] == {"kind": "champion", "model": "retrain-detector", "version": version}
    t = report["transferred"]
    assert t["kept_classes"] == ["circle", "square", "triangle"] and t["new_classes"] == ["star"]
    assert t["transferred"] > 0.9 * t["total"]
    assert "warm start from" in proc.stderr and "new classes start fresh: star" in proc.stderr, proc.stderr
    assert "biases warm up from 0" in proc.stderr  # a fitted model's biases get no high warm-up LR
    assert report["epochs"] == 1 and report["resumed_from"] is None  # a warm start is not a resume



def _steps_per_epoch(paths: Paths) -> list[int]:
    """Optimizer steps of each epoch, from the per-epoch CSV (its rows carry the global step at each epoch's end)."""
    rows = [r for r in csv.DictReader(paths.train_metrics.open()) if r.get("train/loss")]
    ends = [int(r["step"]) + 1 for r in sorted(rows, key=lambda r: int(r["epoch"]))]
    return [b - a for a, b in zip([0, *ends], ends, strict=False)]


# A warm run's schedule and replay at this size: the champion knew batch-1 (about 7 train images), batch-2 is new.
# batch-2 brings star, new to the champion: new_class_runs 0 lets the run take train.warm and replay all the same.
WARM = {"use_champion": True, "warm": {"epochs": 3, "lr": 0.001, "warmup_epochs": 0.5, "close_mosaic": 1,
                                       "new_class_runs": 0},
        "replay": {"old_fraction": 0.25, "min_per_class": 2}}


def test_a_warm_run_with_replay_killed_in_epoch_2_resumes_to_the_unbroken_run_and_replay_off_trains_on_all(
        merged: Path, tmp_path: Path, champion_b1: Path):
    """Replay on: each epoch is batch-2's train images and a few of batch-1's; a SIGKILL in epoch 2 then a rerun gives
    the unbroken run's losses and weights (the draws depend on (seed, epoch) alone).  Replay off: every image.  A young
    class (new_class_runs 3): the full schedule on every image."""
    runs = {}
    for kind in ("straight", "killed", "off", "young"):
        paths = _copy(merged, tmp_path / kind)
        _register_champion(paths.root, champion_b1)
        extra = {"replay": False} if kind == "off" else {
            "warm": {**WARM["warm"], "new_class_runs": 3}} if kind == "young" else {}
        set_train_params(paths.root, **{**WARM, **extra})
        runs[kind] = paths
    assert _train(runs["straight"].root).returncode == 0
    proc = _train(runs["killed"].root, env={"RETRAIN_FAULT": "train.epoch1"})
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    proc = _train(runs["killed"].root)
    assert proc.returncode == 0, proc.stderr
    assert "resuming from" in proc.stderr and "replay: each epoch trains on the" in proc.stderr, proc.stderr
    assert _train(runs["off"].root).returncode == 0
    proc = _train(runs["young"].root)
    assert proc.returncode == 0, proc.stderr
    # star is new to the champion: its head row starts fresh, so the run takes the full schedule on every image
    assert "in their first 3 runs (star: run 1): the full schedule (train.epochs) on every train image" in proc.stderr
    a, b, off, young = (_report(runs[k]) for k in ("straight", "killed", "off", "young"))
    assert a["schedule"] == {"warm": True, "epochs": 3, "lr": 0.001} and a["epochs"] == 3  # train.warm
    assert a["class_runs"] == young["class_runs"] == {"star": 1}  # the champion counted nothing: established
    r = a["replay"]
    assert r["new_batches"] == ["batch-2"] and r["new_images"] > 0 and r["old_images"] > r["old_per_epoch"] > 0
    train_images = r["new_images"] + r["old_images"]
    assert _steps_per_epoch(runs["straight"]) == [-(-(r["new_images"] + r["old_per_epoch"]) // 4)] * 3
    assert off["replay"] is None and _steps_per_epoch(runs["off"]) == [-(-train_images // 4)] * 3
    assert young["schedule"] == {"warm": False, "epochs": 3, "lr": 0.002} and young["replay"] is None
    assert _steps_per_epoch(runs["young"]) == [-(-train_images // 4)] * 3
    assert b["resumed_from"] == LAST and b["replay"] == r

    def losses(paths: Paths) -> list[tuple[int, float]]:
        rows = [row for row in csv.DictReader(paths.train_metrics.open()) if row.get("train/loss")]
        return [(int(row["epoch"]), float(row["train/loss"])) for row in rows]

    ours, theirs = losses(runs["killed"]), losses(runs["straight"])
    assert [e for e, _ in ours] == [e for e, _ in theirs] == [0, 1, 2]
    assert all(abs(x - y) <= 1e-4 * max(1.0, abs(y)) for (_, x), (_, y) in zip(ours, theirs, strict=True)), (
        ours, theirs)
    wa, wb = _weights(runs["straight"]), _weights(runs["killed"])
    diff = max(float((wa[k].float() - wb[k].float()).abs().max()) for k in wa if wa[k].is_floating_point())
    assert diff < 1e-2, diff


@pytest.mark.slow
def test_a_warm_started_model_beats_scratch_on_the_old_classes_after_one_epoch(tmp_path: Path):
    """3-class champion (50 epochs on batch-1) → 1 epoch on batch-1 + batch-2 (4 classes), against 1 from scratch."""
    from retrain.data.sample import BASE_CLASSES, generate
    from retrain.workspace import init_workspace

    samples = tmp_path / "samples"
    generate(samples, batches=2, images_per_batch=60, seed=0)
    size = {"imgsz": 192, "batch": 8, "workers": 0, "cache": "ram", "use_champion": False, "seed": 0}
    old = init_workspace(tmp_path / "old", remote=str(tmp_path / "remote-old"))
    run_cli("ingest", samples / "batch-1", cwd=old.root, check=True)
    run_cli("merge", cwd=old.root, check=True)
    run_cli("validate", cwd=old.root, check=True)
    set_train_params(old.root, **size, epochs=50)
    assert _train(old.root).returncode == 0
    assert _report(old)["ema"]["mAP50"] > 0.3, _report(old)["ema"]
    scores = {}
    for kind in ("warm", "scratch"):
        ws = init_workspace(tmp_path / kind, remote=str(tmp_path / f"remote-{kind}"))
        for b in ("batch-1", "batch-2"):
            run_cli("ingest", samples / b, cwd=ws.root, check=True)
        run_cli("merge", cwd=ws.root, check=True)
        run_cli("validate", cwd=ws.root, check=True)
        set_train_params(ws.root, **{**size, "epochs": 1, "use_champion": kind == "warm",
                                     "augment": {"close_mosaic": 0}})
        if kind == "warm":
            _register_champion(ws.root, old.candidate / "model.pt")
        assert _train(ws.root).returncode == 0
        report = _report(ws)
        assert report["warm_start"]["kind"] == ("champion" if kind == "warm" else "scratch")
        scores[kind] = sum(report["ema"]["per_class"][c] for c in BASE_CLASSES) / len(BASE_CLASSES)
    print("old-class AP50-95 after one epoch:", scores, "champion:", _report(old)["ema"])
    assert scores["warm"] > scores["scratch"] + 0.05, scores


@pytest.mark.slow
def test_sigkill_at_the_sample_size_resumes_to_the_same_map(tmp_path: Path):
    """The kill test at issue 4's own size, where the mAP is far from 0: the default sample data (2 batches x 40),
    the default params (yolo11n, imgsz 320, 30 epochs); SIGKILL in epoch 2, rerun, compare with an unbroken run."""
    from retrain.data.sample import generate
    from retrain.workspace import init_workspace

    generate(tmp_path / "samples", batches=2, images_per_batch=40, seed=0)
    base = init_workspace(tmp_path / "base", remote=str(tmp_path / "remote"))
    for b in ("batch-1", "batch-2"):
        run_cli("ingest", tmp_path / "samples" / b, cwd=base.root, check=True)
    run_cli("merge", cwd=base.root, check=True)
    run_cli("validate", cwd=base.root, check=True)
    set_train_params(base.root, channels_last="off")  # both runs in one memory format (see TINY)
    straight, killed = _copy(base.root, tmp_path / "straight"), _copy(base.root, tmp_path / "killed")
    assert _train(straight.root).returncode == 0
    assert _train(killed.root, env={"RETRAIN_FAULT": "train.epoch1"}).returncode == -signal.SIGKILL
    proc = _train(killed.root)
    assert proc.returncode == 0, proc.stderr
    assert "resuming from" in proc.stderr and "epoch 1 done" in proc.stderr
    a, b = _report(straight), _report(killed)
    print("unbroken:", {k: a["ema"][k] for k in ("mAP50", "mAP50-95")},
          "killed + resumed:", {k: b["ema"][k] for k in ("mAP50", "mAP50-95")})
    assert b["resumed_from"] == LAST and a["epochs"] == b["epochs"] == 30
    assert a["ema"]["mAP50"] > 0.1, a["ema"]  # a comparison of two zeros would show nothing
    assert abs(a["ema"]["mAP50-95"] - b["ema"]["mAP50-95"]) <= 0.02
    assert abs(a["ema"]["mAP50"] - b["ema"]["mAP50"]) <= 0.02
