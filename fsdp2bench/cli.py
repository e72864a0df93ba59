"""What every entry script does with its command line: one-line errors and exit codes, the parser, checks of numbers,
names and devices, the console. The files a run writes (directories, locks, atomic writes, the mark) are files.py's."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import faulthandler
import io
import math
import os
import re
import signal
import socket
import sys
import textwrap
import threading
import time
from typing import Callable, Iterator, NoReturn

from fsdp2bench.names import counted


class UserError(Exception):
    """A problem the user can fix (bad flag, missing file); reported in one line, once per launch."""


class RankError(UserError):
    """A problem of one rank's own (its launcher variables, its peers): every rank that meets it says so."""


class Stopped(Exception):
    """SIGINT or SIGTERM reached this process (isolation.Interrupted is one)."""


def not_a_script(what: str, instead: str) -> NoReturn:
    """A library file at the top of the tree run as a script: it would do nothing and exit 0; one line says what to
    run instead."""
    print(f"error: {what}, not a script: run {instead} (--help lists its options)", file=sys.stderr)
    sys.exit(2)


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
        parsed, extras = super().parse_known_args(
            self.dash_values_joined(sys.argv[1:] if args is None else list(args)), namespace)
        self.refuse_blank_values(parsed)
        return parsed, extras

    def refuse_blank_values(self, parsed: argparse.Namespace) -> None:
        """A text value left empty (``--model ''``) would read as not given, its default taken in silence, and an
        empty item of a list (``--lora_targets q_proj,,v_proj``) as not there: refused, as every other value an
        option cannot take is (a number, a choice: argparse's own line)."""
        for action in self._actions:
            value = getattr(parsed, action.dest, None)
            if not action.option_strings or not isinstance(value, str) or value == action.default:
                continue
            if not value.strip():
                self.error(f"{action.option_strings[0]}: an empty value (leave the option out for its default)")
            if not all(part.strip() for part in value.split(",")):  # a list's empty item, dropped, would hide a typo
                self.error(f"{action.option_strings[0]} {value}: an empty item between commas")

    def dash_values_joined(self, argv: list[str]) -> list[str]:
        """An option's value that starts with a dash (``--links -1,50``; ``--emulate_communication -1,50``, whose
        value may be left out) is its value, not a missing one or an unknown option: joined as ``--links=-1,50``,
        so that the option's own check says what is wrong with it. A word that names an option, or begins the
        name of one (argparse takes ``--sim`` for ``--simulate_world_size``), stays an option."""
        out, i = [], 0
        while i < len(argv):
            action = self._option_string_actions.get(argv[i])
            after = argv[i + 1] if i + 1 < len(argv) else None
            if action is not None and action.nargs in (None, "?") and action.option_strings and after is not None \
                    and after.startswith("-") and not self.names_an_option(after):
                out.append(f"{argv[i]}={after}")
                i += 2
                continue
            out.append(argv[i])
            i += 1
        return out

    def names_an_option(self, word: str) -> bool:
        """Whether ``word`` (``--`` included) is an option of this parser, given in full or begun."""
        name = word.split("=", 1)[0]
        return name == "--" or any(option.startswith(name) for option in self._option_string_actions)


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


def say_interrupted(name: str) -> None:
    if os.environ.get("RANK", "0") == "0":
        print(f"Interrupted ({name}); what was written is whole, nothing more is", file=sys.stderr)


def say_interrupted_outside(exc: BaseException) -> NoReturn:
    say_interrupted(str(exc) or "SIGINT")
    sys.exit(130)


_ENDING: list[bool] = []  # set by exit_with once its command has ended, returned or raised


def ending() -> bool:
    """Whether this process is past its command (``exit_with`` has its outcome: a refusal, an interrupt, a run's
    teardown) or the interpreter is finalizing: an interrupt raised now would land in the teardown or in a finalizer
    it runs, where Python prints it with its stack and goes on (``end_interrupted`` instead)."""
    return bool(_ENDING) or sys.is_finalizing()


