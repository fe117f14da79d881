"""Model files: a retrain model file (the candidate, the champion), ultralytics ``.pt`` files, and the warm start.

A candidate is one ``torch.save`` of plain data (state dict, model yaml, class names, imgsz, data version),
so it loads with ``weights_only=True``: no pickled objects, nothing executed.  An ultralytics ``.pt`` is a
pickle of model objects; it is loaded only after ``torch.serialization.get_unsafe_globals_in_checkpoint``
(which reads the pickle without running it) shows nothing but classes from torch and ultralytics' ``nn``
package, and then still with ``weights_only=True`` restricted to exactly those classes.  Anything else
(``os.system``, ``builtins.eval``, ``getattr``, a class that loads other files such as ``AutoBackend`` ...) is
refused before a byte of it runs.  A model yaml is code to ultralytics (its ``activation`` is ``eval()``ed and its
layer names are looked up among ``ultralytics.nn.tasks``' globals and called): every model is built, and every
``.pt`` unpickled, in ultralytics' restricted mode (no ``eval``, only ``nn.Module`` layers), and a model file
whose yaml does not build that way is refused when it is loaded.
"""

from __future__ import annotations

import importlib
import logging
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from ultralytics.nn.tasks import DetectionModel

from retrain.detector.model import build_model, no_eval
from retrain.errors import RetrainError

log = logging.getLogger(__name__)

FORMAT = "retrain-detector-v1"
#: Modules whose classes an ultralytics checkpoint may name (it pickles nn.Module trees and its arg namespace).
_ALLOWED_PREFIXES = ("torch.nn.modules.", "torch.nn.parameter.", "ultralytics.nn.", "collections.OrderedDict",
                     "ultralytics.utils.IterableSimpleNamespace", "torch._utils._rebuild", "torch.FloatStorage",
                     "torch.HalfStorage", "torch.BFloat16Storage", "torch.LongStorage", "torch.Size")
#: Of those, the modules whose nn.Module classes are model layers (as ultralytics' own restricted loading: not
#: ``ultralytics.nn.autobackend.AutoBackend``, whose constructor, called by a pickle, loads any file unsafely).
_LAYER_MODULES = ("torch.nn.modules.", "ultralytics.nn.modules.", "ultralytics.nn.tasks")
_DATA_CLASSES = ("collections.OrderedDict", "ultralytics.utils.IterableSimpleNamespace", "torch.nn.parameter.")


class ModelFileError(RetrainError):
    """A model file that is missing, damaged, or not safe to load."""


@dataclass(frozen=True)
class ModelFile:
    """Weights and what is needed to rebuild the network.

    Attributes:
        state_dict: Tensor name -> tensor (float32, CPU).
        yaml: The ultralytics model yaml as a dict.
        names: Class names in class-index order.
        imgsz: Training image size.
        meta: Anything else recorded (data version, metrics, source); plain JSON-like values.
    """

    state_dict: dict[str, torch.Tensor]
    yaml: dict[str, Any]
    names: tuple[str, ...]
    imgsz: int
    meta: dict[str, Any]

    def build(self) -> DetectionModel:
        """The network with these weights loaded (strictly)."""
        model = build_model(self.yaml, self.names)
        model.load_state_dict(self.state_dict, strict=True)
        return model


