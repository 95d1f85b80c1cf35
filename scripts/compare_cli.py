"""Compares what the CLI gives on the examples between two revisions of mltrace.

    python scripts/compare_cli.py 189fa32            # that revision against the working tree
    python scripts/compare_cli.py 189fa32 HEAD~3     # two revisions

Each revision is checked out in a scratch git worktree (its C helpers built there), and both run
the same commands with the same interpreter: ``mltrace python`` on every example (and one at
``--level layer``), ``mltrace report`` as text, Markdown and JSON, ``export``, ``diff``, every
subcommand's ``--help``, and the usage errors. What is compared is what does not depend on
timing:

- the recorded spans: a count per (level, name), which must be equal;
- the run directory's files, and the key paths of run.json and of the JSON report;
- exit statuses, and stdout/stderr with numbers replaced by ``N`` and timing-ordered table rows
  set aside (rows are ranked by time, so their order and membership move between runs).

Differences are printed; the verdict line says whether any touched the spans, files, exit
statuses or removed a key (added keys and changed wording are listed for review, since a newer
revision may add features). Exit status: 0 when the spans, files and statuses agree and no key
was removed, 1 otherwise, 2 for usage.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ("infer", "mobilenet", "ort_infer", "keras_infer")
#: First characters of the lines of a drawn table (rich's box characters, Markdown's pipe).
TABLE_LINE_STARTS = frozenset("│┃┏┡└┗╇━─|")
#: Key paths whose keys are data (a verdict's name) or depend on the item (``findings``, the report
#: schema's one open object), compared as one ``*`` key.
DATA_KEYED = (".findings[]", ".findings[].ns")
#: A revision's results: command name → (exit status, stdout, stderr).
Results = dict[str, tuple[int, str, str]]
SUBCOMMANDS = ("python", "report", "export", "import", "view", "diff", "bench", "bricks", "metrics", "merge")


def commands(out: Path) -> list[tuple[str, list[str]]]:
    """The (name, mltrace arguments) pairs run for one revision, writing runs under ``out``."""
    cmds: list[tuple[str, list[str]]] = [("help", ["--help"])]
    cmds += [(f"help-{s}", [s, "--help"]) for s in SUBCOMMANDS]
    for ex in EXAMPLES:
        run = str(out / f"r-{ex}")
        cmds += [
            (f"run-{ex}", ["python", "-o", run, "--name", ex, f"examples/{ex}.py", "--iters", "3"]),
            (f"report-{ex}", ["report", run, "--top", "10", "--width", "200"]),
            (f"reportmd-{ex}", ["report", run, "--format", "md"]),
            (f"reportjson-{ex}", ["report", run, "--format", "json"]),
        ]
    layer = str(out / "r-layer")
    exit3 = out / "exit3.py"
    exit3.write_text('import sys\nprint("a")\nsys.exit(3)\n')
    cmds += [
        ("run-layer", ["python", "--level", "layer", "-o", layer, "--name", "layer", "examples/infer.py", "--iters", "3"]),
        ("report-layer", ["report", layer, "--width", "200"]),
        ("export-chrome", ["export", str(out / "r-infer"), "--format", "chrome-json", "-o", str(out / "x.json")]),
        ("diff", ["diff", str(out / "r-infer"), layer, "--width", "200"]),
        ("exit3", ["python", "-o", str(out / "r-exit"), str(exit3)]),
        ("err-noargs", ["python"]),
        ("err-badlevel", ["python", "--level", "nope", "examples/infer.py"]),
        ("err-report-missing", ["report", "/nonexistent/run"]),
        ("err-script-missing", ["python", "/nonexistent.py"]),
        ("err-unknown", ["frobnicate"]),
    ]
    return cmds


def run_revision(src: Path, out: Path) -> Results:
    """Runs every command with ``src``'s mltrace; returns name → (status, stdout, stderr)."""
    out.mkdir(parents=True)
    env = dict(os.environ, PYTHONPATH=str(src / "src"), OMP_NUM_THREADS="1", TF_CPP_MIN_LOG_LEVEL="3")
    results = {}
    for name, args in commands(out):
        p = subprocess.run([sys.executable, "-m", "mltrace", *args], cwd=ROOT, env=env, capture_output=True, text=True, check=False)
        results[name] = (p.returncode, p.stdout, p.stderr)
        print(f"  {name}: exit {p.returncode}", file=sys.stderr)
    return results


def normalised(text: str, out: Path, src: Path) -> list[str]:
    """``text``'s lines without paths, numbers and timing-ranked table rows."""
    text = text.replace(str(out), "RUNS").replace(str(src), "ROOT").replace(str(ROOT), "ROOT")
    lines = []
    for line in text.splitlines():
        if line[:1] in TABLE_LINE_STARTS:
            continue  # a table's row or rule: rows are ranked by time, and widths follow the names
        line = re.sub(r"\d+(\.\d+)?", "N", line)
        lines.append(re.sub(r"\s+", " ", line).strip())
    return lines


def key_paths(obj: Any, prefix: str = "") -> set[str]:
    """The key paths of a JSON value (lists by their first 50 items); a list's items under ``[]``."""
    if isinstance(obj, dict) and prefix in DATA_KEYED:
        return {prefix + ".*"}
    if isinstance(obj, dict):
        return set().union(*(key_paths(v, f"{prefix}.{k}") for k, v in obj.items())) if obj else {prefix + "{}"}
    if isinstance(obj, list):
        return {prefix + "[]"}.union(*(key_paths(v, prefix + "[]") for v in obj[:50]))
    return {prefix}


