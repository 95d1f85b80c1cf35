"""Reports what the program sees of its terminal, and interleaves stdout and stderr lines.

Used by tests/tracer/test_fdtap.py, run plainly and under ``mltrace python`` with a
terminal on fds 0-2 (``script``): every line must be the same, in the same order.
"""

import os
import sys
import termios

import torch

with torch.no_grad():  # oneDNN and MKL work, so the library level has verbose lines to capture
    torch.nn.Linear(16, 16)(torch.randn(4, 16))
print("isatty", [os.isatty(fd) for fd in (0, 1, 2)], sys.stdout.isatty(), sys.stdin.isatty())
print("size", tuple(os.get_terminal_size(1)), tuple(os.get_terminal_size(2)))
print("line_buffering", sys.stdout.line_buffering)
print("lflag", termios.tcgetattr(1)[3] == termios.tcgetattr(0)[3])
for i in range(3):
    print(f"out {i}")
    print(f"err {i}", file=sys.stderr)
    with torch.no_grad():
        torch.nn.Linear(16, 16)(torch.randn(4, 16))
typed = input("prompt> ")  # on a terminal, Python writes the prompt to stderr
print("typed", repr(typed))
print("\x1b[1;31mcoloured\x1b[0m \t tab \r\n crlf")
sys.stdout.write("no newline at the end")
