"""What every entry script does with its command line: one-line errors, device and output checks, JSON."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import faulthandler
import io
import json
import math
import os
import signal
import socket
import sys
import tempfile
import textwrap
import time
from typing import Callable


class UserError(Exception):
    """A problem the user can fix (bad flag, missing file); reported in one line, once per launch."""


class RankError(UserError):
    """A problem of one rank's own (its launcher variables, its peers): every rank that meets it says so."""


class Stopped(Exception):
    """SIGINT or SIGTERM reached this process (isolation.Interrupted is one)."""


class OneLineParser(argparse.ArgumentParser):
    """A bad flag gets one line and exit code 2, like every other user error."""

    def error(self, message: str):
        print(f"error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


class SurvivingStream:
    """A standard stream whose reader went away (``| head -2`` ended) stops being written to instead
    of raising BrokenPipeError into the run: the run goes on and writes its files. Its descriptor is
    pointed at /dev/null, so that child processes and C code that write to it go on too."""

    def __init__(self, stream):
        self._stream, self._lost = stream, False

    def write(self, text: str) -> int:
        if not self._lost:
            try:
                return self._stream.write(text)
            except BrokenPipeError:
                self._lose()
        return len(text)

    def flush(self) -> None:
        if not self._lost:
            try:
                self._stream.flush()
            except BrokenPipeError:
                self._lose()

    def _lose(self) -> None:
        self._lost = True
        with contextlib.suppress(OSError, ValueError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())
            os.close(devnull)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def set_up_standard_streams() -> None:
    """Standard output and error that outlive their reader (each process calls it once, first), and
    ``kill -USR1 <pid>`` printing every thread's Python stack to standard error, for a process that
    seems stuck."""
    with contextlib.suppress(AttributeError, ValueError, io.UnsupportedOperation):  # no SIGUSR1, or no stderr
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, SurvivingStream):
            setattr(sys, name, SurvivingStream(stream))


def exit_with(run: Callable[[], int]) -> None:
    """Run a command; a UserError becomes one line on stderr and exit code 2.

    A command that ran ends without the interpreter's teardown, which frees one by one the objects
    torch and transformers made: 2.3 s after the last line of a run on a 2-core machine. The exit
    handlers still run (the output directory's lock), and every file was closed before. A refused
    start keeps the ordinary exit: under torchrun the first rank to exit makes it stop the others,
    and the teardown's seconds let them print their own line first."""
    set_up_standard_streams()
    try:
        code = run()
    except UserError as exc:
        refuse(exc)
    except (KeyboardInterrupt, Stopped) as exc:  # outside a run's own handling of interrupts
        if os.environ.get("RANK", "0") == "0":
            print(f"Interrupted ({exc or 'SIGINT'}); what was written is whole, nothing more is", file=sys.stderr)
        sys.exit(130)
    except OSError as exc:  # a file the command writes (a full disk, a directory gone); each is written whole
        if exc.filename is None:
            raise
        print(f"error: cannot write {exc.filename} ({exc.strerror})", file=sys.stderr)
        sys.exit(1)
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# How long a rank other than 0 keeps its refusal to itself: every rank checks the same command line,
# so rank 0 says it and the launcher stops the rest; one still running after this says it itself.
QUIET_REFUSAL_S = 5.0


def refuse(exc: UserError) -> None:
    """A refused launch: one line from rank 0, exit code 2. Under a launcher the other ranks refuse the
    same command line; they stay quiet while rank 0 says why (the launcher then stops them)."""
    rank = os.environ.get("RANK", "0")
    if rank != "0" and not isinstance(exc, RankError):
        time.sleep(QUIET_REFUSAL_S)
        print(f"error: rank {rank}: {exc}", file=sys.stderr)
    else:
        print(f"error: {exc}", file=sys.stderr)
    sys.exit(2)


CONSOLE_WIDTH = 120


def say(text: str, indent: str = "") -> None:
    """A paragraph on the console, each of its lines folded at ``CONSOLE_WIDTH`` columns."""
    print("\n".join(textwrap.fill(line, CONSOLE_WIDTH, subsequent_indent=indent, break_long_words=False,
                                   break_on_hyphens=False) if line else "" for line in text.split("\n")))