def save_model_file(path: Path, model: ModelFile) -> None:
    """Write ``model`` to ``path`` atomically (temp file, fsync, rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    payload = {"format": FORMAT, "state_dict": {k: v.detach().float().cpu() for k, v in model.state_dict.items()},
               "yaml": model.yaml, "names": list(model.names), "imgsz": model.imgsz, "meta": model.meta}
    try:
        with open(tmp, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def load_model_file(path: Path) -> ModelFile:
    """Load a retrain model file or an ultralytics ``.pt`` without running any pickled code.

    Raises:
        ModelFileError: Missing, damaged, of another kind, or naming code that is not model classes.
    """
    if not path.is_file():
        raise ModelFileError(f"{path}: model file not found")
    unsafe = _unsafe_globals(path)
    mf = _retrain_file(path, _torch_load(path, [])) if not unsafe else _ultralytics_file(path, unsafe)
    try:
        mf.build()  # restricted (see build_model): a yaml that names code fails here, before anyone runs it
    except Exception as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ModelFileError(f"{path}: refused: its model yaml does not build as plain model layers "
                             f"({type(e).__name__}: {first}); nothing of it was run") from e
    return mf


def _unsafe_globals(path: Path) -> list[str]:
    try:
        return list(torch.serialization.get_unsafe_globals_in_checkpoint(str(path)))
    except Exception as e:  # a truncated or foreign file: zipfile/pickle errors of many kinds
        raise ModelFileError(f"{path}: not a readable torch file ({type(e).__name__}: {e})") from e


def _torch_load(path: Path, allowed: list[Any]) -> Any:
    try:
        with torch.serialization.safe_globals(allowed), no_eval():
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ModelFileError(f"{path}: cannot be loaded safely ({type(e).__name__}: {str(e).splitlines()[0]})") from e


def _retrain_file(path: Path, obj: Any) -> ModelFile:
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise ModelFileError(f"{path}: not a retrain model file (no '{FORMAT}' format tag)")
    try:
        return ModelFile(dict(obj["state_dict"]), dict(obj["yaml"]), tuple(obj["names"]), int(obj["imgsz"]),
                         dict(obj.get("meta", {})))
    except (KeyError, TypeError, ValueError) as e:
        raise ModelFileError(f"{path}: retrain model file is incomplete ({e})") from e


def _ultralytics_file(path: Path, unsafe: list[str]) -> ModelFile:
    bad = [g for g in unsafe if not g.startswith(_ALLOWED_PREFIXES)]
    if bad:
        raise ModelFileError(f"{path}: refused: its pickle names code that is not a model class "
                             f"({', '.join(sorted(bad)[:5])}); nothing was loaded")
    classes = []
    for g in unsafe:
        module, _, name = g.rpartition(".")
        obj = getattr(importlib.import_module(module), name, None)
        if not isinstance(obj, type):
            raise ModelFileError(f"{path}: refused: {g} is not a class; nothing was loaded")
        layer = g.startswith(_LAYER_MODULES) and issubclass(obj, torch.nn.Module)
        if not layer and not g.startswith(_DATA_CLASSES):
            raise ModelFileError(f"{path}: refused: its pickle names {g}, which is not a model layer; "
                                 "nothing was loaded")
        classes.append(obj)
    ckpt = _torch_load(path, classes)
    model = (ckpt.get("ema") or ckpt.get("model")) if isinstance(ckpt, dict) else None
    if not isinstance(model, DetectionModel):
        raise ModelFileError(f"{path}: not an ultralytics detection checkpoint (no 'model' DetectionModel)")
    names = model.names if isinstance(model.names, dict) else dict(enumerate(model.names))
    imgsz = ckpt.get("train_args", {}).get("imgsz", 640) if isinstance(ckpt.get("train_args"), dict) else 640
    return ModelFile({k: v.float() for k, v in model.state_dict().items()}, dict(model.yaml),  # type: ignore[arg-type]
                     tuple(str(names[i]) for i in range(len(names))), int(imgsz), {"source": "ultralytics"})


@dataclass(frozen=True)
class Transfer:
    """What a warm start carried over.

    Attributes:
        transferred: Tensors copied whole (same name and shape).
        total: Tensors in the model.
        kept_classes: Classes whose head rows came from the source (matched by name).
        new_classes: Classes whose head rows start fresh.
    """

    transferred: int
    total: int
    kept_classes: tuple[str, ...]
    new_classes: tuple[str, ...]


def warm_start(model: DetectionModel, source: ModelFile) -> Transfer:
    """Copy every matching weight of ``source`` into ``model`` with ultralytics' own ``DetectionModel.load``.

    It copies tensors whose name and shape match and, when the class list changed, the class-head rows of
    classes found in both by name; new classes' rows keep their fresh initialisation.
    """
    src = source.build()
    model.load(src, verbose=False)
    src_sd = src.state_dict()
    whole = sum(1 for k, v in model.state_dict().items()
                if k in src_sd and src_sd[k].shape == v.shape and torch.equal(v, src_sd[k]))
    names = [model.names[i] for i in range(len(model.names))]
    kept = tuple(n for n in names if n in source.names)
    new = tuple(n for n in names if n not in source.names)
    t = Transfer(whole, len(model.state_dict()), kept, new)
    log.info("warm start: %d/%d tensors transferred whole; class head rows kept for %s%s", t.transferred, t.total,
             ", ".join(kept) or "no class", f"; new classes start fresh: {', '.join(new)}" if new else "")
    return t
