"""mltrace._mklscan, which reads MKL verbose lines in C for the library level: each line it
decides is read as ``split_mkl_line`` reads it, and the library level's spans, counts and
events.jsonl rows are the same with it as in Python (``MLTRACE_MKL_PARSER=python``)."""

from __future__ import annotations

import importlib.util
import itertools
import random
from pathlib import Path

import pytest

from mltrace.formats.verbose_logs import mkl_call_key, split_mkl_line
from mltrace.tracer.fdtap import TappedLine, _tapped_lines
from mltrace.tracer.sources import library_records
from mltrace.tracer.sources.cpu_library import LibrarySpanMaker, library_spans
from mltrace.tracer.sources.library_records import LibraryRecords

pytestmark = pytest.mark.skipif(importlib.util.find_spec("mltrace._mklscan") is None, reason="the C helper mltrace._mklscan is not built")

DATA = Path(__file__).resolve().parents[1] / "data"
LOGS = [DATA / "mkl" / "torch_mkl_verbose.log", DATA / "onednn" / "torch_profile_exec.log", DATA / "onednn" / "torch_toggle_create.log"]
OFFSET = 1_795_000_000_000_000_000
GEMM = "MKL_VERBOSE SGEMM(N,N,64,64,64,0x7f1a2b3c4d50,0x55aa00112230,64,0x55aa00114440,64,0x7ffc01020304,0x55aa00116650,64)"
UNPARSED, QUIET, UNDECIDED = 0, 1, 2

#: Lines at the edges of the format, each with what the C helper is to say of it: "call", an
#: int (no call: UNPARSED, QUIET), or UNDECIDED (Python reads it).
EDGES: list[tuple[str, str | int]] = [
    (f"{GEMM} 30.36us CNR:OFF Dyn:0 FastMM:1 TID:0  NThr:2", "call"),
    (f"{GEMM} 812ns TID:0 NThr:1", "call"),
    (f"{GEMM} 1.5s", "call"),
    (f"{GEMM} 10.41ms CNR:OFF", "call"),
    (f"{GEMM}\t12.us\tTID:1", "call"),  # a tab, a number ending in its point
    (f"{GEMM}   7us", "call"),
    (f"{GEMM} 0.0005us TID:0", "call"),  # halves round to even: 0 ns
    (f"{GEMM} 0.0015us TID:0", "call"),  # 2 ns
    (f"{GEMM} 0.00150001us TID:0", "call"),  # above the half: 2 ns
    (f"{GEMM} 0.0025us TID:0", "call"),  # 2 ns
    (f"{GEMM} 1795322145360.506104ms", "call"),
    (f"{GEMM} 9223372036854775807ns", "call"),  # the largest int64
    (f"{GEMM} 9223372036854775808ns", UNDECIDED),  # past it: Python keeps it whole (then no call)
    (f"{GEMM} 99999999999999999999999999s TID:0", UNDECIDED),
    (f"{GEMM} 9223372036.8547758075s", UNDECIDED),  # rounds past int64
    (f"{GEMM} 1e-05us TID:0", UNDECIDED),  # exponent forms: Decimal's reading, in Python
    (f"{GEMM} 1e99999999s TID:0", UNDECIDED),
    (f"{GEMM} 5usx", UNPARSED),  # no word boundary after the unit
    (f"{GEMM} 5 us", UNPARSED),
    (f"{GEMM} us", UNPARSED),
    (f"{GEMM}5us", UNPARSED),  # no space before the duration
    (f"{GEMM} 5e+us", UNPARSED),
    (f"{GEMM} 5ps", UNPARSED),
    (f"{GEMM} 5s, 6us", "call"),
    ("MKL_VERBOSE F(a) 5us) 3us rest (x) 4ms", "call"),  # the arguments end at the last ')' that fits
    ("MKL_VERBOSE F(a) 5us) 3usx", "call"),
    ("MKL_VERBOSE F() 5us", "call"),
    ("MKL_VERBOSE _f9(0x1,0X2, 0x3,0x,0xg,0x1f2e,a0x1,0x1z) 5us", "call"),  # which arguments are pointers
    ("MKL_VERBOSE 9F(a) 5us", UNPARSED),
    ("MKL_VERBOSE F (a) 5us", UNPARSED),
    ("MKL_VERBOSE F(a 5us", UNPARSED),
    ("MKL_VERBOSE ", UNPARSED),
    ("MKL_VERBOSE", UNPARSED),
    ("", UNPARSED),
    ("MKL_VERBOSEX SGEMM(a) 5us", UNPARSED),
    ("mkl_verbose SGEMM(a) 5us", UNPARSED),
    ("MKL_VERBOSE oneMKL 2024.0 Update 2 Product build 20240605 for Intel(R) 64 architecture", QUIET),
    ("MKL_VERBOSE something,info,else", QUIET),
    ("random output,info,", QUIET),
    (f"{GEMM} 5us\r", "call"),  # a carriage return at the end is no part of the line
    (f"{GEMM} 5us\r\n", "call"),
    (f"{GEMM} 5us\rTID:0", UNDECIDED),  # control characters: Python's reading
    (f"{GEMM} 5us\x1fTID:0", UNDECIDED),
    (f"{GEMM} 5us\x7f", UNDECIDED),
    (f"{GEMM} 5us é", UNDECIDED),  # beyond ASCII
    (f"{GEMM} ５us", UNDECIDED),  # a full-width digit, which \\d takes
    ("onednn_verbose,v1,primitive,exec,cpu,eltwise,jit,forward_inference,src:f32,,alg:eltwise_relu,2x2,0.5", UNDECIDED),
    ("dnnl_verbose,exec,cpu,eltwise,jit,forward_inference,src:f32,,alg:eltwise_relu,2x2,0.5", UNDECIDED),
]


