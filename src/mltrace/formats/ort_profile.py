"""ONNX Runtime profiles and ONNX graphs → mltrace events (pure functions).

``ort_profile_to_events`` turns the Chrome-trace JSON that ORT's profiler
(``SessionOptions.enable_profiling``) writes per session into model, node, kernel
and GPU spans; ``read_onnx_graph`` reads an ONNX model's nodes with a small
protobuf reader (no ``onnx`` package; weights skipped) so that ``TorchModuleMapper``
can map ORT's node names back to the PyTorch modules they were exported from.
tests/data/onnxruntime/ holds real profiles (ORT 1.31) of the shapes read here.
"""

from __future__ import annotations

import ast
import bisect
import json
import mmap
import os
import re
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mltrace.formats.onnx_flops import CONV_OPS, onnx_flops
from mltrace.run.events import Event, Instant, Span, Track
from mltrace.run.levels import Level
from mltrace.tracer.tracks import TrackRegistry

#: ORT's fixed cap on recorded events per profiling session (``Profiler::global_max_num_events_``):
#: later events are dropped with only a log line, so a profile holding that many was cut short.
ORT_MAX_EVENTS = 1_000_000

#: Profile event names of the session category that become USER spans (the category also holds
#: ``model_run``, one per ``run``, and ``SequentialExecutor::Execute`` inside it).
SESSION_EVENTS = frozenset({"model_loading_uri", "model_loading_array", "model_loading_from_saved_proto", "session_initialization"})

# Node events are named ``<node name>_kernel_time``; some providers add ``_fence_before`` / ``_fence_after``.
_KERNEL_TIME = "_kernel_time"
_FENCES = ("_fence_before", "_fence_after")

#: ONNX tensor element type names (as ORT prints them) → the names torch and numpy use.
_DTYPES = {
    "float": "float32",
    "double": "float64",
    "float16": "float16",
    "bfloat16": "bfloat16",
    "int8": "int8",
    "int16": "int16",
    "int32": "int32",
    "int64": "int64",
    "uint8": "uint8",
    "uint16": "uint16",
    "uint32": "uint32",
    "uint64": "uint64",
    "bool": "bool",
    "string": "string",
}

#: Op types of fused kernels → the op type of the node whose name they keep.
_FUSED_BASE = {"FusedConv": "Conv", "FusedGemm": "Gemm", "FusedMatMul": "MatMul", "NhwcFusedConv": "Conv", "QLinearConv": "Conv"}


# -- ONNX graph (protobuf wire format) ------------------------------------------


@dataclass(frozen=True, slots=True)
class OnnxNode:
    """One node of an ONNX graph, as far as tracing needs it.

    Attributes:
        name: the node's name (may be empty in hand-made graphs).
        op_type: the operator (``"Conv"``).
        inputs: names of its input values.
        outputs: names of its output values.
        metadata: its ``metadata_props`` (key → value).
    """

    name: str
    op_type: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    metadata: Mapping[str, str]


@dataclass
class OnnxGraph:
    """The nodes of a model (subgraphs of If/Loop/Scan included).

    Attributes:
        graph_name: the main graph's name (``"main_graph"``).
        producer_name: who wrote the model (``"pytorch"``).
        producer_version: its version (``"2.13.0+cpu"``).
        nodes: node name → node.
        producer_of: value name → name of the node that outputs it.
        model_metadata: the model's own ``metadata_props``.
        torch_metadata: some node carries ``pkg.torch.onnx.*`` metadata.
        initializer_dims: initializer (weight) name → its shape, as exported (ORT may
            pad a weight's channels for its NCHWc layout; these are the model's).
    """

    graph_name: str = ""
    producer_name: str = ""
    producer_version: str = ""
    nodes: dict[str, OnnxNode] = field(default_factory=dict)
    producer_of: dict[str, str] = field(default_factory=dict)
    model_metadata: dict[str, str] = field(default_factory=dict)
    torch_metadata: bool = False
    initializer_dims: dict[str, tuple[int, ...]] = field(default_factory=dict)

    @property
    def from_pytorch(self) -> bool:
        """Whether the model came from ``torch.onnx.export``: written by it, or by a tool
        that kept its node metadata, or quantized by ONNX Runtime's quantizer
        (``onnx.quantize``) from a graph named as torch names its exports (``main_graph``)."""
        if self.producer_name == "pytorch" or self.torch_metadata:
            return True
        return self.producer_name.startswith("onnx.quantize") and self.graph_name == "main_graph"

    def torch_root_class(self) -> str | None:
        """The exported ``nn.Module``'s class name (``"ResNet"``), from node metadata.

        Private names (``_empty_nn_module_stack_from_metadata_hook``, a helper of
        torch.export's dynamic-shape path) are never taken for the model's.
        """
        for node in self.nodes.values():
            classes = _literal_list(node.metadata.get("pkg.torch.onnx.class_hierarchy"))
            if classes:
                name = classes[0].rsplit(".", 1)[-1]
                if name and not name.startswith("_"):
                    return name
        return None


def _varint(buf: Any, pos: int) -> tuple[int, int]:
    result = 0
    shift = 0
    while True:
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos
        shift += 7
        if shift > 70:
            raise ValueError("malformed protobuf varint")


def _fields(buf: Any, start: int, end: int) -> Iterator[tuple[int, int, int, int]]:
    """Yields ``(field number, wire type, a, b)``: for length-delimited fields
    the payload is ``buf[a:b]``; for varints ``a`` is the value."""
    pos = start
    while pos < end:
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
            yield number, wire, value, 0
        elif wire == 2:
            length, pos = _varint(buf, pos)
            if pos + length > end:
                raise ValueError("truncated protobuf field")
            yield number, wire, pos, pos + length
            pos += length
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
    if pos != end:
        raise ValueError("truncated protobuf message")


def _text(buf: Any, a: int, b: int) -> str:
    return bytes(buf[a:b]).decode("utf-8", "replace")


def _string_map(buf: Any, a: int, b: int) -> tuple[str, str]:
    key = value = ""
    for number, wire, x, y in _fields(buf, a, b):
        if wire == 2 and number == 1:
            key = _text(buf, x, y)
        elif wire == 2 and number == 2:
            value = _text(buf, x, y)
    return key, value


def _read_graph(buf: Any, start: int, end: int, graph: OnnxGraph, depth: int) -> str:
    name = ""
    for number, wire, a, b in _fields(buf, start, end):
        if wire != 2:
            continue
        if number == 1:  # NodeProto node
            _read_node(buf, a, b, graph, depth)
        elif number == 2:
            name = _text(buf, a, b)
        elif number == 5:  # TensorProto initializer: its name and dims, never its data
            _read_initializer(buf, a, b, graph)
        # initializer (5), inputs/outputs (11, 12), value_info (13), …: not needed
    return name


def _read_initializer(buf: Any, start: int, end: int, graph: OnnxGraph) -> None:
    dims: list[int] = []
    name = ""
    for number, wire, a, b in _fields(buf, start, end):
        if number == 1 and wire == 0:
            dims.append(a)
        elif number == 1 and wire == 2:  # packed dims
            pos = a
            while pos < b:
                value, pos = _varint(buf, pos)
                dims.append(value)
        elif number == 8 and wire == 2:
            name = _text(buf, a, b)
    if name:
        graph.initializer_dims[name] = tuple(dims)


def _read_node(buf: Any, start: int, end: int, graph: OnnxGraph, depth: int) -> None:
    inputs: list[str] = []
    outputs: list[str] = []
    name = op_type = ""
    meta: dict[str, str] = {}
    subgraphs: list[tuple[int, int]] = []
    for number, wire, a, b in _fields(buf, start, end):
        if wire != 2:
            continue
        if number == 1:
            inputs.append(_text(buf, a, b))
        elif number == 2:
            outputs.append(_text(buf, a, b))
        elif number == 3:
            name = _text(buf, a, b)
        elif number == 4:
            op_type = _text(buf, a, b)
        elif number == 9:  # metadata_props
            k, v = _string_map(buf, a, b)
            meta[k] = v
        elif number == 5 and depth < 8:  # AttributeProto
            subgraphs.extend(_attribute_subgraphs(buf, a, b))
    _add_node(graph, OnnxNode(name, op_type, tuple(inputs), tuple(outputs), meta))
    for a, b in subgraphs:
        _read_graph(buf, a, b, graph, depth + 1)


def _attribute_subgraphs(buf: Any, start: int, end: int) -> list[tuple[int, int]]:
    """The byte ranges of the graphs an ``AttributeProto`` holds (``g`` = 6, ``graphs`` = 11: If, Loop, Scan)."""
    return [(a, b) for number, wire, a, b in _fields(buf, start, end) if wire == 2 and number in (6, 11)]


