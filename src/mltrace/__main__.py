"""``python -m mltrace …``."""

import os
import sys

# Python put the working directory first on sys.path, where the program's own modules are: the
# runner gives the program that entry, and mltrace's later imports (its finish) look in the
# package's own folder instead, as under the ``mltrace`` command.
if sys.path and os.path.abspath(sys.path[0] or os.curdir) == os.getcwd():
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from mltrace.cli import entry  # noqa: E402 - after the path's first entry is mltrace's

if __name__ == "__main__":
    entry()
