"""Cross-stack on CPU, end to end: ops under layers, oneDNN/MKL calls under ops."""

from __future__ import annotations

from pathlib import Path

import mltrace
from conftest import SCRIPTS, run_cli, run_plain
from mltrace.run.levels import Level


def test_library_level_end_to_end(tmp_path: Path) -> None:
    script = SCRIPTS / "cross_stack.py"
    plain = run_plain(script)
    traced = run_cli("python", "-q", "--level", "library", "-o", str(tmp_path / "run"), str(script))
    assert traced.returncode == 0, traced.stderr.decode()
    assert traced.stdout == plain.stdout  # verbose library lines never reach stdout
    run = mltrace.load_run(tmp_path / "run")
    by_id = run.span_by_id()
    levels = {s.level for s in run.spans}
    assert {Level.MODEL, Level.LAYER, Level.OP, Level.LIBRARY} <= levels
    assert run.meta["levels"]["kernel"]["requested"] is False

    def ancestors(span_id: int | None) -> list[Level]:
        out = []
        while span_id is not None:
            s = by_id[span_id]
            out.append(s.level)
            span_id = s.parent_id
        return out

    # Every op that ran during a model call on its thread lies in a module span.
    models = [s for s in run.spans if s.level == Level.MODEL]
    ops = [s for s in run.spans if s.level == Level.OP]
    inside = [o for o in ops if any(m.track_id == o.track_id and m.start_ns <= o.start_ns and o.end_ns <= m.end_ns for m in models)]
    assert len(inside) > 100
    for op in inside:
        assert Level.MODEL in ancestors(op.parent_id), op
    # Both libraries show: oneDNN for the larger convolutions, MKL for the linear layers.
    lib = [s for s in run.spans if s.level == Level.LIBRARY]
    names = {s.attrs.get("ml.library.name") for s in lib}
    assert {"oneDNN", "MKL"} <= names
    # >= 95 % of the library calls captured from fd 1 are attributed to an op.
    info = run.meta["sources_info"]["cpu.library"]
    raw_calls = info["onednn"] + info["mkl"]
    attached = sum(1 for s in lib if s.parent_id is not None and by_id[s.parent_id].level == Level.OP)
    assert raw_calls == len(lib) and raw_calls > 20
    assert attached / raw_calls >= 0.95
    conv = next(s for s in lib if s.attrs.get("ml.library.kind") == "convolution")
    assert by_id[conv.parent_id].name in ("aten::mkldnn_convolution", "aten::convolution", "aten::_convolution")
    assert run.meta["correlation"]["check_containment"]["outside_parent"] == 0


def test_flash_attention_gemms_are_attributed_to_their_op(tmp_path: Path) -> None:
    # CPU flash attention runs one SGEMM per (query block, key block) on every intra-op
    # thread: the sizes are block sizes, not input dimensions, and the calls overlap. They
    # come in bursts while the program holds the GIL, so many lines are read late.
    script = SCRIPTS / "sdpa_attention.py"
    traced = run_cli("python", "-q", "--level", "library", "-o", str(tmp_path / "run"), str(script))
    assert traced.returncode == 0, traced.stderr.decode()
    assert traced.stdout == run_plain(script).stdout
    run = mltrace.load_run(tmp_path / "run")
    by_id = run.span_by_id()
    mkl = [s for s in run.spans if s.level == Level.LIBRARY and s.attrs.get("ml.library.name") == "MKL"]
    assert run.meta["sources_info"]["cpu.library"]["mkl"] == len(mkl) > 12
    attached = [s for s in mkl if s.parent_id is not None and by_id[s.parent_id].level == Level.OP]
    assert len(attached) / len(mkl) >= 0.95
    # 2 layers x 3 calls: every flash-attention op issued calls and got them (placed by the pass).
    flash = {
        by_id[s.parent_id].id
        for s in attached
        if by_id[s.parent_id].name == "aten::_scaled_dot_product_flash_attention_for_cpu"
        and s.attrs.get("ml.library.placement") == "estimated"
    }
    assert len(flash) == 6
