"""The live op level: torch.profiler ops nest under mltrace's own layer spans.

A real torch.nn model runs on CPU in a real session with the torch.modules
and torch.profiler sources; the checks read the finished run directory.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

from mltrace.config import ProfileOptions
from mltrace.run.events import Span, TrackKind
from mltrace.run.levels import Level
from mltrace.run.store import Run, load_run
from mltrace.tracer import api
from mltrace.tracer.session import Session
from mltrace.tracer.sources.torch_modules import TorchModuleSource
from mltrace.tracer.sources.torch_ops import TorchOpSource


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.head = nn.Sequential(nn.ReLU(), nn.Flatten(), nn.Linear(8 * 14 * 14, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.conv(x))


def record(tmp_path: Path, body) -> tuple[Run, TorchOpSource]:  # type: ignore[no-untyped-def]
    ops = TorchOpSource()
    session = Session(ProfileOptions(output=tmp_path / "run", summary=False), sources=[TorchModuleSource(), ops])
    session.start()
    try:
        body()
    finally:
        session.stop()
    return load_run(tmp_path / "run"), ops


def module_around(op: Span, run: Run) -> Span | None:
    """The innermost model/layer span on the op's track whose interval holds it (brute force)."""
    best = None
    for s in run.spans:
        if s.level in (Level.MODEL, Level.LAYER) and s.track_id == op.track_id:
            if s.start_ns <= op.start_ns and op.end_ns <= s.end_ns and (best is None or s.start_ns >= best.start_ns):
                best = s
    return best


