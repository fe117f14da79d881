"""Fault: the address space capped (`prlimit --as`) below what a RAM image cache needs, above what training needs.

psutil's available memory does not see an ``RLIMIT_AS`` cap, so a cache chosen from it alone could leave training
without room and fail with ``MemoryError`` midway.  ``choose_cache`` takes the headroom as the cap less what the
process has mapped already, and keeps RAM for the cache only when three copies of the decoded images *and*
``TRAINING_ROOM`` (1 GiB: what training maps after the choice) fit in it.  Under a cap that leaves training its
~0.6-0.9 GiB but not that, it chooses disk and the training completes.

The cap is measured here, not hard-coded: the address space of a process that has imported what ``retrain train``
imports, plus ``ROOM`` (``MALLOC_ARENA_MAX=2``, as in any capped deployment: glibc otherwise reserves 64 MiB of
address space per thread).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import load_json, run_cli, set_train_params

pytestmark = [pytest.mark.faults, pytest.mark.slow]

MiB = 2**20
IMGSZ = 64
ROOM = 1000 * MiB  # over the probe: ~170 MiB mapped before the choice, ~0.6-0.7 GiB after (800 fails here)
ENV = {"MALLOC_ARENA_MAX": "2"}


PROBE = """
import psutil, retrain.cli, retrain.data.loading, retrain.training.module, retrain.training.train
print(psutil.Process().memory_info().vms)
"""

CHOOSE = """
import logging
from pathlib import Path
from retrain.config import load_params
from retrain.data.loading import choose_cache
from retrain.data.master import load_master
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
p = load_params(Path("params.yaml"))
master = load_master(Path("data/master"), Path("data"))
print("chosen:", choose_cache(p.runtime.cache, master.doc["images"], p.train.imgsz, 0))
"""


def _python(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "YOLO_OFFLINE": "true", **ENV}
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, check=True)


def _decoded_bytes(images: list[dict]) -> int:
    """What ``choose_cache`` counts: the images resized to IMGSZ, 3 bytes a pixel."""
    need = 0
    for im in images:
        r = IMGSZ / max(im["width"], im["height"])
        need += int(im["width"] * r) * int(im["height"] * r) * 3
    return need


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A validated master of 32 generated images, yolo11n at imgsz 64 for one epoch with an automatic cache."""
    from retrain.data.sample import generate
    from retrain.workspace import init_workspace

    base = tmp_path_factory.mktemp("memcap")
    generate(base / "samples", batches=1, images_per_batch=32, seed=0)
    root = init_workspace(base / "ws", remote=str(base / "remote")).root
    run_cli("ingest", base / "samples" / "batch-1", cwd=root, check=True)
    run_cli("merge", cwd=root, check=True)
    run_cli("validate", cwd=root, check=True)
    set_train_params(root, imgsz=IMGSZ, epochs=1, batch=8, workers=0, cache="auto", use_champion=False,
                     channels_last="off", augment={"close_mosaic": 0})
    return root


def test_without_a_cap_the_cache_is_ram(workspace: Path) -> None:
    proc = _python(CHOOSE, workspace)
    assert "chosen: ram" in proc.stdout, proc.stdout + proc.stderr
    assert "image cache: ram" in proc.stderr and "address-space limit" not in proc.stderr, proc.stderr


def test_under_an_address_space_cap_training_caches_on_disk_and_completes(workspace: Path) -> None:
    prlimit = shutil.which("prlimit")
    if prlimit is None:
        pytest.skip("prlimit (util-linux) is not installed")
    from retrain.data.loading import TRAINING_ROOM

    need = _decoded_bytes(load_json(workspace / "data" / "master" / "annotations.json")["images"])
    cap = int(_python(PROBE, workspace).stdout.split()[-1]) + ROOM
    # A RAM cache would need 3 x `need` and the training's room on top of what the process has mapped (> the probe).
    assert 3 * need + TRAINING_ROOM > ROOM, f"the cap leaves room for a RAM cache: 3 x {need / MiB:.0f} MiB"

    env = {**os.environ, "YOLO_OFFLINE": "true", **ENV, "PATH": os.path.dirname(sys.executable) + os.pathsep
           + os.environ.get("PATH", "")}
    proc = subprocess.run([prlimit, f"--as={cap}", sys.executable, "-m", "retrain", "train"], cwd=workspace, env=env,
                          capture_output=True, text=True, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"cap {cap / MiB:.0f} MiB, need {need / MiB:.0f} MiB:\n{out[-6000:]}"
    line = next((ln for ln in out.splitlines() if "image cache:" in ln), "")
    assert re.search(r"image cache: (disk|none) ", line) and "address-space limit (RLIMIT_AS)" in line, line
    assert f"{cap / MiB:.1f} MiB" in line, line
    assert "MemoryError" not in out
    assert (workspace / "models" / "candidate" / "model.pt").is_file()
    report = load_json(workspace / "reports" / "train.json")
    assert report["epochs"] == 1
