"""Prints what a script sees of its environment, then exits with argv[1] if given (``exit=N``,
``raise``, ``sigint``, ``sigterm``); an atexit handler prints ``atexit`` where Python runs it."""

import atexit
import os
import sys

atexit.register(print, "atexit")

print("argv", sys.argv[1:])
print("argv0", os.path.basename(sys.argv[0]))
print("name", __name__)
print("path0", sys.path[0])
print("main_is_module", sys.modules["__main__"].__dict__ is globals())
sys.stdout.write("no newline at end")
sys.stdout.flush()
if len(sys.argv) > 1 and sys.argv[1].startswith("exit="):
    sys.exit(int(sys.argv[1].split("=")[1]))
if len(sys.argv) > 1 and sys.argv[1] == "raise":
    raise ValueError("boom from the script")
if len(sys.argv) > 1 and sys.argv[1] in ("sigint", "sigterm"):
    import signal
    import time

    os.kill(os.getpid(), signal.SIGINT if sys.argv[1] == "sigint" else signal.SIGTERM)
    time.sleep(5)