def check_ranges(args, ranges: dict[str, tuple[float, float]]) -> None:
    """Every number of a command line finite and in its closed range, ``{option: (low, high)}``; an
    option left at None (not given, no default) is not checked."""
    for name, (low, high) in ranges.items():
        value = getattr(args, name)
        if value is not None and not (math.isfinite(value) and low <= value <= high):
            raise UserError(f"--{name} must be in [{_number(low)}, {_number(high)}], got {value}")


def _number(x: float) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


def one_line(exc: BaseException) -> str:
    """The first line of an exception's message, for an error line that names its cause."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]


def parse_names(text: str, flag: str, known, noun: str = "name") -> list[str]:
    """A comma-separated list of known names, each at most once, in the order given."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise UserError(f"{flag}: unknown {noun}(s) {', '.join(unknown) or '(none given)'}; "
                        f"choose from {', '.join(known)}")
    if len(set(names)) != len(names):
        raise UserError(f"{flag}: {'an' if noun[0] in 'aeiou' else 'a'} {noun} is given twice")
    return names


def pick_device(choice: str):
    """The device the children will use. Asked through NVML, so that the main process never
    initialises CUDA (its children do, each for itself)."""
    import torch

    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    has_gpu = torch.cuda.is_available()
    if choice == "cuda" and not has_gpu:
        raise UserError("--device cuda: no CUDA GPU is visible to this process")
    if choice == "cpu" or not has_gpu:
        return torch.device("cpu")
    check_gpus_per_rank(int(os.environ.get("LOCAL_WORLD_SIZE", 1)), torch.cuda.device_count())
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))


def check_gpus_per_rank(local_ranks: int, gpus: int) -> None:
    """Every rank of this node needs a GPU of its own (rank r takes cuda:LOCAL_RANK); refused before anything
    starts, with the ways out."""
    if local_ranks <= gpus:
        return
    raise UserError(f"{local_ranks} ranks were started on this node but {gpus} GPU{'s are' if gpus != 1 else ' is'} "
                    f"visible to them, and each rank needs a GPU of its own: start {gpus} (--nproc_per_node {gpus}), "
                    f"measure N = {local_ranks} on one GPU with --simulate_world_size {local_ranks}, or run on the "
                    "CPU with --device cpu")


def prepare_output_dir(path: str) -> None:
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".write_test{os.getpid()}")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as exc:
        raise UserError(f"--output_dir {path}: cannot write there ({exc.strerror})") from None


LOCK_FILE = ".fsdp2bench.lock"


def lock_output_dir(path: str) -> None:
    """One launch at a time writes into a directory: two would mix their files silently. The lock
    names its host and process and appears whole or not at all (written under a name of its own,
    then hard-linked into place, which fails if a lock is there); one left by a process that is gone
    is taken over."""
    lock, me = os.path.join(path, LOCK_FILE), f"{socket.gethostname()} {os.getpid()}"
    fd, mine = tempfile.mkstemp(prefix=f"{LOCK_FILE}.", dir=path)
    with os.fdopen(fd, "w") as f:
        f.write(me)
    try:
        for _ in range(2):
            try:
                os.link(mine, lock)
            except FileExistsError:
                _refuse_or_clear(path, lock)
                continue
            atexit.register(_unlock, lock, me)
            return
    finally:
        os.remove(mine)
    raise UserError(f"--output_dir {path}: could not take {LOCK_FILE}")


def _refuse_or_clear(path: str, lock: str) -> None:
    """A lock whose process is gone is removed; one that names a live process, or that cannot be read
    (never made by this code, which writes it whole), is refused."""
    try:
        with open(lock) as f:
            host, pid = f.read().split()
        alive = host != socket.gethostname() or process_running(int(pid))
    except FileNotFoundError:  # its run ended meanwhile
        return
    except (OSError, ValueError):
        raise UserError(f"--output_dir {path}: {lock} is there but does not name a run; remove it if no run is "
                        "writing there") from None
    if alive:
        raise UserError(f"--output_dir {path}: another run (process {pid} on {host}) is writing there; wait for "
                        f"it to end, choose another directory, or remove {lock} if that run is gone")
    with contextlib.suppress(FileNotFoundError):  # another launch may have cleared it first
        os.remove(lock)


def process_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _unlock(lock: str, me: str) -> None:
    with contextlib.suppress(OSError):
        with open(lock) as f:
            if f.read() == me:
                os.remove(lock)