def test_ops_nest_under_live_layer_spans(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Net().eval()
    x = torch.randn(2, 3, 16, 16)

    def body() -> None:
        with torch.no_grad():
            for _ in range(2):
                model(x)

    run, source = record(tmp_path, body)
    assert run.complete
    assert run.meta["levels"]["op"]["recorded"] and run.meta["levels"]["op"]["sources"] == ["torch.profiler"]
    by_id = run.span_by_id()
    ops = [s for s in run.spans if s.level is Level.OP]
    assert len(ops) >= 2 * 10
    assert source.stats is not None and source.stats.spans_by_category["cpu_op"] == len(ops)
    for op in ops:
        around = module_around(op, run)
        assert around is not None, f"{op.name} is outside every module span"
        parent = by_id[op.parent_id]
        while parent.level is Level.OP:  # aten::linear → aten::addmm: ops nest in ops first
            assert parent.track_id == op.track_id
            parent = by_id[parent.parent_id]
        assert parent.id == around.id, (op.name, parent.name, around.name)

    def layers_of(name: str) -> list[str]:
        out = []
        for op in ops:
            if op.name == name:
                parent = by_id[op.parent_id]
                while parent.level is Level.OP:
                    parent = by_id[parent.parent_id]
                out.append(parent.name)
        return out

    assert layers_of("aten::conv2d") == ["conv", "conv"]
    assert layers_of("aten::relu") == ["head.0", "head.0"]
    assert layers_of("aten::addmm") == ["head.2", "head.2"]
    conv = next(op for op in ops if op.name == "aten::conv2d")
    assert conv.attrs["ml.input.shapes"][:3] == [[2, 3, 16, 16], [8, 3, 3, 3], [8]]
    assert conv.attrs["ml.input.dtypes"][:3] == ["float", "float", "float"]
    addmm = next(op for op in ops if op.name == "aten::addmm")
    assert addmm.attrs["ml.flops"] == 2 * 2 * (8 * 14 * 14) * 10  # 2·M·K·N for a [2, 1568] × [1568, 10] product
    main_track = run.tracks[conv.track_id]
    assert main_track.kind == TrackKind.THREAD and main_track.tid == threading.get_native_id()


def test_record_function_lands_inside_the_mltrace_span_around_it(tmp_path: Path) -> None:
    """Clock alignment: Kineto's converted times fall inside mltrace's bracketing span."""

    def body() -> None:
        for n in range(5):
            with api.span(f"outer{n}"), torch.profiler.record_function(f"marker{n}"):
                torch.ones(4).add_(1)

    run, _ = record(tmp_path, body)
    by_name = {s.name: s for s in run.spans}
    for n in range(5):
        outer, marker = by_name[f"outer{n}"], by_name[f"marker{n}"]
        assert outer.start_ns <= marker.start_ns and marker.end_ns <= outer.end_ns
        assert marker.parent_id == outer.id
        add = next(s for s in run.spans if s.name == "aten::add_" and marker.start_ns <= s.start_ns <= marker.end_ns)
        assert add.parent_id == marker.id


def test_ops_on_a_worker_thread_keep_their_track(tmp_path: Path) -> None:
    model = Net().eval()
    x = torch.randn(1, 3, 16, 16)
    worker_tid: list[int] = []

    def work() -> None:
        worker_tid.append(threading.get_native_id())
        with torch.no_grad():
            model(x)

    def body() -> None:
        t = threading.Thread(target=work)
        t.start()
        t.join()

    run, _ = record(tmp_path, body)
    ops = [s for s in run.spans if s.level is Level.OP]
    assert ops, "ops on a worker thread were not recorded"
    assert {run.tracks[s.track_id].tid for s in ops} == set(worker_tid)
    for op in ops:
        around = module_around(op, run)
        assert around is not None and run.tracks[around.track_id].tid == worker_tid[0]


def test_profiler_starts_at_once_when_torch_is_imported_and_stops_cleanly(tmp_path: Path) -> None:
    source = TorchOpSource()
    session = Session(ProfileOptions(output=tmp_path / "run", summary=False), sources=[source])
    session.start()
    try:
        assert source._prof is not None
    finally:
        session.stop()
    assert source._prof is None and source._hook is None


DEFERRED = """
import sys
from pathlib import Path
from mltrace.config import ProfileOptions
from mltrace.run.store import load_run
from mltrace.tracer.session import Session
from mltrace.tracer.sources.torch_ops import TorchOpSource

assert "torch" not in sys.modules
source = TorchOpSource()
session = Session(ProfileOptions(output=Path(sys.argv[1]), summary=False), sources=[source]).start()
assert source._prof is None and not source.profiling  # waits for the program's import
seen = []
def fail():
    raise ValueError("hook broke")
source.around_profiler_start(lambda: seen.append(("before", source.profiling)), lambda: seen.append(("after", source.profiling)))
source.around_profiler_start(fail, fail)
import torch
assert source._prof is not None and source.profiling
assert seen == [("before", False), ("after", True)], seen
assert [e for e in session.errors if "hook failed" in e] == [
    "torch.profiler: before-start hook failed: hook broke", "torch.profiler: after-start hook failed: hook broke"
], session.errors
torch.ones(3).mul_(2)
session.stop()
print(sorted({s.name for s in load_run(sys.argv[1]).spans}))
"""


def test_profiler_waits_for_the_programs_torch_import(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-c", DEFERRED, str(tmp_path / "run")], capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL
    )
    assert out.returncode == 0, out.stderr
    assert "aten::mul_" in out.stdout and "aten::ones" in out.stdout


def test_flops_counted_from_shapes_equal_torchs_own_count(tmp_path: Path) -> None:
    """The op level records shapes only; ``aten_flops`` must give every op the count torch's
    ``with_flops`` gives it: on the example CNN, an encoder, a grouped dilated convolution
    and the matrix products directly."""
    from torch.profiler import ProfilerActivity, profile

    from mltrace.tracer.sources.kineto import kineto_to_events, load_kineto_json
    from mltrace.tracer.tracks import TrackRegistry

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    try:
        from models import encoder, resnet_small
    finally:
        sys.path.pop(0)
    torch.manual_seed(0)
    cnn, enc = resnet_small().eval(), encoder(2).eval()
    grouped = nn.Conv2d(8, 16, 3, stride=2, padding=2, dilation=2, groups=4).eval()
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_flops=True) as prof:
        cnn(torch.randn(2, 3, 64, 64))
        enc(torch.randint(0, 1000, (2, 16)))
        grouped(torch.randn(1, 8, 9, 9))
        torch.mm(torch.randn(3, 4), torch.randn(4, 6))
        torch.baddbmm(torch.randn(2, 3, 5), torch.randn(2, 3, 4), torch.randn(2, 4, 5))
        x = torch.randn(2, 3)
        x * x, x + 1  # noqa: B018
    theirs: dict[int, int] = {}
    for e in prof.profiler.kineto_results.events():
        if e.flops():
            theirs[int(e.external_id())] = int(e.flops())
    path = tmp_path / "kineto.json"
    prof.export_chrome_trace(str(path))
    trace = load_kineto_json(path)
    for e in trace["traceEvents"]:  # as a trace without Kineto's own counts
        e.get("args", {}).pop("flops", None)
    ids = iter(range(1, 1 << 30))
    ops = [s for s in kineto_to_events(trace, TrackRegistry(), lambda: next(ids), lambda t: t).spans if s.level is Level.OP]
    ours = {s.attrs["kineto.external_id"]: s.attrs["ml.flops"] for s in ops if "ml.flops" in s.attrs}
    names = {s.name for s in ops if s.attrs.get("kineto.external_id") in theirs}
    assert {"aten::conv2d", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::mm", "aten::mul", "aten::add"} <= names
    assert len(theirs) > 40
    assert {k: ours.get(k) for k in theirs} == theirs
    # Where torch counts nothing, only mltrace's own rules (aten_flops) give a count.
    from mltrace.formats.aten_flops import _RULES

    torch_rules = {"aten::conv2d", "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::mul", "aten::add"}
    extra = {s.name for s in ops if "ml.flops" in s.attrs and s.attrs["kineto.external_id"] not in theirs}
    assert extra and extra <= set(_RULES) - torch_rules


def _op_tree(ops: list[Span]) -> dict[int, list[Span]]:
    """Each op's child ops by id: the ops its interval directly contains on its track."""
    children: dict[int, list[Span]] = {}
    stack: list[Span] = []
    for s in sorted(ops, key=lambda s: (s.track_id, s.start_ns, -s.end_ns)):
        while stack and not (stack[-1].track_id == s.track_id and stack[-1].start_ns <= s.start_ns and s.end_ns <= stack[-1].end_ns):
            stack.pop()
        if stack:
            children.setdefault(stack[-1].id, []).append(s)
        stack.append(s)
    return children


def test_mltrace_flop_counts_agree_with_the_matrix_products_inside_them(tmp_path: Path) -> None:
    """Where torch counts no FLOPs, ``aten_flops`` counts the multiply-adds of an op's matrix
    products or convolutions. Those ops wrap others: a count must equal the sum of the counts
    of the outermost counted ops inside it (scaling and residual ``mul``/``add``, the
    activation functions, normalizations and softmax, counted per element, aside), so the
    convolution wrappers, ``linear``, ``matmul``, attention, the native multi-head attention and
    the fused encoder layer are each checked against what they call."""
    import torch.nn.functional as F
    from torch.profiler import ProfilerActivity, profile

    from mltrace.tracer.sources.kineto import kineto_to_events, load_kineto_json
    from mltrace.tracer.tracks import TrackRegistry

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    try:
        from models import encoder
    finally:
        sys.path.pop(0)
    torch.manual_seed(0)
    enc = encoder(2).eval()
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 4, 7, 8), torch.randn(2, 4, 7, 6)
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        nn.Conv2d(16, 32, 3, padding=1)(torch.randn(1, 16, 32, 32))  # oneDNN
        nn.Conv2d(3, 8, 3, padding=1)(torch.randn(2, 3, 8, 8))  # torch's own (thnn) path
        F.conv1d(torch.randn(2, 3, 10), torch.randn(5, 3, 3), stride=2)
        nn.ConvTranspose2d(4, 6, 3, stride=2)(torch.randn(1, 4, 5, 5))
        enc(torch.randint(0, 1000, (2, 16)))  # the fused encoder layer (fast path)
        F.linear(torch.randn(2, 3, 4), torch.randn(5, 4))
        F.scaled_dot_product_attention(q, k, v)
        torch.matmul(torch.randn(3, 2, 4), torch.randn(4, 6))
    path = tmp_path / "kineto.json"
    prof.export_chrome_trace(str(path))
    ids = iter(range(1, 1 << 30))
    events = kineto_to_events(load_kineto_json(path), TrackRegistry(), lambda: next(ids), lambda t: t)
    ops = [s for s in events.spans if s.level is Level.OP]
    children = _op_tree(ops)

    from mltrace.formats.aten_flops import ACTIVATION_OPS, NORMALIZATION_OPS

    def counted_inside(op: Span) -> list[Span]:
        out = []
        for child in children.get(op.id, []):
            if "ml.flops" in child.attrs:
                if child.name not in ("aten::mul", "aten::add", *ACTIVATION_OPS, *NORMALIZATION_OPS):
                    out.append(child)
            else:
                out.extend(counted_inside(child))
        return out

    checked = set()
    for op in ops:
        inside = counted_inside(op)
        if "ml.flops" in op.attrs and inside:
            assert op.attrs["ml.flops"] == sum(c.attrs["ml.flops"] for c in inside), op.name
            checked.add(op.name)
    assert {
        "aten::conv2d",
        "aten::convolution",
        "aten::_convolution",
        "aten::thnn_conv2d",
        "aten::conv1d",
        "aten::conv_transpose2d",
        "aten::linear",
        "aten::matmul",
        "aten::scaled_dot_product_attention",
        "aten::_native_multi_head_attention",
        "aten::_transformer_encoder_layer_fwd",
    } <= checked
    counts = {s.name: s.attrs.get("ml.flops") for s in ops}
    assert counts["aten::mkldnn_convolution"] is not None and counts["aten::_slow_conv2d_forward"] is not None
    assert counts["aten::scaled_dot_product_attention"] == 2 * 8 * 5 * 7 * (8 + 6)  # B·H = 8, L = 5, S = 7