def scan_one(line: str) -> tuple[str | int, int]:
    from mltrace import _mklscan

    what, durations = _mklscan.scan([line])
    return what[0], durations[0]


def assert_read_as_python_reads(line: str) -> str | int:
    """What the C helper says of ``line``, checked against ``split_mkl_line``; returns "call"
    for a call."""
    what, duration = scan_one(line)
    parts = split_mkl_line(line)
    if isinstance(what, str):
        assert parts is not None, line
        function, args, parts_ns, rest = parts
        assert (what, duration) == (mkl_call_key(function, args, rest), parts_ns), line
        return "call"
    assert duration == 0
    if what in (UNPARSED, QUIET):
        assert parts is None, line
        quiet = line.startswith("MKL_VERBOSE oneMKL") or ",info," in line
        assert what == (QUIET if quiet else UNPARSED), line
    else:
        assert what == UNDECIDED, line
    return what


@pytest.mark.parametrize(("line", "expected"), EDGES, ids=range(len(EDGES)))
def test_each_line_is_read_as_python_reads_it(line: str, expected: str | int) -> None:
    assert assert_read_as_python_reads(line) == expected


def test_the_keys_mask_whole_pointer_fields_only() -> None:
    what, _ = scan_one("MKL_VERBOSE _f9(0x1,0X2, 0x3,0x,0xg,0x1f2e,a0x1,0x1z) 5us")
    assert what == "_f9\n*,0X2, 0x3,0x,0xg,*,a0x1,0x1z\n"


def test_every_line_of_the_real_logs_is_read_as_python_reads_it() -> None:
    """Every MKL call of the capture is decided in C (none left to Python), every oneDNN line
    is left to Python."""
    for path in LOGS:
        said = [assert_read_as_python_reads(line) for line in path.read_text(encoding="utf-8").splitlines()]
        if "mkl" in path.parts:
            assert said.count("call") == 31 and UNDECIDED not in said
        else:
            assert "call" not in said and said.count(UNDECIDED) > 10


def random_line(rng: random.Random) -> str:
    """A line made of the format's parts, each in its first (right) form half the time, else
    in any of its forms, right and wrong."""

    def pick(forms: list[str]) -> str:
        return forms[0] if rng.random() < 0.5 else rng.choice(forms)

    junk = ["", ")", "(", " ", "\t", ",", "x", "_", "é", "\r", "5", "us", "e"]
    parts = [
        pick(["MKL_VERBOSE ", "MKL_VERBOSE ", "MKL_VERBOSE", "MKL_VERBOSE  ", "onednn_verbose,", "x"]),
        pick(["SGEMM", "F", "_g9", "9F", "", "S GEMM", "SGEMMé"]),
        pick(["(", "(", " (", ""]),
        ",".join(
            pick(["N", "64", "0x7f1a", "0x", "0xg", " 0x1", "0X1", "a0x1", ")", ") 5us", "", "é"]) for _ in range(rng.randrange(0, 6))
        ),
        pick([")", ")", "", ") 3us)"]),
        pick([" ", " ", "\t", "  ", "", "\x0b"]),
        pick(["30.36", "7", "12.", "0.0005", "0.0015", "1e-05", "1.5e+3", "5e", "5e+", ".5", "", "９", "99999999999999999999"]),
        pick(["us", "ns", "ms", "s", "ps", "u", "m", "usx", "s_", "s9"]),
        pick(["", " CNR:OFF Dyn:0 FastMM:1 TID:0  NThr:2", " TID:1", ",info,", ") 4ms", "\r", "\x1f", " é"]),
    ]
    if rng.random() < 0.3:
        at = rng.randrange(len(parts))
        parts[at] += rng.choice(junk)
    return "".join(parts)


