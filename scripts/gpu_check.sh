#!/usr/bin/env bash
# GPU check for mltrace's kernel level and hardware counters, on a machine with an NVIDIA GPU.
#
# Usage: scripts/gpu_check.sh [OUT_DIR]        (default: $OUT)
#
# 1. Installs into a venv (default .venv-gpu; PYTHON=/path/to/python with
#    GPU_CHECK_SKIP_INSTALL=1 to use an existing environment instead): mltrace
#    (editable, from this checkout), torch (PyPI's Linux wheels are CUDA
#    builds), nvidia-ml-py, and the cupti-python and cupy wheels of the
#    driver's CUDA major version. On a machine without a package index, use
#    GPU_CHECK_SKIP_INSTALL=1 PYTHON=python3 with mltrace and those packages
#    importable by it (e.g. PYTHONPATH=src:DIR_WITH_WHEELS_UNPACKED); its
#    first run, on an H100, used cupti-python 13.0.1 so.
# 2. Runs a CNN and a transformer on CUDA under `mltrace python --level kernel`,
#    twice: kernel path "kineto" (torch.profiler) and "cupti-python"
#    (MLTRACE_KERNEL_PATH=cupti-python), and checks model → layer → op → kernel
#    with launch flows, and the NVML counter tracks.
# 3. Runs the same models GPU_CHECK_EXIT_RUNS times (default 10) on each kernel
#    path and counts the runs whose exit status is not the script's 0 (an abort
#    at exit is status 134); any such run fails the check.
# 4. Runs a CuPy program (elementwise and cuBLAS kernels, memcpy, memset, a
#    CUDA graph) through cupti-python and checks kernels, flows, graph launches.
# 5. Prints the key counts and copies small fixtures into OUT_DIR: a Kineto
#    trace (.json.gz), the cupti-python records (JSON), NVML samples (JSON),
#    each run's run.json.
#
# It stops at the first error (set -euo pipefail), and every check that fails
# exits non-zero with a message saying which.
set -euo pipefail

OUT_DIR="${1:-${OUT:-}}"
if [[ -z "$OUT_DIR" ]]; then
    echo "gpu_check: give an output directory as \$1 or set \$OUT" >&2
    exit 2
fi
mkdir -p "$OUT_DIR"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
EXIT_RUNS="${GPU_CHECK_EXIT_RUNS:-10}"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/mltrace-gpu-check.XXXXXX")"
trap 'echo "gpu_check: FAILED (line $LINENO); work files kept in $WORK" >&2' ERR

echo "== GPU"
command -v nvidia-smi >/dev/null || { echo "gpu_check: nvidia-smi not found: no NVIDIA driver here" >&2; exit 1; }
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
CUDA_MAJOR="$(nvidia-smi | sed -n 's/.*CUDA Version: *\([0-9][0-9]*\)\..*/\1/p' | head -n1)"
[[ -n "$CUDA_MAJOR" ]] || { echo "gpu_check: could not read the driver's CUDA version from nvidia-smi" >&2; exit 1; }
echo "driver supports CUDA $CUDA_MAJOR"

if [[ "${GPU_CHECK_SKIP_INSTALL:-0}" == "1" ]]; then
    PY="${PYTHON:?set PYTHON to the interpreter to use with GPU_CHECK_SKIP_INSTALL=1}"
else
    VENV="${VENV:-$REPO/.venv-gpu}"
    echo "== installing into $VENV"
    python3 -m venv "$VENV"
    PY="$VENV/bin/python"
    "$PY" -m pip install --quiet --upgrade pip
    "$PY" -m pip install --quiet -e "$REPO" torch numpy nvidia-ml-py \
        "cupti-python==${CUDA_MAJOR}.*" "cupy-cuda${CUDA_MAJOR}x"
