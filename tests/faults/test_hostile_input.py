"""Fault: hostile input: model files that run code when they are loaded, YAML with Python tags, hostile XML.

Every hostile thing here would, if it ran, create a canary file (a unique path under the test's temp folder).
Each is handed to a real `retrain` process the way a user would hand it over: a warm-start `base_model` in
params.yaml, the registry champion's `model.pt` in the MLflow artifact store (loaded by `retrain train`,
`retrain evaluate` and MLflow's pyfunc loader), a tag in params.yaml (`retrain merge`), a tag in a YOLO batch's
data.yaml and entities in a Pascal VOC batch's XML (`retrain ingest`).  Each must be refused with one `error:`
line naming the file, without a traceback, with the canary absent and nothing of the workspace or registry
changed.
"""

from __future__ import annotations

import builtins
import copy
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any, cast
from xml.etree import ElementTree as ET

import pytest
import torch

from retrain.paths import Paths
from tests.helpers import coco_to_voc, coco_to_yolo, registry_state, run_cli, run_dvc, set_params, snapshot, tree_hash
from tests.integration.test_flow import arrive, tiny_workspace

pytestmark = [pytest.mark.faults]  # the model-file tests (they train or make a champion first) are slow too


class _Call:
    """Pickles as ``func(*args)``: the unpickler calls ``func`` (a plain pickle would run it on load)."""

    def __init__(self, func: Any, *args: Any) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return self.func, self.args


def _canary(tmp: Path) -> Path:
    return tmp / f"CANARY-{uuid.uuid4().hex}"


def _fake_tensors() -> dict[str, torch.Tensor]:
    return {"model.0.conv.weight": torch.zeros(16, 3, 3, 3), "model.0.bn.bias": torch.zeros(16)}


def hostile_model(kind: str, path: Path, canary: Path) -> Path:
    """Write a ``.pt`` (a real ``torch.save`` zip) that creates ``canary`` when loaded unsafely.

    Kinds: ``system`` (``os.system`` in a plain dict), ``exec`` (``builtins.exec``), ``nested`` (an
    ultralytics-looking checkpoint whose ``model`` is the payload, beside real tensors), ``autobackend`` (a class
    from ``ultralytics.nn`` called by the pickle: ``AutoBackend`` loads a second, plain-pickle file), ``dm-yaml``
    (the pickle calls ``DetectionModel`` with a yaml whose ``activation`` ultralytics would ``eval``),
    ``yaml-eval`` (a retrain model file, pure data, whose model yaml's ``activation`` is code) and ``yaml-layer``
    (its yaml names ``torch_safe_load`` as a layer, which would unpickle the second file).
    """
    from ultralytics.nn.autobackend import AutoBackend
    from ultralytics.nn.tasks import DetectionModel

    from retrain.detector.files import ModelFile, save_model_file
    from retrain.detector.model import build_model

    touch = f"touch {canary}"
    if kind == "system":
        torch.save({"weights": _Call(os.system, touch)}, path)
    elif kind == "exec":
        torch.save({"weights": _Call(builtins.exec, f"open({str(canary)!r}, 'w').close()")}, path)
    elif kind == "nested":
        torch.save({"epoch": -1, "best_fitness": None, "model": _Call(os.system, touch), "ema": None,
                    "updates": 0, "optimizer": None, "train_args": {"imgsz": 64, "task": "detect"},
                    "train_metrics": {}, "date": "2025-01-01T00:00:00", "version": "8.4.0",
                    "state_dict": _fake_tensors()}, path)
    elif kind == "autobackend":
        inner = hostile_model("system", path.with_name(f"inner-{path.name}"), canary)
        torch.save({"model": _Call(AutoBackend, str(inner)), "train_args": {"imgsz": 64}}, path)
    elif kind in ("dm-yaml", "yaml-eval", "yaml-layer"):
        real = build_model("yolo11n.yaml", ("a", "b"))
        cfg: dict[str, Any] = copy.deepcopy(cast(dict[str, Any], real.yaml))
        if kind == "yaml-layer":
            inner = hostile_model("system", path.with_name(f"inner-{path.name}"), canary)
            cfg["backbone"] = [[-1, 1, "torch_safe_load", [str(inner)]], *cfg["backbone"]]
        else:
            cfg["activation"] = f"__import__('os').system({touch!r}) or nn.SiLU()"
        if kind == "dm-yaml":
            torch.save({"model": _Call(DetectionModel, cfg), "train_args": {"imgsz": 64}}, path)
        else:
            save_model_file(path, ModelFile(dict(real.state_dict()), cfg, ("a", "b"), 64, {}))
    else:
        raise ValueError(kind)
    return path


