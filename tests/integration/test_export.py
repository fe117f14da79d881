"""`retrain export` for real: the session's trained champion (v1 in a real MLflow registry) exported to ONNX and run
by onnxruntime, checked against the PyTorch model; bad requests refused in one line with nothing written."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from retrain.config import load_params
from retrain.data.master import load_master
from retrain.detector.files import ModelFile, load_model_file
from retrain.detector.onnx_export import export_onnx
from retrain.evaluation.parity import BOX_TOLERANCE, MAP_TOLERANCE, SCORE_TOLERANCE, parity
from retrain.paths import Paths
from tests.helpers import run_cli


@pytest.fixture
def ws(trained: Path, tmp_path: Path) -> Paths:
    shutil.copytree(trained, tmp_path / "ws", symlinks=True)
    return Paths.at(tmp_path / "ws")


def test_the_champion_exports_to_onnx_that_answers_as_pytorch_and_bad_requests_write_nothing(ws: Paths,
                                                                                              tmp_path: Path):
    out = tmp_path / "deploy"
    proc = run_cli("export", out, cwd=ws.root, check=True)
    assert "retrain-detector version 1 exported to" in proc.stdout, proc.stdout
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "classes.json", "metadata.json", "model.onnx"]
    meta = json.loads((out / "metadata.json").read_text())
    mf = load_model_file(ws.candidate / "model.pt")  # v1's file, as the pipeline trained it
    assert meta["version"] == "1" and meta["imgsz"] == mf.imgsz and meta["classes"] == list(mf.names)
    assert json.loads((out / "classes.json").read_text()) == list(mf.names)
    assert meta["sha256"] == hashlib.sha256((out / "model.onnx").read_bytes()).hexdigest()
    p = meta["parity"]
    assert p["passed"] is True and p["split"] == "val" and p["images"] > 0
    assert p["map_torch"] > 0.02  # a model that detects something, so the comparison means something
    assert abs(p["map_onnx"] - p["map_torch"]) <= MAP_TOLERANCE
    assert p["box_diff"] <= BOX_TOLERANCE and p["score_diff"] <= SCORE_TOLERANCE
    readme = (out / "README.md").read_text()
    assert f"[N, 3, {mf.imgsz}, {mf.imgsz}]" in readme and f"[N, {4 + len(mf.names)}, anchors]" in readme

    # onnxruntime on its own, a batch of 3 (the batch axis is dynamic) against the PyTorch network
    import onnxruntime as ort

    x = torch.rand(3, 3, mf.imgsz, mf.imgsz, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = mf.build().eval()(x)[0].numpy()
    session = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    (got,) = session.run(["output0"], {"images": x.numpy()})
    assert got.shape == want.shape == (3, 4 + len(mf.names), want.shape[2])
    assert np.abs(got[:, :4] - want[:, :4]).max() <= BOX_TOLERANCE
    assert np.abs(got[:, 4:] - want[:, 4:]).max() <= SCORE_TOLERANCE

    # Bad requests: one line each, exit 1, nothing written
    again = run_cli("export", out, cwd=ws.root)
    assert again.returncode == 1 and "exists and is not an empty folder" in again.stderr, again.stderr
    missing = run_cli("export", tmp_path / "v99", "--version", "99", cwd=ws.root)
    assert missing.returncode == 1 and "has no version 99" in missing.stderr, missing.stderr
    unknown = run_cli("export", tmp_path / "tf", "--format", "tflite", cwd=ws.root)
    assert unknown.returncode == 1 and "format 'tflite' is not supported" in unknown.stderr, unknown.stderr
    (tmp_path / "a-file").write_text("not a folder")
    unwritable = run_cli("export", tmp_path / "a-file" / "deploy", cwd=ws.root)
    assert unwritable.returncode == 1 and "Not a directory" in unwritable.stderr, unwritable.stderr
    for bad in (missing, unknown, again, unwritable):
        errors = [line for line in bad.stderr.splitlines() if line.startswith("error: ")]
        assert "Traceback" not in bad.stderr and len(errors) == 1, bad.stderr
    assert not (tmp_path / "v99").exists() and not (tmp_path / "tf").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]  # no staging left behind


def test_the_champion_exports_to_openvino_ir_that_answers_as_pytorch(ws: Paths, tmp_path: Path):
    out = tmp_path / "ov"
    proc = run_cli("export", out, "--format", "openvino", cwd=ws.root, check=True)
    assert "retrain-detector version 1 exported to" in proc.stdout, proc.stdout
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "classes.json", "metadata.json", "model.bin",
                                                     "model.xml"]
    meta = json.loads((out / "metadata.json").read_text())
    assert meta["format"] == "openvino" and meta["file"] == "model.xml"
    assert meta["sha256"] == hashlib.sha256((out / "model.xml").read_bytes()).hexdigest()
    p = meta["parity"]
    assert p["passed"] is True and p["images"] > 0 and p["map_torch"] > 0.02
    assert abs(p["map_onnx"] - p["map_torch"]) <= MAP_TOLERANCE
    assert p["box_diff"] <= BOX_TOLERANCE and p["score_diff"] <= SCORE_TOLERANCE
    assert "openvino as ov" in (out / "README.md").read_text()


def test_parity_fails_an_onnx_model_that_answers_differently(ws: Paths, tmp_path: Path):
    mf = load_model_file(ws.candidate / "model.pt")
    params = load_params(ws.params)
    master = load_master(ws.master, ws.data)
    same = parity(mf, export_onnx(mf, tmp_path / "same.onnx"), master, "val", params, ws.cache)
    assert same.passed and same.reason == ""
    # The last layer's weights nudged: the export of that network is not the model it claims to be.
    nudged = {k: (v + 0.05 if k.startswith("model.23.cv3") and v.is_floating_point() else v)
              for k, v in mf.state_dict.items()}
    other = ModelFile(nudged, mf.yaml, mf.names, mf.imgsz, mf.meta)
    diff = parity(mf, export_onnx(other, tmp_path / "other.onnx"), master, "val", params, ws.cache)
    assert not diff.passed and "class score differs" in diff.reason, diff
