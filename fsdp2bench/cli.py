"""What every entry script does with its command line: one-line errors, device and output checks, JSON."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import errno
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
import threading
import time
from typing import Callable, Iterator, NoReturn


# Where the entry scripts are: a launch this package starts (main.py, a timing) runs from there.
PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class UserError(Exception):
    """A problem the user can fix (bad flag, missing file); reported in one line, once per launch."""


class RankError(UserError):
    """A problem of one rank's own (its launcher variables, its peers): every rank that meets it says so."""


class Stopped(Exception):
    """SIGINT or SIGTERM reached this process (isolation.Interrupted is one)."""


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The description's line breaks kept; a switch says that it takes no value (``--quiet``, not ``--quiet
    true``)."""

    def _get_help_string(self, action) -> str:
        text = super()._get_help_string(action) or ""
        if isinstance(action, argparse._StoreTrueAction):
            return text.replace("(default: off)", "(a switch, no value; default: off)")
        return text


class OneLineParser(argparse.ArgumentParser):
    """A bad flag gets one line and exit code 2, like every other user error. ``--help`` opens with how to
    launch the script (``launches``: command, what it is for), then what it does and its documentation page."""

    def __init__(self, what: str, launches: list[tuple[str, str]], docs: str):
        width = max(len(command) for command, _ in launches)
        usage = "\n       ".join(f"{command:{width}}  # {why}" for command, why in launches) + "\n       (options below)"
        super().__init__(usage=usage, description=f"{textwrap.fill(what, CONSOLE_WIDTH)}\n\nDocumentation: {docs}",
                         formatter_class=HelpFormatter)

    def error(self, message: str):
        print(f"error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)

    def parse_known_args(self, args=None, namespace=None):
        return super().parse_known_args(self.dash_values_joined(sys.argv[1:] if args is None else list(args)),
                                        namespace)

    def dash_values_joined(self, argv: list[str]) -> list[str]:
        """An option's value that starts with a dash (``--links -1,50``) is its value, not a missing one: joined
        as ``--links=-1,50``, so that the option's own check says what is wrong with it."""
        out, i = [], 0
        while i < len(argv):
            action = self._option_string_actions.get(argv[i])
            after = argv[i + 1] if i + 1 < len(argv) else None
            if action is not None and action.nargs is None and action.option_strings and after is not None \
                    and after.startswith("-") and after != "--" \
                    and after.split("=", 1)[0] not in self._option_string_actions:
                out.append(f"{argv[i]}={after}")
                i += 2
                continue
            out.append(argv[i])
            i += 1
        return out


NOT_GIVEN = object()


def given_options(parser: argparse.ArgumentParser, argv: list[str] | None) -> set[str]:
    """The options the command line gave, a default given again included: argparse fills in a default only where
    the namespace has no value yet."""
    blank = argparse.Namespace(**{a.dest: NOT_GIVEN for a in parser._actions if a.dest != argparse.SUPPRESS})
    parsed, _ = parser.parse_known_args(argv, blank)
    return {name for name, value in vars(parsed).items() if value is not NOT_GIVEN}


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


def interruption_within(exc: BaseException) -> BaseException | None:
    """The interrupt (Ctrl-C, or SIGTERM's ``Stopped``) among an exception's causes: torch's fake-tensor and
    dispatch code, for one, wraps what a signal raised inside it in an error of its own."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, (KeyboardInterrupt, Stopped)):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def say_interrupted_outside(exc: BaseException) -> NoReturn:
    if os.environ.get("RANK", "0") == "0":
        print(f"Interrupted ({str(exc) or 'SIGINT'}); what was written is whole, nothing more is", file=sys.stderr)
    sys.exit(130)


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
        say_interrupted_outside(exc)
    except OSError as exc:  # a file the command writes (a full disk, a directory gone); each is written whole
        if exc.filename is None:
            raise
        print(f"error: cannot write {exc.filename} ({exc.strerror})", file=sys.stderr)
        sys.exit(1)
    except Exception as exc:  # an interrupt that a library caught and raised again as its own error
        interrupt = interruption_within(exc)
        if interrupt is None:
            raise
        say_interrupted_outside(interrupt)
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


@contextlib.contextmanager
def environment_changed(changes: dict[str, str | None]) -> Iterator[None]:
    """This process's environment with ``changes`` (a value of None removes the variable) for as long as the
    block runs, then as it was."""
    before = {name: os.environ.get(name) for name in changes}
    for name, value in changes.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def say(text: str, indent: str = "") -> None:
    """A paragraph on the console, each of its lines folded at ``CONSOLE_WIDTH`` columns."""
    print("\n".join(textwrap.fill(line, CONSOLE_WIDTH, subsequent_indent=indent, break_long_words=False,
                                   break_on_hyphens=False) if line else "" for line in text.split("\n")), flush=True)


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


HUB_WAIT_S = 2.0  # how long a name that may be a Hub id waits for the Hub to answer


def hub_reachable() -> bool:
    """Whether the Hugging Face Hub accepts a connection within ``HUB_WAIT_S`` (never in offline mode). In a
    thread of its own: a name lookup on a machine without a network can hang far longer than that."""
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        return False
    from urllib.parse import urlsplit

    from huggingface_hub import constants

    where = urlsplit(constants.ENDPOINT)
    answered: list[bool] = []

    def connect() -> None:
        with contextlib.suppress(OSError, ValueError):
            with socket.create_connection((where.hostname, where.port or 443), timeout=HUB_WAIT_S):
                answered.append(True)

    probe = threading.Thread(target=connect, daemon=True)
    probe.start()
    probe.join(HUB_WAIT_S)
    return bool(answered)


def from_hub(load: Callable, name: str, flag: str, what: str, file: str):
    """``load(name)`` for a name that is no local path: from the Hub where it answers, else from the local
    Hugging Face cache alone (the snapshot holding ``file``), so that an offline machine is told at once, not
    after the Hub's retries."""
    from huggingface_hub import constants, try_to_load_from_cache

    reachable = hub_reachable()
    try:
        if reachable:
            return load(name)
        cached = try_to_load_from_cache(name, file)
        if isinstance(cached, str):
            return load(os.path.dirname(cached))
    except Exception as exc:  # unknown id, gated repo, a cache entry transformers cannot read...
        raise UserError(f"{flag} {name}: {what}, and the Hub could not provide it ({type(exc).__name__})") from None
    raise UserError(f"{flag} {name}: {what}, not in the local Hugging Face cache, and the Hub "
                    f"({constants.ENDPOINT}) cannot be reached")


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
    except OSError as exc:
        return exc.strerror or type(exc).__name__
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
