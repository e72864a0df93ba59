"""The files a run writes and reads: its output directory (writable, locked by one launch at a time), paths checked
before anything runs, atomic writes, and the mark that tells this benchmark's files from anyone else's."""

from __future__ import annotations

import atexit
import contextlib
import errno
import hashlib
import json
import math
import os
import socket
import sys
import tempfile

from fsdp2bench.cli import UserError

# Where the entry scripts are: a launch this package starts (main.py, a timing) runs from there.
PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
    names its host, process and the process's start time (a process id is reused once its process is
    gone) and appears whole or not at all (written under a name of its own, then hard-linked into place,
    which fails if a lock is there); one left by a process that is gone is taken over."""
    lock = os.path.join(path, LOCK_FILE)
    me = f"{socket.gethostname()} {os.getpid()} {started_at(os.getpid()):.2f}"
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


def started_at(pid: int) -> float | None:
    """When process ``pid`` of this host started (seconds since the epoch), or None where it is gone."""
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except psutil.NoSuchProcess:
        return None


def _refuse_or_clear(path: str, lock: str) -> None:
    """A lock whose process is gone (or whose process id now names a process started later) is removed;
    one that cannot be read (never made by this code, which writes it whole) is refused, and so is one
    whose process may still be the run that took it, in words true of what is known of it."""
    try:
        with open(lock) as f:
            host, pid, *started = f.read().split()
        pid_number, when = int(pid), float(started[0]) if len(started) == 1 else None
        if pid_number < 1 or len(started) > 1:
            raise ValueError(pid)
    except FileNotFoundError:  # its run ended meanwhile
        return
    except (OSError, ValueError):
        raise UserError(f"--output_dir {path}: {lock} is there but does not name a run; remove it if no run is "
                        "writing there") from None
    holder = _lock_holder(host, pid_number, when)
    if holder:
        wait = "wait for it to end, " if holder.startswith(RUN_HOLDS) else ""
        raise UserError(f"--output_dir {path}: {holder}; {wait}choose another directory, or remove {lock} if no run "
                        "is writing there")
    with contextlib.suppress(FileNotFoundError):  # another launch may have cleared it first
        os.remove(lock)


RUN_HOLDS = "another run"  # the words of a lock held by the process that took it


def _lock_holder(host: str, pid: int, when: float | None) -> str | None:
    """What the process a lock names is, as far as this host can tell, or None where it is gone."""
    if host != socket.gethostname():
        return f"its lock names process {pid} on {host}, another machine, where this one cannot see whether it runs"
    now = started_at(pid)
    if now is None:
        return None
    if when is not None:  # the process that took the lock, or a later one given its id
        return f"{RUN_HOLDS} (process {pid} on {host}) is writing there" if abs(now - when) < 0.05 else None
    return f"its lock names process {pid} on {host}, which is running{_what_runs(pid)}, but the lock does not " \
           "say when its process started, so whether that process took it cannot be told"


def _what_runs(pid: int) -> str:
    """" (python3 main.py ...)": the command line of process ``pid``, shortened, where it can be read."""
    import psutil

    try:
        command = " ".join(os.path.basename(a) if i == 0 else a for i, a in enumerate(psutil.Process(pid).cmdline()))
    except psutil.Error:
        return ""
    return f" ({command[:60]}{'...' if len(command) > 60 else ''})" if command else ""


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
    """What is at ``path``, in the words of an error line (a symbolic link is followed)."""
    try:
        os.stat(path)
    except OSError as exc:
        return _unreachable(path, exc)
    if os.path.isdir(path):
        return "a directory" + ("" if os.access(path, os.R_OK | os.X_OK) else " that cannot be read")
    if os.path.isfile(path):
        return "a file" + ("" if os.access(path, os.R_OK) else " that cannot be read")
    return "neither a file nor a directory"


def _unreachable(path: str, exc: OSError) -> str:
    """Why following ``path`` fails, by the system's own reason: a loop of links is no broken link."""
    if exc.errno == errno.ENOENT:
        return "a broken symbolic link (what it points to does not exist)" if os.path.islink(path) else \
            "no such file or directory"
    loop = "a symbolic link loop (its links lead back to themselves, never to a file)" if os.path.islink(path) \
        else "out of reach (a symbolic link on the way to it loops)"
    words = {errno.ELOOP: loop,
             errno.ENOTDIR: "no such file or directory (a part of the path before its last is a file)",
             errno.EACCES: "out of reach (a directory on the way to it cannot be searched)",
             errno.ENAMETOOLONG: "a name too long for the file system"}
    return words.get(exc.errno, f"out of reach ({exc.strerror})")


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
    """Whether a run can write into ``path``, told leaving nothing behind: a file in the way, no
    writable directory above it, a summary file that is a directory."""
    if not path.strip():
        raise UserError(f"{flag}: an empty path")
    if os.path.lexists(path) and not os.path.isdir(path):
        raise UserError(f"{flag} {path}: {path_kind(path)}, not a directory")
    existing = path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing.rstrip(os.sep)) or "."
    why = "not a directory" if not os.path.isdir(existing) else cannot_create_in(existing)
    if why:
        raise UserError(f"{flag} {path}: cannot write there ({existing}: {why})")
    refuse_directory(os.path.join(path, summary_file))


