"""The registered model as an MLflow pyfunc: images in, boxes, scores and classes out.

The version's artifacts are the retrain model file (``weights``: state dict + yaml + class names + imgsz,
loaded with ``weights_only=True``), its ONNX export (``onnx``, when it matched the PyTorch model at promotion) and,
as MLflow's models-from-code, ``serving.py``, which only names this class: nothing of the model is unpickled when it
is loaded or served.

Backend (``RETRAIN_SERVE_BACKEND`` when the model is loaded): ``auto`` (default) runs the ONNX model with onnxruntime
when the version has one, else the PyTorch network; ``onnx`` requires the ONNX model; ``torch`` always runs PyTorch.
Both answer through the same letterbox, NMS and mapping back to the original pixels.

Input: a DataFrame with an ``image`` column of encoded image bytes (JPEG, PNG ...; base64 in JSON, as MLflow
decodes ``binary`` columns), run in batches of up to ``BATCH`` images.  Output: one row per detection: ``image``
(row of the input), ``x_min``, ``y_min``, ``x_max``, ``y_max`` (pixels of the original image), ``score``,
``class_id``, ``class_name``.  Params (optional, per request): ``conf`` (0.25), ``iou`` (0.7), ``max_det`` (300).
A row that is not a decodable image (not an image, truncated, empty, over PIL's decompression-bomb limit) fails the
request with MLflow's ``INVALID_PARAMETER_VALUE`` (HTTP 400) naming the row.
"""

from __future__ import annotations

import base64
import io
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from mlflow.exceptions import MlflowException
from mlflow.pyfunc import PythonModel
from PIL import Image

from retrain.safety import pil_open

BACKEND_ENV = "RETRAIN_SERVE_BACKEND"
BACKENDS = ("auto", "onnx", "torch")
BATCH = 16  # images per forward pass of a request
COLUMNS = ("image", "x_min", "y_min", "x_max", "y_max", "score", "class_id", "class_name")
DEFAULT_PARAMS: dict[str, Any] = {"conf": 0.25, "iou": 0.7, "max_det": 300}


def _decode(value: Any, row: int) -> np.ndarray:
    """Encoded image bytes (or base64 text) -> RGB uint8 array; PIL's decompression-bomb limit stays on.

    PIL's own ``open`` (ultralytics' patched one would try to pip-install a HEIF plugin for an unknown upload).

    Raises:
        MlflowException: ``INVALID_PARAMETER_VALUE`` (a 400 answer): the row is not a decodable image (one line:
            which row, why).
    """
    try:
        data = base64.b64decode(value) if isinstance(value, str) else bytes(value)
        if not data:
            raise ValueError("no bytes")
        with pil_open(io.BytesIO(data)) as im:
            return np.asarray(im.convert("RGB"))
    except Exception as e:  # binascii, PIL's UnidentifiedImageError, DecompressionBombError, truncated data ...
        raise MlflowException.invalid_parameter_value(
            f"image {row}: not a decodable image ({type(e).__name__}: {e})") from e


def _boxed(letterbox: Any, img: np.ndarray) -> np.ndarray:
    out = letterbox(image=img)
    assert isinstance(out, np.ndarray)  # image only in, image only out
    return out


def backend_choice(has_onnx: bool, wanted: str | None = None) -> str:
    """``onnx`` or ``torch``, from ``RETRAIN_SERVE_BACKEND`` (or ``wanted``) and whether the version has an ONNX model.

    Raises:
        MlflowException: An unknown backend, or ``onnx`` for a version without an ONNX model.
    """
    want = (wanted if wanted is not None else os.environ.get(BACKEND_ENV, "auto")).strip().lower() or "auto"
    if want not in BACKENDS:
        raise MlflowException.invalid_parameter_value(f"{BACKEND_ENV}={want!r}: use one of {', '.join(BACKENDS)}")
    if want == "onnx" and not has_onnx:
        raise MlflowException.invalid_parameter_value(f"{BACKEND_ENV}=onnx: this model version has no ONNX model "
                                                      "(see its retrain.onnx.* tags); use auto or torch")
    return "onnx" if has_onnx and want != "torch" else "torch"


