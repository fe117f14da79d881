"""Three splits and near-copy groups through the real commands: `retrain ingest`, `retrain merge` (a DVC stage),
`retrain validate`, with real DVC in a temp git repo."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from retrain.data.sample import generate_scenes
from retrain.paths import Paths
from tests.helpers import load_json, run_cli, run_dvc, set_params, tree_hash


def test_a_changed_split_rule_is_refused_until_migrated_once_and_recorded(workspace: Paths, sample_root: Path):
    ws = workspace.root
    set_params(ws, "merge", test_fraction=0)  # a master as before the test split: train and val only
    for b in ("batch-1", "batch-2"):
        run_cli("ingest", sample_root / b, cwd=ws, check=True)
    run_cli("merge", cwd=ws, check=True)
    before = load_json(workspace.master / "annotations.json")
    assert {im["split"] for im in before["images"]} == {"train", "val"}
    old = {im["sha256"]: im["split"] for im in before["images"]}

    set_params(ws, "merge", test_fraction=0.2)
    master = tree_hash(workspace.master)
    refused = run_cli("merge", cwd=ws)
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    line = refused.stderr.strip().splitlines()[-1]
    assert "the split rule changed (test_fraction 0.0 -> 0.2)" in line and "--migrate-splits" in line, line
    assert tree_hash(workspace.master) == master  # nothing changed

    migrated = run_cli("merge", "--migrate-splits", cwd=ws, check=True)
    after = load_json(workspace.master / "annotations.json")
    moved = {f"{old[im['sha256']]}->{im['split']}" for im in after["images"] if old[im["sha256"]] != im["split"]}
    n = sum(old[im["sha256"]] != im["split"] for im in after["images"])
    assert n > 0 and moved <= {"val->test", "train->val"}  # test <= the old val share: no trained-on image into test
    assert f"split: {n} images changed split since the previous master" in migrated.stdout, migrated.stdout
    record = after["info"]["split"]["migrations"]
    assert len(record) == 1 and record[0]["images"] == n and record[0]["to"]["test_fraction"] == 0.2
    assert load_json(workspace.merge_report)["split"]["migrations"] == record

    again = run_cli("merge", cwd=ws, check=True)  # the rule is the recorded one now: nothing moves, history kept
    assert "changed split" not in again.stdout
    assert load_json(workspace.master / "annotations.json")["info"]["split"]["migrations"] == record
    run_dvc("repro", "validate", cwd=ws)  # and the pipeline takes it from here


def test_frames_and_reencoded_copies_never_straddle_splits(workspace: Paths, tmp_path: Path):
    ws = workspace.root
    generate_scenes(tmp_path / "scenes", scenes=12, frames=6, seed=3, copies=2)
    run_cli("ingest", tmp_path / "scenes", cwd=ws, check=True)
    out = run_dvc("repro", "validate", cwd=ws)
    assert "Running stage 'validate'" in out
    master = load_json(workspace.master / "annotations.json")
    by_scene: dict[str, set[str]] = defaultdict(set)
    for im in master["images"]:
        by_scene[Path(im["file_name"]).name[:4]].add(im["split"])
    assert all(len(s) == 1 for s in by_scene.values()), by_scene  # every scene (frames and copies) in one split
    assert len(set().union(*by_scene.values())) >= 2  # while scenes do spread over the splits
    groups = load_json(workspace.merge_report)["groups"]
    assert groups["count"] == 12 and groups["images"] == 12 * 8
    checks = {c["rule"]: c for c in json.loads(workspace.validation_report.read_text())["checks"]}
    assert checks["group-split"]["status"] == "pass"

    set_params(ws, "merge", near_duplicate_distance=-1)  # without groups, the hash alone scatters each scene
    run_cli("merge", "--migrate-splits", cwd=ws, check=True)
    master = load_json(workspace.master / "annotations.json")
    scattered = defaultdict(set)
    for im in master["images"]:
        scattered[Path(im["file_name"]).name[:4]].add(im["split"])
    assert any(len(s) > 1 for s in scattered.values())