def cannot_create_in(directory: str) -> str | None:
    """Why no file can be made in ``directory``, found by making one and removing it (root passes
    ``os.access`` where a read-only mount or an immutable directory refuses it), or None."""
    try:
        fd, probe = tempfile.mkstemp(prefix=".write_test", dir=directory)
    except OSError as exc:  # said as the making's failure: /proc's ENOENT is no missing /proc
        return f"no file can be made in it: {exc.strerror or type(exc).__name__}"
    os.close(fd)
    os.remove(probe)
    return None


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
    """Write to a temporary name, then rename: a reader never sees half a file, and a failed or
    interrupted write (a signal arrives as KeyboardInterrupt) leaves the file as it was and nothing
    beside it."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(content)
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        if isinstance(exc, OSError):
            raise OSError(exc.errno, exc.strerror, path) from None  # the file meant, not its temporary name
        raise


# The mark every file of this benchmark carries (a JSON key, a PNG text chunk): what is at a name it writes
# is replaced only where it carries the mark. A run id or a familiar shape is no mark: another program's
# summary.json may hold a "run_id" too.
MARK_KEY, MARK = "written_by", "fsdp2bench"


def write_json(path: str, data: dict) -> None:
    """Strict JSON, which any reader accepts: a value that is NaN or infinite (a diverged loss,
    whose step the summary's ``losses_finite`` check names) is written as null. Marked as this
    benchmark's (``MARK_KEY``)."""
    marked = {**data, MARK_KEY: MARK} if isinstance(data, dict) else data
    write_bytes(path, json.dumps(_finite_or_null(marked), indent=1, allow_nan=False).encode())


def digest_of(path: str) -> str | None:
    """The SHA-256 of a file's bytes (None where it cannot be read): what a run wrote, told from what is there now."""
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return None


def is_ours(path: str) -> bool:
    """Whether the file at ``path`` carries this benchmark's mark: a JSON object with it, a PNG with it in its
    text chunks, or a memory snapshot (a pickle, never opened: unpickling runs code) beside a marked trace."""
    try:
        if path.endswith(".json"):
            with open(path, "rb") as f:
                data = json.loads(f.read())
            return isinstance(data, dict) and data.get(MARK_KEY) == MARK
        if path.endswith(".png"):
            from PIL import Image

            with Image.open(path) as image:
                return image.format == "PNG" and image.info.get(MARK_KEY) == MARK
        if path.endswith(".pkl") and "_memory_snapshot" in os.path.basename(path):
            return is_ours(path.replace("_memory_snapshot", "_memory_usage").rsplit(".", 1)[0] + ".json")
    except (OSError, ValueError, UnicodeDecodeError):  # PIL's UnidentifiedImageError is an OSError
        return False
    return False


def refuse_foreign(paths, flag: str) -> None:
    """Before anything runs: whatever is at a name this run will write and does not carry the benchmark's mark
    (a file of another program, a directory, a symbolic link, broken or not) is left untouched, and the run
    refused in one line."""
    for path in paths:
        if not os.path.lexists(path):
            continue
        if os.path.islink(path) or not os.path.isfile(path):
            what = f"a symbolic link ({path_kind(path)})" if os.path.islink(path) else path_kind(path)
            raise UserError(f"{flag}: {path} is {what}, where this run writes a file; it is left untouched: move "
                            f"it away or choose another {flag}")
        if not is_ours(path):
            raise UserError(f"{flag}: {path} was not written by this benchmark, and this run would replace it; it "
                            f"is left untouched: move it away or choose another {flag}")


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
