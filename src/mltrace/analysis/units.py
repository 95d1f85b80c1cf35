"""Numbers as people read them: durations and SI-prefixed quantities."""

from __future__ import annotations


def fmt_ns(ns: float) -> str:
    """Human duration: 812 ns, 12.3 µs, 4.56 ms, 1.23 s."""
    if ns < 1_000:
        return f"{ns:.0f} ns"
    if ns < 1_000_000:
        return f"{ns / 1e3:.1f} µs"
    if ns < 1_000_000_000:
        return f"{ns / 1e6:.2f} ms"
    return f"{ns / 1e9:.2f} s"


def fmt_si(value: float, unit: str) -> str:
    """A number with an SI prefix: 1.23 GFLOP, 45.6 MB, 0 B."""
    if value == 0:
        return f"0 {unit}"
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"
