#!/usr/bin/env bash
# A short prepared check of training on a lent CUDA GPU (under 4 minutes): bf16-mixed training of a few hundred
# steps of yolo11n and its throughput at imgsz 640, batch 64 (bench/gpu_check.py prints the figures as JSON), with
# what `precision: auto` and `runtime.compile: auto` chose there and why (`run --compile on` to compile: minutes).
#
#   bench/gpu_check.sh fetch    here, once: download the wheels the GPU machine lacks into .whl/ (git-ignored;
#                               that machine has torch, Lightning, OpenCV, pandas, but no PyPI access)
#   bench/gpu_check.sh          there: install .whl/ into /tmp/site, then run the check
#                               (with the device tool: carry [".whl"], command "bash bench/gpu_check.sh")
#   bench/gpu_check.sh smoke    anywhere: the same code on the CPU at a tiny size (tests the script)
set -euo pipefail
cd "$(dirname "$0")/.."
# Not there (all --no-deps): retrain's own needs beyond the machine's image, and ultralytics' small ones.
WHEELS=(ultralytics==8.4.190 ultralytics-thop==2.2.3 pycocotools==2.0.11 orjson==3.13.0 defusedxml==0.7.1
        pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5)

case "${1:-run}" in
  fetch)
    mkdir -p .whl
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      --platform any -d .whl "${WHEELS[@]}"
    ls -1 .whl
    ;;
  smoke)
    exec "${PYTHON:-.venv/bin/python}" bench/gpu_check.py --smoke
    ;;
  run)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
    if [ -d .whl ]; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
      export PYTHONPATH=/tmp/site:$PWD/src
    else
      export PYTHONPATH=$PWD/src
    fi
    export YOLO_OFFLINE=true YOLO_CONFIG_DIR=/tmp/ultralytics-config PYTHONUNBUFFERED=1
    out=${OUT:-/tmp}
    timeout 220 python3 bench/gpu_check.py --out "$out/gpu_check.json" "${@:2}"
    ;;
  *)
    echo "usage: bench/gpu_check.sh [fetch|smoke|run [gpu_check.py options]]" >&2
    exit 2
    ;;
esac