PICKLE_KINDS = ["system", "exec", "nested", "autobackend", "dm-yaml", "yaml-eval", "yaml-layer"]


def _errors(proc: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("error:")]


def _assert_refused_once(proc: subprocess.CompletedProcess[str], *words: str) -> str:
    """Exit 1, exactly one ``error:`` line holding every one of ``words``, no traceback; returns the line."""
    errors = _errors(proc)
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert len(errors) == 1, errors
    assert all(w in errors[0] for w in words), (words, errors)
    return errors[0]


def _state(paths: Paths) -> dict[str, Any]:
    return {**snapshot(paths.root), "candidate": tree_hash(paths.candidate), "registry": registry_state(paths.root),
            "reports": tree_hash(paths.reports)}


@pytest.fixture(scope="module")
def validated(samples: Path, tmp_path_factory: pytest.TempPathFactory) -> Paths:
    """A workspace with batch-1 ingested, merged and validated (ready to train), nothing trained."""
    paths = tiny_workspace(tmp_path_factory.mktemp("hostile-train"))
    run_cli("ingest", samples / "batch-1", cwd=paths.root, check=True)
    run_cli("merge", cwd=paths.root, check=True)
    run_cli("validate", cwd=paths.root, check=True)
    return paths


@pytest.mark.slow
@pytest.mark.parametrize("kind", PICKLE_KINDS)
def test_a_hostile_base_model_is_refused_before_any_of_it_runs(kind: str, validated: Paths, tmp_path: Path) -> None:
    paths = validated
    canary = _canary(tmp_path)
    model = hostile_model(kind, paths.root / f"hostile-{kind}.pt", canary)
    params = (paths.root / "params.yaml").read_text()
    set_params(paths.root, "train", base_model=model.name, use_champion=False)
    before = _state(paths)
    try:
        proc = run_cli("train", cwd=paths.root)
    finally:
        (paths.root / "params.yaml").write_text(params)
    # Refused up front (its pickle or yaml names code), or, for a pickle calling DetectionModel, by ultralytics'
    # restricted parsing inside the weights-only load.
    line = _assert_refused_once(proc, model.name, "cannot be loaded safely" if kind == "dm-yaml" else "refused")
    assert not canary.exists(), line
    assert not paths.candidate.exists()
    model.unlink()
    (paths.root / f"inner-{model.name}").unlink(missing_ok=True)
    assert _state(paths) == {**before, "git-status": _state(paths)["git-status"]}  # params restored, all else same


@pytest.fixture(scope="module")
def champion_ws(samples: Path, tmp_path_factory: pytest.TempPathFactory) -> Paths:
    """A workspace whose registry has a champion (v1), made by `dvc repro` on batch-1."""
    base = tmp_path_factory.mktemp("hostile-champion")
    paths = tiny_workspace(base)
    arrive(samples, "batch-1", paths)
    run_cli("ingest", paths.incoming / "batch-1", cwd=paths.root, check=True)
    run_dvc("repro", cwd=paths.root)
    assert registry_state(paths.root)["aliases"].get("champion") == "1", registry_state(paths.root)
    return paths


def _champion_files(paths: Paths) -> list[Path]:
    """The champion's ``model.pt`` in the artifact store (the file MLflow hands out for models:/...@champion)."""
    from urllib.parse import urlparse

    from mlflow import MlflowClient

    uri = f"sqlite:///{paths.root / 'mlflow.db'}"
    mc = MlflowClient(uri, uri)
    version = mc.get_model_version_by_alias("retrain-detector", "champion").version
    where = urlparse(mc.get_model_version_download_uri("retrain-detector", version))
    assert where.scheme == "file", where
    stored = sorted(Path(where.path).rglob("model.pt"))
    assert len(stored) == 1 and (paths.root / "mlartifacts") in stored[0].parents, stored
    return stored


