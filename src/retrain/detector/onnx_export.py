"""A retrain model file as ONNX (and, from that, OpenVINO IR), and the exported model run by onnxruntime or OpenVINO.

The network is built from the model file's own yaml in ultralytics' restricted mode (``ModelFile.build``: nothing is
unpickled), its Conv+BatchNorm pairs fused as ultralytics' exporter does, its Detect head put in export mode (one
output: the decoded boxes and class scores before NMS), and written by ``torch.onnx.export``'s TorchScript-based
exporter (the graph ultralytics' own ONNX export writes) with a fixed ``imgsz`` x ``imgsz`` input and a dynamic batch
axis, for onnxruntime's CPU provider.  Both backends then go through the same NMS, the same mapping back to the
original pixels and the same scoring (``detector.predict``, pycocotools): ``evaluation.parity`` compares them.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from retrain.detector.files import ModelFile
from retrain.errors import RetrainError

#: ONNX opset: onnxruntime >= 1.16 runs it on CPU, and every op of a YOLO detector exists in it.
OPSET = 17
INPUT, OUTPUT = "images", "output0"


class ExportError(RetrainError):
    """An export that failed, or whose model does not match the PyTorch one."""


def export_onnx(mf: ModelFile, out: Path, opset: int = OPSET) -> Path:
    """Write ``mf`` as an ONNX model to ``out``: input ``images`` float32 [N, 3, imgsz, imgsz] (RGB, 0-1,
    letterboxed), output ``output0`` float32 [N, 4 + classes, anchors] (box centre x, y, width, height in input
    pixels, then each class's score), before NMS.  The model's metadata (``custom_metadata_map``) holds ``names``
    (JSON list, index order) and ``imgsz``, so that a server needs nothing else to run it.

    Returns:
        ``out``.
    """
    import onnx
    from ultralytics.nn.modules.head import Detect

    model = mf.build().float().eval()
    model = model.fuse(verbose=False)
    for m in model.modules():
        if isinstance(m, Detect):
            m.export, m.dynamic = True, False
            m.format = "onnx"  # type: ignore[assignment]  # ultralytics annotates it None
    dummy = torch.zeros(1, 3, mf.imgsz, mf.imgsz)
    out.parent.mkdir(parents=True, exist_ok=True)
    with torch.no_grad(), warnings.catch_warnings():
        # The trace's notes on the head's shape check (constant for a fixed imgsz: what is wanted), and the notice that
        # the TorchScript-based exporter is no longer torch's default: ultralytics' exporter silences both too.
        warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"torch\.onnx.*|retrain\.detector.*")
        model(dummy)  # anchors and strides for this input size, as ultralytics' exporter's dry run
        torch.onnx.export(model, (dummy,), str(out), opset_version=opset, input_names=[INPUT], output_names=[OUTPUT],
                          dynamic_axes={INPUT: {0: "batch"}, OUTPUT: {0: "batch"}}, do_constant_folding=True,
                          dynamo=False)
    proto = onnx.load(str(out))
    for key, value in (("names", json.dumps(list(mf.names))), ("imgsz", str(mf.imgsz))):
        proto.metadata_props.add(key=key, value=value)
    onnx.save(proto, str(out))
    return out


def _through_numpy(run: Callable[[np.ndarray], np.ndarray], img: torch.Tensor) -> torch.Tensor:
    """An exported model's runtime called as the PyTorch model is: a float batch [N, 3, imgsz, imgsz] in 0-1 -> the
    decoded predictions as a torch tensor, for ``detector.predict``'s NMS (``run``: float32 NCHW array in, the
    model's first output out)."""
    return torch.from_numpy(np.asarray(run(np.ascontiguousarray(img.detach().cpu().numpy(), np.float32))))


class OnnxDetector:
    """An exported model in an onnxruntime CPU session, called as the PyTorch model is (``_through_numpy``).

    Attributes:
        names: Class names in index order, from the model's metadata (empty when it has none).
        imgsz: The fixed input size.
    """

    def __init__(self, path: Path, threads: int = 0) -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads  # 0: onnxruntime's default (the physical cores)
        self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        meta = self.session.get_modelmeta().custom_metadata_map
        self.names: list[str] = json.loads(meta.get("names", "[]"))
        self.imgsz = int(self.session.get_inputs()[0].shape[-1])  # fixed at export

    def __call__(self, img: torch.Tensor) -> torch.Tensor:
        return _through_numpy(lambda x: self.session.run([OUTPUT], {INPUT: x})[0], img)


def export_openvino(onnx_path: Path, out: Path) -> Path:
    """Convert an ONNX export (``export_onnx``) to OpenVINO IR: ``out`` (``.xml``) and its ``.bin``, weights kept in
    float32 (OpenVINO's default would halve them to float16), the same input, output and metadata.

    Raises:
        ExportError: The ``openvino`` package is not installed.
    """
    try:
        import openvino as ov
    except ImportError as e:
        raise ExportError("export: --format openvino needs the openvino package "
                          "(pip install 'retrain[openvino]')") from e
    model = ov.convert_model(str(onnx_path))
    out.parent.mkdir(parents=True, exist_ok=True)
    ov.save_model(model, str(out), compress_to_fp16=False)
    return out


class OpenVinoDetector:
    """An OpenVINO IR model compiled for the CPU in float32 (on CPUs with AMX or AVX512-BF16 OpenVINO would otherwise
    infer in bf16, and answer differently), called as the PyTorch model is (``_through_numpy``)."""

    def __init__(self, path: Path) -> None:
        import openvino as ov

        self.compiled = ov.Core().compile_model(str(path), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})

    def __call__(self, img: torch.Tensor) -> torch.Tensor:
        return _through_numpy(lambda x: self.compiled(x)[0], img)


def sha256(path: Path) -> str:
    """The file's sha256 (hex)."""
    return hashlib.sha256(path.read_bytes()).hexdigest()