def test_recurrent_layers_count_each_token_through_each_weight_matrix(tmp_path: Path) -> None:
    """``aten::lstm``/``gru``/``rnn_*`` count 2 · tokens · the elements of their weight matrices
    (torch counts nothing for them), and so does each oneDNN layer inside an LSTM: before, an
    LSTM's only counted op was a bias ``add`` (256 FLOP a call), which outranked the layer's
    formula, so a 50 ms LSTM call was judged overhead-bound at 0.004 % of the roofline."""
    from torch.profiler import ProfilerActivity, profile

    from mltrace.tracer.sources.kineto import kineto_to_events, load_kineto_json
    from mltrace.tracer.tracks import TrackRegistry

    torch.manual_seed(0)
    layers = {
        "lstm": nn.LSTM(6, 8, num_layers=2, bidirectional=True, batch_first=True),
        "gru": nn.GRU(6, 8),
        "rnn": nn.RNN(6, 8, nonlinearity="relu"),
        "projected": nn.LSTM(6, 8, proj_size=4),
    }
    x = torch.randn(3, 5, 6)  # 15 tokens
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for layer in layers.values():
            layer(x)
        layers["gru"](nn.utils.rnn.pack_padded_sequence(torch.randn(5, 3, 6), [5, 4, 2]))  # 11 tokens
    path = tmp_path / "kineto.json"
    prof.export_chrome_trace(str(path))
    ids = iter(range(1, 1 << 30))
    events = kineto_to_events(load_kineto_json(path), TrackRegistry(), lambda: next(ids), lambda t: t)
    ops = [s for s in events.spans if s.level is Level.OP]
    outer = [s.attrs.get("ml.flops") for s in ops if s.name in ("aten::lstm", "aten::gru", "aten::rnn_relu")]

    def weights(m: nn.Module) -> int:
        return sum(p.numel() for p in m.parameters() if p.dim() == 2)

    expected = [2 * 15 * weights(m) for m in layers.values()] + [2 * 11 * weights(layers["gru"])]
    assert outer == expected
    children = _op_tree(ops)
    lstm = next(s for s in ops if s.name == "aten::lstm")
    onednn = [c.attrs["ml.flops"] for c in children[lstm.id] if c.name == "aten::mkldnn_rnn_layer"]
    assert len(onednn) == 4 and sum(onednn) == lstm.attrs["ml.flops"]  # 2 layers × 2 directions


