#!/usr/bin/env python3
"""Generates ``src/mltrace/formats/cuda_cbids.py``: CUDA API callback id → name.

CUPTI numbers every CUDA runtime and driver API function with a callback id
(cbid); cupti-python publishes them as enums (``RuntimeApiTraceCbid`` and
``DriverApiTraceCbid`` in 13.x, ``runtime_api_trace_cbid`` and
``driver_api_trace_cbid`` in 12.x). This script reads those enums from one
cupti-python per CUDA major version and writes them as plain dicts, so that a
cbid that arrives without a name (Kineto's ``INVALID`` for ids newer than its
own table, a record whose name lookup failed) still gets one.

Usage::

    python -m pip download --no-deps 'cupti-python==12.*' -d /tmp/cupti12
    python scripts/gen_cuda_cbid_names.py --cupti /tmp/cupti12/cupti_python-12.8.0-*.whl

The installed cupti-python is always read; each ``--cupti`` adds a wheel or an
unpacked wheel directory (the newest source per major version wins). Each
source is imported in its own interpreter, so two cupti packages never meet;
cupti-python 12.x imports ``cuda.cuda`` at load, which is stubbed when missing
(only the enums are read).

Rules applied to the enum members:

- the suffix ``_vNNNNN`` (the CUDA version that introduced the entry) is dropped,
  as mltrace shows API names (``cudaLaunchKernel_v7000`` → ``cudaLaunchKernel``);
- where an id has several members, the first (the enum's canonical name) is kept;
- ``INVALID``, ``SIZE``, ``FORCE_INT`` and placeholders (``cuda531``,
  ``reserved464``) are not names; a placeholder takes the real name a newer
  major version gives the same id (CUPTI never reuses an id), else the id is
  left out. So each major's table depends only on its own and newer sources,
  and the newest one on the installed cupti-python alone.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUTPUT = REPO / "src" / "mltrace" / "formats" / "cuda_cbids.py"

#: Run in a fresh interpreter: prints {"version", "runtime": {id: name}, "driver": {id: name}}
#: of the cupti-python found first on sys.path (argv[1]: a directory to put first, or "";
#: argv[2]: "stub" to stand in for the cuda-python modules cupti-python 12.x imports).
_READER = r"""
import importlib.metadata, json, sys, types
if sys.argv[1]:
    sys.path.insert(0, sys.argv[1])
if sys.argv[2] == "stub":
    pkg = types.ModuleType("cuda")
    pkg.__path__ = []
    sys.modules["cuda"] = pkg
    for sub in ("cuda", "cudart", "nvrtc"):
        mod = types.ModuleType("cuda." + sub)
        setattr(pkg, sub, mod)
        sys.modules["cuda." + sub] = mod
from cupti import cupti
enums = {name.replace("_", "").lower(): getattr(cupti, name) for name in dir(cupti)}
out = {"version": importlib.metadata.version("cupti-python")}
for api in ("runtime", "driver"):
    enum = enums[api + "apitracecbid"]
    out[api] = {int(m.value): m.name for m in enum}  # iteration skips aliases: canonical names