def removed_keys(ka: set[str], kb: set[str]) -> set[str]:
    """Paths of ``ka`` missing from ``kb``, leaving out those under a list ``kb`` has empty
    (its items' keys cannot be seen there)."""
    removed = set()
    for key in ka - kb:
        at = key.rfind("[]", 0, len(key) - 2 if key.endswith("[]") else len(key))  # the list it lies in
        items = key[: at + 2] if at >= 0 else None
        if items is None or any(k.startswith(items) and k != items for k in kb):
            removed.add(key)
    return removed


def span_counts(run_dir: Path) -> collections.Counter[tuple[str, str]]:
    """(level, name) → spans, read with the working tree's loader."""
    from mltrace.run.store import load_run

    return collections.Counter((str(s.level), s.name) for s in load_run(run_dir).spans)


def report_keys(result: tuple[int, str, str]) -> set[str]:
    """Key paths of a ``report --format json`` output (empty if it is not JSON)."""
    try:
        return key_paths(json.loads(result[1]))
    except json.JSONDecodeError:
        return set()


def compare_outputs(a: Path, b: Path, ra: Results, rb: Results, srcs: tuple[Path, Path]) -> bool:
    """Prints the commands' differing statuses and text; True when no status differs."""
    ok = True
    for name in ra:
        if name.startswith("help-") and ra[name][0] == 2 and rb[name][0] == 0:
            print(f"subcommand added: {name.removeprefix('help-')}")
        elif ra[name][0] != rb[name][0]:
            ok = False
            print(f"EXIT {name}: {ra[name][0]} → {rb[name][0]}")
        if name.startswith("reportjson-"):
            continue  # compared by key paths in compare_runs
        for stream, text_a, text_b in (("stdout", ra[name][1], rb[name][1]), ("stderr", ra[name][2], rb[name][2])):
            la, lb = normalised(text_a, a, srcs[0]), normalised(text_b, b, srcs[1])
            if la != lb:
                print(f"text {name} {stream}:")
                print("".join(f"   - {line[:160]}\n" for line in sorted(set(la) - set(lb))), end="")
                print("".join(f"   + {line[:160]}\n" for line in sorted(set(lb) - set(la))), end="")
    return ok


def compare_keys(what: str, ka: set[str], kb: set[str]) -> bool:
    """Prints removed and added key paths; True when none was removed."""
    added, removed = removed_keys(kb, ka), removed_keys(ka, kb)
    if added:
        print(f"keys added {what}: {sorted(added)}")
    if removed:
        print(f"KEYS REMOVED {what}: {sorted(removed)}")
    return not removed


def compare_run(ex: str, da: Path, db: Path) -> bool:
    """Prints how two run directories of one example differ; True when files, spans and keys agree."""
    ok = True
    fa = {str(f.relative_to(da)) for f in da.rglob("*") if f.is_file()}
    fb = {str(f.relative_to(db)) for f in db.rglob("*") if f.is_file()}
    if fa != fb:
        ok = False
        print(f"FILES {ex}: - {sorted(fa - fb)} + {sorted(fb - fa)}")
    ca, cb = span_counts(da), span_counts(db)
    if ca != cb:
        ok = False
        changed = {k: (ca[k], cb[k]) for k in ca.keys() | cb.keys() if ca[k] != cb[k]}
        print(f"SPANS {ex}: {len(changed)} (level, name) counts differ, e.g. {sorted(changed.items())[:5]}")
    else:
        print(f"spans {ex}: {sum(ca.values())} spans, the same per (level, name)")
    meta_a = key_paths(json.loads((da / "run.json").read_text()))
    meta_b = key_paths(json.loads((db / "run.json").read_text()))
    return compare_keys(f"{ex} run.json", meta_a, meta_b) and ok


def compare_runs(a: Path, b: Path, ra: Results, rb: Results) -> bool:
    """Compares every example's run directory and JSON report; True when nothing essential differs."""
    ok = True
    for ex in (*EXAMPLES, "layer"):
        ok = compare_run(ex, a / f"r-{ex}", b / f"r-{ex}") and ok
        if ex in EXAMPLES:
            name = f"reportjson-{ex}"
            ok = compare_keys(f"{ex} report JSON", report_keys(ra[name]), report_keys(rb[name])) and ok
    return ok


def checkout(rev: str, into: Path) -> Path:
    """A worktree of ``rev`` under ``into`` with its C helpers built."""
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(into), rev], check=True)
    subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=into, check=True, capture_output=True)
    return into


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base", help="the revision to compare against")
    parser.add_argument("new", nargs="?", help="the revision to compare (default: the working tree)")
    ns = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="mltrace-compare-"))
    trees: list[Path] = []
    try:
        trees.append(checkout(ns.base, scratch / "base"))
        new_src = checkout(ns.new, scratch / "new") if ns.new else ROOT
        if ns.new:
            trees.append(new_src)
        print(f"running {ns.base}", file=sys.stderr)
        ra = run_revision(trees[0], scratch / "out-base")
        print(f"running {ns.new or 'the working tree'}", file=sys.stderr)
        rb = run_revision(new_src, scratch / "out-new")
        a, b = scratch / "out-base", scratch / "out-new"
        ok = compare_outputs(a, b, ra, rb, (trees[0], new_src))
        ok = compare_runs(a, b, ra, rb) and ok
        print("verdict: spans, files, exit statuses and keys agree" if ok else "verdict: essential differences above")
        return 0 if ok else 1
    except subprocess.CalledProcessError as exc:
        print(f"compare_cli: {' '.join(map(str, exc.cmd))} failed (exit {exc.returncode})", file=sys.stderr)
        return 2
    finally:
        for tree in trees:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
