"""The deployable forms of a model: the ONNX export each registered version carries (``onnx_for_version``, at
promotion), and ``retrain export``, a registered version as a deployable folder for use outside MLflow.

The version's retrain model file is downloaded from the registry and loaded safely (``detector.files``); its network is
exported to ONNX (``detector.onnx_export``) and, where the workspace has a master with val images, checked against the
PyTorch model on them (every raw prediction, and mAP50-95 through the same NMS and pycocotools).  An export that does
not match is not written.  The folder is written whole or not at all (staged beside it, then renamed): ``model.onnx``,
``classes.json``, ``metadata.json`` (version, imgsz, sha256, parity figures) and a ``README.md`` of the input and
output contract.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from retrain.config import Params
from retrain.data.master import Master, load_master
from retrain.detector.files import ModelFile, load_model_file
from retrain.detector.onnx_export import (
    INPUT,
    OPSET,
    OUTPUT,
    ExportError,
    OpenVinoDetector,
    export_onnx,
    export_openvino,
    sha256,
)
from retrain.device import cpu_threads
from retrain.evaluation.parity import Parity, parity
from retrain.paths import Paths
from retrain.registry.tracking import CHAMPION, client, current_champion, fetch_version, tracking_uri

log = logging.getLogger(__name__)

FORMATS = ("onnx", "openvino")
ONNX_TAG = "retrain.onnx"


@dataclass(frozen=True)
class OnnxAttachment:
    """The ONNX export a new version carries.

    Attributes:
        path: The exported file; ``None`` when it is not attached (it failed, or did not match PyTorch).
        tags: The version's ``retrain.onnx*`` tags: ``attached`` or ``refused``, sha256, opset, parity figures, why not.
    """

    path: Path | None
    tags: dict[str, str]


def onnx_for_version(params: Params, weights: Path, master: Master, cache_dir: Path, workdir: Path) -> OnnxAttachment:
    """Export the candidate's model file to ONNX in ``workdir`` and check it against PyTorch on ``master``'s val images.

    Attached only when the check passes; otherwise the tags say why.  Never raises for a failed export: the version is
    registered anyway (served by PyTorch), and says why it has no ONNX model.
    """
    tags = {f"{ONNX_TAG}.opset": str(OPSET)}
    if not master.images("val"):
        return OnnxAttachment(None, {**tags, ONNX_TAG: "refused",
                                     f"{ONNX_TAG}.reason": "no val images to check it against PyTorch on"})
    try:
        mf = load_model_file(weights)
        onnx = export_onnx(mf, workdir / "model.onnx")
        check = parity(mf, onnx, master, "val", params, cache_dir)
    except Exception as e:  # an export is an addition: whatever fails here, the version registers and says why
        log.warning("promote: the ONNX export was not attached (%s: %s)", type(e).__name__, e)
        return OnnxAttachment(None, {**tags, ONNX_TAG: "refused",
                                     f"{ONNX_TAG}.reason": f"export failed: {type(e).__name__}: {e}"[:4000]})
    tags |= {k: v[:4000] for k, v in check.tags().items()} | {f"{ONNX_TAG}.imgsz": str(mf.imgsz)}
    if not check.passed:
        log.warning("promote: the ONNX export does not match the PyTorch model on %d val images (%s): not attached",
                    check.images, check.reason)
        return OnnxAttachment(None, {**tags, ONNX_TAG: "refused", f"{ONNX_TAG}.reason": check.reason})
    return OnnxAttachment(onnx, {**tags, ONNX_TAG: "attached", f"{ONNX_TAG}.sha256": sha256(onnx)})


@dataclass(frozen=True)
class Exported:
    """What ``retrain export`` wrote.

    Attributes:
        out: The folder.
        model: Registered model name.
        version: The version exported.
        files: The folder's files.
        parity: The check against PyTorch; ``None`` when the workspace had no val images to check on.
    """

    out: Path
    model: str
    version: str
    files: list[str]
    parity: Parity | None


def _version(paths: Paths, params: Params, version: str | None, alias: str | None) -> str:
    name = params.registry.model_name
    if version is not None and alias is not None:
        raise ExportError("export: give --version or --alias, not both")
    if version is not None:
        return version
    found = current_champion(client(tracking_uri(paths.root)), name, params.runtime.registry_wait, alias or CHAMPION)
    if found is None:
        raise ExportError(f"export: {name}@{alias or CHAMPION} does not exist in this workspace's registry")
    return found


def export_version(paths: Paths, params: Params, out: Path, version: str | None = None, alias: str | None = None,
                   fmt: str = "onnx") -> Exported:
    """Export a registered version (default: the champion) into the new folder ``out``.

    Raises:
        ExportError: An unknown format, ``out`` not empty, no such version or alias, or the export does not match the
            PyTorch model on the master's val images (nothing is written then).
    """
    if fmt not in FORMATS:
        raise ExportError(f"export: format {fmt!r} is not supported (supported: {', '.join(FORMATS)})")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"export: {out} exists and is not an empty folder; give a new one")
    name = params.registry.model_name
    number = _version(paths, params, version, alias)
    torch.set_num_threads(cpu_threads(params.runtime))  # the export and its check, as the stages do
    staging = out.parent / f".{out.name}.{uuid.uuid4().hex}.tmp"
    try:
        with tempfile.TemporaryDirectory(prefix="retrain-export-") as tmp:
            reg = fetch_version(tracking_uri(paths.root), name, number, Path(tmp), params.runtime.registry_wait)
            mf = load_model_file(reg.weights)
            onnx = export_onnx(mf, (staging if fmt == "onnx" else Path(tmp)) / "model.onnx")
            model = onnx if fmt == "onnx" else export_openvino(onnx, staging / "model.xml")
            check = None
            if (paths.master / "annotations.json").is_file():
                master = load_master(paths.master, paths.data)
                if master.images("val"):
                    check = parity(mf, onnx if fmt == "onnx" else OpenVinoDetector(model), master, "val", params,
                                   paths.cache)
        if check is None:
            log.warning("export: no master with val images in this workspace: the %s model is not checked against "
                        "PyTorch", fmt)
        elif not check.passed:
            raise ExportError(f"export: {name} version {number}: the {fmt} model does not match the PyTorch one on "
                              f"{check.images} val images: {check.reason}")
        digest = sha256(model)
        source = {"model": name, "version": number, "data_version": str(mf.meta.get("data_version", ""))[:12]}
        (staging / "classes.json").write_text(json.dumps(list(mf.names), indent=1) + "\n")
        (staging / "metadata.json").write_text(json.dumps(
            {**source, "format": fmt, "file": model.name, "sha256": digest, "imgsz": mf.imgsz,
             "classes": list(mf.names), "input": INPUT, "output": OUTPUT,
             "parity": asdict(check) if check else None}, indent=1) + "\n")
        (staging / "README.md").write_text(contract(mf, model.name, digest, check, source, fmt))
        if out.exists():
            out.rmdir()  # empty, checked above
        out.parent.mkdir(parents=True, exist_ok=True)
        staging.rename(out)
    except OSError as e:  # a folder that cannot be written (or read): one line, nothing left behind
        raise ExportError(f"export: {e.filename or out}: {e.strerror or e}") from e
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return Exported(out, name, number, sorted(p.name for p in out.iterdir()), check)


def contract(mf: ModelFile, model_file: str, digest: str, check: Parity | None, source: dict[str, Any],
             fmt: str = "onnx") -> str:
    """The README of an exported folder: what goes in, what comes out, what to do with it."""
    n = len(mf.names)
    checked = (f"Checked against the PyTorch model on the {check.images} {check.split} images of the master: mAP50-95 "
               f"{check.map_onnx:.4f} (PyTorch {check.map_torch:.4f}); raw boxes within {check.box_diff:.2g} px, "
               f"class scores within {check.score_diff:.2g}.") if check else "Not checked against the PyTorch model."
    origin = ", ".join(f"{k} {v}" for k, v in source.items())
    if fmt == "openvino":
        title, made = "OpenVINO IR export", (f"OpenVINO IR (`{model_file}` and its `.bin`, float32 weights), converted "
                                            f"from the ONNX export (opset {OPSET})")
        run = f"""import numpy as np, openvino as ov