print(json.dumps(out))
"""

_SUFFIX = re.compile(r"_v\d+$")
_NOT_NAMES = frozenset({"INVALID", "SIZE", "FORCE_INT"})
_PLACEHOLDER = re.compile(r"(cuda|reserved)\d+")


def read_enums(location: str = "") -> dict[str, Any]:
    """The cbid enums of one cupti-python: the installed one (``""``) or one in a directory.

    Raises:
        RuntimeError: when that cupti-python cannot be imported, even with cuda-python stubbed.
    """
    errors = []
    for stub in ("", "stub"):
        proc = subprocess.run([sys.executable, "-c", _READER, location, stub], capture_output=True, text=True, check=False)
        if proc.returncode == 0:
            data: dict[str, Any] = json.loads(proc.stdout)
            return data
        errors.append(proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}")
    raise RuntimeError(f"cannot read cupti-python at {location or 'the installed one'}: {'; '.join(errors)}")


def read_source(path: Path, scratch: Path) -> dict[str, Any]:
    """The enums of a cupti-python wheel (unpacked into ``scratch``) or unpacked directory."""
    if path.is_dir():
        return read_enums(str(path))
    target = scratch / path.name
    with zipfile.ZipFile(path) as wheel:
        wheel.extractall(target)
    return read_enums(str(target))


def display_name(member: str) -> str | None:
    """The API name shown for an enum member, or None for a member that names no function."""
    if member in _NOT_NAMES:
        return None
    name = _SUFFIX.sub("", member)
    return None if _PLACEHOLDER.fullmatch(name) else name


def _raw_tables(sources: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """The newest source per CUDA major version."""
    by_major: dict[int, dict[str, Any]] = {}
    for src in sources:
        major = int(src["version"].split(".")[0])
        old = by_major.get(major)
        if old is None or _version_key(src["version"]) > _version_key(old["version"]):
            by_major[major] = src
    return dict(sorted(by_major.items()))


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version))


def build_tables(sources: list[dict[str, Any]]) -> tuple[dict[int, str], dict[str, dict[int, dict[int, str]]]]:
    """Display-name tables per API and major version, from the sources' raw enums.

    Returns:
        (the source of each major version, ``{"runtime"|"driver": {major: {cbid: name}}}``).
    """
    raw = _raw_tables(sources)
    versions = {major: f"cupti-python {src['version']}" for major, src in raw.items()}
    tables = {api: {major: _table(raw, api, major) for major in raw} for api in ("runtime", "driver")}
    return versions, tables


def _table(raw: dict[int, dict[str, Any]], api: str, major: int) -> dict[int, str]:
    """cbid → display name of one API in one major version."""
    table = {}
    for key, member in raw[major][api].items():
        name = display_name(member)
        if name is None and _PLACEHOLDER.fullmatch(_SUFFIX.sub("", member)):
            name = _newer_name(raw, api, major, int(key))
        if name is not None:
            table[int(key)] = name
    return dict(sorted(table.items()))


def _newer_name(raw: dict[int, dict[str, Any]], api: str, major: int, cbid: int) -> str | None:
    """The real name the nearest newer major version gives a placeholder id (CUPTI never
    reuses an id, and an older enum sometimes hides a name behind ``cudaNNN``)."""
    for newer in sorted(m for m in raw if m > major):
        name = display_name(raw[newer][api].get(str(cbid), "INVALID"))
        if name is not None:
            return name
    return None


def render(versions: dict[int, str], tables: dict[str, dict[int, dict[int, str]]]) -> str:
    """The text of the generated module."""
    lines = [
        '"""CUDA runtime and driver API names by CUPTI callback id (cbid), per CUDA major version.',
        "",
        "GENERATED by scripts/gen_cuda_cbid_names.py from cupti-python's cbid enums; do not edit.",
        "Sources: " + ", ".join(f"CUDA {m}: {v}" for m, v in versions.items()) + ".",
        "",
        "Names drop CUPTI's ``_vNNNNN`` suffix (``cudaLaunchKernel_v7000`` → ``cudaLaunchKernel``).",
        "Ids only grow from one CUDA release to the next, and the tables agree on every id",
        "they share except for a few names (CUDA 12's ``cudaGetDeviceProperties_v2`` is CUDA 13's",
        "``cudaGetDeviceProperties``), so ``api_name`` picks the table of the trace's CUDA major",
        "version when it is known and the newest table otherwise.",
        '"""',
        "",
        "from __future__ import annotations",
        "",
        "#: Where each major version's names came from.",
        "SOURCES: dict[int, str] = {" + ", ".join(f"{m}: {json.dumps(v)}" for m, v in versions.items()) + "}",
        "",
    ]
    for api, title in (("runtime", "RUNTIME"), ("driver", "DRIVER")):
        lines.append(f"#: CUDA {api} API: CUDA major version → cbid → name.")
        lines.append(f"{title}: dict[int, dict[int, str]] = {{")
        for major, table in tables[api].items():
            lines.append(f"    {major}: {{")
            lines.extend(f"        {cbid}: {json.dumps(name)}," for cbid, name in table.items())
            lines.append("    },")
        lines.append("}")
        lines.append("")
    lines += [
        "",
        "def api_name(api: str, cbid: int, cuda_major: int | None = None) -> str | None:",
        '    """The name of a CUDA API callback id, or None when no table names it.',
        "",
        "    Args:",
        '        api: ``"runtime"`` or ``"driver"``.',
        "        cbid: CUPTI's callback id.",
        "        cuda_major: CUDA major version of the trace (12, 13, …); None or one without a",
        "            table: the newest table.",
        '    """',
        '    tables = RUNTIME if api == "runtime" else DRIVER',
        "    table = tables.get(cuda_major) if cuda_major is not None else None",
        "    if table is None:",
        "        table = tables[max(tables)]",
        "    return table.get(cbid)",
        "",
    ]
    return "\n".join(lines)


def generate(extra: list[Path]) -> tuple[dict[int, str], str]:
    """The sources read per major version, and the module text, from the installed
    cupti-python and the ``extra`` wheels or directories."""
    with tempfile.TemporaryDirectory(prefix="cupti-enums-") as scratch:
        sources = [read_enums()] + [read_source(p, Path(scratch)) for p in extra]
    versions, tables = build_tables(sources)
    return versions, render(versions, tables)


def main(argv: list[str] | None = None) -> int:
    """Writes (or with ``--check`` compares) the generated module; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cupti", type=Path, action="append", default=[], metavar="WHEEL_OR_DIR", help="another cupti-python (e.g. 12.x)")
    parser.add_argument("-o", "--output", type=Path, default=DEFAULT_OUTPUT, help="module to write (default: %(default)s)")
    parser.add_argument("--check", action="store_true", help="exit 1 when the output differs from what would be written")
    args = parser.parse_args(argv)
    for path in args.cupti:
        if not path.exists():
            parser.error(f"no such wheel or directory: {path}")
    try:
        versions, text = generate(args.cupti)
    except RuntimeError as exc:
        sys.stderr.write(f"gen_cuda_cbid_names: {exc}\n")
        return 2
    read = ", ".join(f"CUDA {m}: {v}" for m, v in versions.items())
    if args.check:
        same = args.output.exists() and args.output.read_text() == text
        sys.stderr.write(f"{args.output}: {'up to date' if same else 'differs'} (read {read})\n")
        return 0 if same else 1
    args.output.write_text(text)
    sys.stderr.write(f"wrote {args.output} (read {read})\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
