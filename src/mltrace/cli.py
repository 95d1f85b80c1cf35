"""The ``mltrace`` command line.

``mltrace python [OPTIONS] SCRIPT [ARGS…]`` (or ``-m MODULE``, or ``mltrace run``)
traces a program; everything from SCRIPT on belongs to the script. Other
subcommands work on run directories. Usage errors print one line on stderr and
exit 2.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from mltrace._version import __version__
from mltrace.errors import UsageError
from mltrace.settings import DEBUG

#: Subcommand modules under mltrace.commands (each has add_parser and run).
COMMANDS = ("report", "export", "import_", "view", "diff", "bench", "bricks", "metrics", "merge")

TRACE_COMMANDS = ("python", "run")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def _trace_options_parser(prog: str) -> _Parser:
    p = _Parser(
        prog=prog,
        usage=f"{prog} [OPTIONS] SCRIPT [ARGS...]\n       {prog} [OPTIONS] -m MODULE [ARGS...]",
        add_help=True,
        description="Trace a Python program (everything from SCRIPT on is the script's).",
    )
    p.add_argument("-o", "--output", metavar="DIR", help="run directory to create (must be absent or empty)")
    p.add_argument("--level", metavar="LEVEL", help="deepest level to record: model, layer, op, library or kernel (default: all available)")
    p.add_argument("--name", help="run name (default: the script's stem)")
    p.add_argument(
        "--flush-interval", metavar="SECONDS", dest="flush_interval_s", help="how often events are streamed to disk (default 0.5)"
    )
    p.add_argument(
        "--op-inferences",
        metavar="N",
        dest="op_inferences",
        help="record ops and library calls for the first N model calls of each framework only, then model and "
        "layer spans (PyTorch, TensorFlow, ONNX Runtime)",
    )
    p.add_argument(
        "--max-spans",
        metavar="N",
        dest="max_spans",
        help="count spans as they are recorded, at every level (with CUDA, torch.profiler's once it stops): at N the "
        "op level ends (the library and kernel levels with it), at 1.5N the layer level (model spans go on), "
        "each at the next model call's return; at 2N nothing more is recorded (0: no limit; default: what 10%% "
        "of available memory can finish, at most 2 million)",
    )
    p.add_argument(
        "--memory", action="store_true", help="record PyTorch allocations: bytes and peaks per layer and op, a memory counter per device"
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no summary at the end")
    p.add_argument("--py-spy", action="store_true", help="sample Python stacks with py-spy (source lines per layer)")
    p.add_argument("--native", action="store_true", help="with --py-spy: include native frames")
    p.add_argument(
        "--otlp",
        nargs="?",
        const="",
        metavar="URL",
        help="send spans over OTLP at the end, to URL (--otlp URL or --otlp=URL; a bare --otlp uses "
        "OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT, else localhost:4317)",
    )
    p.add_argument(
        "--no-follow",
        action="store_true",
        help="trace this process only, not the Python processes it starts (multiprocessing, DataLoader workers, "
        "subprocesses, torchrun ranks)",
    )
    return p


def _value_options() -> frozenset[str]:
    """The trace options that take the next word as their value (``-o DIR``), from the parser
    itself, so that a new option cannot be forgotten here."""
    parser = _trace_options_parser("mltrace python")
    return frozenset(
        name
        for action in parser._actions  # noqa: SLF001 - argparse keeps its actions here
        if action.option_strings and action.nargs is None and isinstance(action, argparse._StoreAction)  # noqa: SLF001
        for name in action.option_strings
    )


_VALUE_OPTIONS = _value_options()

#: ``scheme://…`` or ``host:port[/path]`` (a name, an IPv4 address or a bracketed IPv6 one).
_ENDPOINT_RE = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://\S+|(?:[A-Za-z0-9_.-]+|\[[0-9A-Fa-f:.]+\]):\d{1,5}(?:/\S*)?")


def looks_like_endpoint(word: str) -> bool:
    """Whether ``word`` is a URL (``scheme://…``) or a ``host:port`` address, never a script path."""
    return _ENDPOINT_RE.fullmatch(word) is not None


#: Trace options whose value is optional, with the test a following word must pass to be
#: that value (``--otlp http://host:4317 infer.py``); a word that fails it is the script.
_OPTIONAL_VALUE_OPTIONS: dict[str, Callable[[str], bool]] = {"--otlp": looks_like_endpoint}


def split_trace_argv(argv: Sequence[str]) -> tuple[list[str], str | None, str | None, list[str]]:
    """Splits ``[OPTIONS] SCRIPT ARGS…`` / ``[OPTIONS] -m MODULE ARGS…``.

    Returns:
        (mltrace options, script, module, script arguments).

    Raises:
        UsageError: when no script or module is given.
    """
    options: list[str] = []
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok == "--":
            i += 1
            break
        if tok == "-m":
            if i + 1 >= len(argv):
                raise UsageError("-m needs a module name")
            return options, None, argv[i + 1], list(argv[i + 2 :])
        if tok.startswith("-") and tok != "-":
            options.append(tok)
            i += 1
            if tok in _VALUE_OPTIONS:
                if i >= len(argv):
                    raise UsageError(f"{tok} needs a value")
                options.append(argv[i])
                i += 1
            elif tok in _OPTIONAL_VALUE_OPTIONS and i < len(argv) and _OPTIONAL_VALUE_OPTIONS[tok](argv[i]):
                options.append(argv[i])
                i += 1
            continue
        break
    if i < len(argv) and argv[i] == "-m":
        if i + 1 >= len(argv):
            raise UsageError("-m needs a module name")
        return options, None, argv[i + 1], list(argv[i + 2 :])
    if i >= len(argv):
        if "-h" in options or "--help" in options:
            return options, None, None, []
        raise UsageError("no script given (usage: mltrace python [OPTIONS] SCRIPT [ARGS...] or -m MODULE)")
    return options, argv[i], None, list(argv[i + 1 :])


def trace_main(command: str, argv: Sequence[str]) -> int:
    """``mltrace python|run …``: trace the program and return its exit status."""
    from mltrace.config import ProfileOptions
    from mltrace.finish import print_summary
    from mltrace.runner import Target, check_target, mltrace_first, run_target
    from mltrace.tracer.session import Session

    opt_argv, script, module, script_args = split_trace_argv(argv)
    parser = _trace_options_parser(f"mltrace {command}")
    ns = parser.parse_args(opt_argv)
    if script is None and module is None:
        parser.print_help()
        return 0
    target = Target(script, module, script_args)
    check_target(target)
    kwargs: dict[str, Any] = {
        "output": ns.output,
        "level": ns.level,
        "name": ns.name or target.stem,
        "summary": not ns.quiet,
        "py_spy": ns.py_spy,
        "native": ns.native,
        "otlp": ns.otlp,
        "command": ["mltrace", command, *argv],
    }
    if ns.flush_interval_s is not None:
        kwargs["flush_interval_s"] = ns.flush_interval_s
    if ns.op_inferences is not None:
        kwargs["op_inferences"] = ns.op_inferences
    if ns.max_spans is not None:
        kwargs["max_spans"] = ns.max_spans
    if ns.memory:
        kwargs["memory"] = True
    options = ProfileOptions.build(**kwargs)
    session = Session(options)
    session.whole_program = True
    session.start()
    live = _live_otlp(session)
    following = None if ns.no_follow else _follow(session)
    status = 0
    outcome: dict[str, str] = {}
    try:
        status = run_target(target, outcome)
    finally:
        session.meta["exit_status"] = status
        if outcome:
            session.meta["exit_cause"] = outcome["cause"]
        with mltrace_first():  # the finish's imports are mltrace's, not the program's folder's
            _finish(session, following, live, print_summary)
    return status


def _finish(session: Any, following: Any, live: Any, print_summary: Callable[[Any], Any]) -> None:
    """Stops following, the live export and the session (which finishes the run), sends the
    rest of an OTLP export and prints the summary."""
    from mltrace.tracer.messages import warn

    options = session.options
    if following is not None:
        following.disable()
    if live is not None:
        live.stop(session)
    run_dir = session.stop()
    parent = not session.forked_copy  # in a child the script forked, the run and its summary are the parent's
    if options.otlp is not None and parent:
        from mltrace.exporters.otlp_live import send_rest

        send_rest(run_dir, options.otlp or None, live)
    if options.summary and parent:
        try:
            print_summary(run_dir)
        except Exception as exc:
            warn(f"summary failed: {exc}")


def _live_otlp(session: Any) -> Any:
    """The OTLP export while the program runs (``exporters/otlp_live.py``), where ``--otlp`` or
    the OTEL_* variables ask for one; None otherwise (opentelemetry is then never imported)."""
    if session.options.otlp is None and not any(name.startswith("OTEL_") for name in os.environ):
        return None
    from mltrace.exporters.otlp_live import start_live

    return start_live(session)


def _follow(session: Any) -> Any:
    """Follows the program's Python children into the run (``mltrace/follow/``); None, with a
    warning, where that cannot be set up."""
    from mltrace.tracer.messages import warn

    try:
        from mltrace.follow.parent import Following

        return Following(session).enable()
    except Exception as exc:  # the program runs traced in this process alone
        warn(f"child processes will not be traced: {exc}")
        return None


def build_parser() -> _Parser:
    """The parser of every subcommand except the tracing ones."""
    parser = _Parser(prog="mltrace", description="Cross-stack tracer for deep-learning inference.")
    parser.add_argument("--version", action="version", version=f"mltrace {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.add_parser("python", help="trace a Python program: mltrace python [OPTIONS] SCRIPT [ARGS...]")
    sub.add_parser("run", help="same as 'python'")
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"mltrace.commands.{name}")
        except ImportError:
            continue
        module.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (−N where the traced program ended by signal N:
    ``runner.leave`` ends the process by it)."""
    args = list(sys.argv[1:] if argv is None else argv)
    from mltrace.run.store import RunError

    try:
        if args and args[0] in TRACE_COMMANDS:
            return trace_main(args[0], args[1:])
        parser = build_parser()
        if not args:
            parser.print_help(sys.stderr)
            return 2
        ns = parser.parse_args(args)
        func = getattr(ns, "func", None)
        if func is None:
            parser.print_help(sys.stderr)
            return 2
        return int(func(ns))
    except UsageError as exc:
        sys.stderr.write(f"mltrace: error: {exc}\n")
        return 2
    except RunError as exc:
        sys.stderr.write(f"mltrace: error: {exc}\n")
        return 2
    except BrokenPipeError:
        return 0
    except Exception as exc:  # a bug of mltrace's own (the tracing commands handle theirs): one line
        if DEBUG.get() or (args and args[0] in TRACE_COMMANDS):
            raise
        command = args[0] if args else "mltrace"
        sys.stderr.write(
            f"mltrace: internal error in '{command}': {type(exc).__name__}: {exc} (a bug in mltrace; {DEBUG.name}=1 shows the traceback)\n"
        )
        return 1


def entry() -> NoReturn:
    """Console-script entry point."""
    argv = sys.argv[1:]
    status = main(argv)
    if argv and argv[0] in TRACE_COMMANDS:
        from mltrace.runner import leave

        leave(status)  # the traced program's atexit handlers must still run, or its signal end it
    # Reports load millions of objects; freeing them one by one at exit costs
    # seconds and changes nothing, so leave without tearing down.
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(status)
