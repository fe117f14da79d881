"""Ingest + merge with real git and DVC: old and new data together, versioned, reproducible, kill-safe."""

from __future__ import annotations

import csv
import shutil
from pathlib import Path

from retrain.paths import Paths
from tests.helpers import git, load_json, run_cli, run_dvc, tree_hash


def _manifest(paths: Paths) -> dict[str, dict[str, str]]:
    with open(paths.master / "manifest.csv", newline="") as f:
        return {row["sha256"]: row for row in csv.DictReader(f)}


def _commit(paths: Paths, msg: str) -> None:
    git("-c", "user.name=t", "-c", "user.email=t@t", "add", "-A", cwd=paths.root)
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", msg, cwd=paths.root)


def test_two_batches_versioned_together(workspace: Paths, sample_root: Path):
    ws = workspace.root
    run_cli("ingest", sample_root / "batch-1", cwd=ws, check=True)
    run_dvc("repro", "validate", cwd=ws)
    _commit(workspace, "batch-1")
    v1_hash, v1_lock = tree_hash(workspace.master), (ws / "dvc.lock").read_text()
    v1 = load_json(workspace.master / "annotations.json")
    v1_split = {r["sha256"]: r["split"] for r in _manifest(workspace).values()}

    run_cli("ingest", sample_root / "batch-2", cwd=ws, check=True)
    assert "data/master" in run_dvc("status", "validate", cwd=ws) or "changed" in run_dvc("status", "validate", cwd=ws)
    run_dvc("repro", "validate", cwd=ws)
    _commit(workspace, "batch-2")
    v2 = load_json(workspace.master / "annotations.json")
    manifest = _manifest(workspace)

    # The master holds both batches: old and new train together.
    assert {r["batch"] for r in manifest.values()} == {"batch-1", "batch-2"}
    assert len(v2["images"]) == len(v1["images"]) + 12
    # Old class ids unchanged; the new class gets the next id.
    old = {c["name"]: c["id"] for c in v1["categories"]}
    new = {c["name"]: c["id"] for c in v2["categories"]}
    assert all(new[n] == i for n, i in old.items())
    assert new["star"] == max(old.values()) + 1
    # Every image keeps its split.
    assert all(manifest[sha]["split"] == s for sha, s in v1_split.items())
    assert {"train", "val"} <= {r["split"] for r in manifest.values()}
    # DVC agrees that everything is up to date.
    assert "up to date" in run_dvc("status", "validate", cwd=ws).lower()

    # Merging again gives the same bytes, so the DVC hash does not move.
    v2_lock = (ws / "dvc.lock").read_text()
    run_dvc("repro", "-f", "-s", "merge", cwd=ws)
    assert (ws / "dvc.lock").read_text() == v2_lock
    assert "up to date" in run_dvc("status", "validate", cwd=ws).lower()

    # Going back: the previous dvc.lock + dvc checkout gives master v1 byte for byte.
    rev1 = git("rev-list", "--max-count=1", "HEAD~1", cwd=ws).strip()
    git("checkout", rev1, "--", "dvc.lock", cwd=ws)
    assert (ws / "dvc.lock").read_text() == v1_lock
    run_dvc("checkout", "data/master", cwd=ws)
    assert tree_hash(workspace.master) == v1_hash


def test_push_to_the_local_remote_and_pull_into_a_clone(workspace: Paths, sample_root: Path, tmp_path: Path):
    ws = workspace.root
    run_cli("ingest", sample_root / "batch-1", cwd=ws, check=True)
    run_dvc("repro", "validate", cwd=ws)
    _commit(workspace, "batch-1")
    run_dvc("push", cwd=ws)
    clone = tmp_path / "clone"
    git("clone", "-q", str(ws), str(clone), cwd=tmp_path)
    # Only the stages run so far have outputs to pull: `dvc pull` of the whole pipeline would fail on train's.
    run_dvc("pull", "validate", "--with-deps", cwd=clone)
    assert tree_hash(clone / "data" / "master") == tree_hash(workspace.master)
    assert tree_hash(clone / "data" / "batches") == tree_hash(workspace.batches)
    assert "up to date" in run_dvc("status", "validate", cwd=clone).lower()


def test_same_batch_again_changes_nothing(workspace: Paths, sample_root: Path):
    from tests.helpers import snapshot

    ws = workspace.root
    run_cli("ingest", sample_root / "batch-1", cwd=ws, check=True)
    before = snapshot(ws)
    again = run_cli("ingest", sample_root / "batch-1", "--name", "batch-1-again", cwd=ws)
    assert again.returncode == 0
    assert "already ingested with the same content; nothing changed" in again.stdout
    assert snapshot(ws) == before
    # A different batch under a taken name is refused: batches are immutable.
    taken = run_cli("ingest", sample_root / "batch-2", "--name", "batch-1", cwd=ws)
    assert taken.returncode == 1 and "exists with other content" in taken.stderr
    assert snapshot(ws) == before


def test_killed_merge_leaves_the_old_master_usable(workspace: Paths, sample_root: Path):
    ws = workspace.root
    run_cli("ingest", sample_root / "batch-1", cwd=ws, check=True)
    run_cli("merge", cwd=ws, check=True)
    old_hash = tree_hash(workspace.master)
    old_report = (workspace.merge_report).read_text()
    run_cli("ingest", sample_root / "batch-2", cwd=ws, check=True)
    for site in ("merge.half-written", "merge.before-swap"):
        killed = run_cli("merge", cwd=ws, env={"RETRAIN_FAULT": site})
        assert killed.returncode == -9, (site, killed.stderr)
        assert tree_hash(workspace.master) == old_hash
        assert workspace.merge_report.read_text() == old_report
        master = load_json(workspace.master / "annotations.json")  # still parses: usable
        assert len(master["images"]) == 12
    done = run_cli("merge", cwd=ws, check=True)
    assert "master: 24 images" in done.stdout
    assert len(load_json(workspace.master / "annotations.json")["images"]) == 24


