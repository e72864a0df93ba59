"""How each rank's children start, decided without torch.

So that an entry script can start the fork server before its own imports: on the 2x H200 machine
those take about 6 s and the server's (torch, transformers, accelerate) about 10 s, which the
first variants used to wait for.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.context
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Callable

from fsdp2bench.cli import (RankError, UserError, end_interrupted, ending, interruption_within,
                            set_up_standard_streams)
from fsdp2bench.files import process_running
from fsdp2bench.processes.first import handle_ending_signals, one_line_interrupts

# The children's targets live in this package; transformers and accelerate are imported lazily by
# the children, so importing them once in the server is what saves the time.
SERVER_PRELOAD = ["fsdp2bench.train.runner", "fsdp2bench.loading.modes", "accelerate"]
TRANSFORMERS_PRELOAD = ["transformers.models.qwen2.modeling_qwen2", "transformers.models.auto.modeling_auto"]


def server_preload() -> list[str]:
    """What the fork server imports: transformers too, unless torchao is installed. transformers imports torchao
    with its models where it finds it, and with torchao installed that preload left CUDA initialised in the server
    (one H200: torch 2.11, transformers 5.17, torchao 0.18; torchao imported alone did not), after which no child
    forked from it could use the GPU; each child then imports transformers itself."""
    import importlib.util

    return SERVER_PRELOAD + ([] if importlib.util.find_spec("torchao") else TRANSFORMERS_PRELOAD)


def start_method(device_type: str) -> str:
    """On CPU, fork: at once, with everything imported. With CUDA, fork is unusable once the main
    process has merely counted the GPUs, and spawn re-imports torch and transformers for every
    child (10-15 s each on the 2x H200 machine); a fork server is a clean process, started once,
    that imports them once and forks every child from there. FSDP2_BENCH_START_METHOD (fork, spawn
    or forkserver) overrides it, for a platform where the default does not work, and so that the
    tests can run the CUDA path's fork server on CPU."""
    return os.environ.get("FSDP2_BENCH_START_METHOD") or ("forkserver" if device_type == "cuda" else "fork")


def child_context(device_type: str) -> multiprocessing.context.BaseContext:
    method = start_method(device_type)
    context = multiprocessing.get_context(method)
    if method == "forkserver":
        # The server must not initialise CUDA itself: it inherits this variable, so any "is CUDA
        # available?" asked while importing is answered by NVML (cli.pick_device sets it too).
        os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
        context.set_forkserver_preload(server_preload())
    return context


def start_child_server(device_type: str) -> None:
    """Start the fork server now, so that its imports overlap what this process does meanwhile."""
    if child_context(device_type).get_start_method() == "forkserver":
        from multiprocessing import forkserver

        forkserver.ensure_running()


def start_before_imports(argv: list[str]) -> None:
    """An entry script's first step, so that the fork server's imports overlap the script's own."""
    quiet_while_starting()  # until the session catches interrupts itself
    one_rank_env()  # the server's children inherit its environment, not the one set later
    start_child_server(likely_device_type(argv))


def quiet_while_starting() -> None:
    """Every entry script's first step: its streams set up, and a Ctrl-C during its imports and checks
    one line, not a traceback (until the script handles interrupts itself: ``interrupts_raise``)."""
    set_up_standard_streams()
    one_line_interrupts()


def interrupts_raise() -> None:
    """From here on a Ctrl-C, a SIGTERM or a SIGHUP raises KeyboardInterrupt, which the script handles (as a
    Ctrl-C: the launch it waits for is told, what was written is kept)."""
    raise_on_ending_signals(_raise_keyboard_interrupt)


def _raise_keyboard_interrupt(signum, _frame) -> None:
    raise KeyboardInterrupt(*(() if signum == signal.SIGINT else (signal.Signals(signum).name,)))  # SIGINT's: Python's


_RAISING: list[Callable] = []  # the handler that raise_on_ending_signals put on the ending signals
AGAIN_S = 0.05  # how long after a finalizer dropped an interrupt its signal comes again: the finalizer is over