class DetectorModel(PythonModel):
    """A retrain detector behind MLflow's pyfunc interface (the backend: see the module docstring)."""

    names: list[str]
    imgsz: int
    backend: str
    net: Callable[[Any], Any]

    # torch, ultralytics and the detector are imported when a model is loaded or run, not when promote logs this
    # module (MLflow imports it then): seconds of imports the registry write does not need.
    def load_context(self, context: Any) -> None:
        from retrain.detector.files import load_model_file

        # The model file is read (safely) whichever backend runs: a version whose file is refused never serves.
        mf = load_model_file(Path(context.artifacts["weights"]))
        self.names, self.imgsz = list(mf.names), mf.imgsz
        onnx = context.artifacts.get("onnx")
        self.backend = backend_choice(bool(onnx))
        if self.backend == "torch":
            self.net = mf.build().eval().fuse(verbose=False)  # Conv+BatchNorm folded, as ONNX and ultralytics do
            return
        from retrain.detector.onnx_export import OnnxDetector

        session = OnnxDetector(Path(onnx))
        if (session.names, session.imgsz) != (self.names, self.imgsz):
            raise MlflowException(f"{onnx}: the ONNX model's classes and imgsz ({session.names}, {session.imgsz}) are "
                                  f"not the model file's ({self.names}, {self.imgsz})")
        self.net = session

    # A DataFrame hint is one MLflow infers no schema from (the logged signature is the schema) and does not warn
    # about, as it does about a predict with no hint at all, each time this module is imported.
    def predict(self, context, model_input: pd.DataFrame, params=None):
        """Detections of every image of ``model_input`` (see the module docstring)."""
        return self.detect(model_input, params)

    def detect(self, model_input: Any, params: dict[str, Any] | None = None) -> pd.DataFrame:
        """``predict``'s work, typed."""
        import torch
        from ultralytics.data.augment import LetterBox

        from retrain.detector.predict import postprocess

        p = {**DEFAULT_PARAMS, **(params or {})}
        frame = model_input if isinstance(model_input, pd.DataFrame) else pd.DataFrame({"image": list(model_input)})
        if "image" not in frame.columns:
            raise MlflowException.invalid_parameter_value(f"no 'image' column (columns: {list(frame.columns)})")
        if not len(frame):
            raise MlflowException.invalid_parameter_value("no images: the request has no rows")
        images = [_decode(value, i) for i, value in enumerate(frame["image"])]  # every row checked before any runs
        letterbox = LetterBox(new_shape=(self.imgsz, self.imgsz), auto=False)  # as ultralytics' predictor
        classes = list(range(len(self.names)))
        rows: list[tuple[Any, ...]] = []
        for start in range(0, len(images), BATCH):
            chunk = images[start:start + BATCH]
            boxed = np.stack([_boxed(letterbox, img) for img in chunk])
            scaled = np.empty((len(chunk), 3, self.imgsz, self.imgsz), np.float32)  # NCHW in 0-1, in one pass
            np.multiply(boxed.transpose(0, 3, 1, 2), np.float32(1 / 255), out=scaled, casting="unsafe")
            tensor = torch.from_numpy(scaled)
            batch = {"img": tensor, "ori_shape": [img.shape[:2] for img in chunk], "ratio_pad": [None] * len(chunk)}
            with torch.no_grad():
                dets = postprocess(self.net(tensor), batch, list(range(start, start + len(chunk))), classes,
                                   float(p["conf"]), float(p["iou"]), int(p["max_det"]))
            for d in dets:
                x, y, w, h = d["bbox"]
                c = int(d["category_id"])
                rows.append((d["image_id"], x, y, x + w, y + h, d["score"], c, self.names[c]))
        cols = list(zip(*rows, strict=True)) if rows else [()] * len(COLUMNS)
        types = (np.int64, np.float64, np.float64, np.float64, np.float64, np.float64, np.int64, object)
        # Typed columns built directly (a DataFrame's astype per request cost more than onnxruntime's forward pass)
        return pd.DataFrame({c: np.array(v, dtype=t) for c, v, t in zip(COLUMNS, cols, types, strict=True)})


def example_input() -> pd.DataFrame:
    """A one-image request (a small grey JPEG): MLflow runs it through the model when logging and stores it as
    the model's serving example."""
    buf = io.BytesIO()
    Image.new("RGB", (64, 48), (114, 114, 114)).save(buf, format="JPEG")
    return pd.DataFrame({"image": [buf.getvalue()]})
