"""The quality history of a registered model: mAP50-95 of every version, overall and per class, champion moves marked.

``retrain status --plot`` draws it; the promote stage logs it to the new version's MLflow run and the flow publishes it
as the ``retrain-history`` Prefect artifact.  The numbers are the versions' own tags (``retrain.metric.mAP50-95``,
``retrain.metric.per_class``: each candidate on its evaluation's judged split), so the history reads the registry
alone, whatever workspace or machine registered each version.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class History:
    """What the plot draws, one entry per registered version (oldest first).

    Attributes:
        versions: Version numbers.
        overall: mAP50-95 per version (``None`` where a version has no metric tag).
        per_class: Class -> AP50-95 per version (``None`` where the version did not report the class).
        promoted: Versions the gate promoted (the champion moved to them).
        champion: The champion now, if any.
    """

    versions: list[int]
    overall: list[float | None]
    per_class: dict[str, list[float | None]] = field(default_factory=dict)
    promoted: list[int] = field(default_factory=list)
    champion: int | None = None


def _number(text: str) -> float | None:
    try:
        return float(text)
    except (TypeError, ValueError):
        return None


def history(rows: list[dict[str, Any]]) -> History:
    """The history of ``retrain status``'s rows (any order)."""
    rows = sorted(rows, key=lambda r: int(r["version"]))
    versions = [int(r["version"]) for r in rows]
    classes = sorted({c for r in rows for c in r.get("per_class", {})})
    return History(
        versions=versions, overall=[_number(r.get("mAP50-95", "")) for r in rows],
        per_class={c: [r.get("per_class", {}).get(c) for r in rows] for c in classes},
        promoted=[int(r["version"]) for r in rows if r.get("decision") == "promote"],
        champion=next((int(r["version"]) for r in rows if "champion" in r.get("aliases", [])), None))


def figure(h: History, name: str) -> Any:
    """The matplotlib figure: overall mAP50-95 (thick), each class (thin), promotions starred, the champion ringed."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(max(6.0, 0.5 * len(h.versions) + 3), 4.2))
    ax = fig.add_subplot()
    for cls, values in h.per_class.items():
        xs = [v for v, y in zip(h.versions, values, strict=True) if y is not None]
        ax.plot(xs, [y for y in values if y is not None], marker=".", lw=1, alpha=0.6, label=cls)
    by_version = {v: y for v, y in zip(h.versions, h.overall, strict=True) if y is not None}
    ax.plot(list(by_version), list(by_version.values()), marker="o", lw=2.5, color="black", label="overall", zorder=3)
    starred = [v for v in h.promoted if v in by_version]
    ax.scatter(starred, [by_version[v] for v in starred], marker="*", s=220, color="gold", edgecolor="black",
               zorder=4, label="promoted (champion moved)")
    if h.champion in by_version:
        ax.scatter([h.champion], [by_version[h.champion]], s=500, facecolor="none", edgecolor="red", lw=2, zorder=5,
                   label=f"champion now (v{h.champion})")
    ax.set(xlabel="registered version", ylabel="mAP50-95 (each on its evaluation's test images)",
           title=f"{name}: quality per version", xticks=h.versions)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()
    return fig


def save(rows: list[dict[str, Any]], name: str, out: Path) -> Path:
    """Draw ``rows`` (``retrain status``'s) to the PNG ``out``."""
    out.parent.mkdir(parents=True, exist_ok=True)
    figure(history(rows), name).savefig(out, dpi=110)
    return out