def path_kind(path: str) -> str:
    """What is at ``path``, in the words of an error line."""
    if os.path.islink(path) and not os.path.exists(path):
        return "a broken symbolic link (what it points to does not exist)"
    if not os.path.exists(path):
        return "no such file or directory"
    if os.path.isdir(path):
        return "a directory" + ("" if os.access(path, os.R_OK | os.X_OK) else " that cannot be read")
    if os.path.isfile(path):
        return "a file" + ("" if os.access(path, os.R_OK) else " that cannot be read")
    return "neither a file nor a directory"


def looks_like_a_path(name: str) -> bool:
    """A name that can only mean a local path (a Hub id has no leading dot or slash), or one that exists."""
    return os.path.lexists(name) or name.startswith((".", os.sep)) or name.count(os.sep) > 1


def expect_path(path: str, flag: str, wanted: str) -> None:
    """Refuse, saying what is there instead, a path that is not a readable ``wanted`` ("file" or
    "directory")."""
    if not path.strip():
        raise UserError(f"{flag}: an empty path")
    kind = path_kind(path)
    if kind != f"a {wanted}":
        raise UserError(f"{flag} {path}: {kind}" + ("" if kind.startswith(f"a {wanted}") else f", not a {wanted}"))


def check_output_dir(path: str, summary_file: str, flag: str = "--output_dir") -> None:
    """Whether a run can write into ``path``, told without writing anything: a file in the way, no
    writable directory above it, a summary file that is a directory."""
    if not path.strip():
        raise UserError(f"{flag}: an empty path")
    if os.path.lexists(path) and not os.path.isdir(path):
        raise UserError(f"{flag} {path}: {path_kind(path)}, not a directory")
    existing = path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing.rstrip(os.sep)) or "."
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"{flag} {path}: cannot write there ({existing} is not a writable directory)")
    refuse_directory(os.path.join(path, summary_file))


def check_writable_file(path: str, flag: str) -> None:
    """A file the command will write: not a directory, in a directory it can write."""
    if not path.strip():
        raise UserError(f"{flag}: an empty path")
    if os.path.isdir(path) or (os.path.lexists(path) and not os.path.isfile(path)):
        raise UserError(f"{flag} {path}: {path_kind(path)}; the script writes a file there")
    check_output_dir(os.path.dirname(path) or ".", os.path.basename(path), flag)


def refuse_directory(path: str) -> None:
    if os.path.isdir(path):
        raise UserError(f"{path} is a directory; the run writes a file of that name")


def check_replaceable(path: str) -> None:
    """A file the run will rewrite must be replaceable now, not only when the first results arrive.
    An existing one is replaced by a copy of itself: its content does not change."""
    refuse_directory(path)
    if os.path.exists(path):
        try:
            with open(path, "rb") as f:
                content = f.read()
            write_bytes(path, content)
        except OSError as exc:
            raise UserError(f"{path}: cannot be replaced ({exc.strerror}); move it away or choose another "
                            "--output_dir") from None


def write_bytes(path: str, content: bytes) -> None:
    """Write to a temporary name, then rename: a reader never sees half a file, and a failed
    write leaves nothing behind."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(content)
        os.replace(tmp, path)
    except OSError as exc:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise OSError(exc.errno, exc.strerror, path) from None  # the file meant, not its temporary name


def write_json(path: str, data: dict) -> None:
    """Strict JSON, which any reader accepts: a value that is NaN or infinite (a diverged loss,
    whose step the summary's ``losses_finite`` check names) is written as null."""
    write_bytes(path, json.dumps(_finite_or_null(data), indent=1, allow_nan=False).encode())


def _finite_or_null(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite_or_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_null(v) for v in value]
    return value


_UNWRITTEN: dict[str, str] = {}  # summaries this process could not write, and why (their last try)


def save_summary(path: str, data: dict) -> None:
    """A summary that cannot be written costs one line, not the variants still to run; the run's
    end says so again (``unwritten``) unless a later write of it succeeded."""
    try:
        write_json(path, data)
        _UNWRITTEN.pop(path, None)
    except OSError as exc:
        _UNWRITTEN[path] = exc.strerror or type(exc).__name__
        print(f"warning: cannot write {path} ({_UNWRITTEN[path]}); the run goes on", file=sys.stderr, flush=True)


def unwritten() -> str | None:
    """One error line for the summaries that could not be written, or None."""
    if not _UNWRITTEN:
        return None
    return "error: could not write " + "; ".join(f"{p} ({why})" for p, why in _UNWRITTEN.items()) + \
        "; the results so far are in the files that were written"
