"""Faults in the data and model state: kills, a full disk, damaged files, stale DVC locks.

Each test restores the workspace with a champion (``conftest.py``), injects one fault into a real process
(``RETRAIN_FAULT`` at a named point, or a signal from the test), checks that nothing is half-done (``state``:
data/master, dvc.lock, the .dvc files, the registry's versions and aliases), and then that the next run finishes
the job exactly once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

from retrain.paths import Paths
from tests.faults.conftest import Stores, cli, error_lines, leftovers, ok, reap, registry_tables, state
from tests.helpers import load_json, run_dvc

pytestmark = [pytest.mark.faults, pytest.mark.slow, pytest.mark.timeout(1800)]  # the workspaces' build too


def _summary(proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    return json.loads(ok(proc).stdout.strip().splitlines()[-1])


def _finished_once(paths: Paths, prefect_home: Path) -> subprocess.CompletedProcess[str]:
    """The next run (no fault) completes, with one new version and batch 2 merged once."""
    again = cli("run", "--json", cwd=paths.root, prefect_home=prefect_home)
    summary = _summary(again)
    assert summary["version"] == "2", summary
    after = state(paths.root)
    assert after["versions"] == [1, 2] and after["aliases"]["challenger"] == "2", after
    report = load_json(paths.merge_report)
    assert report["totals"]["batches"] == 2 and sorted(report["batches"]) == ["batch-1", "batch-2"]
    assert report["batches"]["batch-2"]["images_in_master"] == 16
    assert "up to date" in run_dvc("status", cwd=paths.root)
    assert leftovers(paths.root) == []
    assert not (paths.incoming / "batch-2").exists()
    return again


# site -> (where it fires, what may have completed before it)
KILLS = {
    "ingest.before-dvc-add": "nothing: the batch was renamed into data/batches but not yet added",
    "merge.half-written": "the ingest; the new master was half-written in staging",
    "train.checkpoint:kill:3": "ingest, merge, validate; the third checkpoint save was half-done",
    "promote.after-register": "everything up to registering version 2; no alias moved",
}


@pytest.mark.parametrize("site", list(KILLS))
def test_a_sigkill_at_each_named_point_leaves_no_half_state_and_the_next_run_finishes_once(
        site: str, stores: Stores, restore: Callable[[str], Paths], tmp_path: Path) -> None:
    paths = restore("champion")
    stores.deliver("batch-2")
    before = state(paths.root)
    killed = cli("run", cwd=paths.root, prefect_home=tmp_path / "prefect", env={"RETRAIN_FAULT": site})
    assert killed.returncode != 0, killed.stdout[-2000:]
    if site.startswith("ingest"):
        assert killed.returncode == -signal.SIGKILL  # the flow's own process (ingest runs in it)
    else:  # a stage process died: the flow failed, saying which stage and how
        assert "exited with -9" in killed.stdout + killed.stderr, killed.stderr[-3000:]
    after = state(paths.root)
    assert after["aliases"] == before["aliases"]  # the champion never moves on a partial run
    if site.startswith("ingest"):
        assert after == before and (paths.incoming / "batch-2").is_dir()
    if site.startswith("merge"):
        assert after["master"] == before["master"] and after["dvc.lock"] == before["dvc.lock"]
        assert after["dvc_files"] != before["dvc_files"]  # the ingest before it completed
    if site.startswith("train"):
        assert after["versions"] == [1] and any((paths.checkpoints).glob(".*.tmp"))  # the half-done save
        last = paths.checkpoints / "last.ckpt"
        assert torch.load(last, map_location="cpu", weights_only=True)["epoch"] == 0  # the one before is whole
    if site.startswith("promote"):
        assert after["versions"] == [1, 2]  # registered; no alias moved (checked above: all as before)
    again = _finished_once(paths, tmp_path / "prefect")
    if site.startswith("train"):
        assert "a checkpoint save that did not finish" in again.stderr and "resuming from" in again.stderr
    if site.startswith("promote"):
        assert "is this candidate already" in again.stderr, again.stderr[-3000:]


def test_a_sigkill_of_the_whole_run_during_dvc_add_is_undone_or_complete_and_the_next_run_finishes_once(
        stores: Stores, restore: Callable[[str], Paths], tmp_path: Path, request: pytest.FixtureRequest) -> None:
    paths = restore("champion")
    stores.deliver("batch-2")
    before = state(paths.root)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "RETRAIN_FAULT", "MLFLOW_"))}
    env |= {"PREFECT_HOME": str(tmp_path / "prefect"), "YOLO_OFFLINE": "true", "DVC_NO_ANALYTICS": "1",
            "PATH": os.path.dirname(sys.executable) + os.pathsep + env["PATH"]}
    with (tmp_path / "killed.log").open("w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "retrain", "run"], cwd=paths.root, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    request.addfinalizer(lambda: reap(proc.pid))
    seen = None
    deadline = time.monotonic() + 300
    while seen is None and proc.poll() is None and time.monotonic() < deadline:
        for p in psutil.Process(proc.pid).children(recursive=True):
            try:
                line = p.cmdline()
            except psutil.Error:
                continue
            if "add" in line and any("dvc" in part for part in line):
                seen = line
        time.sleep(0.01)
    assert seen is not None, (tmp_path / "killed.log").read_text()[-3000:]
    # Into its work: once it has started to copy the batch's files into the cache (or, at the latest, after 5 s).
    cache = paths.root / ".dvc" / "cache"
    cached = sum(1 for _ in cache.rglob("*"))
    deadline = time.monotonic() + 5
    while sum(1 for _ in cache.rglob("*")) == cached and time.monotonic() < deadline:
        time.sleep(0.005)
    os.killpg(proc.pid, signal.SIGKILL)  # the flow, dvc add, Prefect's local API: every process of the run
    proc.wait()
    after = state(paths.root)
    assert {k: v for k, v in after.items() if k != "dvc_files"} == {k: v for k, v in before.items()
                                                                    if k != "dvc_files"}
    admitted = (paths.batches / "batch-2.dvc").exists()
    assert admitted == (after["dvc_files"] != before["dvc_files"])  # either undone or complete
    assert (paths.incoming / "batch-2").is_dir()  # the delivery is set aside only after it is admitted
    _finished_once(paths, tmp_path / "prefect")


def test_no_space_left_writing_the_master_is_one_line_naming_the_disk_and_changes_nothing(
        stores: Stores, restore: Callable[[str], Paths]) -> None:
    paths = restore("champion")
    ok(cli("ingest", stores.samples / "batch-2", cwd=paths.root))
    before = state(paths.root)
    full = cli("merge", cwd=paths.root, env={"RETRAIN_FAULT": "merge.half-written:enospc"})
    assert full.returncode == 1 and "Traceback" not in full.stderr, full.stderr[-3000:]
    [line] = error_lines(full)
    assert "no space left on device writing" in line and "manifest.csv" in line and "the disk mounted at /" in line
    assert state(paths.root) == before and leftovers(paths.root) == []
    assert "master: 32 images" in ok(cli("merge", cwd=paths.root)).stdout


def test_no_space_left_saving_a_checkpoint_keeps_the_last_good_one_and_training_resumes(
        stores: Stores, restore: Callable[[str], Paths]) -> None:
    paths = restore("champion")
    ok(cli("ingest", stores.samples / "batch-2", cwd=paths.root))
    run_dvc("repro", "validate", cwd=paths.root)
    candidate = (paths.candidate / "model.pt").read_bytes()
    full = cli("train", cwd=paths.root, env={"RETRAIN_FAULT": "train.checkpoint:enospc:3"})
    assert full.returncode == 1 and "Traceback" not in full.stderr, full.stderr[-3000:]
    [line] = error_lines(full)
    assert "no space left on device writing" in line and "models/checkpoints/." in line and ".tmp" in line, line
    assert torch.load(paths.checkpoints / "last.ckpt", map_location="cpu", weights_only=True)["epoch"] == 0
    assert leftovers(paths.root) == [] and (paths.candidate / "model.pt").read_bytes() == candidate
    resumed = ok(cli("train", cwd=paths.root))
    assert "resuming from" in resumed.stderr and load_json(paths.train_report)["resumed_from"] == "last.ckpt"


def test_no_space_left_writing_an_mlflow_artifact_registers_nothing_and_keeps_the_champion(
        restore: Callable[[str], Paths]) -> None:
    paths = restore("evaluated")
    before, report = state(paths.root), paths.promotion_report.read_text()  # version 1's
    full = cli("promote", cwd=paths.root, env={"RETRAIN_FAULT": "promote.log-model:enospc"})
    assert full.returncode == 1 and "Traceback" not in full.stderr, full.stderr[-3000:]
    [line] = error_lines(full)
    assert "no space left on device writing" in line and "mlartifacts" in line, line
    assert state(paths.root) == before and paths.promotion_report.read_text() == report
    ok(cli("promote", cwd=paths.root))
    assert registry_tables(paths.root)["versions"] == [1, 2]


def _cache_object(root: Path, md5: str) -> Path:
    return root / ".dvc" / "cache" / "files" / "md5" / md5[:2] / md5[2:]


def test_a_flipped_byte_in_a_cache_object_training_reads_stops_the_run_before_training(
        stores: Stores, restore: Callable[[str], Paths], tmp_path: Path) -> None:
    import hashlib

    paths = restore("champion")
    # Large datasets link the workspace to the cache (DVC's advice): training then reads the cache objects.
    run_dvc("config", "cache.type", "hardlink", cwd=paths.root)
    run_dvc("checkout", "--relink", cwd=paths.root)
    ok(cli("validate", cwd=paths.root))  # its image checks now know these files by (sha256, size, mtime)
    image = sorted((paths.batches / "batch-1" / "images").iterdir())[3]
    obj = _cache_object(paths.root, hashlib.md5(image.read_bytes()).hexdigest())
    assert obj.stat().st_ino == image.stat().st_ino
    st = obj.stat()
    obj.chmod(0o644)
    data = bytearray(obj.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit, as a disk's rot would flip it: same size, same mtime
    obj.write_bytes(bytes(data))
    os.utime(obj, ns=(st.st_atime_ns, st.st_mtime_ns))
    obj.chmod(st.st_mode)
    stores.deliver("batch-2")
    before = state(paths.root)
    stopped = cli("run", cwd=paths.root, prefect_home=tmp_path / "prefect")
    assert stopped.returncode == 1, stopped.stderr[-3000:]
    rel = image.relative_to(paths.data).as_posix()
    # Same size, same mtime: validate's image checks take it as checked already; train re-hashes what it reads.
    assert "validate: Finished in state Completed" in stopped.stderr, stopped.stderr[-3000:]
    assert f"error: {rel}: [image-sha256] sha256 " in stopped.stderr, stopped.stderr[-3000:]
    assert "nothing was trained" in stopped.stderr and "error: error:" not in stopped.stderr
    after = state(paths.root)
    assert after["versions"] == before["versions"] == [1] and after["aliases"] == before["aliases"]
    assert not (paths.checkpoints / "last.ckpt").exists()  # it stopped before a training epoch
    # The repair the message gives: delete the damaged file and its cache object, pull them back from the remote.
    image.unlink()
    obj.unlink()
    run_dvc("pull", "--force", cwd=paths.root)
    assert hashlib.md5(image.read_bytes()).hexdigest() == obj.parent.name + obj.name
    _finished_once(paths, tmp_path / "prefect")


def test_a_garbled_dvc_rwlock_and_an_entry_of_a_reused_pid_are_repaired_and_the_run_goes_on(
        stores: Stores, restore: Callable[[str], Paths], tmp_path: Path) -> None:
    paths = restore("champion")
    stores.deliver("batch-2")
    tmp = paths.root / ".dvc" / "tmp"
    tmp.mkdir(exist_ok=True)
    (tmp / "rwlock").write_text('{"write": {"data/master": {"pid": 12')  # cut short by a SIGKILL mid-write
    (tmp / "lock").write_text("garbage\x00")
    blocked = subprocess.run([sys.executable, "-m", "dvc", "repro", "merge"], cwd=paths.root, capture_output=True,
                             text=True, env={**os.environ, "DVC_NO_ANALYTICS": "1"})
    assert blocked.returncode != 0 and "JSON structure is corrupted" in blocked.stderr  # what DVC alone does
    again = _finished_once(paths, tmp_path / "prefect")
    assert "rwlock: unreadable" in again.stderr, again.stderr[-3000:]
    # An entry whose pid now belongs to a program that is not dvc (this test) would block data/master forever.
    stores.deliver("batch-3")
    (tmp / "rwlock").write_text(json.dumps({"read": {}, "write": {"data/master": {"pid": os.getpid(),
                                                                                  "cmd": "dvc repro"}}}))
    third = cli("run", "--json", cwd=paths.root, prefect_home=tmp_path / "prefect")
    assert _summary(third)["version"] == "3" and registry_tables(paths.root)["versions"] == [1, 2, 3]
    assert "rwlock: dropped entries of processes that are not dvc" in third.stderr, third.stderr[-3000:]
    assert not json.loads((tmp / "rwlock").read_text()).get("write")
