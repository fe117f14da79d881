"""`retrain validate` as a DVC stage: passes good data, stops `dvc repro` on bad data, reports and Data Docs."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import pytest

from retrain.paths import Paths
from tests.helpers import load_json, run_cli, run_dvc, shared_data


def _repro(ws: Path, *targets: str):
    import subprocess
    import sys

    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    return subprocess.run([sys.executable, "-m", "dvc", "repro", *(targets or ("validate",))], cwd=ws,
                          capture_output=True, text=True, env=env)


def test_sample_data_passes_with_report_docs_and_drift(workspace: Paths, sample_root: Path):
    ws = workspace.root
    for b in ("batch-1", "batch-2"):
        run_cli("ingest", sample_root / b, cwd=ws, check=True)
    proc = _repro(ws)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = load_json(workspace.validation_report)
    assert report["passed"] is True and report["counts"]["failures"] == 0
    by_rule = {}
    for c in report["checks"]:
        by_rule.setdefault(c["rule"], []).append(c)
    for rule in ("box-inside-image", "box-area", "known-class", "image-size", "image-decodes", "split",
                 "val-fraction", "unique-content", "schema", "min-train-instances"):
        assert rule in by_rule, rule
    drift = by_rule["drift"][0]  # batch-2 adds a class: its mix differs from batch-1's
    assert isinstance(drift["observed"], float) and drift["observed"] > 0
    assert (workspace.validation_docs / "index.html").is_file()
    verdict = load_json(workspace.validation_verdict)  # names the master that passed; train's DVC dependency
    assert verdict == {"master": hashlib.sha256((workspace.master / "annotations.json").read_bytes()).hexdigest(),
                       "passed": True}
    for table in ("boxes", "images", "classes", "new_boxes"):  # a suite page and a validation page per table
        assert (workspace.validation_docs / "expectations" / f"retrain-{table}.html").is_file()
        assert list((workspace.validation_docs / "validations" / f"retrain-{table}").rglob("*.html"))
    assert "retrain-boxes" in (workspace.validation_docs / "index.html").read_text()
    # Offline: no page loads a script, stylesheet or image from the network, and every local one exists.
    from retrain.validation.datadocs import remote_assets

    assert remote_assets(workspace.validation_docs) == {}
    for page in workspace.validation_docs.rglob("*.html"):
        for ref in re.findall(r'(?:<script[^>]+src|<link[^>]+href)="([^"#?]+)"', page.read_text()):
            assert (page.parent / ref).is_file(), (page, ref)
    # Image checks are cached by content: every master image is in the cache after one run.
    cache = json.loads((ws / ".cache" / "image-checks.json").read_text())
    assert len(cache) == 24
    assert "up to date" in run_dvc("status", "validate", cwd=ws).lower()


def test_bad_master_stops_dvc_repro_before_training(workspace: Paths, sample_root: Path):
    """Data that slipped past ingest (a tampered batch) is caught: dvc repro stops at validate."""
    ws = workspace.root
    run_cli("ingest", sample_root / "batch-1", cwd=ws, check=True)
    assert _repro(ws).returncode == 0
    batch = workspace.batches / "batch-1"
    doc = load_json(batch / "annotations.json")
    im = doc["images"][0]
    doc["annotations"][0]["bbox"] = [im["width"] - 2.0, 1.0, 40.0, 10.0]
    ann = batch / "annotations.json"
    ann.chmod(0o644)
    ann.write_text(json.dumps(doc))
    victim = batch / "images" / doc["images"][1]["file_name"]
    victim.chmod(0o644)
    victim.write_bytes(victim.read_bytes()[:300])
    proc = _repro(ws, "train")  # asks for a model: the run must stop at validate, before train
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "Running stage 'validate'" in out and "Running stage 'train'" not in out, out
    assert not workspace.candidate.exists() and not workspace.train_report.exists()
    assert not workspace.validation_verdict.exists()
    # Run by hand, training refuses a master that has not passed validation: one line, exit 1.
    train = run_cli("train", cwd=ws)
    assert train.returncode == 1 and "has not passed validation" in train.stderr, train.stderr
    assert "Traceback" not in train.stderr and not workspace.candidate.exists()
    assert f"batches/batch-1/images/{im['file_name']}: [box-inside-image]" in out
    assert f"batches/batch-1/images/{victim.name}: [image-decodes]" in out
    report = load_json(workspace.validation_report)
    assert report["passed"] is False
    failed = {c["rule"] for c in report["checks"] if c["status"] == "fail"}
    assert {"box-inside-image", "image-decodes"} <= failed
    example = next(c for c in report["checks"] if c["rule"] == "box-inside-image" and c["status"] == "fail")
    assert example["examples"][0]["batch"] == "batch-1"


def test_coco128_passes_the_box_checks_and_warns_on_rare_classes(workspace: Paths, tmp_path: Path):
    data = shared_data()
    if data is None:
        if os.environ.get("CI"):
            pytest.fail("../shared/data is missing in CI")
        pytest.skip("../shared/data not present")
    coco = shutil.copytree(data / "coco128-coco", tmp_path / "coco128")
    ws = workspace.root
    run_cli("ingest", coco, cwd=ws, check=True)
    run_cli("merge", cwd=ws, check=True)
    proc = run_cli("validate", cwd=ws)
    assert proc.returncode in (0, 1), proc.stderr
    report = load_json(workspace.validation_report)
    status = {}
    for c in report["checks"]:
        status.setdefault(c["rule"], set()).add(c["status"])
    for rule in ("box-inside-image", "box-area", "box-finite", "known-class", "image-size", "image-decodes"):
        assert status[rule] == {"pass"}, (rule, status[rule])
    assert status["min-train-instances"] == {"warn"}
    assert "warning: " in proc.stdout and "[min-train-instances]" in proc.stdout
    assert proc.returncode == 0, proc.stdout + proc.stderr