PYFUNC = """
import sys, mlflow
mlflow.set_tracking_uri(sys.argv[1]); mlflow.set_registry_uri(sys.argv[1])
try:
    mlflow.pyfunc.load_model("models:/retrain-detector@champion")
except Exception as e:
    print(f"{type(e).__name__}: {e}")
    sys.exit(3)
print("loaded")
"""


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["nested", "yaml-eval"])
def test_a_hostile_champion_in_the_artifact_store_is_refused_by_train_evaluate_and_pyfunc(
        kind: str, champion_ws: Paths, tmp_path: Path) -> None:
    paths = champion_ws
    stored = _champion_files(paths)
    good = {f: f.read_bytes() for f in stored}
    canary = _canary(tmp_path)
    hostile = hostile_model(kind, tmp_path / "model.pt", canary)
    before = _state(paths)
    try:
        for f in stored:
            f.write_bytes(hostile.read_bytes())
        for stage in ("train", "evaluate"):
            proc = run_cli(stage, cwd=paths.root)
            line = _assert_refused_once(proc, "model.pt", "refused")
            assert not canary.exists(), (stage, line)
        env = {**os.environ, "YOLO_OFFLINE": "true"}
        served = subprocess.run([sys.executable, "-c", PYFUNC, f"sqlite:///{paths.root / 'mlflow.db'}"],
                                cwd=tmp_path, env=env, capture_output=True, text=True)
        assert served.returncode == 3 and "ModelFileError" in served.stdout and "refused" in served.stdout, \
            served.stdout[-2000:] + served.stderr[-2000:]
        assert not canary.exists()
    finally:
        for f, data in good.items():
            f.write_bytes(data)
    after = _state(paths)
    assert after == before, {k: (before[k], after[k]) for k in before if before[k] != after[k]}
    assert after["registry"]["aliases"]["champion"] == "1"


PARAMS_TAGS = [
    '!!python/object/apply:os.system ["touch {c}"]',
    '!!python/object/new:subprocess.Popen [["touch", "{c}"]]',
    '!!python/object:subprocess.Popen {{args: ["touch", "{c}"]}}',
    "!!python/name:os.system",
    "!!python/module:os",
]


@pytest.fixture(scope="module")
def ingested(samples: Path, tmp_path_factory: pytest.TempPathFactory) -> Paths:
    """A workspace with batch-1 ingested and not merged: a merge that ran would change data/master."""
    paths = tiny_workspace(tmp_path_factory.mktemp("hostile-yaml"))
    run_cli("ingest", samples / "batch-1", cwd=paths.root, check=True)
    return paths


@pytest.mark.parametrize("tag", PARAMS_TAGS)
def test_a_python_tag_in_params_is_refused(tag: str, ingested: Paths, tmp_path: Path) -> None:
    paths = ingested
    canary = _canary(tmp_path)
    params = (paths.root / "params.yaml").read_text()
    assert 'split_salt: retrain-split-v1' in params
    (paths.root / "params.yaml").write_text(params.replace("split_salt: retrain-split-v1",
                                                           f"split_salt: {tag.format(c=canary)}"))
    before = snapshot(paths.root)
    try:
        proc = run_cli("merge", cwd=paths.root)
        after = snapshot(paths.root)
    finally:
        (paths.root / "params.yaml").write_text(params)
    _assert_refused_once(proc, "params.yaml", "not safe YAML")
    assert not canary.exists()
    assert after == before


def test_the_same_workspace_merges_once_params_are_clean(ingested: Paths) -> None:
    """The control: with the tag gone, the same `retrain merge` runs and changes data/master."""
    before = snapshot(ingested.root)
    run_cli("merge", cwd=ingested.root, check=True)
    assert snapshot(ingested.root)["data"] != before["data"]


