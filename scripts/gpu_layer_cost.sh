#!/usr/bin/env bash
# The layer level's cost on a GPU (docs/PERFORMANCE.md, "The same on an H200"), in one run:
#
# 1. what one model call and one layer call cost the program's thread on this host's CPU
#    (`overhead.py --mode span-cost`), so the launch-bound share below can be read per call;
# 2. the layer level against plain in paired blocks on a ResNet-50 (batch 1, fp16,
#    channels_last) and a BERT-base-sized encoder (batch 8, fp16).
#
# Usage: scripts/gpu_layer_cost.sh [OUT_DIR]      (default: $OUT; PAIRS=150, ROUNDS=3)
#
# It runs with the interpreter in $PYTHON (default python3), which must import torch with
# CUDA; this checkout's src is put first on PYTHONPATH and its C helpers are built in place.
# Wheels in .whl/ (cupti-python, perfetto, orjson: none reaches the machine otherwise) are
# installed into a folder of their own first. Each step's output goes to OUT_DIR/<step>.log.
set -euo pipefail

OUT_DIR="${1:-${OUT:-}}"
if [[ -z "$OUT_DIR" ]]; then
    echo "gpu_layer_cost: give an output directory as \$1 or set \$OUT" >&2
    exit 2
fi
mkdir -p "$OUT_DIR"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
PAIRS="${PAIRS:-150}"
ROUNDS="${ROUNDS:-3}"
cd "$REPO"

SITE="$(mktemp -d "${TMPDIR:-/tmp}/mltrace-site.XXXXXX")"
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install --quiet --no-index --no-deps --target "$SITE" .whl/*.whl
fi
export PYTHONPATH="$SITE:$REPO/src${PYTHONPATH:+:$PYTHONPATH}"
"$PY" setup.py build_ext --inplace >"$OUT_DIR/build.log" 2>&1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT_DIR/gpu.txt"

run() {  # run NAME ARGS...: one step, its output kept, its failure named
    local name="$1"
    shift
    echo "== $name"
    if ! "$PY" "$@" >"$OUT_DIR/$name.log" 2>&1; then
        echo "gpu_layer_cost: $name failed (see $name.log)" >&2
        tail -n 20 "$OUT_DIR/$name.log" >&2
        return 1
    fi
    tail -n 12 "$OUT_DIR/$name.log"
}

run span-cost benchmarks/overhead.py --mode span-cost --rounds "$ROUNDS"
run layer-resnet50 benchmarks/overhead.py --mode layer-paired --device cuda --dtype float16 --model cnn \
    --cnn resnet50 --channels-last --batch 1 --pairs "$PAIRS"
run layer-encoder benchmarks/overhead.py --mode layer-paired --device cuda --dtype float16 --model encoder \
    --batch 8 --pairs "$PAIRS"