def _add_node(graph: OnnxGraph, node: OnnxNode) -> None:
    if any(k.startswith("pkg.torch.onnx.") for k in node.metadata):
        graph.torch_metadata = True
    if node.name:
        graph.nodes.setdefault(node.name, node)
        for out in node.outputs:
            if out:
                graph.producer_of.setdefault(out, node.name)


def parse_onnx_graph(data: bytes | memoryview) -> OnnxGraph:
    """Reads node names, types, value names and metadata from a serialized ``ModelProto``.

    Args:
        data: the model file's bytes (weights in it are skipped, not copied).

    Returns:
        The graph's nodes.

    Raises:
        ValueError: if the bytes are not a well-formed ONNX model.
    """
    graph = OnnxGraph()
    buf = memoryview(data)
    try:
        for number, wire, a, b in _fields(buf, 0, len(buf)):
            if wire != 2:
                continue
            if number == 2:
                graph.producer_name = _text(buf, a, b)
            elif number == 3:
                graph.producer_version = _text(buf, a, b)
            elif number == 7:
                graph.graph_name = _read_graph(buf, a, b, graph, 0)
            elif number == 14:
                k, v = _string_map(buf, a, b)
                graph.model_metadata[k] = v
    except IndexError:
        raise ValueError("truncated protobuf data") from None
    finally:
        buf.release()
    return graph


def read_onnx_graph(source: str | os.PathLike[str] | bytes) -> OnnxGraph:
    """Reads an ONNX model's graph from a file (memory-mapped) or from bytes.

    Raises:
        ValueError: if the data is not a well-formed ONNX model.
        OSError: if the file cannot be read.
    """
    if isinstance(source, (bytes, bytearray, memoryview)):
        return parse_onnx_graph(source)
    with open(source, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            raise ValueError("empty model file")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            return parse_onnx_graph(mm)  # type: ignore[arg-type]


# -- ONNX nodes → torch modules --------------------------------------------------


@dataclass(frozen=True, slots=True)
class TorchOrigin:
    """Where an ORT node came from in the exported PyTorch model.

    Attributes:
        module_path: the module's qualified path (``"layer1.0.conv1"``; ``""``
            is the root module).
        module_class: the module's class (``"torch.nn.modules.conv.Conv2d"``) when known.
        how: how it was found: ``"metadata"`` (the exporter's node metadata),
            ``"scope_name"`` (a TorchScript-exporter node name), ``"parameter"``
            (the module owning the node's weight, ``stem.0.weight`` → ``stem.0``),
            ``"fused"``
            (an ORT node named after an original node or value; the name the
            fused node kept decides), or ``"neighbours"`` (an ORT-made node:
            the common module of the mapped nodes executed around it).
        onnx_node: the original ONNX node it maps to, if any.
        file: the user's source file that called the op (from the exporter's
            ``pkg.torch.onnx.stack_trace``: the innermost frame outside torch).
        line: the line in that file.
    """

    module_path: str
    module_class: str | None
    how: str
    onnx_node: str | None = None
    file: str | None = None
    line: int | None = None


def _literal_list(text: str | None) -> list[str] | None:
    if not text:
        return None
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return None
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return list(value)
    return None


def origin_from_metadata(metadata: Mapping[str, str]) -> tuple[str, str | None] | None:
    """The module path and class from a node's ``torch.onnx`` (dynamo) metadata.

    ``torch.onnx.export(dynamo=True)`` (the default since torch 2.9) writes per node
    ``pkg.torch.onnx.name_scopes``: module paths from the root, then the FX node
    (``['', 'layer1', 'layer1.0', 'layer1.0.conv1', 'conv2d_1']``); the module is the
    last scope before the FX node. ``class_hierarchy`` gives the classes alike.

    Returns:
        ``(module_path, module_class)`` or None when the node has no such metadata.
    """
    scopes = _literal_list(metadata.get("pkg.torch.onnx.name_scopes"))
    if scopes:
        classes = _literal_list(metadata.get("pkg.torch.onnx.class_hierarchy"))
        if len(scopes) == 1:
            return "", (classes[0] if classes else None)
        cls = classes[-2] if classes and len(classes) == len(scopes) else None
        return scopes[-2], cls
    namespace = metadata.get("namespace")
    if namespace:
        # ": models.ResNet/layer1: torch.nn.modules.container.Sequential/…/conv2d: aten.conv2d.default"
        parts = [p.split(": ", 1) for p in namespace.split("/")]
        if len(parts) >= 2 and all(len(p) == 2 for p in parts):
            name, cls = parts[-2]
            return name, cls
    return None


_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+)')
_TORCH_PKG = f"{os.sep}torch{os.sep}"


def source_of_stack_trace(text: str | None) -> tuple[str, int] | None:
    """The innermost frame outside torch in a ``pkg.torch.onnx.stack_trace`` value.

    The exporter records the Python stack of the op's call, outermost first
    (``File "/srv/models.py", line 29, in forward``); frames inside the torch
    package (``nn/modules/conv.py``) are skipped, so the result is the line of
    the model's own ``forward`` that issued the op.
    """
    if not text:
        return None
    found: tuple[str, int] | None = None
    for m in _FRAME.finditer(text):
        if _TORCH_PKG not in m.group("file"):
            found = (m.group("file"), int(m.group("line")))
    return found


_REPEAT_SUFFIX = re.compile(r"(.+)_(\d+)\Z")
#: What ORT's quantizer appends to a weight's name (``stem.0.weight_quantized``,
#: ``fc.weight_DequantizeLinear_Output``).
_QUANT_VALUE_SUFFIX = re.compile(r"(_quantized|_DequantizeLinear_Output|_dequantized)\Z")
_PARAMETER = re.compile(r"(?P<path>[A-Za-z_][\w]*(\.\w+)*)\.(weight|bias)\Z")


def module_of_parameter(value: str) -> str | None:
    """The module owning a weight or bias, from the value's name: ``layer1.0.conv1.weight``,
    ``stem.0.weight_quantized`` or ``fc.weight_DequantizeLinear_Output`` → its module path."""
    m = _PARAMETER.match(_QUANT_VALUE_SUFFIX.sub("", value))
    return m.group("path") if m is not None else None


def _parent_path(path: str) -> str:
    return path.rsplit(".", 1)[0] if "." in path else ""


def scope_prefixes(node_names: list[str]) -> frozenset[str]:
    """Every scope prefix (``"/layer1/layer1.0/relu"``) of TorchScript-exporter node names."""
    out: set[str] = set()
    for name in node_names:
        if not name.startswith("/"):
            continue
        parts = name.split("/")[1:-1]
        for i in range(1, len(parts) + 1):
            out.add("/" + "/".join(parts[:i]))
    return frozenset(out)


def origin_from_scope_name(name: str, known_scopes: frozenset[str] = frozenset()) -> str | None:
    """The module path encoded in a TorchScript-exporter node name (``dynamo=False``: no node metadata).

    ``/layer1/layer1.0/conv1/Conv`` → ``layer1.0.conv1``;
    ``/layer2/layer2.0/downsample/downsample.0/Conv`` → ``layer2.0.downsample.0``;
    ``/encoder/layers.0/self_attn/MatMul`` → ``encoder.layers.0.self_attn``;
    ``/Flatten`` → ``""`` (the root module). A scope ``relu_1`` whose plain
    form ``relu`` is among ``known_scopes`` is the module's second call.

    Returns:
        The module path, or None if the name is not scoped.
    """
    if not name.startswith("/") or name.endswith("/"):
        return None
    comps = name.split("/")[1:-1]
    if any(not c for c in comps):
        return None
    path = ""
    last = ""
    raw = ""
    for comp in comps:
        m = _REPEAT_SUFFIX.match(comp)
        if m is not None and f"{raw}/{m.group(1)}" in known_scopes:
            raw_comp = m.group(1)
        else:
            raw_comp = comp
        raw = f"{raw}/{comp}"
        if last and raw_comp.startswith(last + "."):
            # "layer1" then "layer1.0": the child is named with its parent's name
            path = path[: len(path) - len(last)] + raw_comp
        else:
            path = f"{path}.{raw_comp}" if path else raw_comp
        last = raw_comp
    return path


def common_module(a: str, b: str) -> str:
    """The deepest module containing both paths (``"layer1.0.conv1"``, ``"layer1.1"`` → ``"layer1"``)."""
    pa, pb = a.split(".") if a else [], b.split(".") if b else []
    out: list[str] = []
    for x, y in zip(pa, pb):
        if x != y:
            break
        out.append(x)
    return ".".join(out)


_FUSION_SEGMENT = re.compile(r"[A-Za-z0-9]*Fusion\Z")
_NAME_SUFFIXES = (
    re.compile(r"_nchwc\Z"),
    re.compile(r"_new_reshape\Z"),
    re.compile(r"_token_\d+\Z"),
    re.compile(r"_output_\d+\Z"),
    # ORT's dynamic quantizer: node_Conv_3_quant_output_scale_mul, getitem_output_quantized_cast
    re.compile(r"_(output_scale|scales)_mul\Z"),
    re.compile(r"_cast\Z"),
)


