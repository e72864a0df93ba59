"""Helpers that launch the real scripts, the way a user does."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ["torch_optimizer_after_fsdp", "torch_optimizer_before_fsdp_not_fixed",
            "torch_optimizer_before_fsdp_fixed", "accelerate"]
# A tiny Qwen2 on CPU learns visibly within a dozen steps at this learning rate.
TINY = ["--model", "tiny", "--device", "cpu", "--max_steps", "12", "--learning_rate", "1e-3"]


# ``launcher``'s first word: accelerate's launcher with the options after it, instead of torchrun.
ACCELERATE_LAUNCH = "accelerate launch"


def command(args: list[str], nproc: int | None = 2, launcher: list[str] | None = None) -> list[str]:
    """``torchrun --standalone --nproc_per_node nproc <args>``, plain python when nproc is None, torchrun
    with the given ``launcher`` options instead of ``--standalone`` and the process count, or ``accelerate
    launch`` with the options that follow ``ACCELERATE_LAUNCH`` in ``launcher``."""
    if nproc is None and launcher is None:
        return [sys.executable, *args]
    if launcher and launcher[0] == ACCELERATE_LAUNCH:
        return [sys.executable, "-m", "accelerate.commands.launch", *launcher[1:], *args]
    options = launcher if launcher is not None else ["--standalone", f"--nproc_per_node={nproc}"]
    return [sys.executable, "-m", "torch.distributed.run", *options, *args]


def environment(**extra: str) -> dict:
    """One thread per process (2 cores run 2 ranks), unbuffered output, never the Hub; the temp dir is the
    session's own (``TESTS_TMP``, inherited)."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", **extra}


# torchrun's logs; multiprocessing's, when a test kills it; torch's compiled-kernel cache
LEFT_BY_LAUNCHERS = ("torchelastic_", "pymp-", "torchinductor_")
TESTS_TMP: list[str] = []  # the temp dir of every process of this session, its own and those it launches
MACHINE_TMPDIR: list[str | None] = []  # TMPDIR as the session found it


def pytest_configure(config) -> None:
    """Before the test modules are imported (some make files as they are), every process of the session is given
    a temp dir of its own, inside the machine's: on a shared machine, what other jobs write there is theirs.
    pytest's own folders stay where they are (kept for a look after a failure)."""
    machine = tempfile.gettempdir()
    MACHINE_TMPDIR.append(os.environ.get("TMPDIR"))
    os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", machine)
    TESTS_TMP.append(tempfile.mkdtemp(prefix="fsdp2bench-tests-", dir=machine))
    os.environ["TMPDIR"] = tempfile.tempdir = TESTS_TMP[0]