def raise_on_ending_signals(handler: Callable) -> None:
    """Every signal of ``first.ENDING`` to ``handler``, which raises it into the script's work, except where Python
    cannot deliver what it raises. Once the process is ending (``cli.ending``: its outcome known, its teardown and the
    finalizers it runs under way) the signal ends it at once, as an interrupt does. One raised inside a finalizer
    (a ``__del__``, a weakref callback), which Python drops and only prints with its stack, comes again a moment
    later, where the work takes it (``_interrupt_dropped``)."""
    def raise_unless_ending(signum, frame) -> None:
        if ending():
            end_interrupted(signal.Signals(signum).name)
        handler(signum, frame)

    _RAISING[:] = [raise_unless_ending]
    handle_ending_signals(raise_unless_ending)
    sys.unraisablehook = _interrupt_dropped


def _interrupt_dropped(unraisable) -> None:
    """An interrupt a finalizer dropped: nothing printed, the handler put back (it may have ignored the signals after
    its first), and the signal sent again; any other exception Python's own way."""
    interrupt = interruption_within(unraisable.exc_value)
    name = "" if interrupt is None else str(interrupt) or "SIGINT"
    if name not in signal.Signals.__members__ or threading.current_thread() is not threading.main_thread():
        sys.__unraisablehook__(unraisable)
        return
    handle_ending_signals(_RAISING[0])
    again = threading.Timer(AGAIN_S, os.kill, (os.getpid(), signal.Signals[name]))
    again.daemon = True
    again.start()


LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
MAX_RANKS = 1 << 20


def refuse_launcher(what: str) -> None:
    """A script that starts its own processes is one process: under a launcher's N ranks it would run N times over,
    into the same files (and torchrun drops the ``--`` that ends speed.py's own options)."""
    if check_launcher_env()[1] != 1:
        raise UserError(f"{what}: run it with python3, not a launcher (torchrun, accelerate launch)")


def check_launcher_env() -> tuple[int, int]:
    """The launcher's variables, each checked and all checked together, before anything starts: rank
    and world size. Plain ``python`` (no RANK) is one rank (``one_rank_env``); a launcher sets every one."""
    if "RANK" not in os.environ:
        return 0, 1
    env = {name: os.environ.get(name, "").strip() for name in LAUNCHER_VARS}
    missing = [name for name, value in env.items() if not value]
    if missing:
        raise RankError(f"{missing[0]} is not set in the environment but RANK is: a launcher sets all of "
                        f"{', '.join(LAUNCHER_VARS)} (torchrun, accelerate launch); set them all, or none")
    numbers = {}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT"):
        if not env[name].isdigit() or int(env[name]) > MAX_RANKS:
            raise RankError(f"{name}={env[name]!r} in the environment is not an integer in [0, {MAX_RANKS}]")
        numbers[name] = int(env[name])
    rank, world, local_rank, local_world, port = numbers.values()
    for ok, line in ((world >= 1, f"WORLD_SIZE={world} in the environment: a world has at least one rank"),
                     (rank < world, f"RANK={rank} in the environment is not a rank of WORLD_SIZE={world}"),
                     (1 <= local_world <= world, f"LOCAL_WORLD_SIZE={local_world} in the environment is not in "
                                                 f"[1, WORLD_SIZE={world}]"),
                     (local_rank < local_world, f"LOCAL_RANK={local_rank} in the environment is not a rank of "
                                                f"LOCAL_WORLD_SIZE={local_world}"),
                     (1 <= port <= 65535, f"MASTER_PORT={port} in the environment is not a port (1 to 65535)")):
        if not ok:
            raise RankError(line)
    try:
        socket.getaddrinfo(env["MASTER_ADDR"], port)
    except OSError as exc:
        raise RankError(f"MASTER_ADDR={env['MASTER_ADDR']!r} in the environment: no such host ({exc.strerror})") \
            from None
    return rank, world