def end_interrupted(name: str) -> NoReturn:
    """A signal that came as the process ends: it ends at once as an interrupt does, in one line from the first rank
    and exit code 130; what was written stays whole (every file is written under another name and renamed)."""
    say_interrupted(name)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError, AttributeError):
            stream.flush()
    os._exit(130)


def exit_with(run: Callable[[], int]) -> None:
    """Run a command; a UserError becomes one line on stderr and exit code 2.

    A command that ran ends without the interpreter's teardown, which frees one by one the objects
    torch and transformers made: 2.3 s after the last line of a run on a 2-core machine. The exit
    handlers still run (the output directory's lock), and every file was closed before. A refused
    start keeps the ordinary exit: under torchrun the first rank to exit makes it stop the others,
    and the teardown's seconds let them print their own line first. From the moment the command has
    ended, a signal ends the process at once (``ending``)."""
    set_up_standard_streams()
    try:
        code = run()
        _ENDING.append(True)
    except BaseException as exc:
        _ENDING.append(True)
        end_after(exc)
        raise
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def end_after(exc: BaseException) -> None:
    """How a command that raised ends: a UserError in one line and exit code 2, a file it could not write (a full
    disk, a directory gone; each is written whole) in one line and 1, an interrupt outside a run's own handling of
    interrupts (or one that a library caught and raised again as its own error) in one line and 130. Anything else
    is the caller's to raise on."""
    if isinstance(exc, UserError):
        refuse(exc)
    if isinstance(exc, OSError) and exc.filename is not None:
        print(f"error: cannot write {exc.filename} ({exc.strerror})", file=sys.stderr)
        sys.exit(1)
    interrupt = interruption_within(exc) if isinstance(exc, (Exception, KeyboardInterrupt)) else None
    if interrupt is not None:
        say_interrupted_outside(interrupt)


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


GPU_MEMORY_UNITS = {"": 1.0, "gib": 1.0, "gb": 1e9 / 2**30}  # in GiB: a bare number is GiB, GB is 10^9 bytes
GPU_MEMORY_RANGE = (0.001, 1 << 20)  # GiB


def gpu_memory_gib(text: str) -> float:
    """``--gpu_memory``, in GiB, from the size a user thinks in: ``80GB`` (10^9 bytes), ``80GiB``,
    ``80 GiB``, any case, or a bare number of GiB. Every script that takes the flag parses it here, so that
    a bad value gets the same one line everywhere."""
    match = re.fullmatch(r"\s*(.*?)\s*(gib|gb)?\s*", text, re.IGNORECASE)
    try:
        gib = float(match.group(1)) * GPU_MEMORY_UNITS[(match.group(2) or "").lower()]
    except ValueError:
        gib = math.nan
    low, high = GPU_MEMORY_RANGE
    if not (math.isfinite(gib) and low <= gib <= high):
        raise UserError(f"--gpu_memory must be in [{low:g}, {high}] GiB, written as 80GB (10^9 bytes), 80GiB or "
                        f"80 (GiB): got {text!r}")
    return gib


def _number(x: float) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


@contextlib.contextmanager
def quiet_imports() -> Iterator[None]:
    """What some installs log as a package is imported, and the run never uses (torchao's kernels built for another
    Python, which transformers' quantizers and peft import where torchao is installed; bitsandbytes' optional CPU
    kernels; torch's note on torchao's enums): kept off the console, so that a refusal after it stays one line."""
    import logging

    loggers = [logging.getLogger(name) for name in ("torchao", "bitsandbytes", "torch.utils._pytree")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def quietly_import_models() -> None:
    """transformers' model code, imported first here: its quantizers import torchao where it is installed, which
    logs on some installs what no run uses (``quiet_imports``)."""
    with quiet_imports():
        import transformers.modeling_utils  # noqa: F401


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
    raise UserError(f"{counted(local_ranks, 'rank')} {'was' if local_ranks == 1 else 'were'} started on this node "
                    f"but {counted(gpus, 'GPU')} {'is' if gpus == 1 else 'are'} visible to them, and each rank needs "
                    f"a GPU of its own: start {gpus} (--nproc_per_node {gpus}), "
                    f"measure N = {local_ranks} on one GPU with --simulate_world_size {local_ranks}, or run on the "
                    "CPU with --device cpu")
