"""Secrets out of the run: values whose names look secret become ``[redacted]``.

A name looks secret when it contains ``token``, ``secret``, ``key``, ``passw``, ``pwd``,
``credential`` or ``auth`` (``Authorization``), or has ``pass`` as a word of its own
(``DB_PASS``, ``--pass``), in any case. Where a value goes:

- the command line in run.json (and so OTLP's ``process.command_args``): ``--token=abc``,
  ``token=abc`` and ``Authorization: Bearer abc`` keep their name; the value after it, or the
  next argument after ``--password``/``-p``-style options whose name looks secret, does not;
- recorded environment variables (``metadata.recorded_environment``): the name stays, the value
  does not;
- span and instant attributes the program gives (``mltrace.span(..., api_key=…)``).

``MLTRACE_REDACT=0`` (``ProfileOptions.redact``) records everything as it is.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

REDACTED = "[redacted]"

_SECRET_NAME = re.compile(r"token|secret|key|passw|pwd|credential|auth|(?<![a-z])pass(?![a-z])", re.IGNORECASE)
#: ``--name=value``, ``name=value`` and ``Name: value`` (a header), as one argument.
_ASSIGNMENT = re.compile(r"^(?P<name>-{0,2}[A-Za-z_][\w.-]*)(?P<sep>=|:\s*)(?P<value>.*)$", re.DOTALL)
#: An option that takes the next argument as its value: ``--password``, ``-token``.
_OPTION = re.compile(r"^-{1,2}[A-Za-z][\w.-]*$")

_seen: dict[str, bool] = {}  # name → looks secret (attribute keys repeat: one regex search each)


def looks_secret(name: str) -> bool:
    """Whether ``name`` (an argument, variable or attribute name) looks like it holds a secret."""
    known = _seen.get(name)
    if known is None:
        known = _SECRET_NAME.search(name) is not None
        if len(_seen) < 4096:
            _seen[name] = known
    return known


def redact_command(argv: list[str]) -> list[str]:
    """``argv`` with the values of secret-looking options and assignments replaced by ``[redacted]``.

    ``--token=abc`` → ``--token=[redacted]``; ``--password abc`` → ``--password [redacted]``;
    ``Authorization: Bearer abc`` → ``Authorization: [redacted]``. Everything else is kept,
    in order.
    """
    out: list[str] = []
    hide_next = False
    for arg in argv:
        if hide_next:
            out.append(REDACTED)
            hide_next = False
            continue
        if _OPTION.match(arg) and looks_secret(arg):
            out.append(arg)
            hide_next = True
            continue
        m = _ASSIGNMENT.match(arg)
        if m is not None and m.group("value") and looks_secret(m.group("name")):
            out.append(f"{m.group('name')}{m.group('sep')}{REDACTED}")
            continue
        out.append(arg)
    return out


def redact_values(values: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``values`` (environment variables, attributes) with secret-looking names'
    values replaced by ``[redacted]``."""
    return {k: (REDACTED if looks_secret(k) and v is not None else v) for k, v in values.items()}


#: Attribute names mltrace itself gives user spans (their call site): never secret, skipped
#: without a lookup.
_OWN_NAMES = frozenset(
    {
        "code.file.path",
        "code.line.number",
        "code.function.name",
        "ml.defined.file.path",
        "ml.defined.line.number",
        "ml.defined.function.name",
    }
)


def needs_redaction(values: Mapping[str, Any]) -> bool:
    """Whether any name in ``values`` looks secret (a check cheap enough for every span)."""
    seen = _seen
    for k in values:
        if k in _OWN_NAMES:
            continue
        known = seen.get(k)
        if known is None:
            known = looks_secret(k)
        if known:
            return True
    return False