def test_the_op_level_imports_no_torch_module_the_program_did_not(tmp_path: Path) -> None:
    """torch.profiler.profile's start imports torch._inductor (seconds and tens of MB) to read a
    CUDA graphs setting; the CPU profiler starts without it, and records the ops all the same."""
    from conftest import run_cli

    script = tmp_path / "prog.py"
    script.write_text(
        "import sys, torch\n"
        "m = torch.nn.Linear(4, 4)\n"
        "with torch.no_grad():\n"
        "    for _ in range(3):\n"
        "        m(torch.randn(2, 4))\n"
        "print(sorted(k for k in sys.modules if k.startswith('torch._inductor')))\n"
    )
    out = tmp_path / "run"
    done = run_cli("python", "-q", "--level", "op", "-o", str(out), str(script))
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout.decode().strip() == "[]"
    ops = [s for s in load_run(out).spans if s.level == Level.OP]
    assert sum(s.name == "aten::linear" for s in ops) == 3
    assert all("ml.input.shapes" in s.attrs for s in ops if s.name == "aten::linear")


def test_torchs_cycle_warning_is_not_printed_and_the_programs_filters_stay() -> None:
    """torch 2.10–2.11 warn at every torch.profiler start that it "clears events at the end of
    each cycle": mltrace's start hides that one warning, lets others through, and leaves the
    program's warning filters as they were."""
    import warnings

    from mltrace.tracer.sources.torch_ops import _start_quietly

    class Profiler:
        started = False

        def start(self) -> None:
            warnings.warn(
                "Warning: Profiler clears events at the end of each cycle.Only events from the current cycle will be reported.",
                UserWarning,
                stacklevel=1,
            )
            warnings.warn("something else", UserWarning, stacklevel=1)
            self.started = True

    prof = Profiler()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        filters = list(warnings.filters)
        _start_quietly(prof)
        assert warnings.filters == filters
    assert prof.started
    assert [str(w.message) for w in seen] == ["something else"]