@pytest.mark.parametrize("tag", PARAMS_TAGS[:3])
def test_a_python_tag_in_a_batch_data_yaml_is_refused(tag: str, samples: Path, workspace: Paths,
                                                      tmp_path: Path) -> None:
    canary = _canary(tmp_path)
    batch = coco_to_yolo(samples / "batch-1", tmp_path / "yolo-batch")
    (batch / "data.yaml").write_text(f"names: {tag.format(c=canary)}\n")
    before = snapshot(workspace.root)
    proc = run_cli("ingest", batch, cwd=workspace.root)
    errors = _errors(proc)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    named = [e for e in errors if "data.yaml" in e]
    assert len(named) == 1 and "[safe-yaml] not safe YAML" in named[0], errors
    assert errors[-1] == "error: batch yolo-batch refused: 1 problem(s); nothing was changed", errors
    assert not canary.exists()
    assert snapshot(workspace.root) == before


BILLION_LAUGHS = """<?xml version="1.0"?>
<!DOCTYPE lolz [<!ENTITY lol "lol"><!ENTITY lol1 "&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;">
<!ENTITY lol2 "&lol1;&lol1;&lol1;&lol1;&lol1;&lol1;&lol1;&lol1;&lol1;&lol1;">
<!ENTITY lol3 "&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;">
<!ENTITY lol4 "&lol3;&lol3;&lol3;&lol3;&lol3;&lol3;&lol3;&lol3;&lol3;&lol3;">
<!ENTITY lol5 "&lol4;&lol4;&lol4;&lol4;&lol4;&lol4;&lol4;&lol4;&lol4;&lol4;">
<!ENTITY lol6 "&lol5;&lol5;&lol5;&lol5;&lol5;&lol5;&lol5;&lol5;&lol5;&lol5;">
<!ENTITY lol7 "&lol6;&lol6;&lol6;&lol6;&lol6;&lol6;&lol6;&lol6;&lol6;&lol6;">
<!ENTITY lol8 "&lol7;&lol7;&lol7;&lol7;&lol7;&lol7;&lol7;&lol7;&lol7;&lol7;">
<!ENTITY lol9 "&lol8;&lol8;&lol8;&lol8;&lol8;&lol8;&lol8;&lol8;&lol8;&lol8;">]>
<annotation><filename>{file}</filename><size><width>64</width><height>64</height><depth>3</depth></size>
<object><name>&lol9;</name><bndbox><xmin>1</xmin><ymin>1</ymin><xmax>9</xmax><ymax>9</ymax></bndbox></object>
</annotation>
"""
XXE = """<?xml version="1.0"?>
<!DOCTYPE annotation [<!ENTITY xxe SYSTEM "file://{secret}">]>
<annotation><filename>{file}</filename><size><width>64</width><height>64</height><depth>3</depth></size>
<object><name>&xxe;</name><bndbox><xmin>1</xmin><ymin>1</ymin><xmax>9</xmax><ymax>9</ymax></bndbox></object>
</annotation>
"""


@pytest.mark.parametrize("attack", ["billion-laughs", "xxe"])
def test_entities_in_a_voc_xml_are_refused_and_inert(attack: str, samples: Path, workspace: Paths,
                                                     tmp_path: Path) -> None:
    batch = coco_to_voc(samples / "batch-1", tmp_path / "voc-batch")
    xml = sorted((batch / "Annotations").glob("*.xml"))[0]
    image = ET.parse(xml).getroot().findtext("filename")
    secret_text = f"SECRET-{uuid.uuid4().hex}"
    secret = tmp_path / "secret.txt"
    secret.write_text(secret_text)
    xml.write_text((BILLION_LAUGHS if attack == "billion-laughs" else XXE).format(file=image, secret=secret))
    before = snapshot(workspace.root)
    proc = run_cli("ingest", batch, cwd=workspace.root)
    errors = _errors(proc)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    named = [e for e in errors if xml.name in e]
    assert len(named) == 1 and "[xml-valid]" in named[0], errors
    assert secret_text not in proc.stdout + proc.stderr and "lollol" not in proc.stdout + proc.stderr
    assert snapshot(workspace.root) == before
    assert not any(secret_text.encode() in f.read_bytes() for f in workspace.root.rglob("*") if f.is_file())
