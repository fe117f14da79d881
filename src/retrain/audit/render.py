"""``reports/audit/index.html``: the worst audited images, each drawn with its labels and the champion's boxes.

One self-contained page that opens offline: each image is a downscaled JPEG inside the page (a ``data:`` URI) with
the boxes drawn over it as inline SVG, and the style is inline.  Nothing is loaded from anywhere else: no scripts,
no fonts, no links to fetch.
"""

from __future__ import annotations

import base64
import html
import io
from collections.abc import Sequence
from typing import Any

from PIL import ImageOps

from retrain.audit.report import AuditReport, FlaggedImage
from retrain.data.master import Master
from retrain.safety import pil_open, safe_member

_WIDTH = 560  # pixels of a drawn image (longest side)
_STYLE = """body{font:14px system-ui,sans-serif;margin:2em;color:#222}table{border-collapse:collapse}
td,th{border:1px solid #ccc;padding:2px 8px;text-align:left}figure{display:inline-block;margin:0 1em 2em 0;
vertical-align:top}figcaption{max-width:560px}svg text{font:12px sans-serif}.label{stroke:#1a9e3f}
.pred{stroke:#1f5fd1;stroke-dasharray:5 3}.suspect{stroke:#e0211b;stroke-width:4}ul{margin:.3em 0}"""


def _thumbnail(master: Master, file_name: str) -> tuple[str, float]:
    """The image as a JPEG ``data:`` URI no larger than ``_WIDTH``, and its scale from the original pixels."""
    with open(safe_member(master.data_root, master.data_root, file_name), "rb") as f:
        img = ImageOps.exif_transpose(pil_open(io.BytesIO(f.read()))).convert("RGB")
    scale = min(1.0, _WIDTH / max(img.size))
    if scale < 1.0:
        img = img.resize((max(1, round(img.width * scale)), max(1, round(img.height * scale))))
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=85)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode(), scale


def _rect(bbox: Sequence[float], scale: float, cls: str, text: str) -> str:
    x, y, w, h = (v * scale for v in bbox)
    return (f'<rect class="{cls}" x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" fill="none" '
            f'stroke-width="2"><title>{html.escape(text)}</title></rect>'
            f'<text x="{x + 2:.1f}" y="{max(10.0, y - 2):.1f}" fill="{_COLOUR[cls]}">{html.escape(text)}</text>')


_COLOUR = {"label": "#1a9e3f", "pred": "#1f5fd1", "suspect": "#e0211b"}


def _figure(master: Master, image: dict[str, Any], entry: FlaggedImage, dets: list[dict[str, Any]]) -> str:
    uri, scale = _thumbnail(master, image["file_name"])
    names = dict(zip(master.category_ids, master.names, strict=True))
    w, h = round(image["width"] * scale), round(image["height"] * scale)
    shapes = [_rect(a["bbox"], scale, "label", names[a["category_id"]]) for a in master.doc["annotations"]
              if a["image_id"] == image["id"]]
    shapes += [_rect(d["bbox"], scale, "pred", f"{names[d['category_id']]} {d['score']:.2f}") for d in dets]
    shapes += [_rect(x.bbox, scale, "suspect", x.kind) for x in entry.issues]
    items = "".join(
        f"<li><b>{x.kind.replace('_', ' ')}</b>: label {html.escape(str(x.label or '-'))}, champion "
        f"{html.escape(str(x.predicted or '-'))}" + (f" ({x.confidence:.2f})" if x.confidence is not None else "")
        + f", box {[round(v) for v in x.bbox]}</li>" for x in entry.issues)
    return (f'<figure><svg width="{w}" height="{h}" viewBox="0 0 {w} {h}"><image href="{uri}" width="{w}" '
            f'height="{h}"/>{"".join(shapes)}</svg><figcaption><b>{html.escape(entry.file_name)}</b> (batch '
            f"{html.escape(entry.batch)}, {entry.split}) score {entry.score:.3g}<ul>{items}</ul></figcaption></figure>")


def page(report: AuditReport, master: Master, shown: list[dict[str, Any]], dets: list[dict[str, Any]]) -> str:
    """The page: what was audited, per batch, then the shown images worst first.

    Args:
        report: The audit.
        master: The master (images, boxes, class names).
        shown: The master images to draw, worst first (each is in ``report.flagged``).
        dets: The champion's confident boxes on them (COCO result dicts).
    """
    by_file = {f.file_name: f for f in report.flagged}
    rows = "".join(f"<tr><td>{html.escape(b)}</td><td>{r.images}</td><td>{r.flagged}</td>"
                   f"<td>{r.flagged_fraction:.1%}</td>" + "".join(f"<td>{r.issues[k]}</td>" for k in r.issues)
                   + f"<td>{'over the bound' if b in report.failed else ''}</td></tr>"
                   for b, r in report.batches.items())
    kinds = "".join(f"<th>{k.replace('_', ' ')}</th>" for k in report.kinds)
    notes = "".join(f"<p>{html.escape(n)}</p>" for n in report.notes)
    figures = "".join(_figure(master, im, by_file[im["file_name"]], [d for d in dets if d["image_id"] == im["id"]])
                      for im in shown)
    champion = f"champion version {report.champion}" if report.champion else "no champion"
    return (f"<!doctype html><html><head><meta charset=\"utf-8\"><title>retrain: label audit</title>"
            f"<style>{_STYLE}</style></head><body><h1>Label audit</h1><p>{champion}; master "
            f"{report.data_version[:12]}; confident at {report.confident:g}; level {report.level}, bound "
            f"{report.max_flagged_fraction:.0%} flagged per batch. Not audited (the champion trained on them): "
            f"{html.escape(', '.join(report.not_audited) or 'none')}.</p>{notes}"
            f"<table><tr><th>batch</th><th>images</th><th>flagged</th><th>share</th>{kinds}<th></th></tr>{rows}"
            f"</table><h2>The {len(shown)} worst of {len(report.flagged)} flagged images</h2>"
            f"<p>Green: the labels; blue dashed: the champion's confident boxes; red: the suspect boxes.</p>"
            f"{figures}</body></html>\n")