def name_candidates(name: str) -> list[str]:
    """Original node or value names an ORT node name may be derived from, best first.

    After optimisation ORT keeps a fused node's name (a Conv+Relu ``FusedConv`` is
    ``node_Conv_292``) or derives one: ``<value>_nchwc`` for NCHWc layout nodes (the
    original output's name), ``<node>/MatMulAddFusion`` for rewrites, ``…_token_<n>``
    for generated nodes.
    ``node_MatMul_73/MatMulScaleFusion//MatmulTransposeFusion/`` → ``node_MatMul_73``;
    ``relu_nchwc`` → ``relu``; ``/stem/stem.2/Relu_output_0_nchwc`` →
    ``/stem/stem.2/Relu_output_0``, ``/stem/stem.2/Relu``.
    """
    out = [name]
    parts = name.split("/")
    while len(parts) > 1 and (parts[-1] == "" or _FUSION_SEGMENT.match(parts[-1])):
        parts.pop()
    current = "/".join(parts)
    if current != name:
        out.append(current)
    changed = True
    while changed:
        changed = False
        for suffix in _NAME_SUFFIXES:
            stripped = suffix.sub("", current)
            if stripped != current and stripped:
                current = stripped
                out.append(current)
                changed = True
    return out


class TorchModuleMapper:
    """Maps ORT node names (before or after graph optimisation) to torch modules.

    Args:
        graph: the model's graph as exported (see ``read_onnx_graph``).
    """

    def __init__(self, graph: OnnxGraph) -> None:
        self.graph = graph
        self._scopes = scope_prefixes(list(graph.nodes)) if graph.from_pytorch else frozenset()
        self._cache: dict[tuple[str, str], TorchOrigin | None] = {}
        self._classes: dict[str, str] | None = None

    @property
    def module_classes(self) -> dict[str, str]:
        """Module path → class (``"layer1.0"`` → ``"models.BasicBlock"``), from the dynamo
        exporter's ``name_scopes`` and ``class_hierarchy`` (empty for other exports)."""
        if self._classes is None:
            self._classes = {}
            for node in self.graph.nodes.values():
                if "pkg.torch.onnx.class_hierarchy" not in node.metadata:
                    continue
                scopes = _literal_list(node.metadata.get("pkg.torch.onnx.name_scopes")) or []
                classes = _literal_list(node.metadata.get("pkg.torch.onnx.class_hierarchy")) or []
                if len(scopes) == len(classes):
                    for path, cls in zip(scopes[1:-1], classes[1:-1]):
                        self._classes.setdefault(path, cls)
        return self._classes

    def origin_of_node(self, node: OnnxNode) -> TorchOrigin | None:
        """The origin of an original ONNX node: its weight's module where that agrees with
        the metadata, else the metadata, then its scoped name, then its weight's module.

        A Conv exported with its BatchNorm folded in carries the BatchNorm's scope
        (``stem.1``) but the Conv's weight (``stem.0.weight``): the weight decides, so
        the node lands on the Conv2d as in the PyTorch run, and on the same module as
        the quantized copy of it, which keeps the weight's name and loses the metadata.
        """
        param = next((p for p in map(module_of_parameter, node.inputs[1:]) if p is not None), None)
        found = origin_from_metadata(node.metadata)
        if found is not None:
            src = source_of_stack_trace(node.metadata.get("pkg.torch.onnx.stack_trace"))
            scopes = _literal_list(node.metadata.get("pkg.torch.onnx.name_scopes")) or []
            if param is not None and param != found[0] and _parent_path(param) in scopes:
                return TorchOrigin(param, None, "parameter", node.name, *(src or (None, None)))
            return TorchOrigin(found[0], found[1], "metadata", node.name, *(src or (None, None)))
        if self.graph.from_pytorch:
            path = origin_from_scope_name(node.name, self._scopes)
            if path is not None:
                return TorchOrigin(path, None, "scope_name", node.name)
            if param is not None:
                return TorchOrigin(param, None, "parameter", node.name)
        return None

    def _find(self, name: str) -> OnnxNode | None:
        for cand in name_candidates(name):
            node = self.graph.nodes.get(cand)
            if node is not None:
                return node
            producer = self.graph.producer_of.get(cand)
            if producer is not None:
                return self.graph.nodes.get(producer)
        return None

    def _upstream(self, node: OnnxNode, op_type: str, depth: int = 3) -> OnnxNode | None:
        """The nearest node of ``op_type`` feeding ``node`` (ORT fused it into its successor)."""
        frontier = [node]
        seen = {node.name}
        for _ in range(depth):
            nxt: list[OnnxNode] = []
            for n in frontier:
                for value in n.inputs:
                    pname = self.graph.producer_of.get(value)
                    if pname is None or pname in seen:
                        continue
                    seen.add(pname)
                    p = self.graph.nodes[pname]
                    if p.op_type == op_type:
                        return p
                    nxt.append(p)
            frontier = nxt
        return None

    def original_node(self, ort_name: str, op_type: str) -> tuple[OnnxNode, bool] | None:
        """The exported node ORT ran as ``ort_name`` with kernel ``op_type``, and whether
        ORT renamed it (fused or relaid it); None for a node ORT made up."""
        node = self.graph.nodes.get(ort_name)
        if node is not None:
            return node, False
        node = self._find(ort_name)
        if node is None:
            return None
        base = _FUSED_BASE.get(op_type, op_type)
        if node.op_type != base:
            upstream = self._upstream(node, base)
            if upstream is not None:
                node = upstream
        return node, True

    def weight_dims(self, ort_name: str, op_type: str) -> tuple[int, ...] | None:
        """The exported shape of the weight of the node ORT ran as ``ort_name`` (a Conv's
        ``W``), or None when it is not an initializer of the graph."""
        found = self.original_node(ort_name, op_type)
        if found is None:
            return None
        node = found[0]
        at = 3 if node.op_type == "QLinearConv" else 1
        return self.graph.initializer_dims.get(node.inputs[at]) if len(node.inputs) > at else None

    def resolve(self, ort_name: str, op_type: str) -> TorchOrigin | None:
        """The torch module of the node ORT ran as ``ort_name`` with kernel ``op_type``.

        Returns:
            The origin, or None when the name leads to no original node (a node
            ORT made up, such as ``ReorderOutput``; see ``fill_from_neighbours``).
        """
        key = (ort_name, op_type)
        if key in self._cache:
            return self._cache[key]
        result: TorchOrigin | None = None
        found = self.original_node(ort_name, op_type)
        if found is not None:
            node, renamed = found
            result = self.origin_of_node(node)
            if renamed and result is not None:
                result = TorchOrigin(result.module_path, result.module_class, "fused", node.name, result.file, result.line)
        self._cache[key] = result
        return result


def fill_from_neighbours(origins: list[TorchOrigin | None]) -> list[TorchOrigin | None]:
    """Gives nodes without an origin the common module of the mapped nodes around them.

    ``origins`` are in execution order (one run). A node ORT created
    (``ReorderOutput``, ``SkipLayerNormalization``, ``gemm_input_reshape``)
    between nodes of ``encoder.layers.0.self_attn`` and
    ``encoder.layers.0.linear1`` gets ``encoder.layers.0``. Nodes with a
    mapped neighbour on one side only stay unmapped.
    """
    n = len(origins)
    prev: list[TorchOrigin | None] = [None] * n
    nxt: list[TorchOrigin | None] = [None] * n
    last: TorchOrigin | None = None
    for i in range(n):
        prev[i] = last
        o = origins[i]
        if o is not None and o.how != "neighbours":
            last = o
    last = None
    for i in range(n - 1, -1, -1):
        nxt[i] = last
        o = origins[i]
        if o is not None and o.how != "neighbours":
            last = o
    out = list(origins)
    for i in range(n):
        before, after = prev[i], nxt[i]
        if out[i] is None and before is not None and after is not None:
            out[i] = TorchOrigin(common_module(before.module_path, after.module_path), None, "neighbours")
    return out


# -- profile JSON → events ----------------------------------------------------------


#: The event ``args`` conversion uses; ORT's memory statistics (``mem_*``) are dropped on reading.
#: A node event has ``op_name``, ``provider``, ``node_index``, ``input_type_shape`` /
#: ``output_type_shape`` (``type_shapes``), sizes in bytes and ``thread_scheduling_stats`` (µs).
_KEEP_ARGS = frozenset(
    {
        "op_name",
        "provider",
        "node_index",
        "input_type_shape",
        "output_type_shape",
        "parameter_size",
        "activation_size",
        "output_size",
        "thread_scheduling_stats",
        "stream",
        "grid_x",
        "grid_y",
        "grid_z",
        "block_x",
        "block_y",
        "block_z",
        "parent_name",
    }
)


