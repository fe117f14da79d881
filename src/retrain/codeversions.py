"""``code-versions.yaml``: a hash of the installed code each stage runs, which ``dvc.yaml`` lists as a param.

DVC reruns a stage when its dependencies or params change, but the code a stage runs is installed, not in the
workspace, so an upgrade of retrain (or of torch, ultralytics ...) would otherwise leave every stage "up to date".
Each stage's entry hashes the source of the retrain modules its stage imports (followed through their imports,
read as text, nothing imported) and the versions of the libraries that shape its result.  ``retrain init``, ``retrain
ingest`` and every flow run (before DVC plans) write the file when it changed; after an upgrade with no new batch,
``retrain code-versions`` does, and ``dvc repro`` then reruns exactly the stages whose code changed.
"""

from __future__ import annotations

import ast
import hashlib
from importlib import metadata
from pathlib import Path

import yaml

import retrain
from retrain.fsutil import write_atomic
from retrain.paths import Paths

FILE = "code-versions.yaml"

#: Each dvc.yaml stage: the module its command runs, and the libraries whose version can change its result.
STAGES: dict[str, tuple[str, tuple[str, ...]]] = {
    "merge": ("retrain.merge", ("orjson",)),
    "validate": ("retrain.validation.validate", ("great-expectations", "pandas", "pillow")),
    "audit": ("retrain.audit.audit", ("torch", "torchvision", "ultralytics", "cleanlab", "numpy", "opencv-python")),
    "train": ("retrain.training.train", ("torch", "torchvision", "ultralytics", "pytorch-lightning", "pycocotools",
                                         "numpy", "opencv-python")),
    "evaluate": ("retrain.evaluation.evaluate", ("torch", "torchvision", "ultralytics", "pycocotools", "numpy",
                                                 "opencv-python")),
    "promote": ("retrain.promotion.promote", ("mlflow",)),
}

_HEADER = ("# Written by retrain: a hash of the installed code each stage runs (its modules and libraries).\n"
           "# dvc.yaml lists each stage's entry as a param: new code reruns the stages it changes. Do not edit.\n")


def _file(module: str) -> Path | None:
    """The source file of a ``retrain`` module, or ``None`` for something else."""
    parts = module.split(".")
    if parts[0] != "retrain":
        return None
    base = Path(retrain.__file__).parent.joinpath(*parts[1:])
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _imports(path: Path, module: str) -> set[str]:
    """The ``retrain`` modules ``path`` imports (``from retrain.x import y`` may name module ``retrain.x.y``)."""
    found: set[str] = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_bytes())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base
                                                                                                   else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return {m for m in found if m.split(".")[0] == "retrain" and _file(m) is not None}


def modules_of(root: str) -> list[str]:
    """Every ``retrain`` module that ``root`` imports, directly or through others (``root`` included), sorted."""
    seen: set[str] = set()
    todo = [root]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        path = _file(name)
        if path is not None:
            todo.extend(_imports(path, name) - seen)
    return sorted(seen)


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "absent"


def code_versions() -> dict[str, str]:
    """Stage -> 16 hex digits of sha256 over its modules' source and its libraries' versions."""
    out = {}
    for stage, (root, libraries) in STAGES.items():
        h = hashlib.sha256()
        for name in modules_of(root):
            path = _file(name)
            assert path is not None
            h.update(f"{name}\0".encode() + path.read_bytes() + b"\0")
        for dist in libraries:
            h.update(f"{dist}=={_version(dist)}\0".encode())
        out[stage] = h.hexdigest()[:16]
    return out


def record(paths: Paths) -> list[str]:
    """Write ``code-versions.yaml`` when the installed code differs from what it records; the stages that changed."""
    path = paths.root / FILE
    now = code_versions()
    try:
        before = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError):
        before = {}
    changed = [s for s in now if not isinstance(before, dict) or before.get(s) != now[s]]
    if changed:
        write_atomic(path, _HEADER + yaml.safe_dump(now, sort_keys=False))
    return changed
