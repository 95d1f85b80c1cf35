"""mltrace's own lines on stderr (``mltrace: …``): warnings and notices. They never raise,
since the program may have closed stderr."""

from __future__ import annotations

import sys


def warn(message: str) -> None:
    """Prints one mltrace warning line on stderr."""
    say(f"warning: {message}")


def say(text: str) -> None:
    """Prints one mltrace line on stderr."""
    try:
        sys.stderr.write(f"mltrace: {text}\n")
        sys.stderr.flush()
    except Exception:  # stderr closed by the program: nothing else to do
        pass
