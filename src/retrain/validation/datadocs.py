"""Make great-expectations' Data Docs work offline: vendored assets instead of CDN links.

GX's page templates load their scripts and styles from public CDNs (jQuery, Bootstrap, bootstrap-table, Vega,
Font Awesome) and its logo from S3.  Without network the index lists no validations (bootstrap-table builds
that table in the browser) and the pages are unstyled.  ``localize`` copies the assets shipped in
``datadocs_assets/`` into the site and rewrites each page's links to relative paths.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

ASSETS = Path(__file__).with_name("datadocs_assets")
VENDOR = Path("static") / "vendor"

# CDN address (a regex, matched inside src="..."/href="...") -> file under static/vendor/ (or the site's own
# static/ tree, for the logo GX also ships locally).
_LINKS: tuple[tuple[str, str], ...] = (
    (r"https://code\.jquery\.com/jquery-3\.7\.1\.min\.js", "vendor/jquery-3.7.1.min.js"),
    (r"https://maxcdn\.bootstrapcdn\.com/bootstrap/4\.3\.1/css/bootstrap\.min\.css", "vendor/bootstrap-4.3.1.min.css"),
    (r"https://stackpath\.bootstrapcdn\.com/bootstrap/4\.3\.1/js/bootstrap\.min\.js", "vendor/bootstrap-4.3.1.min.js"),
    (r"https://cdnjs\.cloudflare\.com/ajax/libs/popper\.js/1\.12\.9/umd/popper\.min\.js",
     "vendor/popper-1.12.9.min.js"),
    (r"https://unpkg\.com/bootstrap-table@1\.19\.[01]/dist/bootstrap-table\.min\.css",
     "vendor/bootstrap-table-1.19.1.min.css"),
    (r"https://unpkg\.com/bootstrap-table@1\.19\.[01]/dist/bootstrap-table\.min\.js",
     "vendor/bootstrap-table-1.19.1.min.js"),
    (r"https://unpkg\.com/bootstrap-table@1\.19\.[01]/dist/extensions/filter-control/"
     r"bootstrap-table-filter-control(\.min)?\.css", "vendor/bootstrap-table-filter-control-1.19.1.min.css"),
    (r"https://unpkg\.com/bootstrap-table@1\.19\.[01]/dist/extensions/filter-control/"
     r"bootstrap-table-filter-control(\.min)?\.js", "vendor/bootstrap-table-filter-control-1.19.1.min.js"),
    (r"https://cdnjs\.cloudflare\.com/ajax/libs/bootstrap-datepicker/1\.9\.0/css/bootstrap-datepicker\.min\.css",
     "vendor/bootstrap-datepicker-1.9.0.min.css"),
    (r"https://cdnjs\.cloudflare\.com/ajax/libs/bootstrap-datepicker/1\.9\.0/js/bootstrap-datepicker\.min\.js",
     "vendor/bootstrap-datepicker-1.9.0.min.js"),
    (r"https://cdnjs\.cloudflare\.com/ajax/libs/font-awesome/6\.6\.0/css/all\.min\.css",
     "vendor/fontawesome-6.6.0/css/all.min.css"),
    (r"https://cdn\.jsdelivr\.net/npm/@forevolve/bootstrap-dark@1\.1\.0/dist/css/bootstrap-prefers-dark\.css",
     "vendor/bootstrap-prefers-dark-1.1.0.min.css"),
    (r"https://cdn\.jsdelivr\.net/npm/vega@5", "vendor/vega-5.min.js"),
    (r"https://cdn\.jsdelivr\.net/npm/vega-lite@5", "vendor/vega-lite-5.min.js"),
    (r"https://cdn\.jsdelivr\.net/npm/vega-embed@6", "vendor/vega-embed-6.min.js"),
    (r"https://great-expectations-web-assets\.s3\.[a-z0-9-]+\.amazonaws\.com/logo-long\.png(\?[^\"']*)?",
     "images/logo-long.png"),
)
#: A link into the site's own static/ tree, at whatever depth GX wrote it (its validation pages, one folder deeper
#: than the others, point their favicon one level short).
_STATIC = re.compile(r"(?P<attr>(?:src|href)=[\"'])(?:\.\./)*static/")
_PATTERNS = [(re.compile(rf"(?P<attr>(?:src|href)=[\"']){pat}(?P<end>[\"'])"), target) for pat, target in _LINKS]
#: A script or stylesheet still loaded from the network (what ``remote_assets`` reports).
_REMOTE = re.compile(r"<script[^>]+src=[\"'](https?:[^\"']+)|<link[^>]+href=[\"'](https?:[^\"']+)[^>]*>|"
                     r"<img[^>]+src=[\"'](https?:[^\"']+)")


def localize(site: Path) -> int:
    """Copy the vendored assets into ``site``, point every HTML page at them, and fix GX's relative static links.

    Args:
        site: A built Data Docs site (holding ``index.html`` and ``static/``).

    Returns:
        How many links were rewritten.
    """
    shutil.copytree(ASSETS, site / VENDOR, dirs_exist_ok=True, ignore=shutil.ignore_patterns("README.md"))
    rewritten = 0
    for page in site.rglob("*.html"):
        static = Path(*[".."] * (len(page.relative_to(site).parts) - 1), "static").as_posix()
        text = page.read_text(encoding="utf-8")
        for pattern, target in _PATTERNS:
            text, n = pattern.subn(rf"\g<attr>{static}/{target}\g<end>", text)
            rewritten += n
        text = _STATIC.sub(rf"\g<attr>{static}/", text)
        page.write_text(text, encoding="utf-8")
    return rewritten


def remote_assets(site: Path) -> dict[str, list[str]]:
    """Scripts, stylesheets and images that pages of ``site`` still load from the network (page -> URLs)."""
    found: dict[str, list[str]] = {}
    for page in sorted(site.rglob("*.html")):
        urls = [next(g for g in m.groups() if g) for m in _REMOTE.finditer(page.read_text(encoding="utf-8"))]
        if urls:
            found[page.relative_to(site).as_posix()] = urls
    return found
