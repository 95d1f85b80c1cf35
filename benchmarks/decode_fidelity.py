"""A Hugging Face generate() loop traced: how much slower the program runs, and whether the
report's times per output token are the program's own.

Runs, in a child process, a small GPT-2 built from a config (``--layers`` layers of 128 units,
a 1,000-word vocabulary; no download) generating 16 new tokens greedily ``--calls`` times after
two warm-up calls, and times every token as the program sees it (a ``BaseStreamer`` whose
``put`` reads the clock). Plain, then under ``mltrace python`` in each of ``--conditions``:
``default`` (every CPU level; torch.profiler in cycles), ``layer`` (``--level layer``),
``whole`` (``MLTRACE_OP_CYCLE_S=0``: torch.profiler held whole, stopped after the program) and
``other`` (the default level of the mltrace checkout at ``--other-src``, to compare two
versions side by side). Rounds interleave the conditions, the order rotating.

Per condition, medians over rounds of: the program's generate() time and its time per output
token (median and p90 of the steady calls' tokens), as the program saw them; traced, the
report's time per output token (``mltrace report --format json``: median over the steady calls of
``generate[].tpot_median_ns``, which leaves mltrace's own pauses out) and the pauses'
total (run.json ``torch_profiler.switch_s``).

    python benchmarks/decode_fidelity.py
    python benchmarks/decode_fidelity.py --conditions default,other --other-src /tmp/old/src --rounds 5
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

from harness import add_json, loadavg, parser, rotation, run_child, write_json

CHILD = textwrap.dedent(
    """
    import sys, time, statistics
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.generation.streamers import BaseStreamer

    class Clock(BaseStreamer):
        def __init__(self):
            self.times = []
        def put(self, value):
            self.times.append(time.perf_counter_ns())
        def end(self):
            pass

    torch.manual_seed(0)
    torch.set_num_threads(int(sys.argv[3]))
    cfg = GPT2Config(n_layer=int(sys.argv[1]), n_embd=128, n_head=4, vocab_size=1000, n_positions=128,
                     bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(cfg).eval()
    ids = torch.randint(1, 1000, (1, 8))
    calls, tokens = [], []
    with torch.no_grad():
        for i in range(2 + int(sys.argv[2])):
            clock = Clock()
            t0 = time.perf_counter_ns()
            model.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=0, streamer=clock)
            if i >= 2:
                calls.append(time.perf_counter_ns() - t0)
                # put() gets the prompt first, then each new token: a token's time is from the one before
                tokens += [b - a for a, b in zip(clock.times[2:], clock.times[3:])]
    print("RESULT", statistics.median(calls), statistics.median(tokens), statistics.quantiles(tokens, n=10)[-1])
    """
)

CONDITIONS = ("plain", "default", "layer", "whole", "other")


def traced_command(condition: str, script: Path, out: Path, child_args: list[str]) -> tuple[list[str], dict[str, str]]:
    """The command and environment of one traced condition."""
    env = dict(os.environ)
    options = ["--level", "layer"] if condition == "layer" else []
    if condition == "whole":
        env["MLTRACE_OP_CYCLE_S"] = "0"
    return [sys.executable, "-m", "mltrace", "python", "-q", "-o", str(out), *options, str(script), *child_args], env


def report_tpot_ns(run_dir: Path, env: dict[str, str]) -> float | None:
    """The report's time per output token: the median of the steady generate() calls' medians."""
    proc = subprocess.run([sys.executable, "-m", "mltrace", "report", "--format", "json", str(run_dir)], capture_output=True, env=env)
    if proc.returncode != 0:
        return None
    calls = json.loads(proc.stdout).get("generate") or []
    values = [c["tpot_median_ns"] for c in calls[2:] if c.get("tpot_median_ns")]
    return statistics.median(values) if values else None


def one_run(condition: str, script: Path, child_args: list[str], other_src: str | None) -> dict[str, float]:
    """One child of ``condition``: the program's figures and, traced, the report's and the pauses'."""
    if condition == "plain":
        call, token, token_p90 = (float(x) for x in run_child([sys.executable, str(script), *child_args]).result_line())
        return {"call_ms": call / 1e6, "token_ms": token / 1e6, "token_p90_ms": token_p90 / 1e6}
    with tempfile.TemporaryDirectory(prefix="mltrace-decode-") as tmp:
        out = Path(tmp) / "run"
        cmd, env = traced_command(condition, script, out, child_args)
        if condition == "other":
            assert other_src is not None
            env["PYTHONPATH"] = other_src
        call, token, token_p90 = (float(x) for x in run_child(cmd, env=env).result_line())
        row = {"call_ms": call / 1e6, "token_ms": token / 1e6, "token_p90_ms": token_p90 / 1e6}
        reported = report_tpot_ns(out, env)
        if reported is not None:
            row["report_token_ms"] = reported / 1e6
        meta = json.loads((out / "run.json").read_text())
        row["paused_s"] = float((meta.get("torch_profiler") or {}).get("switch_s", 0.0))
        return row


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--conditions", default="default,layer,whole", help=f"traced conditions, of {', '.join(CONDITIONS[1:])}")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--calls", type=int, default=8, help="timed generate() calls per run")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads in the program")
    p.add_argument("--other-src", help="the src/ folder of another mltrace checkout (condition 'other')")
    add_json(p)
    args = p.parse_args()
    conditions = ["plain", *[c for c in args.conditions.split(",") if c]]
    unknown = [c for c in conditions if c not in CONDITIONS]
    if unknown or ("other" in conditions and not args.other_src):
        p.error(f"unknown conditions {unknown}" if unknown else "--other-src is needed for 'other'")
    child_args = [str(args.layers), str(args.calls), str(args.threads)]
    rows: dict[str, list[dict[str, float]]] = {c: [] for c in conditions}
    with tempfile.TemporaryDirectory(prefix="mltrace-decode-") as tmp:
        script = Path(tmp) / "decode.py"
        script.write_text(CHILD)
        for i in range(args.rounds):
            for condition in rotation(conditions, i):
                rows[condition].append(one_run(condition, script, child_args, args.other_src))
            print(f"round {i + 1} of {args.rounds} done (load {loadavg()})", file=sys.stderr)
    print(f"GPT-2 {args.layers}x128, 16 new tokens, {args.calls} timed calls a run, {args.threads} torch thread(s), {args.rounds} rounds")
    keys = ("call_ms", "token_ms", "token_p90_ms", "report_token_ms", "paused_s")
    print(f"{'condition':10s} " + " ".join(f"{k:>16s}" for k in keys))
    summary: dict[str, dict[str, float]] = {}
    for condition, runs in rows.items():
        summary[condition] = {k: statistics.median(r[k] for r in runs) for k in keys if all(k in r for r in runs)}
        print(f"{condition:10s} " + " ".join(f"{summary[condition].get(k, float('nan')):16.2f}" for k in keys))
    plain = summary["plain"]
    for condition in conditions[1:]:
        s = summary[condition]
        ratio = s["call_ms"] / plain["call_ms"]
        fidelity = s.get("report_token_ms", float("nan")) / plain["token_ms"]
        print(f"{condition}: generate() {ratio:.2f}x plain; the report's time per token {fidelity:.2f}x plain's")
    write_json(args.json, {"summary": summary, "rounds": rows})


if __name__ == "__main__":
    main()
