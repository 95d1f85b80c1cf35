"""``python -m mltrace …``."""

from mltrace.cli import entry

if __name__ == "__main__":
    entry()
