"""The registered model as an MLflow pyfunc: images in, boxes, scores and classes out.

The version's artifacts are the retrain model file (``weights``: state dict + yaml + class names + imgsz,
loaded with ``weights_only=True``) and, as MLflow's models-from-code, ``serving.py``, which only names
this class: nothing of the model is unpickled when it is loaded or served.

Input: a DataFrame with an ``image`` column of encoded image bytes (JPEG, PNG ...; base64 in JSON, as MLflow
decodes ``binary`` columns).  Output: one row per detection: ``image`` (row of the input), ``x_min``,
``y_min``, ``x_max``, ``y_max`` (pixels of the original image), ``score``, ``class_id``, ``class_name``.
Params (optional, per request): ``conf`` (0.25), ``iou`` (0.7), ``max_det`` (300).
"""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from mlflow.pyfunc import PythonModel
from PIL import Image

from retrain.safety import pil_open

COLUMNS = ("image", "x_min", "y_min", "x_max", "y_max", "score", "class_id", "class_name")
DEFAULT_PARAMS: dict[str, Any] = {"conf": 0.25, "iou": 0.7, "max_det": 300}


def _decode(value: Any, row: int) -> np.ndarray:
    """Encoded image bytes (or base64 text) -> RGB uint8 array; PIL's decompression-bomb limit stays on.

    PIL's own ``open`` (ultralytics' patched one would try to pip-install a HEIF plugin for an unknown upload).

    Raises:
        ValueError: The row is not a decodable image (one line: which row, why).
    """
    try:
        data = base64.b64decode(value) if isinstance(value, str) else bytes(value)
        with pil_open(io.BytesIO(data)) as im:
            return np.asarray(im.convert("RGB"))
    except Exception as e:  # binascii, PIL's UnidentifiedImageError, DecompressionBombError, truncated data ...
        raise ValueError(f"image {row}: not a decodable image ({type(e).__name__}: {e})") from e


class DetectorModel(PythonModel):
    """A retrain detector behind MLflow's pyfunc interface."""

    # torch, ultralytics and the detector are imported when a model is loaded or run, not when promote logs this
    # module (MLflow imports it then): seconds of imports the registry write does not need.
    def load_context(self, context: Any) -> None:
        from retrain.detector.files import load_model_file

        mf = load_model_file(Path(context.artifacts["weights"]))
        self.names = mf.names
        self.imgsz = mf.imgsz
        self.net = mf.build().eval()

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
        rows: list[tuple[Any, ...]] = []
        letterbox = LetterBox(new_shape=(self.imgsz, self.imgsz), auto=False)  # as ultralytics' predictor
        for i, value in enumerate(frame["image"]):
            img = _decode(value, i)
            boxed = letterbox(image=img)
            assert isinstance(boxed, np.ndarray)  # image only in, image only out
            tensor = torch.from_numpy(np.ascontiguousarray(boxed.transpose(2, 0, 1)))[None].float() / 255
            batch = {"img": tensor, "ori_shape": [img.shape[:2]], "ratio_pad": [None]}
            with torch.no_grad():
                dets = postprocess(self.net(tensor), batch, [i], list(range(len(self.names))), float(p["conf"]),
                                   float(p["iou"]), int(p["max_det"]))
            for d in dets:
                x, y, w, h = d["bbox"]
                c = int(d["category_id"])
                rows.append((i, x, y, x + w, y + h, d["score"], c, self.names[c]))
        out = pd.DataFrame(rows, columns=list(COLUMNS))
        return out.astype({"image": "int64", "x_min": "float64", "y_min": "float64", "x_max": "float64",
                           "y_max": "float64", "score": "float64", "class_id": "int64", "class_name": "str"})


def example_input() -> pd.DataFrame:
    """A one-image request (a small grey JPEG): MLflow runs it through the model when logging and stores it as
    the model's serving example."""
    buf = io.BytesIO()
    Image.new("RGB", (64, 48), (114, 114, 114)).save(buf, format="JPEG")
    return pd.DataFrame({"image": [buf.getvalue()]})