def test_random_lines_are_read_as_python_reads_them() -> None:
    """Lines of the format's parts in right and wrong forms (fixed seed): the C reading of
    ``_MKL_LINE`` agrees with the regular expression's, its backtracking included."""
    rng = random.Random(7)
    said = [assert_read_as_python_reads(random_line(rng)) for _ in range(20_000)]
    assert said.count("call") > 1_000 and said.count(UNPARSED) > 1_000 and said.count(UNDECIDED) > 1_000
    assert said.count(QUIET) > 100


def test_non_utf8_bytes_are_left_to_python() -> None:
    """The tap decodes invalid bytes as U+FFFD: such a line is Python's to read."""
    block = f"{GEMM} 5us TID:0\n{GEMM} 5us TID:\xff0\n".encode("latin-1")
    lines = list(_tapped_lines(1, block))
    from mltrace import _mklscan

    what, durations = _mklscan.scan(lines)
    assert isinstance(what[0], str) and durations[0] == 5_000
    assert what[1] == UNDECIDED and "\ufffd" in lines[1].text


def test_items_that_are_no_line_are_left_to_python() -> None:
    from mltrace import _mklscan

    assert _mklscan.scan([b"MKL_VERBOSE F() 5us", (1,), 3, TappedLine(1, "MKL_VERBOSE F() 5us")]) == ([2, 2, 2, "F\n\n"], [0, 0, 0, 5_000])
    assert _mklscan.scan([]) == ([], [])
    with pytest.raises(TypeError):
        _mklscan.scan(5)  # type: ignore[arg-type]


def spans_and_rows(
    lines: list[TappedLine], monkeypatch: pytest.MonkeyPatch, parser: str | None
) -> tuple[list[object], dict[str, int], bytes]:
    """The spans (with their attributes in order) and counts of ``lines``, and the
    events.jsonl rows of the same calls, read in C (``parser`` None) or in Python."""
    if parser is None:
        monkeypatch.delenv("MLTRACE_MKL_PARSER", raising=False)
    else:
        monkeypatch.setenv("MLTRACE_MKL_PARSER", parser)
    monkeypatch.setattr(library_records, "_new_template_ids", itertools.count(library_records.TEMPLATE_BASE))
    spans, counts = library_spans(lines, lambda ns: ns - OFFSET, 7, itertools.count(1).__next__)
    monkeypatch.setattr(library_records, "_new_template_ids", itertools.count(library_records.TEMPLATE_BASE))
    maker = LibrarySpanMaker(lambda ns: ns - OFFSET, 7, itertools.count(1).__next__)
    assert (maker._scan is None) == (parser == "python")  # type: ignore[attr-defined]
    records = LibraryRecords()
    for i in range(0, len(lines), 64):
        maker.add_records(lines[i : i + 64], records)
    templates, rows, n = records.encode()
    assert n == len(spans) and maker.summary() == counts
    return [(s, list(s.attrs.items())) for s in spans], counts, templates + b"\n" + rows


def test_the_real_logs_give_the_same_spans_and_rows_both_ways(monkeypatch: pytest.MonkeyPatch) -> None:
    lines = [
        TappedLine(5_000_000 + 1_000 * i, text)
        for i, text in enumerate(ln for path in LOGS for ln in path.read_text(encoding="utf-8").splitlines() if not ln.startswith("== "))
    ]
    in_c = spans_and_rows(lines, monkeypatch, None)
    assert in_c == spans_and_rows(lines, monkeypatch, "python")
    assert in_c[1]["mkl"] == 31 and in_c[1]["onednn"] > 10


def test_edge_lines_give_the_same_spans_and_counts_both_ways(monkeypatch: pytest.MonkeyPatch) -> None:
    """Malformed lines, lines left to Python, durations past 64 bits, and calls seen again,
    mixed. A duration past 64 bits is no call, and leaves no part of a row behind (the rows
    once lost their alignment there, and the spans their templates)."""
    texts = [line for line, _ in EDGES] * 2
    lines = [TappedLine(10**12 + 1_000 * i, text) for i, text in enumerate(texts)]
    in_c = spans_and_rows(lines, monkeypatch, None)
    assert in_c == spans_and_rows(lines, monkeypatch, "python")
    counts = in_c[1]
    # Left to Python: 1e-05us and five lines with characters C leaves alone are calls, the two
    # oneDNN lines too; three durations past 64 bits and 1e99999999s are none.
    calls = sum(1 for _, said in EDGES if said == "call")
    unparsed = sum(1 for _, said in EDGES if said == UNPARSED)
    assert (counts["mkl"], counts["onednn"], counts["unparsed"]) == (2 * (calls + 6), 2 * 2, 2 * (unparsed + 4))