def test_killed_ingest_is_never_admitted(workspace: Paths, sample_root: Path):
    ws = workspace.root
    killed = run_cli("ingest", sample_root / "batch-1", cwd=ws, env={"RETRAIN_FAULT": "ingest.before-dvc-add"})
    assert killed.returncode == -9
    assert run_cli("merge", cwd=ws, check=True).stdout.startswith("nothing to train yet: no batch has been ingested")
    assert load_json(workspace.master / "annotations.json")["images"] == []
    ok = run_cli("ingest", sample_root / "batch-1", cwd=ws, check=True)
    assert "batch batch-1 added: 12 images" in ok.stdout
    assert (workspace.batches / "batch-1.dvc").is_file()


def test_init_makes_a_workspace_and_refuses_a_non_empty_folder(tmp_path: Path):
    made = run_cli("init", tmp_path / "new", "--remote", tmp_path / "remote", cwd=tmp_path, check=True)
    assert "workspace ready" in made.stdout
    for f in ("dvc.yaml", "params.yaml", ".dvc/config", "data/incoming/.gitkeep", ".gitignore"):
        assert (tmp_path / "new" / f).exists(), f
    assert str(tmp_path / "remote") in (tmp_path / "new" / ".dvc" / "config").read_text()
    assert git("status", "--porcelain", cwd=tmp_path / "new") == ""
    again = run_cli("init", tmp_path / "new", cwd=tmp_path)
    assert again.returncode == 1 and "not empty" in again.stderr
    shutil.rmtree(tmp_path / "new")


def test_check_remote_restores_into_an_empty_cache_and_names_a_lost_object(workspace: Paths, sample_root: Path):
    ws = workspace.root
    assert "nothing to restore" in run_cli("check-remote", cwd=ws, check=True).stdout
    run_cli("ingest", sample_root / "batch-1", cwd=ws, check=True)
    run_dvc("repro", "validate", cwd=ws)  # train and later stages never ran: nothing of theirs to restore
    _commit(workspace, "batch-1")
    run_dvc("push", cwd=ws)
    ok = run_cli("check-remote", cwd=ws)
    assert ok.returncode == 0 and "restores" in ok.stdout and "verified" in ok.stdout, ok.stderr

    # An object lost from the remote: DVC's own view (dvc status --cloud) still says in sync; a fresh pull does not.
    remote = Path(run_dvc("remote", "list", cwd=ws).split()[1])
    manifest = load_json(workspace.master / "annotations.json")
    image = manifest["images"][0]["file_name"]  # relative to data/
    import hashlib

    md5 = hashlib.md5((workspace.data / image).read_bytes()).hexdigest()
    (remote / "files" / "md5" / md5[:2] / md5[2:]).unlink()
    assert "in sync" in run_dvc("status", "--cloud", cwd=ws)
    lost = run_cli("check-remote", cwd=ws)
    errors = [ln for ln in lost.stderr.splitlines() if ln.startswith("error:")]
    assert lost.returncode == 1 and len(errors) == 1 and "cannot restore" in errors[0], lost.stderr
    assert f"data/{image}" in errors[0] or f"data/master/{Path(image).name}" in errors[0], errors


def test_a_workspace_of_an_earlier_retrain_is_refused_with_the_remedy_then_upgraded(workspace: Paths):
    import yaml

    ws = workspace.root
    doc = yaml.safe_load((ws / "params.yaml").read_text())
    doc["train"].update(threads=2, workers=0, cache="disk")  # where an earlier params.yaml had them
    doc["validate"]["workers"] = 1
    doc["retrain"]["registry_wait"] = 30
    del doc["runtime"]
    del doc["audit"]  # a section new in this version
    del doc["train"]["replay"]  # a key new in this version
    (ws / "params.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    ignore = ws / ".gitignore"
    ignore.write_text(ignore.read_text().replace("/reports/history.png\n", ""))  # as an earlier init wrote it
    (ws / "dvc.yaml").write_text((ws / "dvc.yaml").read_text() + "# edited by hand\n")
    refused = run_cli("status", cwd=ws)
    assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused.stderr
    assert "train.threads" in refused.stderr and "retrain upgrade" in refused.stderr, refused.stderr

    up = run_cli("upgrade", cwd=ws, check=True)
    assert "params.yaml: train.threads -> runtime.threads" in up.stdout, up.stdout
    assert "params.yaml: validate.workers -> runtime.check_workers" in up.stdout
    assert "params.yaml: audit.level added ('warn', the default)" in up.stdout, up.stdout  # dvc.yaml lists it
    assert "dvc.yaml was edited by hand: left alone" in up.stdout
    assert "params.yaml: train.replay added ({'old_fraction': 0.25, 'min_per_class': 20}, the default)" in up.stdout
    assert ".gitignore: /reports/history.png added" in up.stdout and "/reports/history.png" in ignore.read_text()
    from retrain.config import load_params

    params = load_params(ws / "params.yaml")
    assert (params.runtime.threads, params.runtime.workers, params.runtime.cache) == (2, 0, "disk")
    assert (params.runtime.check_workers, params.runtime.registry_wait) == (1, 30)
    again = run_cli("upgrade", cwd=ws, check=True).stdout
    # moved once; the hand edit still stays
    assert "params.yaml:" not in again and ".gitignore" not in again and "left alone" in again, again