fi
"$PY" - <<'EOF'
import torch, cupy, pynvml
from cupti import cupti
assert torch.cuda.is_available(), "torch sees no CUDA device"
print("torch", torch.__version__, "CUDA", torch.version.cuda, torch.cuda.get_device_name(0))
print("cupy", cupy.__version__, "cupti.get_timestamp", cupti.get_timestamp())
pynvml.nvmlInit(); print("NVML GPUs:", pynvml.nvmlDeviceGetCount()); pynvml.nvmlShutdown()
EOF

cat > "$WORK/torch_models.py" <<'EOF'
"""A small CNN and a transformer encoder, inference on CUDA."""
import torch
from torch import nn

class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)
        self.bn = nn.BatchNorm2d(c)
        self.act = nn.ReLU()
    def forward(self, x):
        return self.act(self.bn(self.conv(x))) + x

class Cnn(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 32, 3, stride=2, padding=1), nn.ReLU())
        self.blocks = nn.Sequential(Block(32), Block(32))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(32, 10)
    def forward(self, x):
        return self.fc(torch.flatten(self.pool(self.blocks(self.stem(x))), 1))

dev = torch.device("cuda")
torch.manual_seed(0)
cnn = Cnn().to(dev).eval()
enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(128, 4, 256, batch_first=True), 2).to(dev).eval()
x = torch.randn(8, 3, 64, 64).to(dev)
t = torch.randn(4, 32, 128).to(dev)
with torch.no_grad():
    for _ in range(3):
        y = cnn(x)
        z = enc(t)
torch.cuda.synchronize()
print("cnn", tuple(y.shape), "transformer", tuple(z.shape))
EOF

cat > "$WORK/cupy_work.py" <<'EOF'
"""CuPy: elementwise and cuBLAS kernels, memcpy both ways, memset, a CUDA graph."""
import numpy as np
import cupy as cp

a = cp.asarray(np.arange(1 << 20, dtype=np.float32))   # HtoD memcpy
b = cp.zeros_like(a)                                    # memset
c = a * 2 + b                                           # elementwise kernels
m = cp.random.rand(256, 256, dtype=cp.float32)
p = m @ m                                               # cuBLAS GEMM
g1, g2 = cp.empty_like(m), cp.empty_like(m)            # allocated before capture: no cudaMalloc inside it
s = cp.cuda.Stream(non_blocking=True)
with s:
    s.begin_capture()
    cp.sin(m, out=g1)
    cp.cos(g1, out=g2)
    graph = s.end_capture()
graph.launch(stream=s)                                  # one cudaGraphLaunch, several kernels
s.synchronize()
print("sum", float(c.sum().get()), float(p.sum().get()), float(g2.sum().get()))  # DtoH memcpy
EOF

cat > "$WORK/check_run.py" <<'EOF'
"""Checks one run directory and prints its key counts. Usage: check_run.py RUN KIND EXPECTED_PATH"""
import json, sys
from collections import Counter
from mltrace import load_run
from mltrace.analysis.gpu import gpu_tables, is_gpu_activity
from mltrace.run.levels import Level

run_dir, kind, expected_path = sys.argv[1], sys.argv[2], sys.argv[3]
run = load_run(run_dir)
meta = run.meta
def fail(msg):
    sys.exit(f"gpu_check: {run_dir}: {msg}")
if not run.complete:
    fail("run is not complete")
levels = Counter(s.level.label for s in run.spans)
gpu = [s for s in run.spans if is_gpu_activity(s)]
acts = Counter(s.attrs["gpu.activity"] for s in gpu)
api = [s for s in run.spans if "cuda.api.name" in s.attrs]
launch_flows = [f for f in run.flows if f.kind == "launch"]
counters = Counter(run.tracks[c.track_id].name for c in run.counters)
by_id = run.span_by_id()
def ancestors(s):
    out, cur = [], by_id.get(s.parent_id)
    while cur is not None and len(out) < 256:
        out.append(cur.level)
        cur = by_id.get(cur.parent_id) if cur.parent_id is not None else None
    return out
