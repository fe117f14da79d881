#!/usr/bin/env bash
# Screenshot the great-expectations Data Docs of a workspace in headless Chromium (Debian's `chromium`).
# Usage: bench/datadocs_screenshot.sh WORKSPACE [OUT.png]
# Opens WORKSPACE/reports/validation/index.html and the validation page of the box table, as a person would.
set -euo pipefail
ws=$(cd "${1:?workspace}" && pwd)
out=${2:-bench/out/datadocs.png}
mkdir -p "$(dirname "$out")"
command -v chromium >/dev/null || { echo "chromium is not installed: apt-get install chromium" >&2; exit 2; }
docs="$ws/reports/validation"
[ -f "$docs/index.html" ] || { echo "$docs/index.html not found: run 'retrain validate' first" >&2; exit 2; }
page=$(find "$docs/validations/retrain-boxes" -name '*.html' | sort | tail -n 1)
profile=$(mktemp -d)
trap 'rm -rf "$profile"' EXIT
shoot() {
  chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run --disable-background-networking \
    --disable-component-update --disable-sync --user-data-dir="$profile" --hide-scrollbars \
    --window-size=1400,1600 --screenshot="$2" "file://$1" >/dev/null 2>&1
  [ -s "$2" ] || { echo "no screenshot written for $1" >&2; exit 1; }
  echo "$2"
}
shoot "$docs/index.html" "$out"
shoot "$page" "${out%.png}-boxes.png"
