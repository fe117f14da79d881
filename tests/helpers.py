"""Test helpers: run the CLI for real, snapshot workspace state, write other batch formats."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any
from xml.etree import ElementTree as ET

REPO = Path(__file__).resolve().parents[1]

#: Keys of params.yaml's ``runtime`` section (speed, not results) that tests give together with ``train``'s.
RUNTIME_KEYS = frozenset({"workers", "threads", "cache", "hugepages", "compile", "checkpoint_every_s"})


#: A promotion gate for tests: any first model is promoted; a candidate must be better by 0.001 without forgetting.
GATE = {"min_map": 0.0, "min_delta": 0.001, "max_class_drop": 0.005, "min_class_instances": 1,
        "max_slice_drop": 0.5, "require_significant": False}


def set_params(root: Path, section: str, **values: Any) -> None:
    """Edit one section of a workspace's ``params.yaml`` (keys merged into it; ``train.augment`` merged too)."""
    import yaml

    path = root / "params.yaml"
    doc = yaml.safe_load(path.read_text())
    old = doc.get(section) or {}
    if "augment" in values and isinstance(old.get("augment"), dict):
        values["augment"] = {**old["augment"], **values["augment"]}
    doc[section] = {**old, **values}
    path.write_text(yaml.safe_dump(doc, sort_keys=False))


def set_train_params(root: Path, **train: Any) -> None:
    """Edit ``train``, and ``runtime`` for the keys of ``RUNTIME_KEYS`` given with them (one dict per tiny setup)."""
    runtime = {k: train.pop(k) for k in list(train) if k in RUNTIME_KEYS}
    if train:
        set_params(root, "train", **train)
    if runtime:
        set_params(root, "runtime", **runtime)


def shared_data() -> Path | None:
    """``../shared/data`` beside the checkout (or ``RETRAIN_SHARED_DATA``), if present."""
    p = Path(os.environ.get("RETRAIN_SHARED_DATA", REPO.parent / "shared" / "data"))
    return p if p.is_dir() else None


