"""What every entry script does before any other import: a Ctrl-C or a SIGTERM during its imports and checks is
one line and the exit code of an interrupt, never a traceback. The standard library's modules that Python has
already loaded when a script starts, nothing more, so that the window before it is the interpreter's own."""

from __future__ import annotations

import os
import signal
import sys


def one_line_interrupts() -> None:
    """Until the script handles interrupts itself (``starting.interrupts_raise``, ``session.open_session``)."""
    signal.signal(signal.SIGINT, interrupted_while_starting)
    signal.signal(signal.SIGTERM, interrupted_while_starting)


def interrupted_while_starting(signum, _frame) -> None:
    """Before anything is written (the session takes over before it writes): one line, from the first rank. At
    once: an exception raised into a half-done import would surface at the interpreter's exit."""
    if os.environ.get("RANK", "0") == "0":
        print("Interrupted while starting; nothing ran", file=sys.stderr, flush=True)
    os._exit(130)
