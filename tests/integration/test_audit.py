"""The audit stage for real: a trained tiny champion from the registry, real cleanlab, DVC and the Prefect flow.

The champion (the session's ``trained`` workspace: v1, trained on batch-1 and batch-2) audits a new batch of the
same kind of images with label errors planted box by box (``plant_errors``).  Every CLI call is a real process.
"""

from __future__ import annotations

import re
import shutil
from html.parser import HTMLParser
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from retrain.data.sample import generate_batch, plant_errors
from retrain.paths import Paths
from tests.helpers import dvc_process, git, load_json, registry_state, run_cli, run_dvc, set_params, tree_hash

NEW = "batch-new"


@pytest.fixture(scope="module")
def audited(trained: Path, tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """A copy of the trained workspace, a planted new batch ingested and `dvc repro audit` run (level warn)."""
    base = tmp_path_factory.mktemp("audit")
    shutil.copytree(trained, base / "ws", symlinks=True)
    paths = Paths(base / "ws")
    clean = generate_batch(base / "clean", 2, 30, seed=11).path  # drawn like batch-2, images the champion never saw
    planted = plant_errors(clean, base / NEW, drop=0.2, relabel=0.1, shift=0.1, seed=3)
    run_cli("ingest", base / NEW, cwd=paths.root, check=True)
    # The session's champion is tiny (128 px, 40 epochs on 80 images: test mAP50-95 about 0.03); its confidences
    # seldom reach the default 0.5, so this team would lower audit.confident, as here.
    set_params(paths.root, "audit", confident=0.1)
    out = run_dvc("repro", "audit", cwd=paths.root)
    return SimpleNamespace(paths=paths, base=base, planted=planted, out=out, report=load_json(paths.audit_report))


def test_the_champion_audits_only_the_new_batch_and_flags_the_planted_images_first(audited: SimpleNamespace):
    r, planted = audited.report, audited.planted
    assert "Running stage 'audit'" in audited.out and "Running stage 'train'" not in audited.out
    assert r["champion"] == "1" and list(r["batches"]) == [NEW], r["batches"]
    assert r["not_audited"] == ["batch-1", "batch-2"]  # the champion's own training data (its model file says)
    bad = {name for names in planted.values() for name in names}
    flagged = [Path(f["file_name"]).name for f in r["flagged"]]
    assert flagged and all(f["batch"] == NEW for f in r["flagged"])
    scores = [f["score"] for f in r["flagged"]]
    assert scores == sorted(scores)  # worst first
    assert len(flagged) >= 5 and sum(name in bad for name in flagged[:5]) >= 4, (flagged, sorted(bad))
    assert sum(name in bad for name in flagged) / len(flagged) >= 0.75, (flagged, sorted(bad))
    b = r["batches"][NEW]
    assert b["images"] == 30 and b["flagged"] == len(flagged) and b["flagged_fraction"] == round(len(flagged) / 30, 4)
    assert sum(b["issues"].values()) == sum(len(f["issues"]) for f in r["flagged"]) > 0
    for f in r["flagged"]:
        for x in f["issues"]:
            assert x["kind"] in ("missing", "wrong_class", "bad_location") and len(x["bbox"]) == 4
            assert (x["label"] is None) == (x["kind"] == "missing")
    # The champion's version is not a DVC dependency: an unchanged master is not audited again.
    assert "Running stage 'audit'" not in run_dvc("repro", "audit", cwd=audited.paths.root)


def test_the_audit_page_shows_the_worst_images_and_loads_nothing_from_the_network(audited: SimpleNamespace):
    text = (audited.paths.audit_page / "index.html").read_text()

    class Refs(HTMLParser):
        def __init__(self) -> None:
            super().__init__()
            self.refs: list[str] = []
            self.tags: set[str] = set()

        def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
            self.tags.add(tag)
            self.refs += [v or "" for k, v in attrs if k in ("src", "href", "xlink:href", "srcset", "action", "data")]

    page = Refs()
    page.feed(text)
    assert not {"script", "link", "iframe", "object", "embed"} & page.tags, page.tags
    assert page.refs and all(ref.startswith("data:image/jpeg;base64,") for ref in page.refs), page.refs[:3]
    outside = re.sub(r"data:image/jpeg;base64,[A-Za-z0-9+/=]+", "", text)  # what is not an image inside the page
    assert not re.search(r"url\(|@import|https?:|//[a-z]", outside), "a reference to something outside the page"
    assert len(page.refs) == min(50, len(audited.report["flagged"]))  # audit.show images, each drawn
    worst = audited.report["flagged"][0]
    assert worst["file_name"] in text and 'class="suspect"' in text


def test_fail_stops_dvc_repro_before_training_with_one_line(audited: SimpleNamespace, tmp_path: Path):
    shutil.copytree(audited.paths.root, tmp_path / "ws", symlinks=True)
    paths = Paths(tmp_path / "ws")
    set_params(paths.root, "audit", level="fail", max_flagged_fraction=0.05)
    before = (tree_hash(paths.candidate), registry_state(paths.root))
    proc = run_cli("audit", cwd=paths.root)
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    share = load_json(paths.audit_report)["batches"][NEW]["flagged_fraction"]
    assert errors[0].startswith(f"error: batch {NEW}: {share:.0%} of its images") and "audit/index.html" in errors[0]
    assert "above audit.max_flagged_fraction 5%" in errors[0], errors
    assert not paths.audit_pass.exists()  # train's dependency: DVC cannot run train after it
    repro = dvc_process("repro", cwd=paths.root)
    assert repro.returncode != 0 and "Running stage 'train'" not in repro.stdout, repro.stdout
    assert f"batch {NEW}: {share:.0%} of its images" in repro.stdout + repro.stderr
    assert (tree_hash(paths.candidate), registry_state(paths.root)) == before


def test_fail_stops_the_flow_before_training_with_the_reason(harness: Any, trained: Path, audited: SimpleNamespace,
                                                             tmp_path: Path):
    from flows.retrain import retrain
    from tasks.stages import StageFailed
    from tests.helpers import flow_run_contents

    shutil.copytree(trained, tmp_path / "ws", symlinks=True)
    paths = Paths(tmp_path / "ws")
    shutil.copytree(audited.base / NEW, paths.incoming / NEW)
    set_params(paths.root, "audit", level="fail", max_flagged_fraction=0.05, confident=0.1)
    git("-c", "user.name=t", "-c", "user.email=t@localhost", "commit", "-qam", "audit: fail", cwd=paths.root)
    before = (tree_hash(paths.candidate), registry_state(paths.root))
    state = retrain(project=str(paths.root), return_state=True)
    assert state.is_failed()
    error = state.result(raise_on_failure=False)
    assert isinstance(error, StageFailed) and error.stage == "audit", error
    reason = error.lines()[0]  # the stage's own error lines, as the flow's log and the run's failure show them
    assert reason.startswith(f"batch {NEW}: ") and "above audit.max_flagged_fraction 5%" in reason, error.lines()
    names, artifacts = flow_run_contents(state.state_details.flow_run_id)
    assert names == [f"ingest-{NEW}", "merge", "validate", "audit"]  # failed at once: no retry, no training
    assert "FAILED" in artifacts["retrain-audit"].data and NEW in artifacts["retrain-audit"].data
    assert {"retrain-audit-flagged", "retrain-audit-page"} <= set(artifacts)
    assert (tree_hash(paths.candidate), registry_state(paths.root)) == before