def test_a_warning_shown_once_per_place_stays_shown_once_across_profiler_starts() -> None:
    """Hiding torch's cycle warning must not count as a change of the warning filters: one
    empties every module's record of the warnings it has shown, and a warning the program
    shows once per place showed again after each op-level cycle's start."""
    import warnings

    from mltrace.tracer.sources.torch_ops import _start_quietly

    class Profiler:
        def start(self) -> None:
            pass

    def warn_here() -> None:
        warnings.warn("once per place", UserWarning, stacklevel=1)

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")
        warn_here()
        _start_quietly(Profiler())
        warn_here()
        _start_quietly(Profiler())
        warn_here()
    assert [str(w.message) for w in seen] == ["once per place"]


def test_a_programs_default_warning_prints_once_when_traced_at_the_op_level(tmp_path: Path) -> None:
    """The program warns from one place between model calls for longer than several op-level
    cycles: its stderr has the warning once, as when it runs plain."""
    from conftest import run_cli

    script = tmp_path / "warn_once.py"
    script.write_text(
        "import time, warnings\n"
        "import torch\n"
        "model = torch.nn.Linear(8, 8)\n"
        "x = torch.randn(4, 8)\n"
        "end = time.monotonic() + 1.0\n"
        "while time.monotonic() < end:\n"
        "    model(x)\n"
        "    warnings.warn('shown once per place')\n"
        "print('done')\n"
    )
    done = run_cli("python", "-q", "--level", "op", "-o", str(tmp_path / "run"), str(script))
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout.decode() == "done\n"
    assert done.stderr.decode().count("UserWarning: shown once per place") == 1, done.stderr.decode()
    assert load_run(tmp_path / "run").meta["torch_profiler"]["cycles"] > 1


def test_a_program_that_runs_torch_profiler_itself(tmp_path: Path) -> None:
    """Kineto keeps one profiling session per process: where the program starts torch.profiler
    itself, mltrace's op level ends first (its ops so far kept) and the program's profiler sees
    what it sees without mltrace; the program's output and exit status are its own (mltrace's
    export used to crash the process: exit 139, the output lost)."""
    from conftest import SCRIPTS, mltrace_cmd

    script = str(SCRIPTS / "own_profiler.py")
    plain = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=300)
    traced = subprocess.run(mltrace_cmd("python", "-q", "-o", str(tmp_path / "run"), script), capture_output=True, text=True, timeout=300)
    assert plain.returncode == traced.returncode == 0, traced.stderr
    assert traced.stdout == plain.stdout and "saw: 1" in plain.stdout
    run = load_run(tmp_path / "run")
    assert run.complete and run.meta["errors"] == []
    assert run.meta["op_window"]["reason"] == "the program started torch.profiler itself"
    assert run.meta["op_window"]["ended_after_model_calls"] == 3
    assert sum(1 for s in run.spans if s.name == "aten::linear") == 3  # the calls before it


