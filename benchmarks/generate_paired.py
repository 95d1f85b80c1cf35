"""A Hugging Face GPT-2 ``generate()`` loop: plain against the layer level, paired in one process.

One ``--level layer`` session is started; between blocks of ``--block`` generate() calls,
``nn.Module.__call__`` is switched among torch's own (``plain``), the layer level's C hot path
(``layer``), its Python wrapper (``python``) and a bare ``self.forward(*args, **kwargs)``
(``forward``: torch's ``_wrapped_call_impl`` and ``_call_impl`` frames left out, nothing
recorded), in an order that rotates and mirrors round by round. Each block is timed in the
program thread's CPU time and in wall time; the medians of the per-round differences against
``plain`` are printed, per generate() and per module call, with the check that every kind
generated the same tokens.

``--single``: no session of its own and no switching: the median thread CPU and wall time of
``--rounds`` × ``--block`` generate() calls with whatever ``Module.__call__`` is installed, so
that a plain process and one under ``mltrace python`` can be compared (their wall times
depend on what else the machine runs; docs/PERFORMANCE.md, "A transformers generate() loop").

    python benchmarks/generate_paired.py                 # 25 rounds of 3 generate() calls
    OMP_NUM_THREADS=1 python benchmarks/generate_paired.py --rounds 40
    python benchmarks/generate_paired.py --single
    mltrace python -q --level layer benchmarks/generate_paired.py --single
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import loadavg, rotation


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=25)
    p.add_argument("--block", type=int, default=3, help="generate() calls a block")
    p.add_argument("--tokens", type=int, default=16, help="new tokens a generate() call")
    p.add_argument("--single", action="store_true", help="time generate() as the process runs it, no pairing")
    args = p.parse_args()

    import torch
    import transformers

    import mltrace
    from mltrace.tracer.session import active_session
    from mltrace.tracer.sources.torch_modules import TorchModuleSource

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=1000, n_positions=128)
    model = transformers.GPT2LMHeadModel(config).eval()
    prompt = torch.randint(0, 1000, (1, 8))
    module_cls: Any = torch.nn.Module
    torch_call = module_cls.__call__

    def forward_only(module: Any, *a: Any, **k: Any) -> Any:
        return module.forward(*a, **k)

    def generate() -> Any:
        return model.generate(prompt, max_new_tokens=args.tokens, do_sample=False, pad_token_id=0)

    calls = [0]

    def counting(module: Any, *a: Any, **k: Any) -> Any:
        calls[0] += 1
        return torch_call(module, *a, **k)

    if args.single:
        return single(generate, args.rounds * args.block)
    cpu: dict[str, list[int]] = {}
    wall: dict[str, list[int]] = {}
    tokens: dict[str, Any] = {}
    load = loadavg()
    with torch.no_grad(), tempfile.TemporaryDirectory() as tmp:
        module_cls.__call__ = counting
        generate()
        module_cls.__call__ = torch_call
        with mltrace.profile(output=Path(tmp) / "run", summary=False, level="layer"):
            session = active_session()
            assert session is not None
            (source,) = [s for s in session.started if isinstance(s, TorchModuleSource)]
            kinds = {"plain": torch_call, "layer": module_cls.__call__, "python": source.python_call, "forward": forward_only}
            if kinds["python"] is kinds["layer"]:
                del kinds["python"]  # the C helper is not built: the layer level runs the Python wrapper
            for _ in range(3):
                generate()
            try:
                for i in range(args.rounds):
                    for kind in rotation(list(kinds), i, mirror=True):
                        module_cls.__call__ = kinds[kind]
                        c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
                        for _ in range(args.block):
                            out = generate()
                        cpu.setdefault(kind, []).append((time.thread_time_ns() - c0) // args.block)
                        wall.setdefault(kind, []).append((time.perf_counter_ns() - w0) // args.block)
                        tokens[kind] = out
            finally:
                module_cls.__call__ = kinds["layer"]  # the session puts torch's own back at its end
    per_call = calls[0]
    print(f"GPT-2 (2 layers, 128 wide) generate() of {args.tokens} tokens: {per_call} module calls; "
          f"torch threads {torch.get_num_threads()}; load average before {load}, after {loadavg()}")  # fmt: skip
    print(f"{'kind':8s} {'thread CPU':>11s} {'wall':>9s} {'CPU - plain':>12s} {'a module call':>14s}")
    for kind in kinds:
        diff = statistics.median(a - b for a, b in zip(cpu[kind], cpu["plain"], strict=True))
        print(
            f"{kind:8s} {statistics.median(cpu[kind]) / 1e6:8.2f} ms {statistics.median(wall[kind]) / 1e6:6.2f} ms "
            f"{diff / 1e6:+9.2f} ms {diff / per_call / 1e3:+11.2f} µs"
        )
    same = all(torch.equal(tokens["plain"], t) for t in tokens.values())
    print(f"same tokens in every kind: {same}")
    return 0 if same else 1


def single(generate: Any, count: int) -> int:
    """``count`` generate() calls after 3 untimed ones: their median thread CPU and wall time."""
    import torch

    with torch.no_grad():
        for _ in range(3):
            generate()
        cpu, wall = [], []
        for _ in range(count):
            c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
            generate()
            cpu.append(time.thread_time_ns() - c0)
            wall.append(time.perf_counter_ns() - w0)
    cpu_ms, wall_ms = statistics.median(cpu) / 1e6, statistics.median(wall) / 1e6
    print(f"generate(): thread CPU {cpu_ms:.2f} ms, wall {wall_ms:.2f} ms (medians of {count}); torch threads {torch.get_num_threads()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