def _json_loads() -> Callable[[bytes], Any]:
    try:
        import orjson

        return orjson.loads  # type: ignore[no-any-return]
    except ImportError:  # pragma: no cover - orjson is a dependency
        return json.loads


def _slim(event: Any) -> Any:
    args = event.get("args") if isinstance(event, dict) else None
    if args:
        event["args"] = {k: v for k, v in args.items() if k in _KEEP_ARGS}
    return event


def iter_ort_profile(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """Yields the events of an ORT profile file one by one, without their memory statistics.

    ORT writes ``[``, one event per line, then ``]``; such a file is read a
    line at a time, so a profile of a million events (about 800 MB) is never
    held whole in memory. Any other JSON layout is read at once.

    Raises:
        ValueError: if the file is not an ORT profile (torn or foreign JSON).
        OSError: if it cannot be read.
    """
    loads = _json_loads()
    with open(path, "rb") as f:
        first = f.readline()
        if first.strip() != b"[":
            raw = first + f.read()
            try:
                obj = loads(raw)
            except ValueError as exc:  # orjson.JSONDecodeError and json.JSONDecodeError are ValueErrors
                hint = " (the file looks truncated)" if raw.rstrip()[-1:] not in (b"]", b"}") else ""
                raise ValueError(f"{path}: not valid JSON{hint}: {exc}") from None
            if isinstance(obj, dict) and isinstance(obj.get("traceEvents"), list):
                obj = obj["traceEvents"]
            if not isinstance(obj, list):
                raise ValueError(f"{path}: not an ONNX Runtime profile (no event list)")
            for e in obj:
                if isinstance(e, dict):
                    yield _slim(e)
            return
        closed = False
        for n, line in enumerate(f, start=2):
            text = line.strip()
            if not text:
                continue
            if text == b"]":
                closed = True
                break
            try:
                event = loads(text[:-1] if text.endswith(b",") else text)
            except ValueError as exc:
                raise ValueError(f"{path}: line {n} is not a JSON event (the file looks truncated): {exc}") from None
            if isinstance(event, dict):
                yield _slim(event)
        if not closed:
            raise ValueError(f"{path}: no closing ']' (the file looks truncated)")


def load_ort_profile(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Reads an ORT profile file into a list of events (see ``iter_ort_profile``).

    Raises:
        ValueError: if the file is not an ORT profile (torn or foreign JSON).
        OSError: if it cannot be read.
    """
    return list(iter_ort_profile(path))


@dataclass(frozen=True, slots=True)
class LiveRun:
    """A model span the live wrapper recorded around ``run`` (session ns).

    Attributes:
        span_id: the model span's id.
        start_ns: its start (ns, session clock).
        end_ns: its end (ns, session clock).
        tid: OS id of the calling thread.
    """

    span_id: int
    start_ns: int
    end_ns: int
    tid: int


@dataclass
class OrtProfileStats:
    """What a conversion found (for run.json and tests).

    Attributes:
        events_by_category: raw event counts by ``cat``.
        cpu_events: events of the CPU profiler (every category but ``Kernel``).
        truncated: the profile reached ORT's 1,000,000-event cap.
        model_runs: ``model_run`` events.
        runs_matched: ``model_run`` events matched to a live model span.
        runs_without_nodes: runs in which no node was recorded: ``model_run``
            events without nodes plus live model spans without a
            ``model_run`` (both happen after the event cap).
        node_spans: node (layer-level) spans made.
        op_spans: kernel (op-level) spans made.
        gpu_spans: GPU kernel/memcpy spans made.
        session_spans: model-load / initialisation spans made.
        module_spans: torch-module layer spans made around node spans (``module_spans``).
        skipped: events not converted, by reason.
        torch_mapped: node spans with a torch module, by how they were mapped.
        torch_unmapped: node spans of a PyTorch model without one.
        unmapped_examples: up to 10 node names without one.
        shift_ns: the shift applied to ORT's times so each run lies in its
            live model span (ns; 0 when the clocks agreed).
        alignment_slack_ns: the smallest margin between a matched ORT run and
            its live span, over both ends (ns); negative before the shift.
        threadpool: totals of the intra-op thread-pool statistics.
        clock: ``"epoch"`` or ``"monotonic"``, the clock of the start time.
    """

    events_by_category: dict[str, int] = field(default_factory=dict)
    cpu_events: int = 0
    truncated: bool = False
    model_runs: int = 0
    runs_matched: int = 0
    runs_without_nodes: int = 0
    node_spans: int = 0
    op_spans: int = 0
    gpu_spans: int = 0
    session_spans: int = 0
    module_spans: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    torch_mapped: dict[str, int] = field(default_factory=dict)
    torch_unmapped: int = 0
    unmapped_examples: list[str] = field(default_factory=list)
    shift_ns: int = 0
    alignment_slack_ns: int | None = None
    threadpool: dict[str, int] = field(default_factory=dict)
    clock: str = "epoch"

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready copy."""
        return {
            "events_by_category": dict(self.events_by_category),
            "cpu_events": self.cpu_events,
            "truncated": self.truncated,
            "model_runs": self.model_runs,
            "runs_matched": self.runs_matched,
            "runs_without_nodes": self.runs_without_nodes,
            "node_spans": self.node_spans,
            "op_spans": self.op_spans,
            "gpu_spans": self.gpu_spans,
            "session_spans": self.session_spans,
            "module_spans": self.module_spans,
            "skipped": dict(self.skipped),
            "torch_mapped": dict(self.torch_mapped),
            "torch_unmapped": self.torch_unmapped,
            "unmapped_examples": list(self.unmapped_examples),
            "shift_ns": self.shift_ns,
            "alignment_slack_ns": self.alignment_slack_ns,
            "threadpool": dict(self.threadpool),
            "clock": self.clock,
        }


@dataclass
class OrtEvents:
    """The result of ``ort_profile_to_events``."""

    spans: list[Span] = field(default_factory=list)
    instants: list[Instant] = field(default_factory=list)
    tracks: list[Track] = field(default_factory=list)
    stats: OrtProfileStats = field(default_factory=OrtProfileStats)

    def events(self) -> list[Event]:
        """Spans and instants as one list (tracks are queued by the registry)."""
        return [*self.spans, *self.instants]


def _int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            try:
                return int(value, 16)
            except ValueError:
                return None
    return None


def type_shapes(value: Any) -> tuple[list[list[int]], list[str]]:
    """ORT's ``[{"float": [1, 3, 64, 64]}, …]`` → (shapes, dtypes)."""
    shapes: list[list[int]] = []
    dtypes: list[str] = []
    if not isinstance(value, list):
        return shapes, dtypes
    for item in value:
        if isinstance(item, dict) and len(item) == 1:
            ((dtype, shape),) = item.items()
            if isinstance(shape, list):
                shapes.append([int(d) if isinstance(d, (int, float)) else -1 for d in shape])
                dtypes.append(_DTYPES.get(str(dtype), str(dtype)))
    return shapes, dtypes


def threadpool_attrs(stats: Any) -> dict[str, Any]:
    """Attributes from a node's ``thread_scheduling_stats`` (times in ns).

    ``main_thread`` holds the calling thread's work in µs (``Distribution``,
    ``DistributionEnqueue``, ``Run``, ``Wait``, ``WaitRevoke``) and the
    pool's name; ``sub_threads`` maps each pool thread to ``num_run``, how
    many pieces of the node's work it ran.
    """
    if not isinstance(stats, dict):
        return {}
    out: dict[str, Any] = {}
    main = stats.get("main_thread")
    if isinstance(main, dict):
        name = main.get("thread_pool_name")
        if isinstance(name, str):
            out["ml.ort.threadpool.name"] = name
        block = main.get("block_size")
        if isinstance(block, list):
            out["ml.ort.threadpool.block_size"] = [b for b in block if isinstance(b, int)]
        for key, attr in (
            ("Distribution", "distribution_ns"),
            ("DistributionEnqueue", "distribution_enqueue_ns"),
            ("Run", "run_ns"),
            ("Wait", "wait_ns"),
            ("WaitRevoke", "wait_revoke_ns"),
        ):
            v = _int(main.get(key))
            if v is not None:
                out[f"ml.ort.threadpool.{attr}"] = v * 1000
    subs = stats.get("sub_threads")
    if isinstance(subs, dict):
        runs = [_int(s.get("num_run")) for s in subs.values() if isinstance(s, dict)]
        out["ml.ort.threadpool.sub_threads"] = len(subs)
        out["ml.ort.threadpool.sub_thread_runs"] = sum(r for r in runs if r is not None)
    return out


_SIZE_ATTRS = (
    ("parameter_size", "ml.ort.parameter_bytes"),
    ("activation_size", "ml.ort.activation_bytes"),
    ("output_size", "ml.ort.output_bytes"),
)


def _static_attrs(
    args: dict[str, Any], node_name: str, op: str, weight: Sequence[int] | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The attributes of a node span and of its kernel span that do not change between runs
    (``weight``: a convolution's weight shape as exported, for its FLOPs)."""
    common: dict[str, Any] = {"ml.framework": "onnxruntime"}
    provider = args.get("provider")
    if isinstance(provider, str):
        common["ml.ort.provider"] = provider
    in_shapes, in_dtypes = type_shapes(args.get("input_type_shape"))
    if in_shapes:
        common["ml.input.shapes"] = in_shapes
        common["ml.input.dtypes"] = in_dtypes
    layer = dict(common)
    layer["ml.layer.path"] = node_name
    layer["ml.layer.type"] = op
    out_shapes, out_dtypes = type_shapes(args.get("output_type_shape"))
    if out_shapes:
        layer["ml.output.shapes"] = out_shapes
        layer["ml.output.dtypes"] = out_dtypes
    ni = _int(args.get("node_index"))
    if ni is not None:
        layer["ml.ort.node_index"] = ni
    for key, attr in _SIZE_ATTRS:
        v = _int(args.get(key))
        if v is not None:
            layer[attr] = v
    kernel = dict(common)
    kernel["ml.op.name"] = op
    kernel["ml.op.type"] = op
    kernel["ml.ort.node"] = node_name
    work = _work_attrs(args, op, in_shapes, out_shapes, weight)
    layer.update(work)
    kernel.update(work)
    return layer, kernel


#: Kernels whose output is their first input's buffer (ORT registers them with ``Alias(0, 0)``):
#: they move no data, whatever sizes the profile gives their input and output.
ALIAS_OPS = frozenset({"Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity"})


def _work_attrs(
    args: dict[str, Any], op: str, in_shapes: list[list[int]], out_shapes: list[list[int]], weight: Sequence[int] | None
) -> dict[str, Any]:
    """``ml.flops`` (FLOP, from the op type and run-time shapes; ``onnx_flops``) and
    ``ml.bytes``: the sizes ORT reports for the node's inputs, initializers and outputs
    (bytes; weights ORT pre-packed are not among them, so it is a lower bound), 0 for a
    kernel that returns its input's buffer (``ALIAS_OPS``)."""
    out: dict[str, Any] = {}
    flops = onnx_flops(op, in_shapes, out_shapes, weight)
    if flops is not None:
        out["ml.flops"] = flops
    sizes = [_int(args.get(key)) for key, _ in _SIZE_ATTRS]
    if any(v is not None for v in sizes):
        out["ml.bytes"] = 0 if op in ALIAS_OPS else sum(v for v in sizes if v is not None and v > 0)
    return out


def _node_and_op(e: dict[str, Any]) -> tuple[str, str]:
    """A node event's node name and kernel op type."""
    return str(e.get("name", ""))[: -len(_KERNEL_TIME)], str((e.get("args") or {}).get("op_name", ""))


def align_shift(pairs: list[tuple[tuple[int, int], tuple[int, int]]]) -> tuple[int, int | None]:
    """The shift (ns) that puts each ORT run inside its live model span.

    Each pair is ``((live_start, live_end), (ort_start, ort_end))``; a shift
    ``d`` works for a pair when ``live_start <= ort_start + d`` and
    ``ort_end + d <= live_end``. Returns the ``d`` nearest 0 that works for
    every pair (0 when 0 works, which is the normal case: both clocks come
    from one system clock), or the shift that minimises the worst violation
    when none works, and the smallest margin before shifting.

    Returns:
        ``(shift_ns, slack_ns)``; slack is None without pairs.
    """
    if not pairs:
        return 0, None
    lo = max(live[0] - ort[0] for live, ort in pairs)
    hi = min(live[1] - ort[1] for live, ort in pairs)
    slack = min(min(ort[0] - live[0], live[1] - ort[1]) for live, ort in pairs)
    if lo <= hi:
        return (0 if lo <= 0 <= hi else (lo if lo > 0 else hi)), slack
    return (lo + hi) // 2, slack


_Timed = tuple[int, int, dict[str, Any]]  # (start, end, event): session ns, before the clock shift


def event_times(e: Mapping[str, Any], start_ns: int, to_session_ns: Callable[[int], int]) -> tuple[int, int] | None:
    """An event's start and end on the session clock (ns): ``ts`` and ``dur`` are µs after the
    profiler's start ``start_ns``; None when either is missing or ``dur`` is negative.

    ``start_ns`` is ``InferenceSession.get_profiling_start_time_ns()``, ns since the Unix epoch
    (libstdc++'s ``high_resolution_clock`` is the system clock).
    """
    ts, dur = _int(e.get("ts")), _int(e.get("dur"))
    if ts is None or dur is None or dur < 0:
        return None
    start = to_session_ns(start_ns + ts * 1000)
    return start, start + dur * 1000


def event_kind(cat: str, name: str) -> tuple[str | None, str]:
    """What a complete profile event is: ``"kernel"`` (a GPU kernel or copy), ``"node"`` (a
    node's ``_kernel_time``), ``"run"`` (``model_run``) or ``"session"`` (``SESSION_EVENTS``);
    or None and the reason it is not converted (counted in ``OrtProfileStats.skipped``)."""
    if cat == "Kernel":
        return "kernel", ""
    if cat == "Node":
        if name.endswith(_KERNEL_TIME):
            return "node", ""
        return None, "fence" if name.endswith(_FENCES) else f"node event {name.rsplit('_', 1)[-1]}"
    if cat == "Session":
        if name == "model_run":
            return "run", ""
        return ("session", "") if name in SESSION_EVENTS else (None, name)
    return None, f"category {cat}"


@dataclass
class ProfileParts:
    """A profile's events sorted by what they become.

    Attributes:
        runs: ``model_run`` events, in file order.
        nodes: node kernel-time events, in file order.
        session: model-load and initialisation events.
        gpu: GPU events as ``(index in nodes of the node event before it, -1 if none, start, end, event)``.
        categories: event counts by ``cat`` (every event).
        skipped: events not converted, by reason.
    """

    runs: list[_Timed] = field(default_factory=list)
    nodes: list[_Timed] = field(default_factory=list)
    session: list[_Timed] = field(default_factory=list)
    gpu: list[tuple[int, int, int, dict[str, Any]]] = field(default_factory=list)
    categories: Counter[str] = field(default_factory=Counter)
    skipped: Counter[str] = field(default_factory=Counter)


def split_profile(events: Iterable[dict[str, Any]], times: Callable[[dict[str, Any]], tuple[int, int] | None]) -> ProfileParts:
    """Sorts a profile's events (``times``: ``event_times`` on the session clock) into ``ProfileParts``."""
    parts = ProfileParts()
    timed = {"node": parts.nodes, "run": parts.runs, "session": parts.session}
    for e in events:
        cat = str(e.get("cat", ""))
        parts.categories[cat] += 1
        if e.get("ph", "X") != "X":
            parts.skipped["not a complete event"] += 1
            continue
        t = times(e)
        if t is None:
            parts.skipped["no time"] += 1
            continue
        kind, why = event_kind(cat, str(e.get("name", "")))
        if kind == "kernel":
            parts.gpu.append((len(parts.nodes) - 1, t[0], t[1], e))
        elif kind is not None:
            timed[kind].append((t[0], t[1], e))
        else:
            parts.skipped[why] += 1
    return parts


def _best_live_run(start: int, end: int, candidates: Sequence[LiveRun], starts: Sequence[int], taken: set[int]) -> LiveRun | None:
    """The live run not yet taken that overlaps ``[start, end]`` most, among the 4 latest to start before ``end``."""
    i = bisect.bisect_right(starts, end)
    best: LiveRun | None = None
    best_overlap = 0
    for cand in reversed(candidates[max(0, i - 4) : i]):
        overlap = min(end, cand.end_ns) - max(start, cand.start_ns)
        if cand.span_id not in taken and overlap > best_overlap:
            best, best_overlap = cand, overlap
    return best


def match_live_runs(runs: Sequence[_Timed], live_runs: Sequence[LiveRun]) -> list[LiveRun | None]:
    """Each ``model_run``'s live model span: the one on its thread that it overlaps most, each taken once."""
    by_tid: dict[int, list[LiveRun]] = {}
    for lr in sorted(live_runs, key=lambda r: r.start_ns):
        by_tid.setdefault(lr.tid, []).append(lr)
    starts = {tid: [r.start_ns for r in rs] for tid, rs in by_tid.items()}
    matched: list[LiveRun | None] = []
    taken: set[int] = set()
    for start, end, e in runs:
        tid = _int(e.get("tid"))
        key = tid if tid is not None else -1
        best = _best_live_run(start, end, by_tid.get(key, []), starts.get(key, []), taken)
        if best is not None:
            taken.add(best.span_id)
        matched.append(best)
    return matched


def run_index(
    runs: Sequence[_Timed], run_starts: Sequence[int], start: int, end: int, tid: int | None, any_thread: bool = True
) -> int | None:
    """The run (index in ``runs``, ``run_starts`` their starts) that holds ``[start, end]``: of the 8
    latest to start by ``start``, the latest on thread ``tid``, else (``any_thread``) the latest on
    any thread. ``any_thread`` is for a pool thread of the parallel executor; a thread that called
    ``run`` itself runs only that run's nodes."""
    i = bisect.bisect_right(run_starts, start)
    fallback: int | None = None
    for j in range(i - 1, max(-1, i - 9), -1):
        rs, re_, e = runs[j]
        if rs <= start and end <= re_:
            if _int(e.get("tid")) == tid:
                return j
            if fallback is None and any_thread:
                fallback = j
    return fallback


class LiveRunsByThread:
    """The live runs of each thread, in start order, to find the one a thread was in at a time."""

    def __init__(self, live_runs: Sequence[LiveRun]) -> None:
        self.runs: dict[int, list[LiveRun]] = {}
        for lr in sorted(live_runs, key=lambda r: r.start_ns):
            self.runs.setdefault(lr.tid, []).append(lr)
        self.starts = {tid: [r.start_ns for r in rs] for tid, rs in self.runs.items()}

    def at(self, tid: int | None, ns: int) -> LiveRun | None:
        """The live run thread ``tid`` was inside at ``ns`` (session ns), or None."""
        starts = self.starts.get(tid if tid is not None else -1)
        if not starts:
            return None
        i = bisect.bisect_right(starts, ns) - 1
        lr = self.runs[tid if tid is not None else -1][i] if i >= 0 else None
        return lr if lr is not None and ns <= lr.end_ns else None


@dataclass
class NodeCalls:
    """Each node event's model call.

    Attributes:
        run: its ``model_run`` (index in ``ProfileParts.runs``), or None.
        parent: the id of its model span: its run's, else that of the live run its thread was
            inside (a run in flight when profiling ended has nodes and no ``model_run``), or None.
        dropped: node indices left out: their call ended after the op level's end.
    """

    run: list[int | None]
    parent: list[int | None]
    dropped: set[int]


def node_calls(
    parts: ProfileParts,
    matched: Sequence[LiveRun | None],
    run_ids: Sequence[int],
    live_runs: Sequence[LiveRun],
    shift: int,
    ops_end_ns: int | None,
) -> NodeCalls:
    """Finds each node's model call (``NodeCalls``). With ``ops_end_ns`` (the op level ended early,
    session ns), nodes of calls that ended after it are dropped: the analysis counts only the calls
    that ended by then as calls with ops, and a call in flight then has only some of its nodes."""
    live = LiveRunsByThread(live_runs)
    run_starts = [r[0] for r in parts.runs]
    call_end = {run_ids[i]: (lr.end_ns if lr is not None else r[1] + shift) for i, (r, lr) in enumerate(zip(parts.runs, matched))}
    calls = NodeCalls([], [], set())
    for idx, (s, t_end, e) in enumerate(parts.nodes):
        tid = _int(e.get("tid"))
        r = run_index(parts.runs, run_starts, s, t_end, tid, any_thread=tid not in live.runs)
        parent = run_ids[r] if r is not None else None
        if r is None:
            lr = live.at(tid, s + shift)
            if lr is not None:
                parent = lr.span_id
                call_end[parent] = lr.end_ns
        calls.run.append(r)
        calls.parent.append(parent)
        if ops_end_ns is not None and parent is not None and call_end[parent] > ops_end_ns:
            calls.dropped.add(idx)
    return calls


def torch_origins(nodes: Sequence[_Timed], node_run: Sequence[int | None], mapper: TorchModuleMapper | None) -> list[TorchOrigin | None]:
    """Each node's torch origin, nodes without one filled per run (``node_run``: any key of the
    node's run) from their neighbours (``fill_from_neighbours``)."""
    origins: list[TorchOrigin | None] = [None] * len(nodes)
    if mapper is None:
        return origins
    per_run: dict[int | None, list[int]] = {}
    for idx, r in enumerate(node_run):
        per_run.setdefault(r, []).append(idx)
    for idxs in per_run.values():
        found = [mapper.resolve(*_node_and_op(nodes[i][2])) for i in idxs]
        for i, o in zip(idxs, fill_from_neighbours(found)):
            origins[i] = o
    return origins


def origin_attrs(origin: TorchOrigin, node_name: str) -> dict[str, Any]:
    """A node span's ``ml.torch.*`` (and ``ml.onnx.node``, ``code.*``) attributes from its origin."""
    attrs: dict[str, Any] = {"ml.torch.module_path": origin.module_path, "ml.torch.mapping": origin.how}
    if origin.module_class:
        attrs["ml.torch.module_class"] = origin.module_class
    if origin.onnx_node and origin.onnx_node != node_name:
        attrs["ml.onnx.node"] = origin.onnx_node
    if origin.file is not None:
        attrs["code.file.path"] = origin.file
        attrs["code.line.number"] = origin.line
    return attrs


def copy_activity(name: str) -> str:
    """``gpu.activity`` of a GPU event without a launch grid, from its name (``Memcpy HtoD``)."""
    lower = name.lower()
    return "gpu_memcpy" if "memcpy" in lower else "gpu_memset" if "memset" in lower else "kernel"


def gpu_kernel_attrs(name: str, args: Mapping[str, Any], device: int) -> dict[str, Any]:
    """The attributes of a CUDA EP ``Kernel`` event's span (``args`` as ORT writes them, numbers as strings).

    CUDA EP builds with CUPTI profiling write one ``Kernel`` event per GPU kernel or copy, with
    ``stream``, ``grid_*``, ``block_*`` and, once ORT has merged it behind its node, ``op_name``
    and ``parent_name`` (the node event's name); the device is not written.
    """
    attrs: dict[str, Any] = {"ml.framework": "onnxruntime", "gpu.kernel.name": name, "gpu.device": device}
    stream = _int(args.get("stream"))
    if stream is not None:
        attrs["gpu.stream"] = stream
    grid = [_int(args.get(f"grid_{a}")) for a in "xyz"]
    if all(g is not None and g >= 0 for g in grid):
        attrs["gpu.grid"] = grid
        attrs["gpu.block"] = [_int(args.get(f"block_{a}")) for a in "xyz"]
        attrs["gpu.activity"] = "kernel"
    else:  # memcpy and memset events have a grid of -1
        attrs["gpu.activity"] = copy_activity(name)
    if isinstance(args.get("op_name"), str):
        attrs["ml.op.name"] = args["op_name"]
    return attrs


def kernel_parent(
    parent_name: Any, start_ns: int, prev_node: int, op_by_name: Mapping[str, Sequence[tuple[int, int]]], span_of_node: Sequence[int | None]
) -> int | None:
    """The span a GPU event goes under: the latest op span started by ``start_ns`` of the node ORT
    names its parent (``parent_name``, the node event's name), else the span of the node event
    written before it (index ``prev_node``; -1: none)."""
    if isinstance(parent_name, str) and parent_name in op_by_name:
        spans = op_by_name[parent_name]
        before = [sid for st, sid in spans if st <= start_ns]
        return before[-1] if before else spans[0][1]
    if prev_node >= 0:
        return span_of_node[prev_node]
    return None


def add_threadpool_totals(totals: Counter[str], attrs: Mapping[str, Any]) -> None:
    """Adds one node's thread-pool attributes (``threadpool_attrs``) to the run's totals."""
    for k in ("run_ns", "wait_ns", "distribution_ns"):
        totals[k] += int(attrs.get(f"ml.ort.threadpool.{k}", 0))
    totals["sub_thread_runs"] += int(attrs.get("ml.ort.threadpool.sub_thread_runs", 0))


@dataclass
class _Emitter:
    """What the span-making steps of one conversion share: track and id allocation, the clock
    shift and the output."""

    tracks: TrackRegistry
    thread_names: Mapping[int, str]
    new_id: Callable[[], int]
    shift: int
    out: OrtEvents
    skipped: Counter[str]
    used_tracks: dict[int, Track] = field(default_factory=dict)

    def track_of(self, e: Mapping[str, Any]) -> Track | None:
        """The thread track of a CPU event (by its pid and tid); None without a thread.

        ``pid`` and ``tid`` are OS ids (``gettid``): the thread that called ``run`` for the
        sequential executor, pool threads for the parallel one; GPU events have -1.
        """
        pid, tid = _int(e.get("pid")), _int(e.get("tid"))
        if pid is None or tid is None or tid < 0:
            return None
        t = self.tracks.thread(tid, self.thread_names.get(tid, f"onnxruntime {tid}"), pid=pid if pid >= 0 else None)
        self.used_tracks[t.id] = t
        return t

    def span(
        self, span_id: int, parent: int | None, level: Level, name: str, start: int, end: int, track_id: int, attrs: dict[str, Any]
    ) -> None:
        """Adds a span, its times (ORT's clock) shifted."""
        self.out.spans.append(Span(span_id, parent, level, name, start + self.shift, end + self.shift, track_id, attrs))


def _session_spans(em: _Emitter, session: Sequence[_Timed]) -> None:
    """Model load and initialisation, as USER spans."""
    for s, t_end, e in session:
        tr = em.track_of(e)
        if tr is None:
            em.skipped["no thread"] += 1
            continue
        name = str(e["name"])
        em.span(
            em.new_id(), None, Level.USER, f"onnxruntime {name}", s, t_end, tr.id, {"ml.framework": "onnxruntime", "ml.ort.event": name}
        )
        em.out.stats.session_spans += 1


def _run_spans(
    em: _Emitter, runs: Sequence[_Timed], matched: Sequence[LiveRun | None], model_name: str, model_attrs: Mapping[str, Any]
) -> list[int]:
    """One model span id per ORT run: its live span's, or that of a model span made here."""
    run_ids: list[int] = []
    for (s, t_end, e), live in zip(runs, matched):
        if live is not None:
            run_ids.append(live.span_id)
            continue
        tr = em.track_of(e)
        sid = em.new_id()
        run_ids.append(sid)
        if tr is not None:
            attrs = {"ml.framework": "onnxruntime", **model_attrs, "ml.ort.live_span": False}
            em.span(sid, None, Level.MODEL, model_name, s, t_end, tr.id, attrs)
    return run_ids


def _module_parents(
    em: _Emitter,
    nodes: Sequence[_Timed],
    calls: NodeCalls,
    origins: Sequence[TorchOrigin | None],
    mapper: TorchModuleMapper | None,
) -> dict[int, int]:
    """Makes the module spans of every model call and thread (``module_spans``), for the nodes
    kept; returns node index → the id of the module span that parents it."""
    groups: dict[tuple[int | None, int], list[int]] = {}
    for idx, (_, _, e) in enumerate(nodes):
        tr = em.track_of(e) if idx not in calls.dropped else None
        if tr is not None:
            groups.setdefault((calls.parent[idx], tr.id), []).append(idx)
    classes = mapper.module_classes if mapper is not None else {}
    parent_of: dict[int, int] = {}
    for (parent, track_id), idxs in groups.items():
        rows = [(nodes[i][0] + em.shift, nodes[i][1] + em.shift, track_id, parent, origins[i]) for i in idxs]
        made, parents = module_spans(rows, em.new_id, classes)
        em.out.spans.extend(made)
        em.out.stats.module_spans += len(made)
        parent_of.update((i, p) for i, p in zip(idxs, parents) if p is not None)
    return parent_of


class _NodeSpans:
    """Makes the node (LAYER) and kernel (OP) spans of a profile's node events."""

    def __init__(self, em: _Emitter, mapper: TorchModuleMapper | None, levels: frozenset[Level] | set[Level], n_nodes: int) -> None:
        self.em = em
        self.mapper = mapper
        self.want_layer = Level.LAYER in levels
        self.want_op = Level.OP in levels
        self.mapped: Counter[str] = Counter()
        self.pool: Counter[str] = Counter()
        self.span_of_node: list[int | None] = [None] * n_nodes  # its op span, else its layer span
        self.op_by_name: dict[str, list[tuple[int, int]]] = {}  # node event name → [(start, op span id)]
        self.dropped: set[int] = set()  # node indices left out (``NodeCalls.dropped``)
        self._static: dict[str, tuple[Any, Any, dict[str, Any], dict[str, Any]]] = {}

    def static_attrs(self, node_name: str, op: str, args: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """The node's layer and op attributes that repeat run after run: built once per node and shapes."""
        raw_in, raw_out = args.get("input_type_shape"), args.get("output_type_shape")
        cached = self._static.get(node_name)
        if cached is None or cached[0] != raw_in or cached[1] != raw_out:
            weight = self.mapper.weight_dims(node_name, op) if self.mapper is not None and op in CONV_OPS else None
            cached = (raw_in, raw_out, *_static_attrs(args, node_name, op, weight))
            self._static[node_name] = cached
        return cached[2], cached[3]

    def note_origin(self, origin: TorchOrigin | None, node_name: str) -> None:
        """Counts how the node was mapped to torch, or that a PyTorch model's node was not."""
        stats = self.em.out.stats
        if origin is not None:
            self.mapped[origin.how] += 1
        elif self.mapper is not None and self.mapper.graph.from_pytorch:
            stats.torch_unmapped += 1
            if len(stats.unmapped_examples) < 10 and node_name not in stats.unmapped_examples:
                stats.unmapped_examples.append(node_name)

    def add(self, idx: int, node: _Timed, parent: int | None, module_id: int | None, origin: TorchOrigin | None) -> None:
        """The spans of node event ``idx``: its layer span under its module span (else ``parent``,
        the run's model span), its op span under that."""
        s, t_end, e = node
        tr = self.em.track_of(e)
        if tr is None:
            self.em.skipped["no thread"] += 1
            return
        args = e.get("args") or {}
        node_name = str(e["name"])[: -len(_KERNEL_TIME)]
        op = str(args.get("op_name", "")) or "unknown"
        layer_static, op_static = self.static_attrs(node_name, op, args)
        layer_id: int | None = None
        if self.want_layer:
            self.note_origin(origin, node_name)
            attrs = {**layer_static, **(origin_attrs(origin, node_name) if origin is not None else {})}
            layer_id = self.em.new_id()
            self.em.span(layer_id, module_id if module_id is not None else parent, Level.LAYER, node_name, s, t_end, tr.id, attrs)
            self.em.out.stats.node_spans += 1
            self.span_of_node[idx] = layer_id
        if self.want_op:
            tp = threadpool_attrs(args.get("thread_scheduling_stats"))
            add_threadpool_totals(self.pool, tp)
            op_id = self.em.new_id()
            self.em.span(op_id, layer_id if layer_id is not None else parent, Level.OP, op, s, t_end, tr.id, {**op_static, **tp})
            self.span_of_node[idx] = op_id
            self.op_by_name.setdefault(str(e["name"]), []).append((s + self.em.shift, op_id))
            self.em.out.stats.op_spans += 1


def _gpu_spans(em: _Emitter, gpu: Sequence[tuple[int, int, int, dict[str, Any]]], nodes: _NodeSpans, device: int) -> None:
    """GPU kernels (CUDA EP): on their stream's track, under the node kernel that launched them."""
    for prev_node, start, end, e in gpu:
        if prev_node in nodes.dropped:
            em.skipped["gpu kernel of a call that ended after the op level's end"] += 1
            continue
        args = e.get("args") or {}
        stream = _int(args.get("stream"))
        tr = em.tracks.gpu_stream(device, stream if stream is not None else 0)
        em.used_tracks[tr.id] = tr
        parent = kernel_parent(args.get("parent_name"), start + em.shift, prev_node, nodes.op_by_name, nodes.span_of_node)
        name = str(e.get("name", "")) or "kernel"
        em.span(em.new_id(), parent, Level.KERNEL, name, start, end, tr.id, gpu_kernel_attrs(name, args, device))
        em.out.stats.gpu_spans += 1


def _count_events(stats: OrtProfileStats, parts: ProfileParts, max_events: int) -> None:
    stats.events_by_category = dict(parts.categories)
    stats.cpu_events = sum(n for c, n in parts.categories.items() if c != "Kernel")
    stats.truncated = stats.cpu_events >= max_events
    stats.model_runs = len(parts.runs)


def ort_profile_to_events(
    events: Iterable[dict[str, Any]],
    *,
    start_ns: int,
    to_session_ns: Callable[[int], int],
    tracks: TrackRegistry,
    new_id: Callable[[], int],
    levels: frozenset[Level] | set[Level],
    live_runs: Sequence[LiveRun] = (),
    mapper: TorchModuleMapper | None = None,
    model_name: str = "onnxruntime",
    model_attrs: Mapping[str, Any] | None = None,
    thread_names: Mapping[int, str] | None = None,
    gpu_device: int = 0,
    clock: str = "epoch",
    max_events: int = ORT_MAX_EVENTS,
    ops_end_ns: int | None = None,
) -> OrtEvents:
    """Converts one ORT profile into spans.

    Args:
        events: the profile's events (see ``iter_ort_profile``), read once.
        start_ns: the profiler's start (``get_profiling_start_time_ns()``), ns.
        to_session_ns: converts a time on that clock (ns) to the session clock.
        tracks: allocates thread and GPU-stream tracks (threads keyed by the
            profile's pid and tid).
        new_id: allocates span ids.
        levels: the session's levels: node spans need ``LAYER``, kernel spans
            ``OP``, GPU kernels ``KERNEL``.
        live_runs: the live model spans of this session's ``run`` calls; each
            ``model_run`` is matched to the one it lies in on its thread, and
            nodes become its children. A ``model_run`` without one becomes a
            model span itself. Nodes without a ``model_run`` on their thread
            (a run in flight when profiling ended) go under the live span their
            thread was inside.
        mapper: maps node names to torch modules (models exported from PyTorch).
        model_name: name of model spans made for unmatched runs.
        model_attrs: attributes for those model spans.
        thread_names: OS thread id → name, for new thread tracks.
        gpu_device: CUDA device of ``Kernel`` events (ORT does not write it).
        clock: ``"epoch"`` or ``"monotonic"``, recorded in the stats.
        max_events: the profiler's event cap (ORT's is fixed at 1,000,000);
            a profile with that many CPU events is marked truncated.
        ops_end_ns: when the op level ended early (session ns, run.json
            ``op_window``): nodes (and their GPU kernels) of calls that ended
            after it are left out (``NodeCalls``), counted in ``skipped``.

    Returns:
        Spans (node spans with explicit parents), instants and stats.
    """
    stats = OrtProfileStats(clock=clock)
    out = OrtEvents(stats=stats)
    parts = split_profile(events, lambda e: event_times(e, start_ns, to_session_ns))
    _count_events(stats, parts, max_events)
    matched = match_live_runs(parts.runs, live_runs)
    pairs = [((lr.start_ns, lr.end_ns), (r[0], r[1])) for r, lr in zip(parts.runs, matched) if lr is not None]
    stats.shift_ns, stats.alignment_slack_ns = align_shift(pairs)
    stats.runs_matched = len(pairs)
    em = _Emitter(tracks, thread_names or {}, new_id, stats.shift_ns, out, parts.skipped)
    _session_spans(em, parts.session)
    run_ids = _run_spans(em, parts.runs, matched, model_name, model_attrs or {})
    calls = node_calls(parts, matched, run_ids, live_runs, stats.shift_ns, ops_end_ns)
    # Runs the profiler missed entirely (after its cap) have a live span but no model_run.
    with_nodes = {r for r in calls.run if r is not None}
    stats.runs_without_nodes = sum(1 for i in range(len(parts.runs)) if i not in with_nodes) + len(live_runs) - len(pairs)
    if calls.dropped:
        parts.skipped["node of a call that ended after the op level's end"] += len(calls.dropped)
    origins = torch_origins(parts.nodes, calls.parent, mapper)
    nodes = _NodeSpans(em, mapper, levels, len(parts.nodes))
    nodes.dropped = calls.dropped
    modules = _module_parents(em, parts.nodes, calls, origins, mapper) if nodes.want_layer else {}
    for idx, node in enumerate(parts.nodes):
        if idx not in calls.dropped:
            nodes.add(idx, node, calls.parent[idx], modules.get(idx), origins[idx])
    stats.torch_mapped = dict(nodes.mapped)
    stats.threadpool = dict(nodes.pool)
    if Level.KERNEL in levels:
        _gpu_spans(em, parts.gpu, nodes, gpu_device)
    elif parts.gpu:
        parts.skipped["gpu kernel (kernel level off)"] += len(parts.gpu)
    stats.skipped = dict(parts.skipped)
    out.tracks = list(em.used_tracks.values())
    return out


def module_spans(
    nodes: Sequence[tuple[int, int, int, int | None, TorchOrigin | None]],
    new_id: Callable[[], int],
    classes: Mapping[str, str] | None = None,
) -> tuple[list[Span], list[int | None]]:
    """Layer spans named by torch module path around the nodes that came from them.

    ``nodes`` are the node executions of one run on one thread, in execution order,
    as ``(start_ns, end_ns, track id, parent id, origin)``. Consecutive nodes of
    ``layer1.0.conv1`` get one span ``layer1.0.conv1`` inside one ``layer1.0``
    inside one ``layer1``, as the PyTorch run's layers nest; each module span lasts
    from its first node's start to its last node's end. Nodes without a module, or
    of the root module (``""``), stay under the model. Module spans are made before
    their nodes' spans, so a module of one node, with the node's very interval, has
    the smaller id and stays the outer one when the run is nested by time.
    ``classes`` maps module paths to their classes (``TorchModuleMapper.module_classes``).

    Returns:
        The module spans (``ml.layer.path`` = the module path, ``ml.layer.type`` = its
        class where the exporter named it, else ``"Module"``), and per node the id of
        the module span to parent it (None: keep its own parent).
    """
    made: list[Span] = []
    parents: list[int | None] = []
    stack: list[Span] = []  # open module spans, outermost first
    for start_ns, end_ns, track_id, parent_id, origin in nodes:
        path = origin.module_path if origin is not None else ""
        parts = path.split(".") if path else []
        prefixes = [".".join(parts[: i + 1]) for i in range(len(parts))]
        keep = 0
        while keep < min(len(stack), len(prefixes)) and stack[keep].name == prefixes[keep]:
            keep += 1
        del stack[keep:]
        for prefix in prefixes[keep:]:
            cls = (classes or {}).get(prefix) or (origin.module_class if origin is not None and prefix == path else None)
            attrs: dict[str, Any] = {
                "ml.framework": "onnxruntime",
                "ml.layer.path": prefix,
                "ml.layer.type": cls.rsplit(".", 1)[-1] if cls else "Module",
                "ml.ort.module": True,
            }
            up = stack[-1].id if stack else parent_id
            span = Span(new_id(), up, Level.LAYER, prefix, start_ns, end_ns, track_id, attrs)
            stack.append(span)
            made.append(span)
        for span in stack:
            span.end_ns = max(span.end_ns, end_ns)
        parents.append(stack[-1].id if stack else None)
    return made, parents


def node_op_table(events: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """``(node name, op type)`` of every node kernel event, in file order (for tests and tools)."""
    out: list[tuple[str, str]] = []
    for e in events:
        name = str(e.get("name", ""))
        if e.get("cat") == "Node" and name.endswith(_KERNEL_TIME):
            out.append((name[: -len(_KERNEL_TIME)], str((e.get("args") or {}).get("op_name", ""))))
    return out


# -- lining up a PyTorch run and an ONNX Runtime run ----------------------------------------


@dataclass
class ModuleTime:
    """Time spent in one torch module, by framework (ns).

    Attributes:
        module_path: the module's path (``""`` is the root module).
        torch_ns: total of its PyTorch layer spans, per model call.
        ort_ns: total of the ORT node spans mapped to it or to modules
            inside it, per model call.
        ort_nodes: how many ORT nodes (per model call) it holds.
    """

    module_path: str
    torch_ns: float = 0.0
    ort_ns: float = 0.0
    ort_nodes: float = 0.0


def line_up_by_module_path(spans: Iterable[Span], depth: int | None = None) -> list[ModuleTime]:
    """Lines up PyTorch layer spans and ORT node spans of the same model by torch module path.

    PyTorch layer spans count under their own path (``ml.layer.path``), the
    model span under the root (``""``); ORT
    node spans (``ml.torch.module_path``) count under their module and every
    module above it, so that ``layer1.0`` holds the nodes of
    ``layer1.0.conv1``; totals are divided by the number of model calls of
    each framework. Spans may come from one run or two (concatenate them).

    Args:
        spans: spans of a PyTorch run and of an ORT run of its export.
        depth: keep modules at most this many components deep (``1``:
            ``layer1``, ``fc``); None keeps all.

    Returns:
        One row per module seen by either framework, by path.
    """
    rows: dict[str, ModuleTime] = {}
    calls = {"pytorch": 0, "onnxruntime": 0}
    torch_ns: dict[str, int] = {}
    ort_ns: dict[str, int] = {}
    ort_nodes: dict[str, int] = {}
    for s in spans:
        fw = s.attrs.get("ml.framework")
        if s.level == Level.MODEL and fw in calls:
            calls[str(fw)] += 1
            if fw == "pytorch":
                torch_ns[""] = torch_ns.get("", 0) + s.duration_ns  # the root module
        elif s.level == Level.LAYER and fw == "pytorch":
            path = str(s.attrs.get("ml.layer.path", s.name))
            if depth is None or path.count(".") < depth:
                torch_ns[path] = torch_ns.get(path, 0) + s.duration_ns
        elif s.level == Level.LAYER and fw == "onnxruntime" and "ml.torch.module_path" in s.attrs:
            parts = str(s.attrs["ml.torch.module_path"]).split(".") if s.attrs["ml.torch.module_path"] else []
            for k in range(0, len(parts) + 1):
                if depth is not None and k > depth:
                    break
                path = ".".join(parts[:k])
                ort_ns[path] = ort_ns.get(path, 0) + s.duration_ns
                ort_nodes[path] = ort_nodes.get(path, 0) + 1
    tc, oc = max(calls["pytorch"], 1), max(calls["onnxruntime"], 1)
    for path in set(torch_ns) | set(ort_ns):
        rows[path] = ModuleTime(path, torch_ns.get(path, 0) / tc, ort_ns.get(path, 0) / oc, ort_nodes.get(path, 0) / oc)
    return [rows[p] for p in sorted(rows)]