@pytest.mark.parametrize(("level", "hot_path"), [("op", "c"), ("layer", "c"), ("model", "c"), ("model", "python"), ("layer", "python")])
def test_a_program_profiling_with_stacks(tmp_path: Path, level: str, hot_path: str) -> None:
    """torch.profiler's ``with_stack=True`` reads ``nn.Module.__call__.__code__`` and the
    ``self`` of each of its frames: mltrace's ``__call__`` (the C one, or the Python one of the
    model level and of ``MLTRACE_LAYER_HOT_PATH=python``) gives both (the program failed with
    an AttributeError, or crashed). Nested module calls take torch's own ``__call__`` while a
    profile function runs, so the program's profiler sees every module call it sees plain (the
    C hot path's calls of ``forward`` hid them)."""
    from conftest import SCRIPTS, mltrace_cmd

    script = str(SCRIPTS / "own_profiler.py")
    plain = subprocess.run([sys.executable, script, "stack"], capture_output=True, text=True, timeout=300)
    env = {**os.environ, "MLTRACE_LAYER_HOT_PATH": hot_path} if hot_path == "python" else None
    cmd = mltrace_cmd("python", "-q", "--level", level, "-o", str(tmp_path / "run"), script, "stack")
    traced = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert plain.returncode == traced.returncode == 0, traced.stderr
    assert traced.stdout == plain.stdout and "saw: 1" in plain.stdout
    assert "Linear_0', 'nn.Module: ReLU_0', 'nn.Module: Sequential_0', 'nn.Module: Sequential_1']" in plain.stdout


def test_a_session_started_inside_the_programs_profiler_leaves_it_alone(tmp_path: Path) -> None:
    """The program's torch.profiler already runs when a session starts: mltrace's op level does
    not start (it would take the program's over), says so, and puts torch's functions back."""
    from collections import Counter

    import torch.autograd.profiler as autograd_profiler

    from mltrace import profile

    originals = (autograd_profiler._prepare_profiler, autograd_profiler._enable_profiler)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU()).eval()
    x = torch.randn(2, 8)
    with torch.no_grad(), torch.profiler.profile() as alone:
        model(x)
        model(x)
    with torch.no_grad(), torch.profiler.profile() as prof:
        with profile(output=tmp_path / "run", summary=False):
            model(x)
        model(x)
    # It sees what it sees without mltrace (no op of mltrace's own, such as its MKL warm-up).
    assert Counter(e.name for e in prof.events()) == Counter(e.name for e in alone.events())
    assert sum(1 for e in prof.events() if e.name == "aten::linear") == 2
    run = load_run(tmp_path / "run")
    assert any("the program's own torch.profiler was running" in text for text in run.meta["limitations"])
    assert not [s for s in run.spans if s.level is Level.OP]
    assert (autograd_profiler._prepare_profiler, autograd_profiler._enable_profiler) == originals


def test_the_op_level_puts_torchs_profiler_functions_back(tmp_path: Path) -> None:
    """While the op level runs, torch's ``_prepare_profiler`` and ``_enable_profiler`` are wrapped
    (a start of the program's own ends mltrace's op level); the session's stop unwraps them."""
    import torch.autograd.profiler as autograd_profiler

    from mltrace import profile

    originals = (autograd_profiler._prepare_profiler, autograd_profiler._enable_profiler)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU()).eval()
    with torch.no_grad(), profile(level="op", output=tmp_path / "run", summary=False):
        model(torch.randn(2, 8))
        assert autograd_profiler._enable_profiler is not originals[1]
    assert (autograd_profiler._prepare_profiler, autograd_profiler._enable_profiler) == originals
    assert sum(1 for s in load_run(tmp_path / "run").spans if s.name == "aten::linear") == 1


KINETO_QUIET = """
import os, sys, time, torch
model = torch.nn.Linear(4, 4)
for _ in range(20):
    model(torch.randn(2, 4))
    time.sleep(0.01)
print("KINETO_LOG_LEVEL", os.environ.get("KINETO_LOG_LEVEL"))
"""


@pytest.mark.parametrize("own", [None, "99"])
def test_kineto_prints_no_line_per_cycle_and_the_program_sees_its_own_environment(
    tmp_path: Path, own: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Kineto prints two lines a profiler start and stop at its default level: the op level's
    cycles quiet it for their first start only, so the program (and its children) see the
    environment they would see plain, and a level the user set stays theirs."""
    from conftest import run_cli

    script = tmp_path / "quiet.py"
    script.write_text(KINETO_QUIET)
    env = {"MLTRACE_OP_CYCLE_S": "0.01", **({"KINETO_LOG_LEVEL": own} if own else {})}
    monkeypatch.delenv("KINETO_LOG_LEVEL", raising=False)
    done = run_cli("python", "-q", "--level", "op", "-o", str(tmp_path / "run"), str(script), env=env)
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout.decode().strip() == f"KINETO_LOG_LEVEL {own}"
    assert b"USDT:" not in done.stderr and b"STAGE:" not in done.stderr
    assert load_run(tmp_path / "run").meta["torch_profiler"]["cycles"] >= 3