kernels = [s for s in gpu if s.attrs["gpu.activity"] == "kernel"]
under_op = sum(Level.OP in ancestors(s) for s in kernels)
under_layer = sum(Level.LAYER in ancestors(s) for s in kernels)
print(f"-- {kind}: {run_dir}")
print("   kernel_path:", meta.get("kernel_path"), "| levels recorded:",
      {k: v["recorded"] for k, v in meta["levels"].items()})
print("   spans by level:", dict(levels))
print("   GPU activities:", dict(acts), "| API calls:", len(api), "| launch flows:", len(launch_flows))
print(f"   kernels under an op: {under_op}/{len(kernels)}, under a layer: {under_layer}/{len(kernels)}")
print("   counter samples:", dict(sorted(counters.items())))
if "cupti" in meta:
    c = meta["cupti"]
    print("   cupti clock:", c["clock"], "| launched:", c["gpu_activities_launched"], "/", c["gpu_activities"],
          "| unmatched:", c["unmatched_correlation_ids"], "| skipped:", c["skipped"])
if "torch_profiler" in meta:
    t = meta["torch_profiler"]
    print("   kineto: launched", t["gpu_activities_launched"], "/", t["gpu_activities"], "| unmatched:", t["unmatched_correlation_ids"])
print("   counters_summary:", json.dumps(meta.get("counters_summary", {}))[:600])
tables = gpu_tables(run)
for g in tables.layers[:5]:
    print(f"   layer {g.name}: gpu {g.gpu_inclusive_ns} ns incl, cpu {g.cpu_ns} ns, launches {g.launches}, top {g.top_kernels(2)}")
for k in tables.kernels[:5]:
    print(f"   kernel {k.name[:80]}: {k.count}x {k.total_ns} ns [{k.library}]")
if meta.get("kernel_path") != expected_path:
    fail(f"kernel_path is {meta.get('kernel_path')!r}, expected {expected_path!r}")
if not kernels:
    fail("no kernels recorded")
if len(launch_flows) < len(kernels) * 0.9:
    fail(f"only {len(launch_flows)} launch flows for {len(kernels)} kernels")
if not any(n.startswith("gpu0.") for n in counters):
    fail("no gpu0.* counter samples (NVML)")
if "cpu.utilization" not in counters:
    fail("no cpu.utilization samples")
if kind == "torch":
    for lv in ("model", "layer", "op", "kernel"):
        if not levels.get(lv):
            fail(f"no {lv} spans")
    if under_op < 0.9 * len(kernels) or under_layer < 0.9 * len(kernels):
        fail("kernels are not nested under ops and layers")
if kind == "cupy":
    if not acts.get("gpu_memcpy") or not acts.get("gpu_memset"):
        fail("no memcpy or memset recorded")
    graph = [s for s in kernels if "gpu.graph.id" in s.attrs]
    launchers = {by_id[s.parent_id].name for s in graph if s.parent_id in by_id}
    print(f"   graph kernels: {len(graph)}, launched by {sorted(launchers)}")
    if not graph:
        fail("no kernels from the CUDA graph")
EOF

run_mltrace() {  # run_mltrace NAME SCRIPT [ENV=VALUE ...]
    local name="$1" script="$2"
    shift 2
    (cd "$WORK" && env "$@" "$PY" -m mltrace python --level kernel -o "$WORK/$name" "$script")
}

echo "== torch on CUDA, kernels through Kineto"
run_mltrace torch-kineto "$WORK/torch_models.py"
"$PY" "$WORK/check_run.py" "$WORK/torch-kineto" torch kineto

echo "== torch on CUDA, kernels through cupti-python"
run_mltrace torch-cupti "$WORK/torch_models.py" MLTRACE_KERNEL_PATH=cupti-python MLTRACE_CUPTI_DUMP="$WORK/cupti_records_torch.json"
"$PY" "$WORK/check_run.py" "$WORK/torch-cupti" torch cupti-python

