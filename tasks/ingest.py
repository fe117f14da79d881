"""Ingest as Prefect tasks: one task run per waiting batch, no retries (a refused batch is bad data)."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from retrain.config import load_params
from retrain.errors import RetrainError, disk_full
from retrain.ingest import ingest
from retrain.paths import Paths

#: Where an ingested delivery is moved from ``data/incoming/`` (git-ignored; safe to delete: the batch is in DVC).
DONE = ".ingested"


def waiting(paths: Paths, given: list[str] | None) -> list[Path]:
    """The batches to ingest: ``given`` paths, else every folder in ``data/incoming/`` (not hidden), by name."""
    if given:
        return [Path(p).resolve() for p in given]
    if not paths.incoming.is_dir():
        return []
    return sorted(p for p in paths.incoming.iterdir() if p.is_dir() and not p.name.startswith("."))


def _set_aside(paths: Paths, source: Path) -> Path | None:
    """Move an ingested delivery out of ``data/incoming/`` so that it is no longer waiting."""
    if source.parent != paths.incoming:
        return None  # a path given by the user stays where it is
    done = paths.incoming / DONE
    done.mkdir(exist_ok=True)
    target = done / source.name
    n = 1
    while target.exists():
        n += 1
        target = done / f"{source.name}.{n}"
    shutil.move(str(source), str(target))
    return target


@task(name="ingest", task_run_name="ingest-{name}", cache_policy=NO_CACHE)
def ingest_batch(root: str, source: str, name: str) -> dict[str, Any]:
    """Check one batch and add it to ``data/batches`` (``retrain ingest``); refuse it with one line per problem.

    Args:
        root: The workspace.
        source: The batch folder.
        name: Its name in ``data/batches``.

    Returns:
        ``name``, ``added`` (False: the same content was there already), ``images``, ``boxes``, ``seconds``.

    Raises:
        BatchRejected: The batch failed a check; nothing in the workspace changed.
    """
    logger = get_run_logger()
    paths = Paths.at(root)
    params = load_params(paths.params)
    t0 = time.perf_counter()
    try:
        result = ingest(paths, Path(source), params, name)
    except RetrainError as e:
        for line in e.lines():
            logger.error(line)
        create_markdown_artifact(f"# Batch {name} refused\n\nNothing in the workspace changed.\n\n"
                                 + "".join(f"- {ln}\n" for ln in e.lines()),
                                 key="retrain-ingest-refused", description=f"why batch {name} was refused")
        raise
    except OSError as e:  # a full disk is one line too; ingest wrote nothing (it stages, then renames)
        full = disk_full(e, str(paths.staging))
        if full is None:
            raise
        logger.error(str(full))
        raise full from e
    for note in result.notes:
        logger.info("note: batch %s: %s", result.name, note)
    for p in result.dropped:  # ingest.bad_boxes: drop
        logger.warning("dropped: %s", p.format(result.name))
    moved = _set_aside(paths, Path(source))
    logger.info("batch %s %s: %d images, %d boxes%s", result.name,
                "added" if result.added else "already ingested with the same content", result.images, result.boxes,
                f"; delivery moved to {moved}" if moved else "")
    return {"name": result.name, "added": result.added, "images": result.images, "boxes": result.boxes,
            "seconds": time.perf_counter() - t0}
