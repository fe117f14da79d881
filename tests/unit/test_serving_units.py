"""The served pyfunc's choices without a model: which backend runs, and what a bad row answers."""

from __future__ import annotations

import base64
import io

import pytest
from mlflow.exceptions import MlflowException
from PIL import Image

from retrain.registry.pyfunc import BACKEND_ENV, _decode, backend_choice


@pytest.mark.parametrize(("wanted", "has_onnx", "runs"), [
    ("auto", True, "onnx"), ("auto", False, "torch"), ("onnx", True, "onnx"), ("torch", True, "torch"),
    ("torch", False, "torch"), (" ONNX ", True, "onnx"), ("", True, "onnx")])
def test_the_backend_follows_the_setting_and_what_the_version_has(wanted: str, has_onnx: bool, runs: str) -> None:
    assert backend_choice(has_onnx, wanted) == runs


def test_the_backend_is_read_from_the_environment_and_bad_settings_are_refused(monkeypatch) -> None:
    monkeypatch.setenv(BACKEND_ENV, "torch")
    assert backend_choice(True) == "torch"
    monkeypatch.delenv(BACKEND_ENV)
    assert backend_choice(True) == "onnx"
    with pytest.raises(MlflowException, match="this model version has no ONNX model"):
        backend_choice(False, "onnx")
    with pytest.raises(MlflowException, match=r"RETRAIN_SERVE_BACKEND='tensorrt': use one of auto, onnx, torch"):
        backend_choice(True, "tensorrt")


def test_a_row_is_decoded_from_bytes_or_base64_and_a_bad_one_is_a_400_naming_it() -> None:
    buf = io.BytesIO()
    Image.new("RGB", (8, 6), (1, 2, 3)).save(buf, format="PNG")
    for value in (buf.getvalue(), base64.b64encode(buf.getvalue()).decode()):
        img = _decode(value, 0)
        assert img.shape == (6, 8, 3) and tuple(img[0, 0]) == (1, 2, 3)
    for value, why in ((b"", "no bytes"), (b"GIF89a-not-really", "UnidentifiedImageError"),
                       (buf.getvalue()[:30], "image 4")):
        with pytest.raises(MlflowException, match=why) as e:
            _decode(value, 4)
        assert e.value.error_code == "INVALID_PARAMETER_VALUE" and str(e.value).startswith("image 4: ")
