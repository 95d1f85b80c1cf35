"""Parsers for the verbose logs of oneDNN and oneMKL (pure functions).

Both libraries print one line per call on the process's standard output (file
descriptor 1) when their verbose mode is on (``ONEDNN_VERBOSE=profile_exec``,
``MKL_VERBOSE=1``, or the runtime calls ``dnnl_set_verbose(1)`` and
``mkl_verbose(1)``). ``parse_onednn_line`` and ``parse_mkl_line`` read one such
line each; ``onednn_flops`` and ``gemm_flops`` count the work of a call from it.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from decimal import Decimal

ONEDNN_PREFIXES: tuple[bytes, ...] = (b"onednn_verbose,", b"dnnl_verbose,")
"""Line prefixes of oneDNN verbose output (``dnnl_`` before oneDNN 2.x renamed it)."""

MKL_PREFIX = b"MKL_VERBOSE "
"""Line prefix of oneMKL verbose output."""

VERBOSE_PREFIXES: tuple[bytes, ...] = (*ONEDNN_PREFIXES, MKL_PREFIX)
"""Every prefix that marks a library verbose line."""

_NS_PER_MS = Decimal(1_000_000)
_VERSION = re.compile(r"v\d+\Z")
_NUMBER = re.compile(r"\d+(?:\.\d*)?\Z")
_COMPONENTS = frozenset({"primitive", "graph", "common", "ukernel"})
# Operations whose last field is a time: executions and primitive creations.
_TIMED_OPERATIONS = ("exec", "create")
_MKL_LINE = re.compile(
    r"MKL_VERBOSE (?P<func>[A-Za-z_]\w*)\((?P<args>.*)\)\s+"
    r"(?P<time>\d+(?:\.\d*)?(?:e[-+]?\d+)?)(?P<unit>ns|us|ms|s)\b(?P<rest>.*)\Z"
)
_MKL_UNIT_NS = {"ns": Decimal(1), "us": Decimal(1_000), "ms": Decimal(1_000_000), "s": Decimal(1_000_000_000)}
_MKL_UNIT_DIGITS = {"ns": 0, "us": 3, "ms": 6, "s": 9}
_DESC_FIELD = re.compile(r"([a-z]+)(\d+)")


@dataclass(frozen=True, slots=True)
class OneDnnCall:
    """One oneDNN verbose line about a primitive (execution or creation).

    Attributes:
        start_epoch_ns: start of the call in ns since the Unix epoch, or None
            when the line has no timestamp (``ONEDNN_VERBOSE_TIMESTAMP`` unset).
        duration_ns: execution time (``exec``) or creation time (``create…``), ns.
        operation: ``"exec"``, ``"create:cache_miss"``, ``"create:cache_hit"``,
            ``"create_nested:cache_miss"``, …
        engine: ``"cpu"``, ``"gpu:0"``, …
        kind: primitive kind (``"convolution"``, ``"reorder"``, ``"matmul"``, …).
        impl: implementation (``"jit:avx512_core"``, ``"brg_matmul:avx512_core_bf16"``).
        prop: propagation kind (``"forward_training"``, ``"undef"`` for reorders).
        memory: memory descriptors, space separated (``"src:f32::blocked:abcd::f0 dst:…"``).
        attrs: primitive attributes (``"attr-scratchpad:user attr-post-ops:sum"``).
        aux: auxiliary information (``"alg:convolution_direct"``), may be empty.
        desc: problem description (``"mb1_ic3oc64_ih224oh112kh7…"``, ``"4x64:64x32"``).
        component: ``"primitive"`` (``""`` on oneDNN 2.x, which prints none).
    """

    start_epoch_ns: int | None
    duration_ns: int
    operation: str
    engine: str
    kind: str
    impl: str
    prop: str
    memory: str
    attrs: str
    aux: str
    desc: str
    component: str = "primitive"

    @property
    def is_exec(self) -> bool:
        """Whether the line reports an execution (not a creation)."""
        return self.operation == "exec"


@dataclass(frozen=True, slots=True)
class MklCall:
    """One oneMKL verbose line.

    Attributes:
        function: the routine as MKL names it (``"SGEMM"``, ``"DGEMM"``,
            ``"SGEMM_BATCH"``, ``"SGEMV"``, ``"FFT"``, …).
        args: the arguments as printed, one string each (pointers as ``0x…``).
        duration_ns: the call's duration (ns).
        tid: ``TID``, the OpenMP thread number of the caller (not an OS id);
            None if absent.
        nthr: ``NThr``, threads MKL could use for the call; None if absent.
        settings: every other ``key:value`` field (``{"CNR": "OFF", "Dyn": "0", …}``).
    """

    function: str
    args: tuple[str, ...]
    duration_ns: int
    tid: int | None
    nthr: int | None
    settings: tuple[tuple[str, str], ...] = ()


def is_verbose_line(line: bytes) -> bool:
    """Whether ``line`` (bytes, with or without its newline) is oneDNN or MKL verbose output."""
    return line.startswith(VERBOSE_PREFIXES)


def _ms_to_ns(text: str) -> int | None:
    """Converts a decimal number of milliseconds to integer ns (exactly, rounded half even).

    oneDNN stamps times with ``gettimeofday`` (µs resolution) and prints ms with 6 decimals;
    reading the decimals exactly, with no binary floating point on the way, adds no error.
    """
    exact = _plain_decimal_ns(text, 6)
    if exact is not None:
        return exact
    try:
        value = Decimal(text)
        if not value.is_finite() or value < 0:
            return None
        return int((value * _NS_PER_MS).to_integral_value())
    except ArithmeticError:  # not a number, or past Decimal's exponent range ("1e99999999")
        return None


def parse_onednn_line(line: str) -> OneDnnCall | None:
    """Parses one oneDNN verbose line about a primitive.

    The layout (``ONEDNN_VERBOSE_TIMESTAMP=1`` adds the start stamp, ms since the epoch)::

        onednn_verbose,v1,1795322145360.506104,primitive,exec,cpu,convolution,jit:avx512_core,
          forward_training,src:f32:a:blocked:abcd::f0 wei:... dst:...,attr-scratchpad:user,
          alg:convolution_direct,mb1_ic3oc64_ih224oh112kh7sh2dh0ph3_iw224ow112kw7sw2dw0pw3,3.48

    i.e. prefix, [version], [start], [component], operation, engine, primitive kind,
    implementation, propagation kind, memory descriptors, attributes, auxiliary, problem
    description, time (ms). oneDNN 2.x prints neither version nor component
    (``dnnl_verbose,exec,…``), earlier 3.x releases the component, recent ones (3.7 in
    TensorFlow 2.21, 3.12 in torch 2.13) both.

    Args:
        line: one line of output, with or without its trailing newline.

    Returns:
        The call, or None for anything else: ``info`` headers, graph-component
        lines, ``error``/``check`` lines, other output, garbage.
    """
    text = line.rstrip("\r\n")
    if not text.startswith(("onednn_verbose,", "dnnl_verbose,")):
        return None
    fields = text.split(",")
    i = 1
    if i < len(fields) and _VERSION.match(fields[i]):
        i += 1
    start_ns: int | None = None
    if i < len(fields) and _NUMBER.match(fields[i]):
        start_ns = _ms_to_ns(fields[i])
        i += 1
    component = ""
    if i < len(fields) and fields[i] in _COMPONENTS:
        component = fields[i]
        i += 1
    if component not in ("", "primitive"):
        return None  # graph partitions have another layout; torch eager does not use them
    if i >= len(fields) or not fields[i].startswith(_TIMED_OPERATIONS):
        return None
    operation = fields[i]
    rest = fields[i + 1 :]
    # engine, kind, impl, prop ... memory ..., attrs, aux, desc, time: memory
    # descriptors may in principle hold commas, so the tail is read from the end.
    if len(rest) < 9:
        return None
    duration_ns = _ms_to_ns(rest[-1])
    if duration_ns is None:
        return None
    return OneDnnCall(
        start_epoch_ns=start_ns,
        duration_ns=duration_ns,
        operation=operation,
        engine=rest[0],
        kind=rest[1],
        impl=rest[2],
        prop=rest[3],
        memory=",".join(rest[4:-4]),
        attrs=rest[-4],
        aux=rest[-3],
        desc=rest[-2],
        component=component,
    )


def parse_mkl_line(line: str) -> MklCall | None:
    """Parses one oneMKL verbose line.

    The layout::

        MKL_VERBOSE SGEMM(T,N,128,4,256,0x7ffc…,0x5639…,256,0x5639…,256,0x7ffc…,0x5639…,128) 30.36us
          CNR:OFF Dyn:0 FastMM:1 TID:0  NThr:2

    i.e. the function, its arguments as passed (pointers print as addresses, so batched
    calls show no sizes), the duration with a unit, and ``key:value`` settings. ``TID`` is
    the OpenMP thread number, not an OS thread id. There is no timestamp.

    Args:
        line: one line of output, with or without its trailing newline.

    Returns:
        The call, or None for the version header, other output and garbage.
    """
    parts = split_mkl_line(line)
    if parts is None:
        return None
    function, arguments, duration, rest = parts
    tid: int | None = None
    nthr: int | None = None
    settings: list[tuple[str, str]] = []
    for item in rest.split():
        key, sep, value = item.partition(":")
        if not sep:
            continue
        if key == "TID" and value.isdigit():
            tid = int(value)
        elif key == "NThr" and value.isdigit():
            nthr = int(value)
        else:
            settings.append((key, value))
    args = tuple(map(str.strip, arguments.split(","))) if arguments else ()
    return MklCall(
        function=function.upper(),
        args=args,
        duration_ns=duration,
        tid=tid,
        nthr=nthr,
        settings=tuple(settings),
    )


def split_mkl_line(line: str) -> tuple[str, str, int, str] | None:
    """The parts of an MKL verbose line: the function and arguments as printed, the duration
    (ns) and the text after it (settings, ``TID``, ``NThr``); None where ``parse_mkl_line``
    gives None. Two lines whose parts other than the duration are equal (pointers aside)
    are the same call; a caller that has parsed one of them whole need not parse the other.
    """
    m = _MKL_LINE.match(line.rstrip("\r\n"))
    if m is None:
        return None
    function, args, number, unit, rest = m.groups()
    duration = _mkl_duration_ns(number, unit)
    if duration is None:
        return None
    return function, args, duration, rest


#: An MKL argument that is a pointer: a whole comma-separated field, ``0x`` and hex digits.
POINTER_FIELD = re.compile(r"(?<![^,])0x[0-9a-fA-F]+(?![^,])")


def mkl_call_key(function: str, args: str, rest: str) -> str:
    """The parts of an MKL line (``split_mkl_line``'s but the duration) as one text, each pointer
    argument as ``*``: lines of the same key are the same call. The parts hold no newline
    (``_MKL_LINE``), so newlines join them unambiguously; ``mltrace._mklscan`` makes the same
    text in C."""
    return f"{function}\n{POINTER_FIELD.sub('*', args)}\n{rest}"


def _plain_decimal_ns(number: str, scale: int) -> int | None:
    """A plain decimal number (``"30.36"``, ``"12."``, ``"7"``) times ``10**scale``, read with
    integers and rounded half even, as ``Decimal`` reads it; None for any other form."""
    whole, _, fraction = number.partition(".")
    if not whole.isdigit() or not (fraction.isdigit() or not fraction) or not whole.isascii() or not fraction.isascii():
        return None
    ns = int(whole) * 10**scale + int(fraction[:scale].ljust(scale, "0") or "0")
    rest = fraction[scale:]
    if rest and (rest[0] > "5" or (rest[0] == "5" and (rest[1:].strip("0") or ns % 2))):
        ns += 1
    return ns


@functools.lru_cache(maxsize=4096)
def _mkl_duration_ns(number: str, unit: str) -> int | None:
    """An MKL duration (``"30.36"``, ``"us"``) as integer ns, read exactly and rounded half
    even; plain decimals are read with integers, exponent forms (``"1e-05"``) with ``Decimal``.
    Kept for the last 4,096 durations as printed: a loop's calls print the same few hundred
    again and again, and the flusher reads one for every MKL line (PERFORMANCE.md)."""
    exact = _plain_decimal_ns(number, _MKL_UNIT_DIGITS[unit])
    if exact is not None:
        return exact
    try:
        return int((Decimal(number) * _MKL_UNIT_NS[unit]).to_integral_value())
    except ArithmeticError:  # past Decimal's exponent range ("1e99999999")
        return None


# -- FLOP estimates -------------------------------------------------------


def parse_problem_desc(desc: str) -> dict[str, int]:
    """Splits a oneDNN convolution-style problem description into its numbers.

    ``"g16mb1_ic16oc16_ih32oh32kh3sh1dh0ph1_iw32ow32kw3sw1dw0pw1"`` gives
    ``{"g": 16, "mb": 1, "ic": 16, "oc": 16, "ih": 32, "oh": 32, "kh": 3, …}``.
    Names follow oneDNN's benchdnn: ``mb`` batch, ``g`` groups, ``ic``/``oc``
    channels, ``i``/``o``/``k``/``s``/``d``/``p`` + ``d``/``h``/``w`` input,
    output, kernel, stride, dilation and padding per spatial axis.
    """
    return {name: int(value) for name, value in _DESC_FIELD.findall(desc)}


def conv_flops(desc: str, kind: str = "convolution") -> int | None:
    """Estimates the FLOPs of a forward convolution or deconvolution (FLOP).

    Formula (two FLOPs per multiply-add; bias and post-ops not counted)::

        convolution:   2 * mb * oc * (od * oh * ow) * (ic / g) * (kd * kh * kw)
        deconvolution: 2 * mb * ic * (id * ih * iw) * (oc / g) * (kd * kh * kw)

    A deconvolution is the transpose of a convolution, so the roles of input
    and output swap. Missing spatial axes count 1 (2D and 1D problems omit the
    depth, and 1D the height); a missing width equals the height, as in
    benchdnn's short form.

    Args:
        desc: the oneDNN problem description.
        kind: ``"convolution"`` or ``"deconvolution"``.

    Returns:
        The FLOPs, or None when ``desc`` is not a convolution description.
    """
    p = parse_problem_desc(desc)
    if not {"ic", "oc"} <= p.keys() or not ({"oh", "kh"} <= p.keys() or {"ow", "kw"} <= p.keys()):
        return None
    mb, g = p.get("mb", 1), p.get("g", 1)

    def spatial(prefix: str) -> int:
        h = p.get(prefix + "h", 1)
        w = p.get(prefix + "w", h if prefix + "h" in p else 1)
        return p.get(prefix + "d", 1) * h * w

    kernel = spatial("k")
    if kind == "convolution":
        return 2 * mb * p["oc"] * spatial("o") * (p["ic"] // g) * kernel
    if kind == "deconvolution":
        return 2 * mb * p["ic"] * spatial("i") * (p["oc"] // g) * kernel
    return None


def matmul_flops(desc: str) -> int | None:
    """Estimates the FLOPs of a oneDNN matmul from ``"[B…x]MxK:[B…x]KxN"`` (FLOP).

    Formula: ``2 * batch * M * N * K`` with ``batch`` the product of the
    (broadcast) leading dimensions; bias and post-ops are not counted.
    Runtime dimensions (``*``) give None.
    """
    parts = desc.split(":")
    if len(parts) < 2:
        return None
    try:
        src = [int(v) for v in parts[0].split("x")]
        wei = [int(v) for v in parts[1].split("x")]
    except ValueError:
        return None
    if len(src) < 2 or len(src) != len(wei):
        return None
    batch = 1
    for a, b in zip(src[:-2], wei[:-2]):
        batch *= max(a, b)
    m, k = src[-2], src[-1]
    n = wei[-1]
    return 2 * batch * m * n * k


def inner_product_flops(desc: str) -> int | None:
    """Estimates the FLOPs of a oneDNN inner product from ``"mbXicY[ihH…]ocZ"`` (FLOP).

    Formula: ``2 * mb * oc * ic * (id * ih * iw)`` (spatial input dimensions,
    if any, are folded into the reduction).
    """
    p = parse_problem_desc(desc)
    if not {"mb", "ic", "oc"} <= p.keys():
        return None
    spatial = p.get("id", 1) * p.get("ih", 1) * p.get("iw", 1)
    return 2 * p["mb"] * p["oc"] * p["ic"] * spatial


def onednn_flops(call: OneDnnCall) -> int | None:
    """Estimates the FLOPs of one oneDNN forward primitive (FLOP), or None.

    Convolutions, deconvolutions, matmuls (and ``gemm_api``, oneDNN's BLAS-like
    ``dnnl_sgemm``, same description) and inner products are estimated
    (see the helpers above); backward passes and every other kind (reorders,
    eltwise, pooling, …, which are memory-bound) give None.
    """
    if not call.prop.startswith("forward") and call.kind not in ("matmul", "gemm_api"):
        return None
    if call.kind in ("convolution", "deconvolution"):
        return conv_flops(call.desc, call.kind)
    if call.kind in ("matmul", "gemm_api"):  # gemm_api: dnnl_sgemm calls (TensorFlow's MatMul)
        return matmul_flops(call.desc)
    if call.kind == "inner_product":
        return inner_product_flops(call.desc)
    return None


def gemm_mnk(call: MklCall) -> tuple[int, int, int] | None:
    """The ``(M, N, K)`` of a BLAS ``?GEMM`` or ``?GEMM_BATCH_STRIDED`` call, else None.

    BLAS signature: ``?GEMM(transa, transb, m, n, k, alpha, a, lda, b, ldb,
    beta, c, ldc)``. ``?GEMM_BATCH`` passes its sizes by pointer, so MKL's
    log shows addresses and the sizes cannot be known.
    """
    if not re.fullmatch(r"[SDCZ]GEMM(?:_BATCH_STRIDED)?", call.function) or len(call.args) < 5:
        return None
    try:
        return int(call.args[2]), int(call.args[3]), int(call.args[4])
    except ValueError:
        return None


def gemm_flops(call: MklCall) -> int | None:
    """Estimates the FLOPs of a BLAS GEMM or GEMV call from its sizes (FLOP).

    Formulas (two FLOPs per multiply-add; the ``beta * C`` term is not
    counted, since ``beta`` is printed only as a pointer)::

        SGEMM/DGEMM(…, M, N, K, …)                 2 * M * N * K
        CGEMM/ZGEMM (complex: 4 mul + 4 add)       8 * M * N * K
        ?GEMM_BATCH_STRIDED(…, batch_size)         the above * batch_size
        SGEMV/DGEMV(trans, M, N, …)                2 * M * N   (complex: 8 * M * N)

    Returns:
        The FLOPs, or None for other routines and for calls whose sizes MKL
        printed as pointers (``?GEMM_BATCH``).
    """
    per_mac = 8 if call.function[:1] in ("C", "Z") else 2
    mnk = gemm_mnk(call)
    if mnk is not None:
        m, n, k = mnk
        flops = per_mac * m * n * k
        if call.function.endswith("_BATCH_STRIDED"):
            try:
                flops *= int(call.args[-1])
            except ValueError:
                return None
        return flops
    if re.fullmatch(r"[SDCZ]GEMV", call.function) and len(call.args) >= 3:
        try:
            return per_mac * int(call.args[1]) * int(call.args[2])
        except ValueError:
            return None
    return None
