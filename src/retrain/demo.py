"""The demo loop on generated sample data: what the README's main command runs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import yaml

from retrain.config import load_params
from retrain.data.ingest import ingest
from retrain.data.sample import generate
from retrain.paths import Paths
from retrain.workspace import commit, dvc, init_workspace, require_workspace
from retrain.workspace import master_version as dvc_master_version


def run_demo(workspace: Path, batches: int, images_per_batch: int, seed: int) -> Iterator[str]:
    """Make (or reuse) a workspace, generate sample batches, and per batch: ingest, ``dvc repro``, commit, push.

    Args:
        workspace: The workspace folder; made with ``init`` when it is not one yet.
        batches: Sample batches to generate.
        images_per_batch: Images in each.
        seed: Sample-data seed.

    Yields:
        Lines for the user.
    """
    paths = Paths.at(workspace)
    if not (paths.root / ".dvc").is_dir():
        init_workspace(paths.root)
        yield f"workspace made: {paths.root}"
    require_workspace(paths)
    params = load_params(paths.params)
    samples = generate(paths.incoming, batches, images_per_batch, seed)
    rows = []
    for s in samples:
        result = ingest(paths, s.path, params.ingest, params.validation, s.path.name)
        dvc(["repro", "-q"], paths.root, "dvc repro")
        commit(paths, f"retrain: batch {result.name}, data {(dvc_master_version(paths) or '?')[:12]}")
        dvc(["push", "-q"], paths.root, "dvc push")
        report = yaml.safe_load(paths.merge_report.read_text(encoding="utf-8"))["totals"]
        promotion = yaml.safe_load(paths.promotion_report.read_text(encoding="utf-8"))
        score = yaml.safe_load(paths.eval_report.read_text(encoding="utf-8"))["candidate"]["metrics"]["mAP50-95"]
        verdict = f"v{promotion['version']} " + ("champion" if promotion["promoted"] else "challenger")
        rows.append((result.name, "added" if result.added else "same", (dvc_master_version(paths) or '?')[:12],
                     report["images"], report["boxes"], report["classes"], f"{score:.3f}", verdict))
    yield (f"{'batch':<10} {'ingest':<7} {'data version':<13} {'images':>6} {'boxes':>6} {'classes':>7} "
           f"{'mAP50-95':>8}  registry")
    for r in rows:
        yield f"{r[0]:<10} {r[1]:<7} {r[2]:<13} {r[3]:>6} {r[4]:>6} {r[5]:>7} {r[6]:>8}  {r[7]}"
    yield f"master: {paths.master}  report: {paths.merge_report}"
    status = dvc(["status", "-q"], paths.root, "dvc status").strip()
    yield "dvc status: " + (status or "clean")
    yield f"look at it: cd {paths.root} && git log --oneline && dvc metrics show && retrain status"
