"""Building an ultralytics ``DetectionModel`` from its yaml, in ultralytics' restricted mode.

A model yaml is code to ultralytics (its ``activation`` is ``eval()``ed and its layer names are looked up among
``ultralytics.nn.tasks``' globals and called): every model is built, and every ``.pt`` unpickled (``files.py``), in
that restricted mode (no ``eval``, only ``nn.Module`` layers).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from copy import deepcopy
from typing import Any

from ultralytics.nn.tasks import DetectionModel, _SafeLoad, yaml_model_load


@contextlib.contextmanager
def no_eval() -> Iterator[None]:
    """ultralytics' restricted mode for this thread: ``parse_model`` evaluates nothing and builds only nn.Module
    layers (the mode its own ``weights_only`` loading uses)."""
    before = getattr(_SafeLoad._local, "active", False)
    _SafeLoad._local.active = True
    try:
        yield
    finally:
        _SafeLoad._local.active = before


def build_model(model_yaml: str | dict[str, Any], names: tuple[str, ...] | list[str]) -> DetectionModel:
    """An untrained ``DetectionModel`` for ``names`` from an ultralytics yaml name or dict (nothing downloaded).

    Built in ultralytics' restricted mode: nothing of the yaml is ``eval()``ed, and its layers must be nn.Modules
    (a model file's yaml comes with the file, which may be hostile).
    """
    cfg = deepcopy(model_yaml) if isinstance(model_yaml, dict) else yaml_model_load(model_yaml)
    cfg["nc"] = len(names)  # ours, not the yaml's 80 (which ultralytics would announce overriding)
    with no_eval():
        model = DetectionModel(cfg=cfg, ch=3, nc=len(names), verbose=False)
    model.names = dict(enumerate(names))
    return model