def run_cli(*args: str | Path, cwd: Path, env: dict[str, str] | None = None, check: bool = False
            ) -> subprocess.CompletedProcess[str]:
    """Run ``python -m retrain ARGS`` in ``cwd`` as a user would."""
    full_env = {**os.environ, "YOLO_OFFLINE": "true", **(env or {})}
    bindir = os.path.dirname(sys.executable)
    full_env["PATH"] = bindir + os.pathsep + full_env.get("PATH", "")
    proc = subprocess.run([sys.executable, "-m", "retrain", *map(str, args)], cwd=cwd, env=full_env,
                          capture_output=True, text=True, check=False)
    if check and proc.returncode != 0:
        raise AssertionError(f"retrain {args} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc


def dvc_process(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run real DVC (with this interpreter's ``retrain`` on PATH); the finished process, whatever its exit code."""
    return subprocess.run([sys.executable, "-m", "dvc", *args], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, "DVC_NO_ANALYTICS": "1",
                               "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]})


def run_dvc(*args: str, cwd: Path) -> str:
    """Run real DVC; fail the test with its output if it fails."""
    proc = dvc_process(*args, cwd=cwd)
    assert proc.returncode == 0, f"dvc {args}: {proc.stdout}\n{proc.stderr}"
    return proc.stdout


def git(*args: str, cwd: Path) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout


def tree_hash(path: Path) -> str:
    """sha256 over every file (path + bytes) under ``path``; '' when absent."""
    if not path.exists():
        return ""
    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        h.update(f.relative_to(path).as_posix().encode())
        h.update(hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()


def snapshot(root: Path) -> dict[str, str]:
    """Everything that must not change when a batch is refused: data/, DVC files, git index and status."""
    return {
        "data": tree_hash(root / "data"),
        "dvc.lock": tree_hash(root / "dvc.lock"),
        "dvc-cache": tree_hash(root / ".dvc" / "cache"),
        "git-index": git("ls-files", "-s", cwd=root),
        "git-status": git("status", "--porcelain", "--untracked-files=all", cwd=root),
        "git-head": git("rev-parse", "HEAD", cwd=root),
    }


def copy_batch(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    return dst


def load_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def coco_to_voc(coco_batch: Path, out: Path) -> Path:
    """Write a COCO sample batch as Pascal VOC (JPEGImages/ + Annotations/*.xml)."""
    doc = load_json(coco_batch / "annotations.json")
    cats = {c["id"]: c["name"] for c in doc["categories"]}
    (out / "JPEGImages").mkdir(parents=True)
    (out / "Annotations").mkdir()
    for im in doc["images"]:
        shutil.copy(coco_batch / "images" / im["file_name"], out / "JPEGImages" / im["file_name"])
        root = ET.Element("annotation")
        ET.SubElement(root, "filename").text = im["file_name"]
        size = ET.SubElement(root, "size")
        ET.SubElement(size, "width").text = str(im["width"])
        ET.SubElement(size, "height").text = str(im["height"])
        ET.SubElement(size, "depth").text = "3"
        for a in doc["annotations"]:
            if a["image_id"] != im["id"]:
                continue
            obj = ET.SubElement(root, "object")
            ET.SubElement(obj, "name").text = cats[a["category_id"]]
            bb = ET.SubElement(obj, "bndbox")
            x, y, w, h = a["bbox"]
            for k, v in (("xmin", x), ("ymin", y), ("xmax", x + w), ("ymax", y + h)):
                ET.SubElement(bb, k).text = repr(float(v))
        ET.ElementTree(root).write(out / "Annotations" / (Path(im["file_name"]).stem + ".xml"))
    return out


def coco_to_yolo(coco_batch: Path, out: Path) -> Path:
    """Write a COCO sample batch in the ultralytics YOLO layout."""
    doc = load_json(coco_batch / "annotations.json")
    cats = sorted(doc["categories"], key=lambda c: c["id"])
    index = {c["id"]: i for i, c in enumerate(cats)}
    (out / "images" / "train").mkdir(parents=True)
    (out / "labels" / "train").mkdir(parents=True)
    (out / "data.yaml").write_text("names:\n" + "".join(f"  {i}: {c['name']}\n" for i, c in enumerate(cats)))
    for im in doc["images"]:
        shutil.copy(coco_batch / "images" / im["file_name"], out / "images" / "train" / im["file_name"])
        lines = []
        for a in doc["annotations"]:
            if a["image_id"] == im["id"]:
                x, y, w, h = a["bbox"]
                W, H = im["width"], im["height"]
                lines.append(f"{index[a['category_id']]} {(x + w / 2) / W:.6f} {(y + h / 2) / H:.6f} "
                             f"{w / W:.6f} {h / H:.6f}")
        (out / "labels" / "train" / (Path(im["file_name"]).stem + ".txt")).write_text("\n".join(lines) + "\n")
    return out


def bomb_png(path: Path, width: int = 30000, height: int = 30000) -> Path:
    """A tiny PNG whose header claims width x height (its data is a few bytes)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64))
                     + chunk(b"IEND", b""))
    return path


def flow_run_contents(flow_run_id: Any) -> tuple[list[str], dict[str, Any]]:
    """Task run names (by start time) and artifacts (by key) of a flow run, read with the Prefect client."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    only = FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=only)
        artifacts = client.read_artifacts(flow_run_filter=only)
    names = [r.name for r in sorted(runs, key=lambda r: (r.start_time or r.expected_start_time))]
    return names, {a.key: a for a in artifacts if a.key}


def flow_run_logs(flow_run_id: Any) -> list[str]:
    """Every log message of a flow run and its task runs, as the Prefect UI lists them (read with the client)."""
    from prefect import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    messages: list[str] = []
    with get_client(sync_client=True) as client:
        while True:  # the API returns at most 200 a page
            page = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])),
                                    limit=200, offset=len(messages))
            messages += [log.message for log in page]
            if len(page) < 200:
                return messages


def registry_state(root: Path, name: str = "retrain-detector") -> dict[str, Any]:
    """Versions and aliases of the registered model in the workspace's sqlite store (empty when none)."""
    import mlflow
    from mlflow.exceptions import MlflowException

    uri = f"sqlite:///{root / 'mlflow.db'}"
    if not (root / "mlflow.db").exists():
        return {"versions": [], "aliases": {}}
    client = mlflow.MlflowClient(tracking_uri=uri, registry_uri=uri)
    try:
        model = client.get_registered_model(name)
    except MlflowException:
        return {"versions": [], "aliases": {}}
    versions = sorted(int(v.version) for v in client.search_model_versions(f"name = '{name}'"))
    return {"versions": versions, "aliases": {k: str(v) for k, v in model.aliases.items()}}