echo "== clean exits: each kernel path ${EXIT_RUNS} times (GPU_CHECK_EXIT_RUNS), 4 at a time"
exit_run() {  # exit_run PATH I: prints "PATH I STATUS FIRST_STDERR_LINE_ABOUT_IT"
    local path="$1" i="$2" dir="$WORK/exit-$1-$2" status=0
    (cd "$WORK" && env MLTRACE_KERNEL_PATH="$path" "$PY" -m mltrace python --level kernel -o "$dir/run" \
        "$WORK/torch_models.py" >"$dir.out" 2>"$dir.err") || status=$?
    echo "$path $i $status $(grep -m1 -i 'free\|corrupt\|abort\|segmentation' "$dir.err" | head -c 120)"
    [[ "$status" == 0 ]] && rm -rf "$dir" "$dir.out" "$dir.err"
    return 0
}
export -f exit_run
export WORK PY
for i in $(seq 1 "$EXIT_RUNS"); do printf 'kineto %s\ncupti-python %s\n' "$i" "$i"; done \
    | xargs -P 4 -L 1 bash -c 'exit_run "$0" "$1"' >"$WORK/exits.txt"
sort "$WORK/exits.txt"
cp "$WORK/exits.txt" "$OUT_DIR/exits.txt"
abnormal="$(awk '$3 != 0' "$WORK/exits.txt" | wc -l)"
echo "abnormal exits: $abnormal of $((2 * EXIT_RUNS))"
[[ "$abnormal" == 0 ]] || { echo "gpu_check: $abnormal traced runs did not exit with the script's status 0" >&2; false; }

echo "== CuPy through cupti-python"
run_mltrace cupy "$WORK/cupy_work.py" MLTRACE_KERNEL_PATH=cupti-python MLTRACE_CUPTI_DUMP="$WORK/cupti_records_cupy.json"
"$PY" "$WORK/check_run.py" "$WORK/cupy" cupy cupti-python

echo "== fixtures"
(cd "$WORK" && "$PY" - "$OUT_DIR" <<'EOF'
"""A Kineto trace of the same models (with_modules), and NVML samples of the torch run."""
import gzip, json, runpy, shutil, sys
from pathlib import Path
import torch
from torch.profiler import ProfilerActivity, profile
from mltrace import load_run

out = Path(sys.argv[1])
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True, with_stack=True, with_modules=True) as prof:
    runpy.run_path("torch_models.py", run_name="__main__")
prof.export_chrome_trace("kineto_cuda_models.json")
with open("kineto_cuda_models.json", "rb") as f, gzip.open(out / "kineto_cuda_models.json.gz", "wb") as g:
    shutil.copyfileobj(f, g)
run = load_run("torch-kineto")
samples = {}
for c in run.counters:
    t = run.tracks[c.track_id]
    samples.setdefault(t.name, {"unit": t.unit, "device": t.device, "samples": []})["samples"].append([c.ts_ns, c.value])
(out / "nvml_samples.json").write_text(json.dumps({"interval_s": run.meta["sources"]["nvml"]["interval_s"], "counters": samples}))
print("kineto trace:", (out / "kineto_cuda_models.json.gz").stat().st_size, "bytes gz;", "NVML counters:", len(samples))
EOF
)
gzip -c "$WORK/cupti_records_cupy.json" > "$OUT_DIR/cupti_records_cupy.json.gz"
gzip -c "$WORK/cupti_records_torch.json" > "$OUT_DIR/cupti_records_torch.json.gz"
for r in torch-kineto torch-cupti cupy; do
    cp "$WORK/$r/run.json" "$OUT_DIR/run-$r.json"
done
ls -l "$OUT_DIR"
trap - ERR
rm -rf "$WORK"
echo "gpu_check: OK"
