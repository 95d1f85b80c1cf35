"""oneDNN / MKL verbose line parsers and FLOP estimates, against real captured logs."""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path

import pytest

from mltrace.formats.verbose_logs import (
    MklCall,
    OneDnnCall,
    conv_flops,
    gemm_flops,
    gemm_mnk,
    inner_product_flops,
    is_verbose_line,
    matmul_flops,
    onednn_flops,
    parse_mkl_line,
    parse_onednn_line,
    parse_problem_desc,
)

DATA = Path(__file__).resolve().parent.parent / "data"
ONEDNN_EXEC = DATA / "onednn" / "torch_profile_exec.log"
ONEDNN_CREATE = DATA / "onednn" / "torch_toggle_create.log"
ONEDNN_TF = DATA / "onednn" / "tf_profile_exec.log"
MKL_LOG = DATA / "mkl" / "torch_mkl_verbose.log"


def lines_of(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines()


# -- every line of the real logs ------------------------------------------


@pytest.mark.parametrize(("path", "n_headers"), [(ONEDNN_EXEC, 7), (ONEDNN_CREATE, 7), (ONEDNN_TF, 8)], ids=lambda p: str(p))
def test_every_onednn_primitive_line_parses(path: Path, n_headers: int) -> None:
    lines = lines_of(path)
    verbose = [ln for ln in lines if is_verbose_line(ln.encode())]
    headers = [ln for ln in verbose if ",info," in ln]
    calls = [parse_onednn_line(ln) for ln in verbose if ln not in headers]
    # version, runtime, isa, gpu, graph backend, (TF's oneDNN: sparse), two templates
    assert len(headers) == n_headers
    assert calls and all(isinstance(c, OneDnnCall) for c in calls)
    assert all(parse_onednn_line(h) is None for h in headers)
    # user lines of the capture script are neither verbose nor parsed
    user = [ln for ln in lines if not is_verbose_line(ln.encode())]
    assert user and all(ln.startswith("== ") for ln in user)
    assert all(parse_onednn_line(ln) is None and parse_mkl_line(ln) is None for ln in user)


def test_onednn_exec_log_contents() -> None:
    calls = [c for c in map(parse_onednn_line, lines_of(ONEDNN_EXEC)) if c is not None]
    assert len(calls) == 19
    assert all(c.is_exec for c in calls)
    assert {c.kind for c in calls} == {"convolution", "deconvolution", "matmul", "reorder"}
    starts = [c.start_epoch_ns for c in calls if c.start_epoch_ns is not None]
    assert len(starts) == 19 and starts == sorted(starts)  # one thread issued them, in order


def test_tensorflow_log() -> None:
    calls = [c for c in map(parse_onednn_line, lines_of(ONEDNN_TF)) if c is not None]
    assert [c.kind for c in calls] == ["reorder", "convolution", "pooling", "gemm_api", "gemm_api"]
    dense = calls[3]  # Keras Dense(10) on the flattened 2x16x16x8 activations
    assert dense.impl == "" and dense.desc == "2x2048:2048x10"
    assert dense.start_epoch_ns == 1_795_322_967_352_106_934
    assert dense.duration_ns == 62_073_000
    assert onednn_flops(dense) == 2 * 2 * 10 * 2048
    assert onednn_flops(calls[1]) == 2 * 2 * 8 * 32 * 32 * 3 * 9  # Conv2D(8, 3, "same") on 2x32x32x3
    assert onednn_flops(calls[2]) is None  # pooling: memory-bound, not estimated


def test_onednn_create_log_has_creations_without_timestamps() -> None:
    calls = [c for c in map(parse_onednn_line, lines_of(ONEDNN_CREATE)) if c is not None]
    ops = [c.operation for c in calls]
    assert ops.count("exec") == 19
    assert ops.count("create:cache_miss") == 19
    assert ops.count("create_nested:cache_miss") == 1
    assert all(c.start_epoch_ns is None for c in calls)


def test_onednn_convolution_line_fields() -> None:
    line = lines_of(ONEDNN_EXEC)[9]
    call = parse_onednn_line(line + "\n")
    assert call == OneDnnCall(
        start_epoch_ns=1_795_322_166_121_667_969,
        duration_ns=2_150_150,
        operation="exec",
        engine="cpu",
        kind="convolution",
        impl="jit:avx512_core",
        prop="forward_training",
        memory="src:f32:a:blocked:abcd::f0 wei:f32:a:blocked:Acdb16a::f0 bia:f32:a:blocked:a::f0 dst:f32:a:blocked:aBcd16b::f0",
        attrs="attr-scratchpad:user",
        aux="alg:convolution_direct",
        desc="mb1_ic3oc64_ih224oh112kh7sh2dh0ph3_iw224ow112kw7sw2dw0pw3",
        component="primitive",
    )


def test_onednn_reorder_and_matmul_fields() -> None:
    lines = lines_of(ONEDNN_EXEC)
    reorder = parse_onednn_line(lines[8])
    assert reorder is not None
    assert (reorder.kind, reorder.impl, reorder.prop, reorder.aux, reorder.desc) == ("reorder", "jit:uni", "undef", "", "64x3x7x7")
    matmul = parse_onednn_line(lines[32])
    assert matmul is not None
    assert matmul.kind == "matmul" and matmul.impl == "brg_matmul:avx512_core_bf16"
    assert matmul.attrs == "attr-scratchpad:user attr-post-ops:sum"
    assert matmul.desc == "4x64:64x32"
    assert matmul.start_epoch_ns == 1_795_322_166_132_298_096
    assert matmul.duration_ns == 23_926  # 0.0239258 ms, rounded to the ns


def test_every_mkl_line_parses() -> None:
    lines = lines_of(MKL_LOG)
    verbose = [ln for ln in lines if is_verbose_line(ln.encode())]
    header = [ln for ln in verbose if ln.startswith("MKL_VERBOSE oneMKL")]
    assert len(header) == 1 and parse_mkl_line(header[0]) is None
    calls = [parse_mkl_line(ln) for ln in verbose if ln not in header]
    assert len(calls) == 31 and all(isinstance(c, MklCall) for c in calls)
    functions = {c.function for c in calls if c is not None}
    assert functions == {"SGEMM", "SGEMM_BATCH", "DGEMM", "SGEMV"}
    # the grad-mode attention runs SGEMMs on the second OpenMP thread
    assert {c.tid for c in calls if c is not None} == {0, 1}


def test_mkl_sgemm_fields() -> None:
    line = lines_of(MKL_LOG)[9]  # the nn.Linear(256, 128) on a 4x256 input
    call = parse_mkl_line(line)
    assert call is not None
    assert call.function == "SGEMM"
    assert call.args[:5] == ("T", "N", "128", "4", "256")
    assert call.args[5].startswith("0x") and len(call.args) == 13
    assert call.duration_ns == 30_360
    assert (call.tid, call.nthr) == (0, 2)
    assert call.settings == (("CNR", "OFF"), ("Dyn", "0"), ("FastMM", "1"))
    assert gemm_mnk(call) == (128, 4, 256)
    assert gemm_flops(call) == 2 * 128 * 4 * 256


@pytest.mark.parametrize(
    ("text", "duration_ns"),
    [
        ("MKL_VERBOSE SGEMM(N,N,2,2,2,0x1,0x2,2,0x3,2,0x4,0x5,2) 10.41ms CNR:OFF Dyn:0 FastMM:1 TID:0  NThr:2", 10_410_000),
        ("MKL_VERBOSE SGEMM(N,N,2,2,2,0x1,0x2,2,0x3,2,0x4,0x5,2) 812ns CNR:OFF TID:0 NThr:1", 812),
        ("MKL_VERBOSE SGEMM(N,N,2,2,2,0x1,0x2,2,0x3,2,0x4,0x5,2) 1.5s CNR:OFF TID:0 NThr:1", 1_500_000_000),
    ],
)
def test_mkl_duration_units(text: str, duration_ns: int) -> None:
    call = parse_mkl_line(text)
    assert call is not None and call.duration_ns == duration_ns


# -- other oneDNN layouts (from oneDNN's documentation of older versions) -------


@pytest.mark.parametrize(
    ("text", "start", "component"),
    [
        # oneDNN 2.x: no version, no component, dnnl_ prefix, no timestamp
        (
            "dnnl_verbose,exec,cpu,convolution,jit:avx2,forward_inference,src_f32::blocked:abcd:f0 "
            "dst_f32::blocked:aBcd8b:f0,,alg:convolution_direct,mb1_ic3oc64_ih224oh112kh7sh2dh0ph3_iw224ow112kw7sw2dw0pw3,2.16",
            None,
            "",
        ),
        # oneDNN 3.0-3.4 with ONEDNN_VERBOSE_TIMESTAMP=1: timestamp before the component
        (
            "onednn_verbose,1693400000123.25,primitive,exec,cpu,convolution,jit:avx2,forward_inference,src_f32::blocked:abcd:f0 "
            "dst_f32::blocked:aBcd8b:f0,,alg:convolution_direct,mb1_ic3oc64_ih224oh112kh7sh2dh0ph3_iw224ow112kw7sw2dw0pw3,2.16",
            1_693_400_000_123_250_000,
            "primitive",
        ),
    ],
)
def test_older_onednn_layouts(text: str, start: int | None, component: str) -> None:
    call = parse_onednn_line(text)
    assert call is not None
    assert call.start_epoch_ns == start
    assert call.component == component
    assert (call.kind, call.impl, call.prop) == ("convolution", "jit:avx2", "forward_inference")
    assert call.duration_ns == 2_160_000
    assert call.desc.startswith("mb1_ic3oc64")
    assert onednn_flops(call) == 236_027_904


@pytest.mark.parametrize(
    "text",
    [
        "",
        "hello world",
        "onednn_verbose,v1,info,oneDNN v3.12.0 (commit 80afa71049cd69a3df32adcccb623b12cd7baa22)",
        "onednn_verbose,v1,1795322166132.298096,graph,exec,cpu,100002,matmul_post_ops,,f32:ab,,strict,dnnl_backend,0.01",
        "onednn_verbose,v1,primitive,exec,cpu,convolution",  # truncated
        "onednn_verbose,v1,primitive,exec,cpu,reorder,jit:uni,undef,src dst,attr,,64x3x7x7,notanumber",
        "onednn_verbose,v1,primitive,error,cpu,convolution,jit,undef,a,b,c,d,1.0",
        "MKL_VERBOSE oneMKL 2024.0 Update 2 Product build 20240605",
        "MKL_VERBOSE SGEMM(N,N,2,2,2) fast CNR:OFF",
        "MKL_VERBOSE SGEMM N,N 1us",
        "xMKL_VERBOSE SGEMM(N) 1us",
        "\x00\xff garbage \ufffd",
    ],
)
def test_garbage_returns_none(text: str) -> None:
    assert parse_onednn_line(text) is None
    assert parse_mkl_line(text) is None


def test_is_verbose_line() -> None:
    assert is_verbose_line(b"onednn_verbose,v1,info,x\n")
    assert is_verbose_line(b"dnnl_verbose,exec,cpu")
    assert is_verbose_line(b"MKL_VERBOSE SGEMM(N) 1us")
    assert not is_verbose_line(b"MKL_VERBOSE=1")
    assert not is_verbose_line(b" onednn_verbose,")
    assert not is_verbose_line(b"hello\n")


# -- FLOP formulas on known shapes ------------------------------------------


def test_problem_desc_fields() -> None:
    p = parse_problem_desc("g16mb1_ic16oc16_ih32oh32kh3sh1dh0ph1_iw32ow32kw3sw1dw0pw1")
    assert p["g"] == 16 and p["mb"] == 1 and p["ic"] == 16 and p["oc"] == 16
    assert (p["ih"], p["oh"], p["kh"], p["sh"], p["dh"], p["ph"]) == (32, 32, 3, 1, 0, 1)


@pytest.mark.parametrize(
    ("desc", "kind", "flops"),
    [
        # ResNet stem: 64 filters of 3x7x7 over a 112x112 output: 2 * 64*112*112 * 3*49
        ("mb1_ic3oc64_ih224oh112kh7sh2dh0ph3_iw224ow112kw7sw2dw0pw3", "convolution", 2 * 64 * 112 * 112 * 3 * 49),
        # batch 2, 3x3, 16 -> 32 channels on 16x16
        ("mb2_ic16oc32_ih16oh16kh3sh1dh0ph1_iw16ow16kw3sw1dw0pw1", "convolution", 2 * 2 * 32 * 16 * 16 * 16 * 9),
        # depthwise: each output channel sees ic/g = 1 input channel
        ("g16mb1_ic16oc16_ih32oh32kh3sh1dh0ph1_iw32ow32kw3sw1dw0pw1", "convolution", 2 * 16 * 32 * 32 * 1 * 9),
        # 3D: depth counts like the other axes
        ("mb2_ic2oc4_id8od6kd3sd1dd0pd0_ih8oh6kh3sh1dh0ph0_iw8ow6kw3sw1dw0pw0", "convolution", 2 * 2 * 4 * 216 * 2 * 27),
        # deconvolution: every input pixel scatters ic * oc/g * k taps
        ("mb1_ic8oc4_ih16oh32kh4sh2dh0ph1_iw16ow32kw4sw2dw0pw1", "deconvolution", 2 * 8 * 256 * 4 * 16),
        # benchdnn short form: width omitted means width = height
        ("mb1ic3oc8ih10oh8kh3", "convolution", 2 * 8 * 64 * 3 * 9),
        ("64x3x7x7", "convolution", None),
        ("mb1_ic3oc64_ih224oh112kh7", "pooling", None),
    ],
)
def test_conv_flops(desc: str, kind: str, flops: int | None) -> None:
    assert conv_flops(desc, kind) == flops


def test_matmul_and_inner_product_flops() -> None:
    assert matmul_flops("4x64:64x32") == 2 * 4 * 32 * 64
    assert matmul_flops("3x8x16:1x16x4") == 2 * 3 * 8 * 4 * 16  # broadcast batch
    assert matmul_flops("*x64:64x32") is None
    assert matmul_flops("64x3x7x7") is None
    assert inner_product_flops("mb4ic256oc128") == 2 * 4 * 128 * 256
    assert inner_product_flops("mb2ic16ih4iw4oc10") == 2 * 2 * 10 * 16 * 16


def test_onednn_flops_by_kind() -> None:
    calls = [c for c in map(parse_onednn_line, lines_of(ONEDNN_EXEC)) if c is not None]
    flops = {(c.kind, c.desc): onednn_flops(c) for c in calls}
    assert flops[("matmul", "4x64:64x32")] == 16_384
    assert flops[("convolution", "mb1_ic3oc64_ih224oh112kh7sh2dh0ph3_iw224ow112kw7sw2dw0pw3")] == 236_027_904
    assert all(v is None for (kind, _), v in flops.items() if kind == "reorder")


def mkl(function: str, *args: str) -> MklCall:
    return MklCall(function, args, 1000, 0, 1)


@pytest.mark.parametrize(
    ("call", "flops"),
    [
        (mkl("SGEMM", "T", "N", "128", "4", "256", "0x1", "0x2", "256", "0x3", "256", "0x4", "0x5", "128"), 2 * 128 * 4 * 256),
        (mkl("DGEMM", "N", "N", "4", "8", "16", "0x1", "0x2", "4", "0x3", "16", "0x4", "0x5", "4"), 2 * 4 * 8 * 16),
        (mkl("ZGEMM", "N", "N", "2", "3", "4", "0x1", "0x2", "2", "0x3", "4", "0x4", "0x5", "2"), 8 * 2 * 3 * 4),
        (
            mkl("SGEMM_BATCH_STRIDED", "N", "N", "2", "3", "4", "0x1", "0x2", "2", "6", "0x3", "4", "12", "0x4", "0x5", "2", "6", "10"),
            2 * 2 * 3 * 4 * 10,
        ),
        (mkl("SGEMV", "t", "16", "8", "0x1", "0x2", "16", "0x3", "1", "0x4", "0x5", "1"), 2 * 16 * 8),
        (mkl("SGEMM_BATCH", "T", "N", "0x1", "0x2", "0x3"), None),  # sizes passed by pointer
        (mkl("FFT", "scfi64"), None),
    ],
)
def test_gemm_flops(call: MklCall, flops: int | None) -> None:
    assert gemm_flops(call) == flops


def test_gemm_flops_of_real_log() -> None:
    calls = [c for c in map(parse_mkl_line, lines_of(MKL_LOG)) if c is not None]
    dgemm = next(c for c in calls if c.function == "DGEMM")
    assert gemm_flops(dgemm) == 2 * 4 * 8 * 16  # 8x16 @ 16x4 in float64
    sgemv = next(c for c in calls if c.function == "SGEMV")
    assert gemm_flops(sgemv) == 2 * 16 * 8
    batches = [c for c in calls if c.function == "SGEMM_BATCH"]
    assert len(batches) == 2 and all(gemm_flops(c) is None for c in batches)


@pytest.mark.parametrize(
    "number",
    ["30.36", "0.5", "7", "12.", "0.0005", "0.0015", "0.00250", "2.5", "3.5", "0.0004999", "1795322145360.506104", "1e-05", "1.5e+3"],
)
def test_durations_and_stamps_read_exactly_as_decimal_reads_them(number: str) -> None:
    """Plain decimals are read with integers, not ``Decimal``: the same ns, halves rounded to even."""
    for unit, scale in (("ns", 1), ("us", 10**3), ("ms", 10**6), ("s", 10**9)):
        call = parse_mkl_line(f"MKL_VERBOSE SGEMV(N,2,2) {number}{unit} TID:0")
        assert call is not None and call.duration_ns == int((Decimal(number) * scale).to_integral_value())
    if "e" not in number:
        stamped = parse_onednn_line(
            f"onednn_verbose,v1,{number},primitive,exec,cpu,eltwise,jit,forward_inference,src:f32,,alg:eltwise_relu,2x2,{number}"
        )
        assert stamped is not None and stamped.start_epoch_ns == stamped.duration_ns == int((Decimal(number) * 10**6).to_integral_value())


def test_a_number_past_decimals_range_is_no_call() -> None:
    """A duration or stamp past ``Decimal``'s exponent range is garbage, not an exception on
    the flusher's thread."""
    assert parse_mkl_line("MKL_VERBOSE SGEMV(N,2,2) 1e99999999s TID:0") is None
    line = "onednn_verbose,v1,primitive,exec,cpu,eltwise,jit,forward_inference,src:f32,,alg:eltwise_relu,2x2,1e99999999"
    assert parse_onednn_line(line) is None
