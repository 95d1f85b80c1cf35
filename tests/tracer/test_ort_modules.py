"""ONNX Runtime runs read like the PyTorch model they came from: layers named by torch module
path with FLOPs, int8 copies paired with their fp32 origin.

A small ResNet from examples/models.py (widths 4…32, so ORT's NCHWc layout pads the stem's
4 channels to its block size) is exported with both torch exporters, quantized with
``quantize_dynamic``, and run in ORT inside an in-process session; the report's JSON data
and ``mltrace diff`` are checked as a user reads them.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
import torch

import mltrace
from mltrace.analysis.bottleneck import analyze
from mltrace.analysis.diff import ADDED, REMOVED, diff_runs
from mltrace.analysis.report_data import build_report
from mltrace.config import ProfileOptions
from mltrace.run.levels import Level
from mltrace.run.store import Run
from mltrace.tracer.session import Session
from mltrace.tracer.sources.onnxruntime import OrtSource

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "examples"))
from models import ResNet  # noqa: E402

IMAGE = np.random.default_rng(1).standard_normal((2, 3, 32, 32), dtype=np.float32)
RUNS = 2


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The model, per-call FLOPs of its Conv2d and Linear layers, and its ONNX files."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    torch.manual_seed(0)
    model = ResNet(widths=(4, 8, 16, 32), num_classes=10).eval()
    flops: dict[str, int] = {}

    def count(name: str) -> Any:
        def hook(module: Any, _inp: Any, out: torch.Tensor) -> None:
            w = module.weight
            # 2 · N · H_out · W_out · numel(W) for a Conv2d; 2 · batch · in · out for a Linear
            flops[name] = 2 * (out.numel() // out.shape[1]) * w.numel()

        return hook

    hooks = [
        module.register_forward_hook(count(name))
        for name, module in model.named_modules()
        if isinstance(module, (torch.nn.Conv2d, torch.nn.Linear))
    ]
    x = torch.from_numpy(IMAGE)
    with torch.no_grad():
        model(x)
    for hook in hooks:
        hook.remove()
    out = tmp_path_factory.mktemp("onnx")
    torch.onnx.export(model, (x,), str(out / "dynamo.onnx"), dynamo=True, external_data=False)
    torch.onnx.export(model, (x,), str(out / "legacy.onnx"), dynamo=False, input_names=["x"])
    for name in ("dynamo", "legacy"):
        quantize_dynamic(str(out / f"{name}.onnx"), str(out / f"{name}.int8.onnx"), weight_type=QuantType.QInt8)
    return {"model": model, "flops": flops, "dir": out}


def traced(tmp_path: Path, onnx_file: Path, opt: ort.GraphOptimizationLevel = ort.GraphOptimizationLevel.ORT_ENABLE_ALL) -> Run:
    options = ort.SessionOptions()
    options.graph_optimization_level = opt
    session = Session(ProfileOptions(output=tmp_path, summary=False), sources=[OrtSource()]).start()
    try:
        sess = ort.InferenceSession(str(onnx_file), options, providers=["CPUExecutionProvider"])
        for _ in range(RUNS):
            sess.run(None, {sess.get_inputs()[0].name: IMAGE})
    finally:
        path = session.stop()
    return mltrace.load_run(path)


@pytest.mark.parametrize("exporter", ["dynamo", "legacy"])
@pytest.mark.parametrize("opt", ["off", "all"])
def test_json_layers_by_module_path_with_flops(tmp_path: Path, models: dict[str, Any], exporter: str, opt: str) -> None:
    level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL if opt == "off" else ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    run = traced(tmp_path / "run", models["dir"] / f"{exporter}.onnx", level)
    report = build_report(run, analyze(run))
    layers = {entry["name"]: entry for entry in report["layers"]}
    # Every Conv2d and the Linear is a layer named by its torch path, with the FLOPs torch's
    # formula gives (the NCHWc stem runs with 16 padded channels; the count is the model's 4).
    for name, per_call in models["flops"].items():
        entry = layers.get(name)
        assert entry is not None, (name, sorted(layers))
        assert entry["calls"] == RUNS, entry
        assert entry["flops"] == RUNS * per_call, (name, entry["flops"], per_call)
        assert entry["bytes"] > 0
    # Containers as in the PyTorch run, and ORT's node names beneath them.
    assert {"layer1", "layer1.0", "layer4.1", "stem"} <= set(layers)
    assert layers["layer1"]["flops"] >= layers["layer1.0.conv1"]["flops"] + layers["layer1.1.conv2"]["flops"]
    nodes = [name for name in layers if name.startswith(("node_", "/")) or name.endswith("_nchwc")]
    assert nodes, sorted(layers)
    assert [m["name"] for m in report["models"]] == ["ResNet" if exporter == "dynamo" else exporter]
    if exporter == "dynamo":
        assert layers["layer1.0"]["type"] == "BasicBlock"


@pytest.mark.parametrize("exporter", ["dynamo", "legacy"])
def test_int8_copy_keeps_module_paths_and_diff_pairs_them(tmp_path: Path, models: dict[str, Any], exporter: str) -> None:
    fp32 = traced(tmp_path / "fp32", models["dir"] / f"{exporter}.onnx")
    int8 = traced(tmp_path / "int8", models["dir"] / f"{exporter}.int8.onnx")
    int8_layers = {entry["name"]: entry for entry in build_report(int8, analyze(int8))["layers"]}
    convs = [name for name in models["flops"] if name != "fc"]
    for name in convs:  # ConvInteger nodes: the module of their weight, FLOPs as in fp32
        assert name in int8_layers, (name, sorted(int8_layers))
        assert int8_layers[name]["flops"] == RUNS * models["flops"][name]
    d = diff_runs(fp32, int8)
    for name in [*convs, "layer1.0", "layer4"]:
        row = d.row("layers", name)
        assert row is not None and row.status not in (ADDED, REMOVED), (name, row)
    model_rows = [r for r in d.layers if r.calls_a and r.calls_b and r.name in ("ResNet", f"{exporter} → {exporter}.int8")]
    assert len(model_rows) == 1, [r.name for r in d.layers if r.status in (ADDED, REMOVED)]


@pytest.mark.parametrize("exporter", ["dynamo", "legacy"])
def test_layer_types_count_each_flop_once(tmp_path: Path, models: dict[str, Any], exporter: str) -> None:
    """The torch modules hold the ORT nodes that ran them: the "By layer type" table counts each
    node's FLOPs in its own type alone (a module type, ``Module`` for the legacy exporter's, holds
    none of them), so the column sums to the model's FLOPs, not to several times them."""
    run = traced(tmp_path / "run", models["dir"] / f"{exporter}.onnx")
    a = analyze(run)
    (model,) = [r for r in a.layers if r.stat.level is Level.MODEL]
    flops = {t.type: t.flops for t in a.types}
    assert sum(flops.values()) == pytest.approx(model.flops) and model.flops >= RUNS * sum(models["flops"].values())
    for container in ("Module", "Sequential", "BasicBlock", "Conv2d"):
        assert flops.get(container, 0) == 0, (container, flops)
    assert flops.get("Conv", 0) + flops.get("FusedConv", 0) > 0, flops
    assert [(t["type"], t["flops"]) for t in build_report(run, a)["types"]] == list(flops.items())