model = ov.Core().compile_model("{model_file}", "CPU", {{"INFERENCE_PRECISION_HINT": "f32"}})  # as checked
pred = model(batch.astype(np.float32))[0]  # batch: [N, 3, {mf.imgsz}, {mf.imgsz}]"""
    else:
        title, made = "ONNX export", f"ONNX, opset {OPSET}"
        run = f"""import numpy as np, onnxruntime as ort
session = ort.InferenceSession("{model_file}", providers=["CPUExecutionProvider"])
(pred,) = session.run(["{OUTPUT}"], {{"{INPUT}": batch.astype(np.float32)}})  # batch: [N, 3, {mf.imgsz}, {mf.imgsz}]"""
    return f"""# {source.get('model', 'retrain detector')}: {title}

`{model_file}` (sha256 `{digest}`), from {origin}. {made}. Classes: `classes.json` ({n}, index order).

## Input
`{INPUT}`: float32 `[N, 3, {mf.imgsz}, {mf.imgsz}]`, N any (dynamic batch). RGB, values 0-1. Each image resized so
that its longer side is {mf.imgsz} (aspect kept) and padded to {mf.imgsz} x {mf.imgsz} with grey (114/255), centred:
ultralytics' `LetterBox`.

## Output
`{OUTPUT}`: float32 `[N, {4 + n}, anchors]`, before NMS. Per anchor: box centre x, y, width, height in input pixels,
then one score (0-1) per class. Apply NMS (ultralytics' `non_max_suppression`; evaluation used conf 0.001,
iou 0.7, 300 detections), then undo the letterbox (subtract the padding, divide by the scale) for original pixels.

## Parity
{checked}

## Run it
```python
{run}
```
"""
