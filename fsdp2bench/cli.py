"""What every entry script does with its command line: one-line errors, device and output checks, JSON."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import math
import os
import socket
import sys
from typing import Callable


class UserError(Exception):
    """A problem the user can fix (bad flag, missing file); reported in one line."""


class OneLineParser(argparse.ArgumentParser):
    """A bad flag gets one line and exit code 2, like every other user error."""

    def error(self, message: str):
        print(f"error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


def exit_with(run: Callable[[], int]) -> None:
    """Run a command; a UserError becomes one line on stderr and exit code 2.

    A command that ran ends without the interpreter's teardown, which frees one by one the objects
    torch and transformers made: 2.3 s after the last line of a run on a 2-core machine. The exit
    handlers still run (the output directory's lock), and every file was closed before. A refused
    start keeps the ordinary exit: under torchrun the first rank to exit makes it stop the others,
    and the teardown's seconds let them print their own line first."""
    try:
        code = run()
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


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
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))


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
    names its host and process; one left by a process that is gone is taken over."""
    lock, me = os.path.join(path, LOCK_FILE), f"{socket.gethostname()} {os.getpid()}"
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            _refuse_or_clear(path, lock)
            continue
        with os.fdopen(fd, "w") as f:
            f.write(me)
        atexit.register(_unlock, lock, me)
        return
    raise UserError(f"--output_dir {path}: could not take {LOCK_FILE}")


def _refuse_or_clear(path: str, lock: str) -> None:
    try:
        with open(lock) as f:
            host, pid = f.read().split()
        alive = host != socket.gethostname() or process_running(int(pid))
    except (OSError, ValueError):
        host, pid, alive = "?", "?", False  # unreadable: left by a run that died while writing it
    if alive:
        raise UserError(f"--output_dir {path}: another run (process {pid} on {host}) is writing there; wait for "
                        f"it to end, choose another directory, or remove {lock} if that run is gone")
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


def check_output_dir(path: str, summary_file: str, flag: str = "--output_dir") -> None:
    """Whether a run can write into ``path``, told without writing anything: a file in the way, no
    writable directory above it, a summary file that is a directory."""
    if not path.strip():
        raise UserError(f"{flag}: an empty path")
    if os.path.exists(path) and not os.path.isdir(path):
        raise UserError(f"{flag} {path}: not a directory")
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
    if os.path.isdir(path):
        raise UserError(f"{flag} {path}: a directory; a file goes there")
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
    except OSError:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


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


def save_summary(path: str, data: dict) -> None:
    """A summary that cannot be written costs one line, not the variants still to run."""
    try:
        write_json(path, data)
    except OSError as exc:
        print(f"warning: cannot write {path} ({exc.strerror}); the run goes on", file=sys.stderr, flush=True)
