"""What every entry script does before any other import: a Ctrl-C, a SIGTERM or a closed terminal's SIGHUP during
its imports and checks is one line and the exit code of an interrupt, never a traceback. The standard library's
modules that Python has already loaded when a script starts, nothing more, so that the window before it is the
interpreter's own."""

from __future__ import annotations

import os
import signal
import sys


# The signals that end a run as a Ctrl-C does: SIGINT, SIGTERM, and SIGHUP (its terminal closed) unless the run was
# started to outlive its terminal (nohup: SIGHUP ignored from the start, and it stays so).
ENDING = (signal.SIGINT, signal.SIGTERM, *(() if signal.getsignal(signal.SIGHUP) == signal.SIG_IGN else
                                           (signal.SIGHUP,)))


def handle_ending_signals(handler) -> None:
    """Every signal of ``ENDING`` to ``handler``."""
    for signum in ENDING:
        signal.signal(signum, handler)


def one_line_interrupts() -> None:
    """Until the script handles interrupts itself (``starting.interrupts_raise``, ``session.open_session``)."""
    handle_ending_signals(interrupted_while_starting)


def interrupted_while_starting(signum, _frame) -> None:
    """Before anything is written (the session takes over before it writes): one line, from the first rank. At
    once: an exception raised into a half-done import would surface at the interpreter's exit."""
    if os.environ.get("RANK", "0") == "0":
        print("Interrupted while starting; nothing ran", file=sys.stderr, flush=True)
    os._exit(130)