def pytest_unconfigure(config) -> None:
    """The session's temp dir goes with it, what the launchers leave there too."""
    if TESTS_TMP:
        tempfile.tempdir = os.path.dirname(TESTS_TMP[0])
        if MACHINE_TMPDIR[0] is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = MACHINE_TMPDIR[0]
        shutil.rmtree(TESTS_TMP.pop(), ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def nothing_left_in_the_temp_dir():
    """The tests' processes leave nothing of theirs in their temp dir but the launchers' own leftovers (what the
    test modules made as they were imported is already there, and removed by them at exit)."""
    before = set(os.listdir(TESTS_TMP[0]))
    yield
    left = sorted(n for n in set(os.listdir(TESTS_TMP[0])) - before if not n.startswith(LEFT_BY_LAUNCHERS))
    assert not left, f"left in the tests' temp dir {TESTS_TMP[0]}: {left}"


def hangup_as_from_a_terminal() -> None:
    """In a launched script, before it runs: SIGHUP as a terminal's shell leaves it, whatever this session inherited
    (a suite started under nohup ignores it, and a script keeps an ignored SIGHUP ignored, as nohup asks)."""
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def start_script(args: list[str], nproc: int | None = 2, launcher: list[str] | None = None, own_group: bool = False,
                 **env: str) -> subprocess.Popen:
    """The same launch as ``run_script``, left running (to signal it, or to start several); ``own_group``: in a
    process group of its own, which a terminal's Ctrl-C reaches whole (``os.killpg(proc.pid, ...)``)."""
    return subprocess.Popen(command(args, nproc, launcher), cwd=ROOT, env=environment(**env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=own_group,
                            preexec_fn=hangup_as_from_a_terminal)


def run_script(args: list[str], nproc: int | None = 2, timeout: int = 300, launcher: list[str] | None = None,
               **env: str) -> subprocess.CompletedProcess:
    """Launch a script of the project as a user does, wait for it, and keep its output."""
    return subprocess.run(command(args, nproc, launcher), cwd=ROOT, env=environment(**env), capture_output=True,
                          text=True, timeout=timeout, preexec_fn=hangup_as_from_a_terminal)


def child_running(pid: int, marker: str, timeout: float = 60.0):
    """The first child process of ``pid`` whose command line holds ``marker``, or whose name is it, waited for;
    a child that has just ended (a zombie, or gone) is passed over."""
    import time

    import psutil

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for child in psutil.Process(pid).children():
            try:
                if marker in " ".join(child.cmdline()) or child.name() == marker:
                    return child
            except psutil.Error:
                continue
        time.sleep(0.05)
    raise AssertionError(f"no child of {pid} running {marker} within {timeout} s")


def refusal(validate, argv: list[str]) -> str | None:
    """What a script's ``validate`` (its checks of the command line, which it runs before any process or file
    exists) says of ``argv``, called in this process: None where it accepts it, else the one line a launch
    prints (a UserError as ``cli.exit_with`` says it, or the parser's own line). For refusals that need no
    process; the launches that check that a refusal is that line and exit code 2 are kept beside them."""
    from fsdp2bench.cli import UserError  # here: the session's temp dir is set before torch is imported

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            validate(argv)
            return None
        except UserError as exc:
            return f"error: {exc}"
        except SystemExit as exc:
            assert exc.code == 2, (argv, exc.code)
    lines = err.getvalue().strip().splitlines()
    assert len(lines) == 1, (argv, lines)
    return lines[0]


def load(path: Path) -> dict:
    with open(path) as f:
        return json.load(f)


@pytest.fixture(scope="session")
def suite(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """One 2-rank run of all four variants, shared by the tests that read its output."""
    out = tmp_path_factory.mktemp("suite")
    proc = run_script(["main.py", *TINY, "--output_dir", str(out)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out, proc


@pytest.fixture(scope="session")
def diverged(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """One single-process run of two intended variants, the second diverging at step 1 (a NaN injected), shared
    by the tests that read what a run with a failed check writes and says."""
    out = tmp_path_factory.mktemp("diverged")
    proc = run_script(["main.py", "--model", "tiny", "--device", "cpu", "--max_steps", "4", "--variants",
                       "torch_optimizer_after_fsdp,torch_optimizer_before_fsdp_fixed", "--inject_failure",
                       "torch_optimizer_before_fsdp_fixed:1:0:nan", "--output_dir", str(out)], nproc=None)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    return out, proc


@pytest.fixture(scope="session")
def cpu_sweep(tmp_path_factory) -> Path:
    """One single-process sweep of the four variants at simulated N = 2 and 8 (2 steps), shared by the tests that
    draw a sweep's figures."""
    out = tmp_path_factory.mktemp("sweep")
    proc = run_script(["main.py", *TINY, "--max_steps", "2", "--simulate_world_size", "2,8", "--output_dir",
                       str(out)], nproc=None)
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.fixture(scope="session")
def loaded(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """One 2-rank run of loading.py over every mode with the ~100M-parameter preset (a 100MB-sharded checkpoint),
    shared by the tests that read or draw what it writes."""
    out = tmp_path_factory.mktemp("loading")
    proc = run_script(["loading.py", "--model", "small", "--device", "cpu", "--checkpoint_shard_size", "100MB",
                       "--output_dir", str(out)])
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    return out, proc
