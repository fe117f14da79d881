"""``retrain rollback`` and ``retrain status``: the champion's history, and the registry at a glance."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from mlflow.exceptions import MlflowException

from retrain.errors import RetrainError
from retrain.registry.tracking import CHAMPION, client, current_champion
from retrain.registry.versions import CHALLENGER, TAG, record_champion_move

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Rollback:
    """A rollback done.

    Attributes:
        previous: The version that was champion.
        champion: The version that is champion now.
    """

    previous: str
    champion: str


def rollback(uri: str, name: str, to: str | None = None) -> Rollback:
    """Move ``champion`` back: to ``to``, else to the champion the current one replaced (its parent version).

    Args:
        uri: Tracking URI.
        name: Registered model name.
        to: The version to make champion (default: the previous champion).

    Returns:
        What moved.

    Raises:
        RetrainError: No champion, no previous champion, or ``to`` is not a version of the model.
    """
    mc = client(uri)
    now = current_champion(mc, name)
    if now is None:
        raise RetrainError(f"model registry: {name} has no champion; nothing to roll back")
    target = to
    if target is None:
        parent = mc.get_model_version(name, now).tags.get(f"{TAG}parent_version", "none")
        if parent == "none":
            raise RetrainError(f"model registry: {name} version {now} was the first champion; there is no previous "
                               "one (use --to VERSION)")
        target = parent
    try:
        mc.get_model_version(name, target)
    except MlflowException as e:
        raise RetrainError(f"model registry: {name} has no version {target} ({e.message})") from e
    if target == now:
        raise RetrainError(f"model registry: version {now} is already {name}@{CHAMPION}")
    mc.set_model_version_tag(name, now, f"{TAG}rolled_back", "true")
    mc.set_registered_model_alias(name, CHAMPION, target)
    record_champion_move(mc, name, {"champion": target, "from": now, "by": "rollback"})
    log.info("%s@%s: version %s -> %s (rollback)", name, CHAMPION, now, target)
    return Rollback(now, target)


def status(uri: str, name: str) -> list[dict[str, Any]]:
    """Every version of the model, newest first: aliases, data version, metrics, decision.

    Raises:
        RetrainError: The registry cannot be read.
    """
    mc = client(uri)
    try:
        versions = mc.search_model_versions(f"name = '{name}'")
    except MlflowException as e:
        raise RetrainError(f"model registry: cannot list {name} ({e.message})") from e
    aliases: dict[str, list[str]] = {}
    if versions:  # search results carry no aliases in every store; the registered model has them all
        for alias, version in mc.get_registered_model(name).aliases.items():
            aliases.setdefault(str(version), []).append(alias)
    rows = []
    for mv in sorted(versions, key=lambda v: int(v.version), reverse=True):
        t = mv.tags
        rows.append({"version": str(mv.version), "aliases": sorted(aliases.get(str(mv.version), [])),
                     "data_version": t.get(f"{TAG}data_version", "")[:12],
                     "data_dvc_md5": t.get(f"{TAG}data_dvc_md5", ""), "git_rev": t.get(f"{TAG}git_rev", "")[:10],
                     "mAP50-95": t.get(f"{TAG}metric.mAP50-95", ""), "mAP50": t.get(f"{TAG}metric.mAP50", ""),
                     "decision": t.get(f"{TAG}decision", ""), "parent": t.get(f"{TAG}parent_version", ""),
                     "rolled_back": t.get(f"{TAG}rolled_back", "") == "true", "onnx": t.get(f"{TAG}onnx", ""),
                     "per_class": _per_class(t.get(f"{TAG}metric.per_class", "")),
                     "created": mv.creation_timestamp})
    return rows


def _per_class(text: str) -> dict[str, float]:
    """The ``metric.per_class`` tag (absent on versions an earlier retrain registered: then no classes)."""
    try:
        found = json.loads(text) if text else {}
    except ValueError:
        return {}
    return {str(k): float(v) for k, v in found.items()} if isinstance(found, dict) else {}


def status_lines(rows: list[dict[str, Any]], name: str) -> list[str]:
    """``rows`` as an aligned table for the terminal."""
    if not rows:
        return [f"{name}: no versions registered yet"]
    head = ("version", "aliases", "data", "dvc md5", "git", "mAP50-95", "mAP50", "decision", "parent", "onnx")
    table = [head] + [(r["version"], ",".join(r["aliases"]) or "-", r["data_version"], r["data_dvc_md5"][:12],
                       r["git_rev"], r["mAP50-95"][:6], r["mAP50"][:6],
                       r["decision"] + (" (rolled back)" if r["rolled_back"] else ""), r["parent"], r["onnx"] or "-")
                      for r in rows]
    widths = [max(len(str(row[i])) for row in table) for i in range(len(head))]
    champion = next((r["version"] for r in rows if CHAMPION in r["aliases"]), "none")
    challenger = next((r["version"] for r in rows if CHALLENGER in r["aliases"]), "none")
    return [f"{name}: champion version {champion}, challenger version {challenger}",
            *("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in table)]


def ui_links(uri: str, name: str, version: str, ui_base: str) -> dict[str, str]:
    """Links into the MLflow UI for a model version and the run it was logged in.

    Args:
        uri: Tracking URI (an ``http(s)`` server is its own UI; a local store is shown by ``mlflow ui``).
        name: Registered model name.
        version: The model version.
        ui_base: Base URL of ``mlflow ui`` for a local store.

    Returns:
        ``{"version": url, "run": url}`` (``run`` only when the version names one).
    """
    base = (uri if uri.split(":", 1)[0] in ("http", "https") else ui_base).rstrip("/")
    links = {"version": f"{base}/#/models/{quote(name)}/versions/{version}"}
    mc = client(uri)
    run_id = mc.get_model_version(name, version).run_id
    if run_id:
        experiment = mc.get_run(run_id).info.experiment_id
        links["run"] = f"{base}/#/experiments/{experiment}/runs/{run_id}"
    return links