def one_rank_env() -> None:
    """Without torchrun or accelerate launch (plain ``python``) this process is the only rank: the
    launcher's variables, and the launcher's store in a process of its own, as torchrun's agent holds
    it. Not in this process: it forks the children, and a store's server is a thread (libuv's loop);
    a fork taken while that thread holds a lock leaves the child the lock and no thread to release
    it, so that the child can hang before its first step."""
    if "RANK" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    subprocess.Popen([sys.executable, "-c", STORE_HOST, str(port), str(os.getpid())], stdin=subprocess.DEVNULL,
                     stdout=subprocess.DEVNULL)
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True")


# What a launcher sets beside LAUNCHER_VARS (torchrun's agent: its group, its role, its run and restart).
LAUNCHER_EXTRA = ("GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE")


def own_launch_env() -> dict[str, str]:
    """The environment of a launch that must stand alone (a layout search's timing): this process's, without its
    launcher's variables, so that the launch meets no rank but its own and starts a store of its own. With them it
    shared this process's store and every key in it, and one launch's abort ended each launch after it."""
    return {name: value for name, value in os.environ.items()
            if name not in (*LAUNCHER_VARS, *LAUNCHER_EXTRA, START_GATE) and not name.startswith("TORCHELASTIC_")}


# The store's process: it ignores Ctrl-C, SIGTERM and SIGHUP (the run it serves decides what an interrupt means, and
# needs the store to say so: a terminal's Ctrl-C or a kill of the process group reaches this process too, and a
# store gone first made every process still asking it print torch's C++ stack) and ends with the process that
# started it.
STORE_HOST = """
import ctypes, os, signal, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
signal.signal(signal.SIGHUP, signal.SIG_IGN)
port, parent = int(sys.argv[1]), int(sys.argv[2])
try:
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
except (OSError, AttributeError):
    pass
from torch.distributed import TCPStore
store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
while os.getppid() == parent:
    time.sleep(0.2)
"""


def likely_device_type(argv: list[str]) -> str:
    """The device type ``--device`` in ``argv`` will give, told before torch is imported: "auto" is
    a GPU where the NVIDIA driver's control device exists. A wrong guess costs a server that stays
    idle, or a server started later, at the usual place (session.open_session)."""
    choice = "auto"
    for i, arg in enumerate(argv):
        if arg == "--device" and i + 1 < len(argv):
            choice = argv[i + 1]
        elif arg.startswith("--device="):
            choice = arg.split("=", 1)[1]
    if choice in ("cpu", "cuda"):
        return choice
    return "cuda" if os.path.exists("/dev/nvidiactl") and os.environ.get("CUDA_VISIBLE_DEVICES") != "" else "cpu"


# --------------------------------------------------------------------------- started ahead of its turn

START_GATE = "FSDP2_BENCH_START_GATE"  # "<pid>:<path>", set by matrix.py for the launch after the running one
GATE_POLL_S = 0.05


def started_ahead() -> bool:
    """matrix.py starts each launch while the one before it still trains, so that its imports and its
    set-up (about 11 s a launch on one H200) overlap that one; it trains only once that one has ended."""
    return START_GATE in os.environ


GO, CANCELLED = "go", "cancelled"


def wait_for_turn() -> str | None:
    """Block until matrix.py writes the gate file: ``GO`` once the launch before this one has ended,
    ``CANCELLED`` when matrix.py ends before this launch's turn (it has said why). None: not started
    ahead. Refused in one line if matrix.py is gone without a word."""
    if not started_ahead():
        return None
    owner, _, path = os.environ[START_GATE].partition(":")
    while not os.path.exists(path):
        if not process_running(int(owner)):
            raise UserError(f"matrix.py (process {owner}), which started this launch ahead of its turn, is gone")
        time.sleep(GATE_POLL_S)
    with open(path) as f:
        return f.read()


def open_gate(path: str, word: str) -> None:
    """Tell a launch waiting in ``wait_for_turn`` to go or to end (written whole, then renamed)."""
    with open(path + ".tmp", "w") as f:
        f.write(word)
    os.replace(path + ".tmp", path)
