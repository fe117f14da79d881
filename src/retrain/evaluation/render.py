"""``reports/eval.md`` (a table a person reads) and the PNG plots of an evaluation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from retrain.evaluation.report import EvalReport


def _num(v: float | None) -> str:
    return "n/a" if v is None or v < 0 else f"{v:.4f}"


def _signed(new: float | None, old: float | None) -> str:
    if new is None or old is None or new < 0 or old < 0:
        return ""
    return f"{new - old:+.4f}"


def markdown(report: EvalReport) -> str:
    """The evaluation as markdown: overall, val beside, per class, per object size, per origin batch, and the
    bootstrap interval."""
    cand = report.candidate.metrics
    champ = report.champion.metrics if report.champion else None
    title = f"champion (v{report.champion.version})" if report.champion else "champion (none yet)"
    split = report.split
    lines = [f"# Evaluation on {report.images} {split} images (data {report.data_version[:12]})", "",
             *[f"Note: {n}." for n in report.notes], *([""] if report.notes else []),
             f"The gate judges on the {split} split.", "",
             f"| metric | {title} | candidate | delta |", "|---|---:|---:|---:|"]
    for key, attr in (("mAP50-95", "map"), ("mAP50", "map50"), ("mAP75", "map75"), ("AR100", "ar100")):
        old = getattr(champ, attr) if champ else None
        new = getattr(cand, attr)
        lines.append(f"| {key} | {_num(old)} | {_num(new)} | {_signed(new, old)} |")
    if report.val is not None:
        v = report.val
        old_v = v.champion.map if v.champion else None
        lines.append(f"| mAP50-95 on the {v.images} val images (beside: val chose the candidate's checkpoint) | "
                     f"{_num(old_v)} | {_num(v.candidate.map)} | {_signed(v.candidate.map, old_v)} |")
    delta = report.delta
    if delta:
        lo, hi = delta.ci
        lines += ["", f"Paired bootstrap over {split} images ({delta.resamples} resamples): candidate - champion "
                  f"mAP50-95 {delta.map:+.4f}, {delta.confidence:.0%} interval [{lo:+.4f}, {hi:+.4f}]."]
    lines += ["", "## Per object size (AP50-95; COCO: small < 32x32 px, medium < 96x96, large)", "",
              f"| size | boxes | {title} | candidate | delta |", "|---|---:|---:|---:|---:|"]
    for size, new_s in cand.sizes.items():
        old_s = champ.sizes.get(size) if champ else None
        boxes = sum(c.get(size, 0) for c in report.size_instances.values())
        lines.append(f"| {size} | {boxes} | {_num(old_s)} | {_num(new_s)} | {_signed(new_s, old_s)} |")
    lines += ["", "## Per class (AP50-95; then small / medium / large)", "",
              f"| class | {split} boxes | {title} | candidate | delta | candidate small / medium / large |",
              "|---|---:|---:|---:|---:|---|"]
    for name, boxes in report.instances.items():
        old_ap = champ.per_class.get(name) if champ else None
        new_ap = cand.per_class.get(name)
        known = "" if not report.champion or name in report.champion.classes else " (new)"
        by_size = " / ".join(_num(v) for v in cand.per_class_size.get(name, {}).values())
        lines.append(f"| {name}{known} | {boxes} | {_num(old_ap)} | {_num(new_ap)} | {_signed(new_ap, old_ap)} | "
                     f"{by_size} |")
    lines += ["", f"## Per origin batch (mAP50-95 on its {split} images)", "",
              f"| batch | images | {title} | candidate | delta |", "|---|---:|---:|---:|---:|"]
    for name, sl in cand.slices.items():
        old_map = champ.slices[name].map if champ else None
        lines.append(f"| {name} | {sl.images} | {_num(old_map)} | {_num(sl.map)} | {_signed(sl.map, old_map)} |")
    return "\n".join(lines) + "\n"


def plots(report: EvalReport, champ_ev: Any, cand_ev: Any, folder: Path) -> list[Path]:
    """``per_class_ap.png`` (both models' AP50-95 per class) and ``pr_curve.png`` (precision-recall at IoU 0.5).

    Args:
        report: The evaluation report.
        champ_ev: The champion's ``COCOeval``, accumulated over all judged images (``None``: none, or no detections).
        cand_ev: The candidate's.
        folder: Where to write.

    Returns:
        The files written.
    """
    import matplotlib  # a second to import: only when plots are drawn, and its backend chosen before pyplot

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    names = list(report.instances)
    models = [("candidate", report.candidate.metrics, cand_ev)]
    if report.champion:
        models.insert(0, (f"champion v{report.champion.version}", report.champion.metrics, champ_ev))
    fig, ax = plt.subplots(figsize=(max(6.0, 0.6 * len(names) + 2), 4))
    width = 0.8 / len(models)
    x = np.arange(len(names))
    for i, (label, m, _) in enumerate(models):
        ax.bar(x + i * width - 0.4 + width / 2, [max(m.per_class.get(n, 0.0), 0.0) for n in names], width,
               label=label)
    ax.set_xticks(x, names, rotation=45 if len(names) > 8 else 0, ha="right" if len(names) > 8 else "center")
    ax.set_ylabel("AP50-95")
    ax.set_ylim(0, 1)
    ax.set_title(f"AP per class on the {report.split} images")
    ax.legend()
    fig.tight_layout()
    out = [folder / "per_class_ap.png"]
    fig.savefig(out[0], dpi=100)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(5, 4))
    for label, _, ev in models:
        recall = np.linspace(0, 1, 101)
        if ev is None:
            ax.plot(recall, np.zeros_like(recall), label=f"{label} (no detections)")
            continue
        p = ev.eval["precision"][0, :, :, 0, -1]  # IoU 0.5, area all, 100 detections
        valid = p[:, (p > -1).all(axis=0)]
        curve = valid.mean(axis=1) if valid.size else np.zeros(len(recall))
        ax.plot(recall, curve, label=label)
    ax.set_xlabel("recall")
    ax.set_ylabel("precision")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1.02)
    ax.set_title("Precision-recall at IoU 0.5 (mean over classes)")
    ax.legend()
    fig.tight_layout()
    out.append(folder / "pr_curve.png")
    fig.savefig(out[-1], dpi=100)
    plt.close(fig)
    return out
